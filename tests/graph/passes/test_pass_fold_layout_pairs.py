"""FoldLayoutPairsPass: Reshape/Transpose pairs folded to nothing where provable, to one node otherwise, never
where unsafe; the graph computes the same values (onnxruntime before and after). No torch."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from qeff_kv.errors import PassInvariantError
from qeff_kv.graph.passes import FoldLayoutPairsPass

RNG = np.random.default_rng(0)
W = RNG.standard_normal((8, 12)).astype(np.float32)


def _model(nodes, inputs, outputs, inits=()) -> ir.Model:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    return ir.serde.deserialize_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


def _run(model: ir.Model, feeds: dict) -> list[np.ndarray]:
    proto = ir.serde.serialize_model(model)
    proto.ir_version = 8
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def _const(name, values):
    return helper.make_node("Constant", [], [name], value=helper.make_tensor(name, TensorProto.INT64,
                                                                            [len(values)], values))


def _attention_output(shape_of: str) -> ir.Model:
    """x = MatMul(h, W) [B, S, 12] -> Reshape [0, 0, -1, 4] -> Reshape [Shape(<shape_of>)[0], [1], -1] -> y."""
    nodes = [
        helper.make_node("MatMul", ["h", "W"], ["x"]),
        _const("a", [0, 0, -1, 4]),
        helper.make_node("Reshape", ["x", "a"], ["mid"]),
        helper.make_node("Shape", [shape_of], ["shp"]),
        _const("i0", [0]), _const("i1", [1]), _const("ax", [0]), _const("m1", [-1]),
        helper.make_node("Gather", ["shp", "i0"], ["g0"]), helper.make_node("Gather", ["shp", "i1"], ["g1"]),
        helper.make_node("Squeeze", ["g0", "ax"], ["s0"]), helper.make_node("Squeeze", ["g1", "ax"], ["s1"]),
        helper.make_node("Unsqueeze", ["s0", "ax"], ["u0"]), helper.make_node("Unsqueeze", ["s1", "ax"], ["u1"]),
        helper.make_node("Concat", ["u0", "u1", "m1"], ["b"], axis=0),
        helper.make_node("Reshape", ["mid", "b"], ["y"]),
        helper.make_node("Relu", ["y"], ["out"]),
    ]
    inputs = [helper.make_tensor_value_info("h", TensorProto.FLOAT, ["B", "S", 8]),
              helper.make_tensor_value_info("other", TensorProto.FLOAT, ["B", "S", 12])]
    model = _model(nodes, inputs, [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)],
                   [onnx.numpy_helper.from_array(W, "W")])
    for node in model.graph:   # the exporter's scalar index: Gather by a 0-d constant, no Squeeze
        if node.op_type == "Squeeze":
            node.outputs[0].replace_all_uses_with(node.inputs[0])
    for node in [n for n in model.graph if n.op_type == "Squeeze"]:
        model.graph.remove(node, safe=True)
    for node in model.graph:
        if node.op_type == "Gather":
            idx = node.inputs[1].producer()
            value = int(idx.attributes["value"].value.numpy()[0])
            idx.attributes["value"] = ir.AttrTensor("value", ir.tensor(np.array(value, dtype=np.int64)))
    model.graph.sort()
    return model


def _ops(model: ir.Model) -> list[str]:
    return [n.op_type for n in model.graph]


def test_attention_output_pair_is_removed():
    model = _attention_output("h")
    feeds = {"h": RNG.standard_normal((2, 3, 8)).astype(np.float32),
             "other": np.zeros((2, 3, 12), np.float32)}
    before = _run(model, feeds)
    p = FoldLayoutPairsPass()
    assert p(model).modified and (p.removed, p.merged) == (1, 0)
    assert "Reshape" not in _ops(model)
    np.testing.assert_array_equal(_run(model, feeds)[0], before[0])


def test_dims_of_an_unrelated_tensor_only_merge():
    """B and S read from another input are not provably x's: one Reshape to b stays (it still checks them)."""
    model = _attention_output("other")
    feeds = {"h": RNG.standard_normal((2, 3, 8)).astype(np.float32),
             "other": np.zeros((2, 3, 12), np.float32)}
    before = _run(model, feeds)
    p = FoldLayoutPairsPass()
    p(model)
    assert (p.removed, p.merged) == (0, 1) and _ops(model).count("Reshape") == 1
    np.testing.assert_array_equal(_run(model, feeds)[0], before[0])


@pytest.mark.parametrize("second, merged", [([6, 8], True), ([0, -1], False)], ids=["constant", "zero-entry"])
def test_constant_reshape_pair(second, merged):
    """[2, 3, 8] -> [6, 2, 4] -> second: merged unless a 0 in the second copies a dim the first made."""
    nodes = [_const("a", [6, 2, 4]), helper.make_node("Reshape", ["x", "a"], ["mid"]),
             _const("b", second), helper.make_node("Reshape", ["mid", "b"], ["y"])]
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 8])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    feeds = {"x": RNG.standard_normal((2, 3, 8)).astype(np.float32)}
    before = _run(model, feeds)
    p = FoldLayoutPairsPass()
    p(model)
    assert p.merged == int(merged) and _ops(model).count("Reshape") == (1 if merged else 2)
    out = _run(model, feeds)[0]
    assert out.shape == before[0].shape
    np.testing.assert_array_equal(out, before[0])


@pytest.mark.parametrize("p1, p2, left", [((0, 2, 1, 3), (0, 2, 1, 3), 0), ((1, 0, 2, 3), (0, 2, 3, 1), 1)],
                         ids=["cancel", "compose"])
def test_transpose_pairs(p1, p2, left):
    nodes = [helper.make_node("Transpose", ["x"], ["mid"], perm=list(p1)),
             helper.make_node("Transpose", ["mid"], ["y"], perm=list(p2)),
             helper.make_node("Relu", ["y"], ["out"])]
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4, 5])],
                   [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)])
    feeds = {"x": RNG.standard_normal((2, 3, 4, 5)).astype(np.float32)}
    before = _run(model, feeds)
    FoldLayoutPairsPass()(model)
    assert _ops(model).count("Transpose") == left
    np.testing.assert_array_equal(_run(model, feeds)[0], before[0])


def test_shared_intermediate_is_left_alone():
    nodes = [helper.make_node("Transpose", ["x"], ["mid"], perm=[1, 0]),
             helper.make_node("Transpose", ["mid"], ["y"], perm=[1, 0]),
             helper.make_node("Relu", ["mid"], ["z"])]
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
                    helper.make_tensor_value_info("z", TensorProto.FLOAT, None)])
    assert not FoldLayoutPairsPass()(model).modified and _ops(model).count("Transpose") == 2


# ------------------------------------------------------------------------------------------------ ensures
def _transposes() -> ir.Model:
    nodes = [helper.make_node("Transpose", ["x"], ["mid"], perm=[1, 0], name="t1"),
             helper.make_node("Transpose", ["mid"], ["y"], perm=[1, 0], name="t2"),
             helper.make_node("Relu", ["y"], ["out"])]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                  [helper.make_tensor_value_info("out", TensorProto.FLOAT, [2, 3])])


def test_ensures_refuses_a_transpose_pair_left_unfolded():
    class Idle(FoldLayoutPairsPass):
        def call(self, model):
            return ir.passes.PassResult(model, modified=False)

    with pytest.raises(PassInvariantError, match=r"^FoldLayoutPairsPass broke its invariant: the Transpose pairs "
                                                 r"ending in t2 are left unfolded$"):
        Idle()(_transposes())
    model = _transposes()
    assert FoldLayoutPairsPass()(model).modified and _ops(model) == ["Relu"]   # the real pass: ensures holds


def test_ensures_refuses_a_changed_output_shape():
    class Reshapes(FoldLayoutPairsPass):
        def call(self, model):
            result = super().call(model)
            model.graph.outputs[0].shape = ir.Shape([3, 2])
            return result

    with pytest.raises(PassInvariantError, match=r"^FoldLayoutPairsPass broke its invariant: it changed the graph "
                                                 r"outputs \(out -> out\)$"):
        Reshapes()(_transposes())
