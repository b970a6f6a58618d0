"""OrtInvalidIndexPass: the peer's ``INT32_MAX`` "invalid index" constants, found by where their data goes (the
indices of a ``GatherND``/``ScatterND``), become 0 (gather) or -1 (scatter), and onnxruntime's CPU kernels then
run the graph; a constant that feeds something else keeps its value there; a graph without them is left alone; its
``ensures`` refuses a graph where one still reaches an index input. Hand-made graphs, no torch. (The peer's
exported graphs are tested in ``tests/runtime/test_runtime_peer.py``.)"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from qeff_kv.errors import PassInvariantError
from qeff_kv.graph.passes import OrtInvalidIndexPass
from qeff_kv.graph.passes.ort_invalid_index import INVALID_INDEX

DATA = np.arange(12, dtype=np.float32).reshape(4, 3)


def _gather_graph(invalid: int = INVALID_INDEX) -> ir.Model:
    """``GatherND(data, Where(idx > 2, <invalid>, idx))``; the invalid constant is also added to a float output."""
    nodes = [helper.make_node("Constant", [], ["invalid"], name="invalid",
                              value=numpy_helper.from_array(np.array([[invalid]], np.int64))),
             helper.make_node("Greater", ["idx", "limit"], ["past"]),
             helper.make_node("Where", ["past", "invalid", "idx"], ["safe_idx"], name="mask_idx"),
             helper.make_node("GatherND", ["data", "safe_idx"], ["rows"], name="read"),
             helper.make_node("Cast", ["invalid"], ["invalid_f"], to=TensorProto.FLOAT),
             helper.make_node("ReduceSum", ["invalid_f"], ["marker"], keepdims=0)]
    inits = [numpy_helper.from_array(np.array(2, np.int64), "limit")]
    inputs = [helper.make_tensor_value_info("data", TensorProto.FLOAT, [4, 3]),
              helper.make_tensor_value_info("idx", TensorProto.INT64, [2, 1])]
    outputs = [helper.make_tensor_value_info("rows", TensorProto.FLOAT, [2, 3]),
               helper.make_tensor_value_info("marker", TensorProto.FLOAT, [])]
    graph = helper.make_graph(nodes, "g", inputs, outputs, inits)
    return ir.serde.deserialize_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


def _run(model: ir.Model, idx) -> list[np.ndarray]:
    proto = ir.serde.serialize_model(model)
    proto.ir_version = 8
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"data": DATA, "idx": np.array(idx, np.int64).reshape(2, 1)})


def test_gather_constant_becomes_zero_and_onnxruntime_runs_the_graph():
    model = _gather_graph()
    with pytest.raises(Exception, match="invalid index"):
        _run(model, [1, 3])   # position 3 is past the limit: index INT32_MAX
    p = OrtInvalidIndexPass()
    assert p(model).modified and (p.gather_constants, p.scatter_constants) == (1, 0)
    rows, marker = _run(model, [1, 3])
    np.testing.assert_array_equal(rows, DATA[[1, 0]])   # the invalid position reads slot 0 (masked by the graph)
    assert marker == float(INVALID_INDEX)                # the constant's other reader keeps its value
    assert not p.find(model)


def test_a_graph_without_invalid_indices_is_left_alone():
    model = _gather_graph(invalid=0)
    nodes = [n.name for n in model.graph]
    assert not OrtInvalidIndexPass()(model).modified and [n.name for n in model.graph] == nodes


def test_ensures_refuses_an_invalid_index_left_on_an_index_path():
    class Idle(OrtInvalidIndexPass):
        def call(self, model):
            return ir.passes.PassResult(model, modified=False)

    with pytest.raises(PassInvariantError, match=r"^OrtInvalidIndexPass broke its invariant: 1 invalid-index "
                                                 r"constants still reach GatherND/ScatterND indices$"):
        Idle()(_gather_graph())
