"""ToDialectPass and StaticToRetainedPass (issue 49): greedy tokens equal before and after every conversion built,
round trips restore the names, ``check`` passes on converted graphs, a growing cache and a foreign graph's retained ->
static are refused in one line (nothing changed), prefixes kept."""

from __future__ import annotations

import pytest

import dialect_loops
from growing_graph import growing_graph
from suite import OWN_CTX_LEN, PROMPT_A
from qeff_kv.contract import naming
from qeff_kv.errors import DialectError
from qeff_kv.graph import graphio
from qeff_kv.graph.passes import StaticToRetainedPass, ToDialectPass
from qeff_kv.graph.passes.dialects.to_dialect import conversion_pass
from qeff_kv.tools.check import check

CAP = 32
PROMPT = [5, 17, 42, 9, 3]


def _io(model) -> list[str]:
    return [v.name for v in list(model.graph.inputs) + list(model.graph.outputs)]


@pytest.fixture(scope="module")
def static_graph(tmp_path_factory):
    return dialect_loops.static_cache_graph(tmp_path_factory.mktemp("static") / "static.onnx", capacity=CAP)


def test_static_to_retained_same_tokens(static_graph, tmp_path):
    model = dialect_loops.convert(static_graph, tmp_path / "retained.onnx", naming.RETAINED_STATE)
    names = _io(model)
    assert naming.WRITE_INDICES_INPUT not in names and naming.NONPAD_KV_SEQLEN_INPUT not in names
    assert "past_key.0" in names and "past_value.1_RetainedState" in names
    layout = graphio.layout_of(model)
    assert layout.update == "in-place"
    assert [tuple(p.input.shape) for p in layout.pairs][0] == ("batch", 2, CAP, 8)
    want = dialect_loops.greedy_loop(static_graph, PROMPT, 12, capacity=CAP)
    assert len(set(want)) > 2
    assert dialect_loops.greedy_loop(tmp_path / "retained.onnx", PROMPT, 12, capacity=CAP) == want
    assert check(tmp_path / "retained.onnx").ok


def test_static_to_retained_keeps_prefix(tmp_path):
    src = dialect_loops.static_cache_graph(tmp_path / "s.onnx", capacity=CAP, prefix="VLLM")
    model = dialect_loops.convert(src, tmp_path / "r.onnx", naming.RETAINED_STATE)
    assert graphio.layout_of(model).prefixes == ["VLLM"]
    assert "past_key.0_VLLM_RetainedState" in _io(model)
    assert check(tmp_path / "r.onnx", expected_prefix="VLLM").ok
    assert (dialect_loops.greedy_loop(tmp_path / "r.onnx", PROMPT, 6, capacity=CAP)
            == dialect_loops.greedy_loop(src, PROMPT, 6, capacity=CAP))


def test_retained_shared_round_trip(own_graphs, tmp_path):
    src = own_graphs / "qeff_llama_default.onnx"
    want = dialect_loops.greedy_loop(src, PROMPT_A, 8, capacity=OWN_CTX_LEN)
    shared = dialect_loops.convert(src, tmp_path / "pp.onnx", "shared-past-present")
    assert graphio.layout_of(shared).update == "shared-buffer"
    assert "past_key_values.0.key" in _io(shared) and "present.1.value" in _io(shared)
    assert dialect_loops.greedy_loop(tmp_path / "pp.onnx", PROMPT_A, 8, capacity=OWN_CTX_LEN) == want
    back = dialect_loops.convert(tmp_path / "pp.onnx", tmp_path / "rs.onnx", naming.RETAINED_STATE)
    assert _io(back) == _io(graphio.load(src))
    assert dialect_loops.greedy_loop(tmp_path / "rs.onnx", PROMPT_A, 8, capacity=OWN_CTX_LEN) == want
    assert check(tmp_path / "rs.onnx").ok


def test_static_retained_shared_retained_names(static_graph, tmp_path):
    first = dialect_loops.convert(static_graph, tmp_path / "r1.onnx", naming.RETAINED_STATE)
    dialect_loops.convert(tmp_path / "r1.onnx", tmp_path / "pp.onnx", "shared-past-present")
    again = dialect_loops.convert(tmp_path / "pp.onnx", tmp_path / "r2.onnx", naming.RETAINED_STATE)
    assert _io(again) == _io(first)
    # static -> shared past/present in one conversion (through retained state): the same graph, the same tokens
    direct = dialect_loops.convert(static_graph, tmp_path / "pp2.onnx", "shared-past-present")
    assert _io(direct) == _io(graphio.load(tmp_path / "pp.onnx"))
    want = dialect_loops.greedy_loop(static_graph, [1, 5, 9, 13, 17, 21], 8, capacity=CAP)
    assert dialect_loops.greedy_loop(tmp_path / "pp2.onnx", [1, 5, 9, 13, 17, 21], 8, capacity=CAP) == want
    assert check(tmp_path / "pp2.onnx").ok


def test_growing_refused_in_one_line(tmp_path):
    model = graphio.load(growing_graph(tmp_path / "g.onnx"))
    names = _io(model)
    for to in (naming.RETAINED_STATE, "shared-past-present", naming.STATIC_CACHE):
        with pytest.raises(DialectError) as exc:
            conversion_pass(model, to)
        msg = str(exc.value)
        assert "\n" not in msg and "grows by concatenation" in msg and "fixed-capacity" in msg
    with pytest.raises(DialectError):
        ToDialectPass(naming.RETAINED_STATE)(model)
    assert _io(model) == names


def test_foreign_retained_to_static_refused(static_graph, tmp_path):
    """A retained graph no qeff-kv target wrote (here: converted from a static cache) is refused: how its attention
    reads the cache is not known (our exports: tests/graph/passes/test_pass_retained_to_static.py)."""
    model = dialect_loops.convert(static_graph, tmp_path / "r.onnx", naming.RETAINED_STATE)
    with pytest.raises(DialectError, match="not a qeff-kv export") as exc:
        conversion_pass(model, naming.STATIC_CACHE)
    assert "\n" not in str(exc.value)


def test_already_there_and_unknown(static_graph):
    model = graphio.load(static_graph)
    assert conversion_pass(model, naming.STATIC_CACHE) is None
    assert isinstance(conversion_pass(model, naming.RETAINED_STATE), StaticToRetainedPass)
    with pytest.raises(DialectError, match="unknown KV dialect"):
        conversion_pass(model, "paged")


def test_static_without_kv_heads_refused(static_graph):
    model = graphio.load(static_graph)
    for node in model.graph:
        if node.op_type == "Attention":
            del node.attributes["kv_num_heads"]
    names = _io(model)
    with pytest.raises(DialectError, match="kv_heads are unknown"):
        StaticToRetainedPass()(model)
    assert _io(model) == names
