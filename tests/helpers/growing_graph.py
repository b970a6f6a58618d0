"""A tiny growing past/present graph (``present.<i>.key = Concat(past_key_values.<i>.key, new)``), built with
onnx.helper, for the refusals of the dialect conversions (tests/graph/passes/test_pass_to_dialect.py,
tests/tools/test_rewrite_to.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qeff_kv.contract import naming


def growing_graph(path, *, layers: int = 1) -> Path:
    """Write the graph to ``path``; logits are a sum over the grown key buffer, enough to run it."""
    nodes, inputs, outputs = [], [], []
    inputs.append(helper.make_tensor_value_info(naming.INPUT_IDS_INPUT, TensorProto.INT64, ["batch", "seq"]))
    embed = numpy_helper.from_array(np.ones((16, 2, 1, 4), np.float32), "embed")
    nodes += [helper.make_node("Gather", ["embed", naming.INPUT_IDS_INPUT], ["e5"]),
              helper.make_node("Squeeze", ["e5", "one"], ["e4"])]
    for i in range(layers):
        for stem in naming.EXPORT_STEMS:
            past = naming.dialect_name(naming.PAST_PRESENT, stem, i)
            present = naming.dialect_name(naming.PAST_PRESENT, stem, i, output=True)
            inputs.append(helper.make_tensor_value_info(past, TensorProto.FLOAT, ["batch", 2, "past", 4]))
            outputs.append(helper.make_tensor_value_info(present, TensorProto.FLOAT, ["batch", 2, "total", 4]))
            nodes.append(helper.make_node("Transpose", ["e4"], [f"new_{stem}_{i}"], perm=[0, 2, 1, 3]))
            nodes.append(helper.make_node("Concat", [past, f"new_{stem}_{i}"], [present], axis=2))
    nodes.append(helper.make_node("ReduceSum", [outputs[0].name], [naming.LOGITS_OUTPUT], keepdims=1))
    outputs.insert(0, helper.make_tensor_value_info(naming.LOGITS_OUTPUT, TensorProto.FLOAT, [None, 1, 1, 1]))
    one = numpy_helper.from_array(np.array([2], np.int64), "one")
    graph = helper.make_graph(nodes, "growing", inputs, outputs, [embed, one])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    onnx.checker.check_model(model)
    onnx.save(model, Path(path))
    return Path(path)
