"""Small retained-state graphs built with onnx.helper for the rewrite/check/buffers tests.

Every layer's KV input is updated by one ``ScatterND`` straight into its retained output (in-place safe),
and the graph runs in onnxruntime. Options let a test break one rule at a time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qeff_kv import naming

KV_DIMS = ["batch_size", 2, "ctx_len", 4]


def build(layers: int = 2, prefix: str | None | Sequence[str | None] = None, *,
          stems: Sequence[str] = naming.EXPORT_STEMS,
          extra_inputs: Sequence[str] = (), extra_outputs: Sequence[str] = (),
          initializer_inputs: Sequence[str] = (), intermediate: Sequence[str] = (),
          drop_outputs: Sequence[str] = (), drop_inputs: Sequence[str] = (),
          output_dims: dict[str, list] | None = None, output_dtype: dict[str, int] | None = None,
          extra_reader: str | None = None, non_kv_retained: Sequence[str] = (),
          layer_ids: Sequence[int] | None = None, ir_version: int = 8) -> onnx.ModelProto:
    """A retained-state graph with ``layers`` layers of ``stems``; ``prefix`` may be one per layer."""
    layer_ids = list(range(layers)) if layer_ids is None else list(layer_ids)
    prefixes = list(prefix) if isinstance(prefix, (list, tuple)) else [prefix] * len(layer_ids)
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", "seq_len"]),
              helper.make_tensor_value_info("kv_update", TensorProto.FLOAT, [1, 2, "ctx_len", 4])]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch_size", "seq_len"])]
    nodes = [helper.make_node("Cast", ["input_ids"], ["logits"], to=TensorProto.FLOAT, name="cast_logits")]
    inits = [numpy_helper.from_array(np.array([[0]], dtype=np.int64), "scatter_idx")]
    output_dims = output_dims or {}
    output_dtype = output_dtype or {}
    for layer, p in zip(layer_ids, prefixes):
        for stem in stems:
            x = naming.kv_input_name(stem, layer, p)
            y = naming.retained_name(x)
            if x not in drop_inputs:
                inputs.append(helper.make_tensor_value_info(x, TensorProto.FLOAT, KV_DIMS))
            if y not in drop_outputs:
                outputs.append(helper.make_tensor_value_info(
                    y, output_dtype.get(y, TensorProto.FLOAT), output_dims.get(y, KV_DIMS)))
            if x not in drop_inputs and y not in drop_outputs:
                nodes.append(helper.make_node("ScatterND", [x, "scatter_idx", "kv_update"], [y], name=f"scatter_{x}"))
            elif x not in drop_inputs:
                nodes.append(helper.make_node("Shape", [x], [f"shape_of_{x}"], name=f"shape_{x}"))
            elif y not in drop_outputs:
                nodes.append(helper.make_node("Identity", ["kv_update"], [y], name=f"id_{y}"))
    if extra_reader is not None:  # a second reader of a KV input: breaks in-place safety
        nodes.append(helper.make_node("ReduceSum", [extra_reader], ["extra_sum"], keepdims=0, name="extra_reader"))
        outputs.append(helper.make_tensor_value_info("extra_sum", TensorProto.FLOAT, []))
    for n in extra_inputs:
        inputs.append(helper.make_tensor_value_info(n, TensorProto.FLOAT, [1]))
        nodes.append(helper.make_node("Identity", [n], [f"{n}__copy"], name=f"use_{n}"))
    for n in extra_outputs:
        outputs.append(helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch_size", "seq_len"]))
        nodes.append(helper.make_node("Identity", ["logits"], [n], name=f"make_{n}"))
    for n in non_kv_retained:  # e.g. vision_embeds / vision_embeds_RetainedState (names given in full)
        src = naming.retained_source(n)
        if src is None:
            inputs.append(helper.make_tensor_value_info(n, TensorProto.FLOAT, [1]))
        else:
            outputs.append(helper.make_tensor_value_info(n, TensorProto.FLOAT, [1]))
            nodes.append(helper.make_node("Identity", [src], [n], name=f"keep_{n}"))
    for n in initializer_inputs:
        inits.append(numpy_helper.from_array(np.zeros([1], dtype=np.float32), n))
        inputs.append(helper.make_tensor_value_info(n, TensorProto.FLOAT, [1]))
        nodes.append(helper.make_node("Identity", [n], [f"{n}__copy"], name=f"use_{n}"))
    for n in intermediate:
        nodes.append(helper.make_node("Identity", ["logits"], [n], name=f"mid_{n}"))
        nodes.append(helper.make_node("Identity", [n], [f"{n}__sink"], name=f"sink_{n}"))
    graph = helper.make_graph(nodes, "kv_test", inputs, outputs, initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="qeff-kv-tests")
    model.ir_version = ir_version
    helper.set_model_props(model, {"origin": "tests"})
    return model


def save(model: onnx.ModelProto, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def io_signature(path_or_proto) -> tuple[list, list]:
    """(inputs, outputs) as lists of (name, elem_type, dims) with dim names kept; initializer inputs skipped."""
    m = path_or_proto if isinstance(path_or_proto, onnx.ModelProto) else onnx.load(str(path_or_proto),
                                                                                     load_external_data=False)
    inits = {i.name for i in m.graph.initializer}

    def sig(vi):
        t = vi.type.tensor_type
        dims = None if not t.HasField("shape") else [
            d.dim_param if d.HasField("dim_param") else (d.dim_value if d.HasField("dim_value") else None)
            for d in t.shape.dim]
        return (vi.name, t.elem_type, dims)

    return ([sig(v) for v in m.graph.input if v.name not in inits], [sig(v) for v in m.graph.output])
