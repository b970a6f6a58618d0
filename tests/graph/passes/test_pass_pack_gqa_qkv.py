"""PackGQAQKVPass: a GroupQueryAttention whose query, key and value are each the identity layout round trip of a
projection of one input gets one packed projection (key and value inputs empty) and computes exactly what it
computed (onnxruntime before and after); a node whose projections read different inputs is left alone; its
``ensures`` refuses a graph where a packable node was left unpacked or a graph output changed. No torch."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from qeff_kv.errors import PassInvariantError
from qeff_kv.graph.passes import PackGQAQKVPass

RNG = np.random.default_rng(0)
HIDDEN, HQ, HKV, D, PAST = 16, 4, 2, 8, 6
S = 3


def _gqa_graph(key_input: str = "h", bias: bool = False) -> ir.Model:
    """q/k/v = Reshape(Reshape(MatMul(h, W) [+ b], [dim0(h), dim1(h), -1, D]), [0, 0, -1]) into one GQA node;
    ``key_input``: what the key projection reads (``h`` or another input ``g``)."""
    f = TensorProto.FLOAT
    nodes: list = []
    inits = [numpy_helper.from_array(np.array(0, np.int64), "i0"), numpy_helper.from_array(np.array(1, np.int64), "i1"),
              numpy_helper.from_array(np.array([0], np.int64), "ax0"),
              numpy_helper.from_array(np.array([-1], np.int64), "minus1"),
              numpy_helper.from_array(np.array([D], np.int64), "d"),
              numpy_helper.from_array(np.array([0, 0, -1], np.int64), "flat")]
    for name, heads in (("q", HQ), ("k", HKV), ("v", HKV)):
        src = key_input if name == "k" else "h"
        inits.append(numpy_helper.from_array(RNG.standard_normal((HIDDEN, heads * D)).astype(np.float32), f"W{name}"))
        nodes.append(helper.make_node("MatMul", [src, f"W{name}"], [f"{name}_proj"], name=f"{name}_proj"))
        proj = f"{name}_proj"
        if bias:
            inits.append(numpy_helper.from_array(RNG.standard_normal(heads * D).astype(np.float32), f"b{name}"))
            nodes.append(helper.make_node("Add", [proj, f"b{name}"], [f"{name}_biased"]))
            proj = f"{name}_biased"
        shape_of = f"{name}_src_shape"
        nodes += [helper.make_node("Shape", [src], [shape_of]),
                  helper.make_node("Gather", [shape_of, "i0"], [f"{name}_d0"]),
                  helper.make_node("Unsqueeze", [f"{name}_d0", "ax0"], [f"{name}_u0"]),
                  helper.make_node("Gather", [shape_of, "i1"], [f"{name}_d1"]),
                  helper.make_node("Unsqueeze", [f"{name}_d1", "ax0"], [f"{name}_u1"]),
                  helper.make_node("Concat", [f"{name}_u0", f"{name}_u1", "minus1", "d"], [f"{name}_4d"], axis=0),
                  helper.make_node("Reshape", [proj, f"{name}_4d"], [f"{name}_heads"]),
                  helper.make_node("Reshape", [f"{name}_heads", "flat"], [name])]
    nodes.append(helper.make_node(
        "GroupQueryAttention", ["q", "k", "v", "past_key", "past_value", "seqlens_k", "total"],
        ["attn", "present_key", "present_value"], domain="com.microsoft", name="gqa", num_heads=HQ,
        kv_num_heads=HKV))
    inputs = [helper.make_tensor_value_info("h", f, [1, S, HIDDEN]), helper.make_tensor_value_info("g", f, [1, S, HIDDEN]),
              helper.make_tensor_value_info("past_key", f, [1, HKV, PAST, D]),
              helper.make_tensor_value_info("past_value", f, [1, HKV, PAST, D]),
              helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
              helper.make_tensor_value_info("total", TensorProto.INT32, [])]
    outputs = [helper.make_tensor_value_info("attn", f, [1, S, HQ * D])]
    graph = helper.make_graph(nodes, "g", inputs, outputs, inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    return ir.serde.deserialize_model(proto)


FEEDS = {"h": RNG.standard_normal((1, S, HIDDEN)).astype(np.float32),
         "g": RNG.standard_normal((1, S, HIDDEN)).astype(np.float32),
         "past_key": RNG.standard_normal((1, HKV, PAST, D)).astype(np.float32),
         "past_value": RNG.standard_normal((1, HKV, PAST, D)).astype(np.float32),
         "seqlens_k": np.array([4], np.int32), "total": np.array(5, np.int32)}


def _run(model: ir.Model) -> np.ndarray:
    proto = ir.serde.serialize_model(model)
    proto.ir_version = 8
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])
    names = {i.name for i in sess.get_inputs()}
    return sess.run(None, {k: v for k, v in FEEDS.items() if k in names})[0]


def _gqa(model: ir.Model) -> ir.Node:
    return next(n for n in model.graph if n.op_type == "GroupQueryAttention")


@pytest.mark.parametrize("bias", [False, True], ids=["plain", "bias"])
def test_three_projections_become_one_and_attention_is_unchanged(bias):
    model = _gqa_graph(bias=bias)
    before = _run(model)
    assert PackGQAQKVPass()(model).modified
    node = _gqa(model)
    assert node.inputs[1] is None and node.inputs[2] is None
    packed = node.inputs[0].producer()
    if bias:
        assert packed.op_type == "Add" and packed.inputs[1].name == "gqa.qkv_bias"
        packed = packed.inputs[0].producer()
    assert packed.op_type == "MatMul" and packed.inputs[0].name == "h"
    assert packed.inputs[1].name == "gqa.qkv_weight" and packed.inputs[1].const_value.shape.dims == (HIDDEN, (HQ + 2 * HKV) * D)
    assert sum(1 for n in model.graph if n.op_type == "MatMul") == 1   # the three projections are gone
    np.testing.assert_allclose(_run(model), before, rtol=1e-5, atol=1e-5)


def test_projections_of_different_inputs_are_left_alone():
    model = _gqa_graph(key_input="g")
    ops = [n.op_type for n in model.graph]
    assert not PackGQAQKVPass()(model).modified
    assert [n.op_type for n in model.graph] == ops and _gqa(model).inputs[1].name == "k"


def test_ensures_refuses_a_packable_node_left_unpacked():
    class Idle(PackGQAQKVPass):
        def call(self, model):
            return ir.passes.PassResult(model, modified=False)

    with pytest.raises(PassInvariantError, match=r"^PackGQAQKVPass broke its invariant: GroupQueryAttention gqa still "
                                                 r"reads three separate projections$"):
        Idle()(_gqa_graph())


def test_ensures_refuses_a_renamed_graph_output():
    class Renames(PackGQAQKVPass):
        def call(self, model):
            result = super().call(model)
            model.graph.outputs[0].name = "attention"
            return result

    with pytest.raises(PassInvariantError, match=r"it changed the graph outputs \(attn -> attention\)$"):
        Renames()(_gqa_graph())
