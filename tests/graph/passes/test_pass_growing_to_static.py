"""GrowingToStaticPass (issue 49): a growing past/present graph in mobius-onnx's default shape (ai.onnx Attention,
opset 24, with past inputs) rebuilt over a static cache and, through it, retained state: greedy tokens and chunked
logits equal before and after, ``check`` passes (in-place rule included), the prefix kept, the static form that of
mobius' own ``--static-cache`` twin; every graph whose attention is not recognised refused in one line, nothing
changed."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

import dialect_loops
from cli_checks import cli, one_error
from growing_graph import growing_graph
from qeff_kv.contract import naming
from qeff_kv.errors import DialectError, RewriteError
from qeff_kv.graph import graphio
from qeff_kv.graph.passes import GrowingToStaticPass
from qeff_kv.graph.passes.dialects.to_dialect import conversion_pass
from qeff_kv.tools.check import check
from qeff_kv.tools.rewrite import rewrite

CAP = 32
PROMPTS = ([5, 17, 42, 9, 3], [1], [60, 2, 2, 2, 2, 2, 2, 2, 2, 2])


def _io(model) -> list[str]:
    return [v.name for v in list(model.graph.inputs) + list(model.graph.outputs)]


@pytest.fixture(scope="module")
def growing(tmp_path_factory):
    return dialect_loops.growing_attention_graph(tmp_path_factory.mktemp("growing") / "g.onnx", positions=CAP)


@pytest.fixture(scope="module")
def converted(growing, tmp_path_factory):
    out = tmp_path_factory.mktemp("converted")
    for to in (naming.STATIC_CACHE, naming.RETAINED_STATE):
        rewrite(growing, out / f"{to}.onnx", to=to, capacity=CAP)
    return out


@pytest.mark.parametrize("to", [naming.STATIC_CACHE, naming.RETAINED_STATE])
def test_same_tokens_and_check(growing, converted, to):
    dst = converted / f"{to}.onnx"
    for prompt in PROMPTS:
        want = dialect_loops.greedy_loop(growing, prompt, 12, capacity=CAP)
        assert len(set(want)) > 2
        assert dialect_loops.greedy_loop(dst, prompt, 12, capacity=CAP) == want
    report = check(dst, expected_prefix=None)
    assert report.ok and report.rule("inplace").status == "pass", report.failed
    assert graphio.layout_of(graphio.load(dst)).update == ("indexed-scatter" if to == naming.STATIC_CACHE
                                                           else "in-place")


@pytest.mark.parametrize("to", [naming.STATIC_CACHE, naming.RETAINED_STATE])
def test_chunked_prefill_same_logits(growing, converted, to):
    chunks = [[5, 17, 42], [9, 3, 8, 8], [1], [30, 31]]
    want = dialect_loops.step_logits(growing, chunks, capacity=CAP)
    got = dialect_loops.step_logits(converted / f"{to}.onnx", chunks, capacity=CAP)
    for w, g in zip(want, got):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_static_form_is_mobius_twin(growing, converted, tmp_path):
    """The converted graph has the inputs, outputs and operators of the static twin written as mobius does."""
    twin = graphio.load(dialect_loops.static_cache_graph(tmp_path / "twin.onnx", capacity=CAP))
    model = graphio.load(converted / f"{naming.STATIC_CACHE}.onnx")
    def shapes(m):
        return [(v.name, tuple(v.shape.dims)) for v in list(m.graph.inputs)[2:] + list(m.graph.outputs)]

    assert shapes(model) == shapes(twin)
    assert naming.ATTENTION_MASK_INPUT not in _io(model)
    ops = lambda m: sorted(n.op_type for n in m.graph)  # noqa: E731
    assert ops(model) == ops(twin)
    attention = next(n for n in model.graph if n.op_type == "Attention")
    assert [v.name if v is not None else "" for v in attention.inputs][1:] == [
        "updated_key_cache.0", "updated_value_cache.0", "", "", "", naming.NONPAD_KV_SEQLEN_INPUT]
    assert len(attention.outputs) == 1 and attention.attributes["is_causal"].value == 1
    for prompt in PROMPTS:   # same seed, same weights: the twin decodes the same tokens
        assert (dialect_loops.greedy_loop(tmp_path / "twin.onnx", prompt, 8, capacity=CAP)
                == dialect_loops.greedy_loop(growing, prompt, 8, capacity=CAP))


def test_four_d_keys_and_values(tmp_path):
    src = dialect_loops.growing_attention_graph(tmp_path / "g4.onnx", positions=CAP, four_d=True, seed=2)
    rewrite(src, tmp_path / "s.onnx", to=naming.STATIC_CACHE, capacity=CAP)
    assert check(tmp_path / "s.onnx").ok
    for prompt in PROMPTS:
        assert (dialect_loops.greedy_loop(tmp_path / "s.onnx", prompt, 10, capacity=CAP)
                == dialect_loops.greedy_loop(src, prompt, 10, capacity=CAP))
    with pytest.raises(DialectError, match="4-D keys and values") as exc:
        rewrite(src, tmp_path / "r.onnx", to=naming.RETAINED_STATE, capacity=CAP)
    assert "\n" not in str(exc.value) and not (tmp_path / "r.onnx").exists()


def test_prefix_kept(growing, tmp_path):
    rewrite(growing, tmp_path / "p.onnx", prefix="VLLM")
    for to, name in ((naming.STATIC_CACHE, "updated_key_cache.1_VLLM"),
                     (naming.RETAINED_STATE, "past_key.1_VLLM_RetainedState")):
        res = rewrite(tmp_path / "p.onnx", tmp_path / f"{to}.onnx", to=to, capacity=CAP)
        assert res.prefix == "VLLM" and name in _io(graphio.load(tmp_path / f"{to}.onnx"))
        assert check(tmp_path / f"{to}.onnx", expected_prefix="VLLM").ok
        assert (dialect_loops.greedy_loop(tmp_path / f"{to}.onnx", PROMPTS[0], 6, capacity=CAP)
                == dialect_loops.greedy_loop(growing, PROMPTS[0], 6, capacity=CAP))
    res = rewrite(tmp_path / "p.onnx", tmp_path / "new.onnx", to=naming.STATIC_CACHE, capacity=CAP, prefix="B2")
    assert graphio.layout_of(graphio.load(tmp_path / "new.onnx")).prefixes == ["B2"]


# ------------------------------------------------------------------------------------------------ refusals
def _refused(model, to=naming.STATIC_CACHE, capacity=CAP, match=None) -> str:
    names = _io(model)
    with pytest.raises(DialectError, match=match) as exc:
        conversion_pass(model, to, capacity)
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith(f"cannot convert to {to}: ")
    assert _io(model) == names
    return msg


def test_concat_growing_refused(tmp_path):
    model = graphio.load(growing_graph(tmp_path / "c.onnx"))
    for to in (naming.STATIC_CACHE, naming.RETAINED_STATE):
        msg = _refused(model, to, match="feeds Concat")
        assert "grows by concatenation" in msg and "fixed-capacity" in msg


def test_group_query_attention_refused(growing):
    model = graphio.load(growing)
    for node in model.graph:
        if node.op_type == "Attention":
            node.op_type, node.domain = "GroupQueryAttention", "com.microsoft"
    _refused(model, match="feeds GroupQueryAttention")


def test_mask_used_for_something_else_refused(growing):
    model = graphio.load(growing)
    mask = next(v for v in model.graph.inputs if v.name == naming.ATTENTION_MASK_INPUT)
    axis = ir.Value(name="axis", const_value=ir.tensor(np.array(1, np.int64)))
    model.graph.register_initializer(axis)
    rows = ir.node("CumSum", [mask, axis], name="padding_rows", num_outputs=1)
    rows.outputs[0].name = "row_positions"
    model.graph.append(rows)
    model.graph.outputs.append(rows.outputs[0])
    _refused(model, match=r"attention_mask feeds CumSum \(padding_rows\)")


def test_mask_not_from_attention_mask_refused(growing):
    model = graphio.load(growing)
    keep = ir.Value(name="all_true", const_value=ir.tensor(np.ones((1, 1, 1, 1), bool)))
    model.graph.register_initializer(keep)
    node = next(n for n in model.graph if n.op_type == "Attention")
    node.replace_input_with(3, keep)
    _refused(model, match="is not attention_mask cast to bool")


def test_capacity_and_opset_refused(growing, tmp_path):
    model = graphio.load(growing)
    _refused(model, capacity=None, match="needs a capacity")
    _refused(model, to="shared-past-present", match="convert to retained-state first")
    model.opset_imports[""] = 23
    _refused(model, match="imports ai.onnx 23")
    with pytest.raises(DialectError, match="cannot convert to static-cache: the graph imports"):
        GrowingToStaticPass(CAP)(model)
    static = graphio.load(dialect_loops.static_cache_graph(tmp_path / "s.onnx", capacity=CAP))
    _refused(static, naming.RETAINED_STATE, capacity=CAP + 1, match=f"already holds {CAP} positions")
    assert conversion_pass(static, naming.RETAINED_STATE, CAP) is not None


def test_cli(growing, tmp_path):
    res = cli("rewrite", growing, "-o", tmp_path / "s.onnx", "--to", "static-cache", "--capacity", str(CAP))
    assert res.exit_code == 0, res.output
    assert cli("check", tmp_path / "s.onnx").exit_code == 0
    one_error(cli("rewrite", growing, "-o", tmp_path / "x.onnx", "--to", "static-cache"), "needs a capacity")
    one_error(cli("rewrite", growing_graph(tmp_path / "c.onnx"), "-o", tmp_path / "x.onnx", "--to",
                  "retained-state", "--capacity", "8"), "grows by concatenation")
    assert not (tmp_path / "x.onnx").exists()
    with pytest.raises(RewriteError, match="capacity is for a conversion"):
        rewrite(growing, tmp_path / "y.onnx", prefix="A", capacity=CAP)
