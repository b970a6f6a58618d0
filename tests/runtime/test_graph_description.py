"""The resolved description of a graph (qeff_kv/runtime/graph_description.py) and the batching strategies
(qeff_kv/runtime/decoding/batching.py): each batching mode resolved from the graphs that have it, the memory kinds, the
refusals in one line, and the session reading what it is from the description."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

import _recurrent_graph as rg
from _kv_graphs import build
from qeff_kv.graph import graphio
from qeff_kv.errors import ContractError, RuntimeInputError
from qeff_kv.runtime import Session
from qeff_kv.runtime.decoding.batching import ContinuousBatching, LockStep, OneSequence
from qeff_kv.runtime.execution.row_views import RowViews
from qeff_kv.runtime.memory.hybrid import Sequence
from qeff_kv.runtime.graph_description import GraphDescription, Requested
from qeff_kv.runtime.model_files import resolve_model
from qeff_kv.runtime.memory.recurrent import CheckpointPolicy
from ring_graphs import ring_graph


def describe(model, **asked) -> GraphDescription:
    files = resolve_model(model)
    return GraphDescription.resolve(graphio.load(files.onnx_path), files.manifest, files.onnx_path.name,
                                    Requested(**asked))


# ============================================================================================ batching modes
def test_a_graph_without_batch_index_holds_one_sequence(own_graph):
    d = describe(own_graph)
    assert type(d.batching) is OneSequence and not d.batching.continuous_batching and not d.batching.lockstep
    assert (d.dims.ctx_len, d.ctx_len, d.dims.prefill_seq_len, d.dims.max_sequences) == (64, 64, 8, 1)
    assert d.own_graph and d.inplace and d.inplace_issues == () and d.memory.kinds == ("full",)
    assert not d.speculative and d.media is None and not d.mrope and not d.ccl and not d.recurrent


def test_batch_index_is_continuous_batching_with_the_manifests_slots(own_cb_graph):
    d = describe(own_cb_graph)
    assert type(d.batching) is ContinuousBatching and d.batching.continuous_batching
    assert d.dims.max_sequences == 3 and d.ctx_len == 64   # full_batch_size of the manifest, no slot reserved
    with pytest.raises(RuntimeInputError, match=r"^the graph was exported for full_batch_size=3 slots \(manifest\); "
                                                r"4 sequences were requested$"):
        describe(own_cb_graph, max_sequences=4)


def test_several_sequences_without_batch_index_run_in_lock_step(own_fused_graph):
    d = describe(own_fused_graph, max_sequences=3)
    assert type(d.batching) is LockStep and d.batching.lockstep and d.dims.max_sequences == 3
    assert (d.dims.ctx_len, d.ctx_len) == (64, 63)   # each row keeps its last slot for idle rows' writes
    assert type(describe(own_fused_graph).batching) is OneSequence


def test_lock_step_is_refused_where_it_cannot_be_exact(own_fused_graph):
    with pytest.raises(RuntimeInputError, match=r"^graph has no batch_index input: max_sequences=2 needs lock-step "
                                                r"batching, which is not possible: the buffers are not bound in "
                                                r"place \(inplace=False"):
        describe(own_fused_graph, max_sequences=2, inplace=False)


def test_the_session_reads_its_mode_from_the_description(own_cb_graph, own_fused_graph):
    s = Session(own_cb_graph)
    assert s.graph.batching.continuous_batching and s.continuous_batching and not s.lockstep
    assert (s.ctx_len, s.max_sequences, s.prefill_seq_len) == (s.graph.ctx_len, 3, 8)
    lock = Session(own_fused_graph, max_sequences=2)
    assert lock.lockstep and lock.ctx_len == lock.cache.ctx_len == 63
    assert lock.cache.positional.arrays[next(iter(lock.cache.positional.arrays))].shape[2] == 64   # allocated at the graph's ctx_len


# ============================================================================================ the strategies
def _seq(slot: int, length: int) -> Sequence:
    s = Sequence(slot, slot)
    s.length = length
    return s


def _step(batching, rows: int) -> dict[str, np.ndarray]:
    return {"input_ids": np.zeros((rows, 1), np.int64), "position_ids": np.zeros((rows, 1), np.int64),
            **batching.step_inputs(rows)}


def test_continuous_batching_names_each_rows_slot():
    b = ContinuousBatching()
    a, c = _seq(2, 5), _seq(0, 9)
    arrays = _step(b, 2)
    b.fill_decode(arrays, [a, c], [11, 12], [a, c])
    assert arrays["input_ids"].ravel().tolist() == [11, 12] and arrays["position_ids"].ravel().tolist() == [5, 9]
    assert arrays["batch_index"].ravel().tolist() == [2, 0]
    assert [b.logits_row(r, s) for r, s in enumerate([a, c])] == [0, 1]
    assert b.decode_rows([a, c], 3) == 2 and b.prefill_views(None, a) is None and b.decode_views(None, 2, 3) is None


def test_lock_step_runs_the_rows_in_use_and_reads_each_sequences_own():
    b = LockStep()
    fed, idle, above = _seq(1, 4), _seq(0, 7), _seq(3, 9)
    assert b.decode_rows([idle, fed], 4) == 2 and b.decode_rows([above, fed], 4) == 4   # up to the highest slot fed
    arrays = _step(b, 2)
    assert set(arrays) == {"input_ids", "position_ids"}   # no batch_index
    b.fill_decode(arrays, [fed, above], [42, 5], [fed, idle, above])
    assert arrays["input_ids"].ravel().tolist() == [0, 42]
    assert arrays["position_ids"].ravel().tolist() == [7, 4]   # idle rows write at their next free position
    assert b.logits_row(0, fed, 2) == 1 and b.usable_ctx_len(64) == 63
    buffers = {"past_key.0": np.arange(4 * 6, dtype=np.float32).reshape(4, 1, 3, 2)}
    views = RowViews(buffers)
    assert b.decode_views(views, 4, 4) is None                   # every row: the whole buffers
    first = b.decode_views(views, 2, 4)
    assert first is b.decode_views(views, 2, 4)                  # made once
    assert first["past_key.0"].shape() == [2, 1, 3, 2]
    assert first["past_key.0"].data_ptr() == buffers["past_key.0"].ctypes.data   # a view, not a copy


def test_lock_step_runs_one_sequence_in_its_own_row():
    """A step feeding one sequence (a solo step) runs one row, the batch-1 view of the sequence's own row (the
    binding a prefill makes): the run the sequence alone in slot 0 makes, wherever it sits."""
    b = LockStep()
    fed, idle = _seq(2, 4), _seq(0, 7)
    assert b.decode_rows([fed], 4) == 1
    arrays = _step(b, 1)
    b.fill_decode(arrays, [fed], [42], [fed, idle])
    assert arrays["input_ids"].ravel().tolist() == [42] and arrays["position_ids"].ravel().tolist() == [4]
    assert b.logits_row(0, fed, 1) == 0
    buffers = {"past_key.0": np.arange(4 * 6, dtype=np.float32).reshape(4, 1, 3, 2)}
    solo = b.decode_views(RowViews(buffers), 1, 4, [fed])["past_key.0"]
    assert solo.shape() == [1, 1, 3, 2] and solo.data_ptr() == buffers["past_key.0"][2:3].ctypes.data


def test_one_sequence_refuses_a_step_of_several():
    with pytest.raises(RuntimeInputError, match="^a graph without batch_index decodes one sequence per step$"):
        OneSequence().decode_rows([_seq(0, 1), _seq(1, 1)], 1)


# ============================================================================================ memory kinds
def test_our_rings_are_padded_and_another_exporters_fed_within_them(tmp_path):
    ours = describe(ring_graph(tmp_path / "ours"), ctx_len=32)
    assert ours.memory.kinds == ("full", "ring") and ours.rings.capacity == 6 and ours.rings.window == 6
    assert not ours.memory.ring_within and ours.memory.pad_ring
    theirs = describe(ring_graph(tmp_path / "theirs", cache=None), ctx_len=32)
    assert theirs.memory.ring_within and not theirs.memory.pad_ring
    with pytest.raises(RuntimeInputError, match=r"^the graph fixes seq_len=4 and has another exporter's "):
        describe(ring_graph(tmp_path / "fixed", cache=None, seq_len=4), ctx_len=32)


def test_recurrent_states_are_the_second_memory(tmp_path):
    d = describe(rg.save(tmp_path / "hybrid.onnx"), ctx_len=16, max_sequences=2,
                 checkpoints=CheckpointPolicy.of(4, 2))
    assert d.recurrent and "recurrent" in d.memory.kinds and d.memory.checkpoints == CheckpointPolicy(4, 2)
    assert {p.stem for p in d.memory.recurrent} == {"conv_state", "recurrent_state"}
    assert all(not p.recurrent for p in d.memory.positional) and not d.memory.replaced_states
    assert type(d.batching) is ContinuousBatching


# ============================================================================================ refusals
def test_a_graph_that_is_not_a_decoder_is_refused(tmp_path):
    path = tmp_path / "no_positions.onnx"
    onnx.save(build(), str(path))
    with pytest.raises(ContractError, match=r"^graph has no 'position_ids' input; not a decoder graph of the "
                                            r"retained-state contract$"):
        describe(path)


def test_settings_that_would_do_nothing_or_contradict_the_graph_are_refused(own_graph, tmp_path):
    with pytest.raises(RuntimeInputError, match=r"^image_token_id applies to vision-language graphs; "
                                                r"qeff-kv-tiny-llama\.onnx is a text decoder$"):
        describe(own_graph, image_token_id=5)
    with pytest.raises(RuntimeInputError, match=r"^the graph leaves ctx_len symbolic"):
        describe(ring_graph(tmp_path))


def test_speculative_target_graph_says_so(peer2_dir):
    d = describe(peer2_dir / "llama_tlm_plain.onnx", ctx_len=32)
    assert d.speculative and d.speculative_tokens is None and not d.own_graph


def test_vision_language_and_ccl_graphs_say_so(peer_vlm_dir):
    vlm = describe(peer_vlm_dir / "qeff_llava_single_vllm.onnx", ctx_len=40, prefill_seq_len=8, image_token_id=397)
    assert vlm.media is not None and vlm.media.kind == "single" and not vlm.mrope and not vlm.ccl
    with pytest.raises(RuntimeInputError, match=r"^graph has no batch_index input: max_sequences=2 needs lock-step "
                                                r"batching, which is not possible: it is a vision-language graph"):
        describe(peer_vlm_dir / "qeff_llava_single_vllm.onnx", ctx_len=40, max_sequences=2, image_token_id=397)
    ccl = describe(peer_vlm_dir / "qeff_llama_ccl_vllm.onnx", ctx_len=32)
    assert ccl.ccl and ccl.media is None
