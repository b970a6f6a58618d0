"""A traced graph over 2 GB (torch writes every large tensor to its own file, Constant attributes included) is
saved by the exporter with its Constant tensors inline and its initializers in the one data file: the saved
graph loads and runs from its own folder once the traced folder is gone. No torch: a small graph stands in,
with the size threshold lowered."""

from __future__ import annotations

import shutil

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from qeff_kv.graph import graphio
from qeff_kv.export import options as opt
from qeff_kv.export import publish


def test_external_constant_attribute_inlined_when_saving_with_external_data(tmp_path, monkeypatch):
    traced = tmp_path / "raw"
    traced.mkdir()
    c = np.arange(12, dtype=np.float32).reshape(3, 4)
    w = np.ones((4, 4), np.float32)
    const = numpy_helper.from_array(c, "cos_cache")
    init = numpy_helper.from_array(w, "W")
    for t, fname in ((const, "cos_cache_file"), (init, "W_file")):   # as torch writes a graph over 2 GB
        (traced / fname).write_bytes(t.raw_data)
        t.ClearField("raw_data")
        t.data_location = TensorProto.EXTERNAL
        t.external_data.add(key="location", value=fname)
    graph = helper.make_graph(
        [helper.make_node("Constant", [], ["c"], value=const), helper.make_node("MatMul", ["c", "W"], ["m"]),
         helper.make_node("Add", ["m", "x"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 4])], [init])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8),
              str(traced / "model.onnx"))
    model = graphio.load(traced / "model.onnx")
    monkeypatch.setattr(opt, "EXTERNAL_DATA_THRESHOLD", 0)
    out = tmp_path / "stage" / "model.onnx"
    out.parent.mkdir()
    publish.save_graph(model, out, lambda _m: None)
    shutil.rmtree(traced)
    assert sorted(p.name for p in out.parent.iterdir()) == ["model.onnx", "model.onnx.data"]
    x = np.full((3, 4), 0.5, np.float32)
    y = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_array_equal(y, c @ w + x)
