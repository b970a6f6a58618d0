"""FuseSkipRMSNormPass: a residual Add followed by transformers' float32 RMSNorm becomes one
``SkipSimplifiedLayerNormalization`` whose outputs equal the unfused graph's (onnxruntime before and after); a norm
of a tensor that is not a sum is left alone; the pass applies to float32 exports only; its ``ensures`` refuses a
graph where a matching norm was left unfused or a graph output changed. Hand-made graphs, no torch."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from qeff_kv.errors import PassInvariantError
from qeff_kv.graph.passes import FuseSkipRMSNormPass

RNG = np.random.default_rng(0)
H, EPS = 8, 1e-6
FEEDS = {"a": RNG.standard_normal((1, 3, H)).astype(np.float32),
         "b": RNG.standard_normal((1, 3, H)).astype(np.float32)}


def _scalar(name: str, value: float):
    return numpy_helper.from_array(np.array(value, np.float32), name)


def _norm_graph(of_sum: bool = True) -> ir.Model:
    """``s = a + b`` (or ``a`` alone), ``c = Cast(s)``; ``y = w * Cast(c * 1 / sqrt(mean(c^2) + eps))``; outputs
    ``Relu(y)`` and ``Relu(c)`` (the residual read again, as the next layer does)."""
    f = TensorProto.FLOAT
    nodes = [helper.make_node("Add", ["a", "b"], ["s"], name="residual")] if of_sum else \
        [helper.make_node("Identity", ["a"], ["s"])]
    nodes += [helper.make_node("Cast", ["s"], ["c"], to=f),
              helper.make_node("Pow", ["c", "two"], ["sq"]),
              helper.make_node("ReduceMean", ["sq"], ["mean"], axes=[-1], keepdims=1),
              helper.make_node("Add", ["mean", "eps"], ["var"]),
              helper.make_node("Sqrt", ["var"], ["std"]),
              helper.make_node("Div", ["one", "std"], ["inv"]),
              helper.make_node("Mul", ["c", "inv"], ["normed"]),
              helper.make_node("Cast", ["normed"], ["normed32"], to=f),
              helper.make_node("Mul", ["w", "normed32"], ["y"], name="norm_out"),
              helper.make_node("Relu", ["y"], ["out"]), helper.make_node("Relu", ["c"], ["res"])]
    inits = [_scalar("two", 2.0), _scalar("eps", EPS), _scalar("one", 1.0),
             numpy_helper.from_array(RNG.standard_normal(H).astype(np.float32), "w")]
    io = [helper.make_tensor_value_info(n, f, [1, 3, H]) for n in ("a", "b")]
    outs = [helper.make_tensor_value_info(n, f, [1, 3, H]) for n in ("out", "res")]
    graph = helper.make_graph(nodes, "g", io, outs, inits)
    return ir.serde.deserialize_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


def _run(model: ir.Model) -> list[np.ndarray]:
    proto = ir.serde.serialize_model(model)
    proto.ir_version = 8
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, FEEDS)


def _ops(model: ir.Model) -> list[str]:
    return [n.op_type for n in model.graph]


def test_residual_norm_is_fused_and_computes_the_same_values():
    model = _norm_graph()
    before = _run(model)
    assert FuseSkipRMSNormPass()(model).modified
    assert _ops(model) == ["SkipSimplifiedLayerNormalization", "Relu", "Relu"]
    fused = next(iter(model.graph))
    assert fused.domain == "com.microsoft" and fused.attributes["epsilon"].value == pytest.approx(EPS)
    assert [v.name for v in fused.inputs] == ["a", "b", "w"]
    assert [o.name for o in model.graph.outputs] == ["out", "res"]
    after = _run(model)
    for x, y in zip(before, after):
        np.testing.assert_allclose(y, x, rtol=1e-5, atol=1e-6)


def test_norm_of_a_tensor_that_is_not_a_sum_is_left_alone():
    model = _norm_graph(of_sum=False)
    ops = _ops(model)
    assert not FuseSkipRMSNormPass()(model).modified and _ops(model) == ops


def test_applies_to_float32_exports_only():
    assert FuseSkipRMSNormPass.dtypes == ("float32",)


def test_ensures_refuses_a_matching_norm_left_unfused():
    class Idle(FuseSkipRMSNormPass):
        def call(self, model):
            return ir.passes.PassResult(model, modified=False)

    with pytest.raises(PassInvariantError, match=r"^FuseSkipRMSNormPass broke its invariant: the RMSNorm ending in "
                                                 r"norm_out is still unfused$"):
        Idle()(_norm_graph())


def test_ensures_refuses_a_changed_graph_input():
    class Retypes(FuseSkipRMSNormPass):
        def call(self, model):
            result = super().call(model)
            model.graph.inputs[0].dtype = ir.DataType.FLOAT16
            return result

    with pytest.raises(PassInvariantError, match=r"it changed the graph inputs \(a, b -> a, b\)$"):
        Retypes()(_norm_graph())
