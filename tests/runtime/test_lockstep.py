"""Lock-step batching (issue 11, item 3): several sequences in a graph without ``batch_index`` (the fused target):
each prefilled through its own row of the buffers, all decoding in one step; tokens equal to each prompt alone
(transformers' greedy tokens), the buffers never reallocated, and one-line refusals where it cannot work."""

from __future__ import annotations

import pytest

from suite import requires_torch
from families import NEW, PROMPTS

pytestmark = [requires_torch]

THIRD = [7, 99, 3, 12, 64, 101, 5]


@pytest.mark.parametrize("target", ["onnxruntime-fused", "onnxruntime", "portable"])
def test_three_sequences_decode_together_with_parity(target, family_exports, family_models):
    from hf_models import hf_greedy
    from qeff_kv.runtime import Session

    res = family_exports("llama", target)
    sess = Session(res.out_dir, max_sequences=3)
    assert sess.lockstep and sess.max_sequences == 3 and sess.inplace
    assert sess.cache.positional.arrays["past_key.0"].shape[0] == 3
    before = sess.kv_data_pointers()
    prompts = [PROMPTS[0], PROMPTS[1], THIRD]
    got = [g.tokens for g in sess.generate(prompts, max_new_tokens=NEW, stop_tokens=[])]
    assert got == [hf_greedy(family_models("llama"), p, NEW) for p in prompts]
    assert sess.kv_data_pointers() == before


def test_sequences_of_different_ages_and_idle_rows(family_exports, family_models):
    """One sequence decodes while another waits, a third joins later in a freed slot: every row's tokens stay
    exact (idle rows write only past their valid length)."""
    from hf_models import hf_greedy
    from qeff_kv.runtime import Session

    sess = Session(family_exports("llama", "onnxruntime-fused").out_dir, max_sequences=2)
    a = sess.generate([PROMPTS[0]], max_new_tokens=3, stop_tokens=[])[0]
    b = sess.generate([PROMPTS[1]], max_new_tokens=NEW, stop_tokens=[])[0]        # a idles meanwhile
    rest_a = sess.generate([a.sequence], max_new_tokens=NEW - 3, stop_tokens=[])[0]
    assert a.tokens + rest_a.tokens == hf_greedy(family_models("llama"), PROMPTS[0], NEW)
    assert b.tokens == hf_greedy(family_models("llama"), PROMPTS[1], NEW)
    sess.remove_sequence(b.sequence)
    c = sess.generate([THIRD], max_new_tokens=NEW, stop_tokens=[])[0]
    assert c.tokens == hf_greedy(family_models("llama"), THIRD, NEW)


def test_lockstep_keeps_the_last_slot(family_exports):
    from qeff_kv.runtime import Session

    sess = Session(family_exports("llama", "onnxruntime-fused").out_dir, max_sequences=2)
    assert sess.ctx_len == 31    # CTX 32, one slot kept for idle rows' writes
    assert sess.describe()["lockstep"] is True


def test_lockstep_refusals(family_exports):
    from qeff_kv.errors import RuntimeInputError
    from qeff_kv.runtime import Session

    with pytest.raises(RuntimeInputError) as err:
        Session(family_exports("gemma3_sw", "portable").out_dir, max_sequences=2)
    assert str(err.value) == ("graph has no batch_index input: max_sequences=2 needs lock-step batching, which is "
                              "not possible: the graph has sliding-window ring buffers (an idle row's write would "
                              "land in a slot the ring holds)")
    with pytest.raises(RuntimeInputError, match="not in-place safe"):
        Session(family_exports("llama", "portable").out_dir, max_sequences=2, inplace=False)



def test_a_step_runs_only_the_rows_in_use(family_exports, family_models):
    """A step runs rows 0 .. the highest slot fed (a view of the first rows), one row when it feeds one sequence
    (its own row): a sequence alone in slot 0 of three decodes in one-row steps and not a byte of the rows above
    it changes; a second sequence in slot 1, alone too, decodes in one-row steps of its own row (not a byte of
    rows 0 and 2 changes); every token stays exact."""
    import numpy as np

    from hf_models import hf_greedy
    from qeff_kv.runtime import Session

    sess = Session(family_exports("llama", "onnxruntime-fused").out_dir, max_sequences=3)
    arrays = sess.cache.positional.arrays
    before = {k: v.copy() for k, v in arrays.items()}
    a = sess.generate([PROMPTS[0]], max_new_tokens=3, stop_tokens=[])[0]
    assert a.sequence.slot == 0 and sess.timings.decode_rows == sess.timings.decode_steps == 2
    assert all(np.array_equal(v[1:], before[k][1:]) for k, v in arrays.items())
    held_a = {k: v[0].copy() for k, v in arrays.items()}
    b = sess.generate([PROMPTS[1]], max_new_tokens=NEW, stop_tokens=[])[0]          # a idles in row 0 meanwhile
    assert b.sequence.slot == 1 and sess.timings.decode_rows == 2 + (NEW - 1)
    assert all(np.array_equal(v[2:], before[k][2:]) and np.array_equal(v[0], held_a[k]) for k, v in arrays.items())
    rest_a = sess.generate([a.sequence], max_new_tokens=NEW - 3, stop_tokens=[])[0]  # slot 0 alone again
    assert sess.timings.decode_rows == 2 + (NEW - 1) + (NEW - 3)
    assert a.tokens + rest_a.tokens == hf_greedy(family_models("llama"), PROMPTS[0], NEW)
    assert b.tokens == hf_greedy(family_models("llama"), PROMPTS[1], NEW)


def test_warm_up_leaves_nothing_behind(family_exports, family_models):
    """``warm_up`` (what ``qeff-kv serve`` runs before serving) runs a prefill and a step over every row in
    sequences of its own and removes them: no sequence, no timings, and the tokens after it are exact; a session
    holding a sequence is refused in one line."""
    from hf_models import hf_greedy
    from qeff_kv.errors import RuntimeInputError
    from qeff_kv.runtime import Session

    sess = Session(family_exports("llama", "onnxruntime-fused").out_dir, max_sequences=3)
    sess.warm_up()
    assert sess.sequences == [] and sess.timings.decode_steps == 0 and sess.timings.prefill_tokens == 0
    got = [g.tokens for g in sess.generate([PROMPTS[0], THIRD], max_new_tokens=NEW, stop_tokens=[])]
    assert got == [hf_greedy(family_models("llama"), p, NEW) for p in (PROMPTS[0], THIRD)]
    with pytest.raises(RuntimeInputError, match="^warm_up runs on a session without sequences; remove them first$"):
        sess.warm_up()
