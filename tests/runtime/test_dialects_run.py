"""Issue 49: the runtime runs a shared-buffer past/present graph and a static-cache graph exactly (tokens equal to a
plain onnxruntime loop / the retained-state original), with the cache verbs; a growing past/present graph bound in
place is refused in one line (it runs from the fixed buffers: tests/runtime/test_dialects_grow.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper
import onnx

from dialect_loops import greedy_loop, session_greedy, static_cache_graph
from qeff_kv.contract import naming
from qeff_kv.errors import ContractError, RuntimeInputError
from qeff_kv.graph import graphio
from qeff_kv.runtime.execution.dialect_feeds import ControlFeeds, row_spans
from qeff_kv.runtime.session import Session

PROMPT = [3, 17, 5, 29, 11, 2, 40, 8, 13]
OTHER = [9, 1, 33, 4, 21]
CAPACITY = 32
N = 8


# ------------------------------------------------------------------ shared-buffer past/present
@pytest.fixture(scope="module")
def shared_buffer_graph(own_graph, tmp_path_factory) -> Path:
    """The suite's retained-state export with its KV renamed to past/present (the same fixed buffers in and out),
    and an ``attention_mask`` input (onnxruntime-genai's) that the graph does not read."""
    src = graphio.load(own_graph / "model.onnx") if (own_graph / "model.onnx").is_file() else None
    if src is None:
        src = graphio.load(next(own_graph.glob("*.onnx")))
    for v in list(src.graph.inputs) + list(src.graph.outputs):
        parsed = naming.parse_kv_name(v.name)
        if parsed is not None:
            v.name = parsed.in_dialect(naming.PAST_PRESENT).name
    src.graph.inputs.append(ir.Value(name=naming.ATTENTION_MASK_INPUT, type=ir.TensorType(ir.DataType.INT64),
                                     shape=ir.Shape(["batch", "total_len"])))
    out = tmp_path_factory.mktemp("shared-buffer") / "shared.onnx"
    graphio.save(src, out)
    return out


def test_shared_buffer_tokens_equal_the_retained_original(own_graph, shared_buffer_graph):
    ref = session_greedy(Session(own_graph), PROMPT, N)
    s = Session(shared_buffer_graph, ctx_len=64, prefill_seq_len=4)
    assert s.layout.dialect == naming.PAST_PRESENT and s.layout.update == "shared-buffer"
    assert session_greedy(s, PROMPT, N) == ref
    # attention_mask: [rows, positions held after the step], ones below the row's held length
    mask = s.binding.feeds.last[naming.ATTENTION_MASK_INPUT]
    assert mask.shape == (1, len(PROMPT) + N - 1) and mask.all()
    # bound in place: each present output is its past input's buffer
    outs = s.bound_output_pointers()
    assert all(outs[p.output_name] == s.kv_data_pointers()[p.input_name] for p in s.layout.pairs)


# ------------------------------------------------------------------ static cache
@pytest.fixture(scope="module")
def static_graph(tmp_path_factory) -> Path:
    return static_cache_graph(tmp_path_factory.mktemp("static") / "static.onnx", capacity=CAPACITY)


@pytest.fixture(scope="module")
def static_ref(static_graph) -> dict:
    return {tuple(p): greedy_loop(static_graph, p, N, capacity=CAPACITY) for p in (PROMPT, OTHER)}


def test_static_cache_tokens_equal_a_plain_loop(static_graph, static_ref):
    s = Session(static_graph)
    assert s.ctx_len == CAPACITY and s.layout.update == "indexed-scatter"
    assert s.cache.positional.arrays[s.layout.pairs[0].input_name].shape == (1, 1, CAPACITY, 16)
    assert session_greedy(s, PROMPT, N) == static_ref[tuple(PROMPT)]
    # chunked prefill (4, 4, 1 tokens: the short chunk unpadded) gives the same tokens
    assert session_greedy(Session(static_graph, prefill_seq_len=4), PROMPT, N) == static_ref[tuple(PROMPT)]
    # double-buffered (outputs to a spare set, swapped after each run): the same
    assert session_greedy(Session(static_graph, inplace=False), PROMPT, N) == static_ref[tuple(PROMPT)]


def test_static_cache_in_place(static_graph):
    s = Session(static_graph)
    assert s.inplace and not s.inplace_issues
    session_greedy(s, PROMPT, 2)
    outs, ins = s.bound_output_pointers(), s.kv_data_pointers()
    assert all(outs[p.output_name] == ins[p.input_name] for p in s.layout.pairs)


def test_static_cache_rewind_regenerates(static_graph, static_ref):
    s = Session(static_graph)
    seq = s.add_sequence()
    ref = static_ref[tuple(PROMPT)]
    assert session_greedy(s, PROMPT, N, seq) == ref
    s.truncate(seq, len(PROMPT) - 3)
    assert session_greedy(s, PROMPT[-3:], N, seq) == ref
    s.truncate(seq, 0)
    assert session_greedy(s, OTHER, N, seq) == static_ref[tuple(OTHER)]


def test_static_cache_two_sequences_in_lock_step(static_graph, static_ref):
    s = Session(static_graph, max_sequences=2)
    assert s.lockstep
    a, b = s.add_sequence(), s.add_sequence()
    ta, tb = [int(np.argmax(s.prefill(a, PROMPT)))], [int(np.argmax(s.prefill(b, OTHER)))]
    tb.append(int(np.argmax(s.decode({b: tb[-1]})[b])))   # row 0 idle: its write lands past its length
    while len(ta) < N:
        out = s.decode({a: ta[-1], b: tb[-1]} if len(tb) < N else {a: ta[-1]})
        ta.append(int(np.argmax(out[a])))
        if b in out:
            tb.append(int(np.argmax(out[b])))
    assert ta == static_ref[tuple(PROMPT)] and tb == static_ref[tuple(OTHER)]


def test_static_cache_feeds_stay_within_capacity():
    feeds = ControlFeeds({naming.WRITE_INDICES_INPUT: np.dtype(np.int64),
                          naming.NONPAD_KV_SEQLEN_INPUT: np.dtype(np.int64)}, 8, pads=False)
    first, held = row_spans(np.array([[5, 6, -1], [2, -1, -1]]))
    assert first.tolist() == [5, 2] and held.tolist() == [7, 3]

    class IO:
        def bind_ortvalue_input(self, name, value):
            pass

    with pytest.raises(RuntimeInputError, match="past its capacity of 8 slots"):
        feeds.feed(IO(), np.array([[6, 7, -1]]))     # TensorScatter would write slots 6..8
    with pytest.raises(RuntimeInputError, match="consecutive"):
        feeds.feed(IO(), np.array([[-1, 2, 3]]))


def test_static_cache_save_load_state(static_graph, static_ref, tmp_path):
    s = Session(static_graph)
    seq = s.add_sequence()
    ref = static_ref[tuple(PROMPT)]
    s.prefill(seq, PROMPT)
    path = s.save_state(seq, tmp_path / "state.kvstate")
    other = Session(static_graph)
    loaded = other.load_state(path)
    assert loaded.length == len(PROMPT)
    other.truncate(loaded, len(PROMPT) - 1)
    assert session_greedy(other, PROMPT[-1:], N, loaded) == ref


def test_static_cache_capacity_is_kept(static_graph):
    s = Session(static_graph, prefill_seq_len=8)
    seq = s.add_sequence()
    s.prefill(seq, list(range(1, CAPACITY)))      # 31 positions: chunks 8, 8, 8, 7 (never padded past 32)
    s.decode({seq: 1})                            # the last slot
    with pytest.raises(RuntimeInputError, match="exceed the capacity"):
        s.decode({seq: 1})


# ------------------------------------------------------------------ refusals
def _growing_graph(path: Path) -> Path:
    """A past/present graph whose present is Concat(past, new): not a fixed buffer."""
    vi = helper.make_tensor_value_info
    nodes, inputs, outputs = [], [vi("input_ids", TensorProto.INT64, ["b", "s"]),
                                  vi("position_ids", TensorProto.INT64, ["b", "s"])], []
    for stem in naming.EXPORT_STEMS:
        past, present = (naming.dialect_name(naming.PAST_PRESENT, stem, 0, output=o) for o in (False, True))
        inputs.append(vi(past, TensorProto.FLOAT, ["b", 2, "past", 4]))
        outputs.append(vi(present, TensorProto.FLOAT, ["b", 2, "total", 4]))
        nodes.append(helper.make_node("Concat", [past, past], [present], axis=2))
    nodes.append(helper.make_node("Cast", ["input_ids"], ["logits"], to=TensorProto.FLOAT))
    outputs.insert(0, vi("logits", TensorProto.FLOAT, ["b", "s"]))
    model = helper.make_model(helper.make_graph(nodes, "grows", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    onnx.save(model, path)
    return path


def test_growing_past_present_in_place_is_refused(tmp_path):
    """A growing graph runs from the fixed buffers (tests/runtime/test_dialects_grow.py), never in place."""
    with pytest.raises(ContractError) as err:
        Session(_growing_graph(tmp_path / "grows.onnx"), ctx_len=16, inplace=True)
    assert str(err.value) == ("grows.onnx grows by concatenation and inplace=True was asked (its present is a new "
                              "tensor, copied back): the runtime cannot feed it exactly")
