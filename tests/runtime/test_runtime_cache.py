"""Cache manager: sequences as slots, truncate/rewind, several sequences per step, capacity refusals.

Runs on our own graphs and on the peer's (``graphs``), each compared with its own reference tokens."""

from __future__ import annotations

import numpy as np
import pytest

from qeff_kv.errors import RuntimeInputError
from qeff_kv.runtime import Session

from suite import PROMPT_A as A, PROMPT_B as B

C = [9, 8, 7]


@pytest.fixture
def cb(graphs):
    return Session(graphs / "qeff_llama_cb_vllm.onnx", ctx_len=16, prefill_seq_len=8, max_sequences=3)


@pytest.fixture
def single(graphs):
    return Session(graphs / "qeff_llama_vllm.onnx", ctx_len=16, prefill_seq_len=8)


def alone(graphs, prompt, n=8):
    s = Session(graphs / "qeff_llama_vllm.onnx", ctx_len=16, prefill_seq_len=8)
    return s.generate([prompt], max_new_tokens=n, stop_tokens=[])[0].tokens


def test_lifecycle_and_memory(cb):
    c = cb.cache
    assert (c.num_sequences, c.max_sequences) == (0, 3)
    per_pos = 4 * 2 * 16 * 4  # 4 buffers x heads 2 x head_dim 16 x float32
    assert c.bytes_per_position == per_pos
    assert c.memory_capacity == 3 * 16 * per_pos and c.memory_used == 0
    s0, s1 = c.create(), c.create()
    assert (s0.slot, s1.slot, c.num_sequences) == (0, 1, 2)
    cb.prefill(s0, A)
    cb.prefill(s1, C)
    assert c.length(s0) == 8 and c.length(s1) == 3
    assert c.memory_used == 11 * per_pos
    c.truncate(s0, 5)
    assert c.length(s0) == 5 and s0.tokens == A[:5] and c.memory_used == 8 * per_pos
    c.reset(s1)
    assert c.length(s1) == 0
    c.destroy(s1)
    assert c.num_sequences == 1 and c.free_slots() == [1, 2]
    with pytest.raises(RuntimeInputError, match="does not exist"):
        c.length(s1)
    s2 = c.create()
    assert s2.slot == 1 and s2.id != s1.id
    with pytest.raises(RuntimeInputError, match="cannot truncate"):
        c.truncate(s0, 6)
    c.create()
    with pytest.raises(RuntimeInputError, match="all 3 sequence slots are in use"):
        c.create()


def test_truncate_moves_no_data(cb):
    seq = cb.add_sequence()
    cb.prefill(seq, A)
    snapshot = {n: a.copy() for n, a in cb.cache.positional.arrays.items()}
    cb.truncate(seq, 2)
    for n, a in cb.cache.positional.arrays.items():
        assert np.array_equal(a, snapshot[n])


def test_rewind_then_redecode_equals_fresh_run(single, graphs):
    [g] = single.generate([A], max_new_tokens=8, stop_tokens=[])
    assert g.tokens == graphs.llama_a
    seq = g.sequence
    # rewind into the prompt, then feed a different continuation: same as a fresh run of that prompt
    single.truncate(seq, 3)
    [g2] = single.generate([(seq, B[:5])], max_new_tokens=8, stop_tokens=[])
    assert g2.tokens == alone(graphs, A[:3] + B[:5])
    # rewind to the prompt end minus one and re-feed the last prompt token: the same tokens again
    prompt2 = A[:3] + B[:5]
    assert seq.tokens[:8] == prompt2
    single.truncate(seq, 7)
    [g3] = single.generate([(seq, prompt2[7:])], max_new_tokens=8, stop_tokens=[])
    assert g3.tokens == g2.tokens


def test_sequences_of_different_lengths_decode_together(cb, graphs):
    gens = cb.generate([A, C, B[:5]], max_new_tokens=6, stop_tokens=[])
    assert [g.sequence.length for g in gens] == [8 + 5, 3 + 5, 5 + 5]
    for g, p in zip(gens, [A, C, B[:5]]):
        assert g.tokens == alone(graphs, p, 6)
    assert cb.timings.decode_steps == 5  # one step per token for all three together


def test_new_sequence_prefilled_while_others_keep_state(cb, graphs):
    ref_a, ref_b = graphs.llama_a, graphs.llama_b
    [ga] = cb.generate([A], max_new_tokens=3, stop_tokens=[])
    assert ga.tokens == ref_a[:3]
    [gb] = cb.generate([B], max_new_tokens=4, stop_tokens=[])  # prefilled into slot 1 while A waits
    assert gb.sequence.slot == 1 and gb.tokens == ref_b[:4]
    gens = cb.generate([ga.sequence, gb.sequence], max_new_tokens=4, stop_tokens=[])
    assert gens[0].tokens == ref_a[3:7]
    assert gens[1].tokens == ref_b[4:8]


def test_stop_tokens_and_finish_reasons(single, graphs):
    stop = graphs.llama_a[2]
    [g] = single.generate([A], max_new_tokens=8, stop_tokens=[stop])
    assert g.tokens == graphs.llama_a[:graphs.llama_a.index(stop) + 1] and g.finish_reason == "stop"


def test_capacity_refused_before_anything_runs(cb):
    seq = cb.add_sequence()
    cb.prefill(seq, C)
    before = (cb.timings.prefill_tokens, cb.cache.num_sequences, seq.length)
    with pytest.raises(RuntimeInputError, match=r"need 17 positions; the capacity is ctx_len=16"):
        cb.generate([A, B], max_new_tokens=10)  # B alone: 8 + 10 - 1 = 17
    with pytest.raises(RuntimeInputError, match="new sequences requested but only 2 of 3 slots are free"):
        cb.generate([A, B, C], max_new_tokens=2)
    with pytest.raises(RuntimeInputError, match="outside the vocabulary"):
        cb.generate([A, [1, 256]], max_new_tokens=2)
    with pytest.raises(RuntimeInputError, match="exceed the capacity"):
        cb.prefill(seq, list(range(14)))
    with pytest.raises(RuntimeInputError, match="need 30 positions"):
        cb.stream([A], max_new_tokens=23)  # refused when called, not when first iterated
    assert (cb.timings.prefill_tokens, cb.cache.num_sequences, seq.length) == before


def test_capacity_stop_instead_of_error(single, graphs):
    [g] = single.generate([A], max_new_tokens=20, on_capacity="stop", stop_tokens=[])
    assert g.finish_reason == "capacity" and len(g.tokens) == 9 and g.sequence.length == 16
    assert g.tokens[:8] == graphs.llama_a


def test_graph_without_batch_index_runs_sequences_in_lock_step(single, graphs):
    """One sequence by default; with max_sequences the rows of the buffers hold several, prefilled one by one
    and decoded together (runtime/lockstep.py), each with its own tokens."""
    with pytest.raises(RuntimeInputError, match="only 1 of 1 slots"):
        single.generate([A, B], max_new_tokens=1)
    two = Session(graphs / "qeff_llama_vllm.onnx", ctx_len=16, max_sequences=2)
    assert two.lockstep and two.ctx_len == 15   # the last slot is kept for idle rows' writes
    a, b = two.generate([A, B], max_new_tokens=8, stop_tokens=[])
    assert a.tokens == graphs.llama_a and b.tokens == graphs.llama_b


def test_symbolic_ctx_len_must_be_given(graphs):
    """A bare graph (no manifest beside it) leaves ctx_len symbolic."""
    with pytest.raises(RuntimeInputError, match=r"leaves ctx_len symbolic.*--ctx-len"):
        Session(graphs / "qeff_llama_vllm.onnx")


def test_export_folder_gives_the_dimensions(own_cb_graph):
    """An export folder's manifest fixes ctx_len, the prefill length and the slots; a smaller capacity and fewer
    slots may still be asked for."""
    s = Session(own_cb_graph)
    assert (s.ctx_len, s.prefill_seq_len, s.max_sequences, s.eos_token_ids) == (64, 8, 3, [2])
    s = Session(own_cb_graph, ctx_len=16, max_sequences=2)
    assert (s.ctx_len, s.max_sequences) == (16, 2)
    with pytest.raises(RuntimeInputError, match="exported for full_batch_size=3"):
        Session(own_cb_graph, max_sequences=4)


def test_fused_export_in_place_and_rewind(own_fused_graph, own_graphs):
    """onnxruntime-fused (GroupQueryAttention appends into the bound buffer itself): the same tokens as
    transformers, no KV buffer ever reallocated, and a rewind re-decodes as a fresh run does."""
    s = Session(own_fused_graph, ctx_len=16)
    assert s.inplace, s.inplace_issues
    ptrs = s.kv_data_pointers()
    toks = []
    for ev in s.stream([A], max_new_tokens=8, stop_tokens=[]):
        toks.append(ev.token)
        assert s.kv_data_pointers() == ptrs
        out = s.bound_output_pointers()
        assert all(out[p.output_name] == ptrs[p.input_name] for p in s.layout.pairs)
    assert toks == own_graphs.llama_a
    seq = ev.sequence
    s.truncate(seq, 3)
    [g] = s.generate([(seq, B[:5])], max_new_tokens=8, stop_tokens=[])
    fresh = Session(own_fused_graph, ctx_len=16)
    assert g.tokens == fresh.generate([A[:3] + B[:5]], max_new_tokens=8, stop_tokens=[])[0].tokens
