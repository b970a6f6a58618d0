"""GateVisionEncoderPass: a single vision-language graph's vision encoder moves into an ``If`` on
``image_idx >= 0``; every output is unchanged for an image step and a decode step (onnxruntime before and after);
a graph without ``image_idx`` is left alone; its ``ensures`` refuses a graph where the gate is missing or a graph
output changed. A hand-made graph with the merge's shape (rows flattened to ``[-1, W]``, read by a ``Gather`` at
a clamped ``image_idx``, dropped by a ``Where``), no torch."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from qeff_kv.contract import naming
from qeff_kv.errors import PassInvariantError
from qeff_kv.graph.passes import GateVisionEncoderPass

RNG = np.random.default_rng(0)
P, W = 4, 6


def _single_graph(with_image_idx: bool = True) -> ir.Model:
    f = TensorProto.FLOAT
    idx = naming.IMAGE_IDX if with_image_idx else "slot"
    nodes = [helper.make_node("MatMul", [naming.PIXEL_VALUES, "Wv"], ["enc"], name="encoder"),
             helper.make_node("Relu", ["enc"], ["enc_act"]),
             helper.make_node("Reshape", ["enc_act", "flat"], ["rows"], name="flatten"),
             helper.make_node("Reshape", [idx, "one"], ["idx1"]),
             helper.make_node("Max", ["idx1", "zero1"], ["idx_clamped"]),
             helper.make_node("Gather", ["rows", "idx_clamped"], ["row"], axis=0),
             helper.make_node("Add", ["x", "row"], ["merged"]),
             helper.make_node("GreaterOrEqual", [idx, "zero"], ["has_image"]),
             helper.make_node("Where", ["has_image", "merged", "x"], ["out"]),
             helper.make_node("Identity", [naming.PIXEL_VALUES], [naming.retained_name(naming.PIXEL_VALUES)])]
    inits = [numpy_helper.from_array(RNG.standard_normal((P, W)).astype(np.float32), "Wv"),
             numpy_helper.from_array(np.array([-1, W], np.int64), "flat"),
             numpy_helper.from_array(np.array([1], np.int64), "one"),
             numpy_helper.from_array(np.array([0], np.int64), "zero1"),
             numpy_helper.from_array(np.zeros((1, 1), np.int64), "zero")]
    inputs = [helper.make_tensor_value_info(naming.PIXEL_VALUES, f, [2, P]),
              helper.make_tensor_value_info(idx, TensorProto.INT64, [1, 1]),
              helper.make_tensor_value_info("x", f, [1, W])]
    outputs = [helper.make_tensor_value_info("out", f, [1, W]),
               helper.make_tensor_value_info(naming.retained_name(naming.PIXEL_VALUES), f, [2, P])]
    graph = helper.make_graph(nodes, "g", inputs, outputs, inits)
    return ir.serde.deserialize_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


def _run(model: ir.Model, image_idx: int) -> list[np.ndarray]:
    proto = ir.serde.serialize_model(model)
    proto.ir_version = 8
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(1)
    return sess.run(None, {naming.PIXEL_VALUES: rng.standard_normal((2, P)).astype(np.float32),
                           naming.IMAGE_IDX: np.array([[image_idx]], np.int64),
                           "x": rng.standard_normal((1, W)).astype(np.float32)})


def test_encoder_moves_into_an_if_and_every_output_is_unchanged():
    model = _single_graph()
    before = {i: _run(model, i) for i in (-1, 0, 1)}
    p = GateVisionEncoderPass()
    assert p(model).modified and p.gated == 3   # MatMul, Relu, the flattening Reshape
    gate = model.graph.node("vision_encoder_gate")
    assert gate.op_type == "If" and [n.name for n in gate.attributes["then_branch"].value][0] == "encoder"
    assert "encoder" not in [n.name for n in model.graph]
    for i, outs in before.items():   # an image step (0, 1) and a decode step (-1)
        for x, y in zip(outs, _run(model, i)):
            np.testing.assert_array_equal(y, x)


def test_a_graph_without_image_idx_is_left_alone():
    model = _single_graph(with_image_idx=False)
    nodes = [n.name for n in model.graph]
    assert not GateVisionEncoderPass()(model).modified and [n.name for n in model.graph] == nodes


def test_ensures_refuses_a_gate_that_is_not_there():
    class Claims(GateVisionEncoderPass):   # says it gated, did nothing
        def call(self, model):
            self.gated = 3
            return ir.passes.PassResult(model, modified=True)

    with pytest.raises(PassInvariantError, match=r"^GateVisionEncoderPass broke its invariant: 0 vision_encoder_gate "
                                                 r"nodes, expected one$"):
        Claims()(_single_graph())


def test_ensures_refuses_a_dropped_graph_output():
    class Drops(GateVisionEncoderPass):
        def call(self, model):
            result = super().call(model)
            model.graph.outputs.pop()
            return result

    with pytest.raises(PassInvariantError, match=r"it changed the graph outputs \(out, pixel_values_RetainedState -> "
                                                 r"out\)$"):
        Drops()(_single_graph())
