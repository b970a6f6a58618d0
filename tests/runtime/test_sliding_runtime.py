"""Sliding-window exports in qeff-kv's runtime (issue 9, item 3): buffers at their own capacities, bound in
place; prompts several windows long; rewinding exact within the ring and refused beyond it; state files and
the prefill -> decode hand-off carrying ring buffers; a state from a graph with another window refused.

Models: the ``*_sw`` families of tests/helpers/families.py (window SW=6, ctx_len CTX=32, chunks of CHUNK=4).
"""

from __future__ import annotations

import numpy as np
import pytest

from suite import requires_torch
from families import CHUNK, CTX, NEW, SW

pytestmark = [requires_torch]

LONG = [int(t) for t in np.random.default_rng(7).integers(3, 128, size=4 * SW)]


def _greedy(sess, prompt, new):
    return sess.generate([prompt], max_new_tokens=new, stop_tokens=[])[0].tokens


@pytest.mark.parametrize("target", ["portable", "onnxruntime", "onnxruntime-fused"])
def test_session_runs_ring_graphs_in_place_with_parity(target, family_exports, family_models):
    from hf_models import hf_greedy
    from qeff_kv.runtime import Session

    result = family_exports("gemma3_sw", target)
    sess = Session(result.out_dir)
    assert sess.inplace, sess.inplace_issues
    shapes = {n: a.shape for n, a in sess.cache.positional.arrays.items()}
    slots = SW if target != "onnxruntime-fused" else CTX
    assert shapes["past_key.0"] == (1, 2, slots, 16) and shapes["past_key.5"] == (1, 2, CTX, 16)
    before = sess.kv_data_pointers()
    assert _greedy(sess, LONG, NEW) == hf_greedy(family_models("gemma3_sw"), LONG, NEW)
    assert sess.kv_data_pointers() == before   # the same buffers throughout: nothing reallocated or swapped


def test_continuous_batching_ring_graph_runs_sequences_side_by_side(family_models, tmp_path):
    """Three sequences with different prompts in one continuous-batching ring graph: each gets transformers'
    tokens, decoding together."""
    from hf_models import hf_greedy
    from qeff_kv.export import export_model
    from qeff_kv.runtime import Session

    res = export_model(family_models("gemma2_sw"), tmp_path / "cb", ctx_len=CTX, prefill_seq_len=CHUNK,
                       target="onnxruntime", continuous_batching=True, full_batch_size=3)
    sess = Session(res.out_dir)
    prompts = [LONG, LONG[:9], LONG[5:19]]
    got = [g.tokens for g in sess.generate(prompts, max_new_tokens=NEW, stop_tokens=[])]
    assert got == [hf_greedy(family_models("gemma2_sw"), p, NEW) for p in prompts]


def test_rewind_within_the_ring_is_exact_and_beyond_it_refused(family_exports):
    from qeff_kv.errors import RuntimeInputError
    from qeff_kv.runtime import Session

    sess = Session(family_exports("mistral_sw", "portable").out_dir)
    whole = _greedy(sess, LONG, NEW)
    sess.remove_sequence(sess.sequences[0])
    seq = sess.add_sequence()
    sess.prefill(seq, LONG + whole[:3])             # written = 27
    with pytest.raises(RuntimeInputError, match=r"^cannot rewind sequence") as err:
        sess.truncate(seq, len(LONG))                # needs positions the ring overwrote
    assert "\n" not in str(err.value)
    assert seq.length == len(LONG) + 3               # a refused rewind changes nothing
    sess.truncate(seq, len(LONG) + 2)                # one position back: exact
    out = sess.generate([(seq, [whole[2]])], max_new_tokens=NEW - 3, stop_tokens=[])[0].tokens
    assert out == whole[3:]
    sess.truncate(seq, 0)                            # a reset always works
    assert sess.generate([(seq, LONG)], max_new_tokens=NEW, stop_tokens=[])[0].tokens == whole


def test_state_file_round_trip_and_handoff_between_targets(family_exports, tmp_path):
    """Prefill on the portable ring export, save; decode in a new session of the onnxruntime ring export of the
    same checkpoint: tokens identical to one uninterrupted run."""
    from qeff_kv.runtime import Session

    whole = _greedy(Session(family_exports("gemma2_sw", "onnxruntime").out_dir), LONG, NEW)
    pre = Session(family_exports("gemma2_sw", "portable").out_dir)
    gen = pre.generate([LONG], max_new_tokens=1, stop_tokens=[])[0]
    path = pre.save_state(gen.sequence, tmp_path / "s.safetensors")
    dec = Session(family_exports("gemma2_sw", "onnxruntime").out_dir)
    seq = dec.load_state(path)
    rest = dec.generate([seq], max_new_tokens=NEW - 1, stop_tokens=[])[0].tokens
    assert gen.tokens + rest == whole


def test_state_from_a_graph_with_another_window_is_refused(family_models, family_exports, tmp_path):
    import json
    import shutil

    from qeff_kv.errors import StateFileError
    from qeff_kv.export import export_model
    from qeff_kv.runtime import Session

    src = family_models("mistral_sw")
    other = tmp_path / "w8"
    cfg = json.loads((src / "config.json").read_text())
    cfg["sliding_window"] = 8
    shutil.copytree(src, other)
    (other / "config.json").write_text(json.dumps(cfg))
    res8 = export_model(other, tmp_path / "e8", ctx_len=CTX, prefill_seq_len=CHUNK)
    s6 = Session(family_exports("mistral_sw", "portable").out_dir)
    g = s6.generate([LONG], max_new_tokens=1, stop_tokens=[])[0]
    path = s6.save_state(g.sequence, tmp_path / "s6.safetensors")
    with pytest.raises(StateFileError) as err:
        Session(res8.out_dir).load_state(path)
    assert "window" in str(err.value) and "\n" not in str(err.value)


def test_a_ring_state_decodes_on_the_fused_export(family_exports, tmp_path):
    """The disaggregated split across layouts: prefill on the portable export (ring buffers of the window),
    decode on the fused export of the same checkpoint (full-length buffers, GQA's window): the state is
    unrolled by position, and the tokens equal the fused export's own."""
    from qeff_kv.runtime import Session

    whole = _greedy(Session(family_exports("gemma3_sw", "onnxruntime-fused").out_dir), LONG, NEW)
    pre = Session(family_exports("gemma3_sw", "portable").out_dir)
    gen = pre.generate([LONG], max_new_tokens=1, stop_tokens=[])[0]
    path = pre.save_state(gen.sequence, tmp_path / "ring.safetensors")
    dec = Session(family_exports("gemma3_sw", "onnxruntime-fused").out_dir)
    seq = dec.load_state(path)
    rest = dec.generate([seq], max_new_tokens=NEW - 1, stop_tokens=[])[0].tokens
    assert gen.tokens + rest == whole
