"""The hand-made ring graph of the runtime's sliding-window tests (tests/runtime/test_runtime_ring.py), shared by the
tests of other folders that need a small graph with a ring layer and a full-length layer (no exporter, no torch).

The graph (``ring_graph``) writes, for every token at position ``p``, the key ``[token, p]`` and the value
``[-token, -p]`` into each layer's buffer: layer 0 a ring (axis ``sliding_window``, slot ``p % C``), layer 1 a
full-length cache (axis ``ctx_len``, slot ``p``) unless ``global_layer=False``. Padding rows (``position_ids =
-1``) repeat their row's last valid token and position, as our exports do. Logits are zeros (greedy picks 0).
"""

from __future__ import annotations

import json

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qeff_kv.contract import naming

V = 16
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7]   # 14 tokens: more than two windows of 6


def ring_graph(path, *, window: int | None = 6, cache: str | None = "ring", ring_dim="sliding_window",
               global_layer: bool = True, ring_layer: bool = True, seq_len="seq_len", cb: bool = False,
               manifest: dict | None = None):
    """Write the graph (and, with ``manifest``, a manifest.json naming it) under ``path``; returns the model path
    (the folder when a manifest is written)."""
    path.mkdir(parents=True, exist_ok=True)
    n, i = [], []
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", seq_len]),
              helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch_size", seq_len])]
    if cb:
        inputs.append(helper.make_tensor_value_info("batch_index", TensorProto.INT64, ["batch_size", 1]))
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch_size", 1, V])]
    i += [numpy_helper.from_array(np.array(0, np.int64), "zero"),
          numpy_helper.from_array(np.array([-1], np.int64), "axis_last"),
          numpy_helper.from_array(np.array([1], np.int64), "axis1"),
          numpy_helper.from_array(np.array([1, 3], np.int64), "axes13"),
          numpy_helper.from_array(np.array([1, V], np.int64), "one_v")]
    # padding rows repeat the row's last valid token and position
    n += [helper.make_node("ArgMax", ["position_ids"], ["last"], axis=1, keepdims=1),
          helper.make_node("GatherElements", ["position_ids", "last"], ["last_pos"], axis=1),
          helper.make_node("GatherElements", ["input_ids", "last"], ["last_tok"], axis=1),
          helper.make_node("Less", ["position_ids", "zero"], ["is_pad"]),
          helper.make_node("Where", ["is_pad", "last_pos", "position_ids"], ["pos"]),
          helper.make_node("Where", ["is_pad", "last_tok", "input_ids"], ["tok"]),
          helper.make_node("Cast", ["tok"], ["tok_f"], to=TensorProto.FLOAT),
          helper.make_node("Cast", ["pos"], ["pos_f"], to=TensorProto.FLOAT),
          helper.make_node("Unsqueeze", ["tok_f", "axes13"], ["tok4"]),
          helper.make_node("Unsqueeze", ["pos_f", "axes13"], ["pos4"]),
          helper.make_node("Concat", ["tok4", "pos4"], ["key_new"], axis=3),        # [B, 1, S, 2]
          helper.make_node("Neg", ["key_new"], ["value_new"]),
          helper.make_node("Mul", ["pos", "zero"], ["zeros_bs"])]
    if cb:
        n.append(helper.make_node("Add", ["zeros_bs", "batch_index"], ["rows"]))
    else:
        n.append(helper.make_node("Identity", ["zeros_bs"], ["rows"]))
    n += [helper.make_node("Unsqueeze", ["rows", "axis_last"], ["rows3"]),
          helper.make_node("Unsqueeze", ["zeros_bs", "axis_last"], ["heads3"])]
    layers = ([0] if ring_layer else []) + ([1] if global_layer else [])
    for layer in layers:
        ring = layer == 0
        dims = ["batch_size", 1, ring_dim if ring else "ctx_len", 2]
        x0 = naming.kv_input_name("past_key", layer)
        if ring:
            n += [helper.make_node("Shape", [x0], ["cap"], start=2, end=3),
                  helper.make_node("Mod", ["pos", "cap"], ["slot"])]
        slot = "slot" if ring else "pos"
        n += [helper.make_node("Unsqueeze", [slot, "axis_last"], [f"slot3_{layer}"]),
              helper.make_node("Concat", ["rows3", "heads3", f"slot3_{layer}"], [f"idx3_{layer}"], axis=-1),
              helper.make_node("Unsqueeze", [f"idx3_{layer}", "axis1"], [f"idx_{layer}"])]
        for stem, new in (("past_key", "key_new"), ("past_value", "value_new")):
            x = naming.kv_input_name(stem, layer)
            y = naming.retained_name(x)
            inputs.append(helper.make_tensor_value_info(x, TensorProto.FLOAT, dims))
            # a static ring axis: the retained output still names it (how the runtime tells a ring)
            out_dims = ["batch_size", 1, "sliding_window", 2] if ring and isinstance(ring_dim, int) else dims
            outputs.append(helper.make_tensor_value_info(y, TensorProto.FLOAT, out_dims))
            n.append(helper.make_node("ScatterND", [x, f"idx_{layer}", new], [y]))
    n += [helper.make_node("Shape", ["input_ids"], ["b"], start=0, end=1),
          helper.make_node("Concat", ["b", "one_v"], ["logits_shape"], axis=0),
          helper.make_node("ConstantOfShape", ["logits_shape"], ["logits"],
                           value=numpy_helper.from_array(np.zeros(1, np.float32)))]
    model = helper.make_model(helper.make_graph(n, "ring_test", inputs, outputs, initializer=i),
                              opset_imports=[helper.make_opsetid("", 17)], producer_name="qeff-kv-tests")
    model.ir_version = 8
    props = {}
    if window is not None:
        props[naming.SLIDING_WINDOW_META] = str(window)
    if cache is not None:
        props[naming.SLIDING_CACHE_META] = cache
    if props:
        helper.set_model_props(model, props)
    onnx.checker.check_model(model)
    onnx.save(model, str(path / "model.onnx"))
    if manifest is None:
        return path / "model.onnx"
    (path / "manifest.json").write_text(json.dumps({"onnx": "model.onnx", **manifest}))
    return path
