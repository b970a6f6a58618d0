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


# ------------------------------------------------------------------ a tiny growing decoder (issue 49: runs)
def _w(rng, name: str, shape, scale: float):
    return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)


def _attention_layer(i: int, rng, nodes: list, inits: list, h: str, *, hidden: int, heads: int, head_dim: int) -> str:
    """One layer: q, k, v; ``present = Concat(past, new, axis=2)``; softmax over the present's positions allowed by
    the causal mask (key slot ``j`` <= the query's position) and ``attention_mask``; a residual, Tanh."""
    p, width = f"layers.{i}", heads * head_dim
    for w, shape in (("wq", (hidden, width)), ("wk", (hidden, width)), ("wv", (hidden, width)),
                     ("wo", (width, hidden))):
        inits.append(_w(rng, f"{p}.{w}", shape, 1.0 / np.sqrt(shape[0])))
    for proj in ("q", "k", "v"):
        nodes += [helper.make_node("MatMul", [h, f"{p}.w{proj}"], [f"{p}/{proj}3"]),
                  helper.make_node("Reshape", [f"{p}/{proj}3", "heads_shape"], [f"{p}/{proj}4"]),
                  helper.make_node("Transpose", [f"{p}/{proj}4"], [f"{p}/{proj}"], perm=[0, 2, 1, 3])]
    key, value = (naming.dialect_name(naming.PAST_PRESENT, stem, i, output=o)
                  for stem, o in (("past_key", True), ("past_value", True)))
    past_key, past_value = (naming.dialect_name(naming.PAST_PRESENT, stem, i) for stem in naming.EXPORT_STEMS)
    nodes += [
        helper.make_node("Concat", [past_key, f"{p}/k"], [key], axis=2),
        helper.make_node("Concat", [past_value, f"{p}/v"], [value], axis=2),
        helper.make_node("Transpose", [key], [f"{p}/kT"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", [f"{p}/q", f"{p}/kT"], [f"{p}/qk"]),
        helper.make_node("Mul", [f"{p}/qk", "scale"], [f"{p}/scores"]),
        helper.make_node("Where", ["allowed", f"{p}/scores", "minus_inf"], [f"{p}/masked"]),
        helper.make_node("Softmax", [f"{p}/masked"], [f"{p}/probs"], axis=-1),
        helper.make_node("MatMul", [f"{p}/probs", value], [f"{p}/ctx4"]),
        helper.make_node("Transpose", [f"{p}/ctx4"], [f"{p}/ctxT"], perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", [f"{p}/ctxT", "flat_shape"], [f"{p}/ctx"]),
        helper.make_node("MatMul", [f"{p}/ctx", f"{p}.wo"], [f"{p}/o"]),
        helper.make_node("Add", [h, f"{p}/o"], [f"{p}/res"]),
        helper.make_node("Tanh", [f"{p}/res"], [f"{p}/h"]),
    ]
    return f"{p}/h"


def _mask_nodes(past0: str) -> list:
    """``allowed [batch, 1, seq, total]``: key slot ``j`` <= the query's position, and ``attention_mask[b, j]``."""
    return [
        helper.make_node("Shape", [past0], ["past_len"], start=2, end=3),
        helper.make_node("Shape", [naming.INPUT_IDS_INPUT], ["seq_len"], start=1, end=2),
        helper.make_node("Add", ["past_len", "seq_len"], ["total"]),
        helper.make_node("Squeeze", ["total"], ["total_s"]),
        helper.make_node("Range", ["zero", "total_s", "one_s"], ["kpos"]),
        helper.make_node("Unsqueeze", [naming.POSITION_IDS_INPUT, "axes_2"], ["qpos"]),
        helper.make_node("LessOrEqual", ["kpos", "qpos"], ["causal"]),
        helper.make_node("Cast", [naming.ATTENTION_MASK_INPUT], ["held_b"], to=TensorProto.BOOL),
        helper.make_node("Unsqueeze", ["held_b", "axes_1"], ["held"]),
        helper.make_node("And", ["causal", "held"], ["allowed3"]),
        helper.make_node("Unsqueeze", ["allowed3", "axes_1"], ["allowed"]),
    ]


def growing_decoder(path, *, layers: int = 2, seed: int = 0, capacity: int = 64, vocab: int = 64,
                    hidden: int = 32, heads: int = 2, head_dim: int = 8) -> Path:
    """A tiny seeded-random decoder in the growing past/present dialect, as mobius-onnx's and optimum's default
    builds wire it (``present = Concat(past, new)``, ``attention_mask [batch, past + seq]``, ``position_ids``); a
    learned positional embedding gathered at ``position_ids`` stands in for RoPE. Writes ``path``; returns it."""
    rng = np.random.default_rng(seed)
    inits = [_w(rng, "embed", (vocab, hidden), 1.0), _w(rng, "pos_embed", (capacity, hidden), 1.0),
             _w(rng, "lm_head", (hidden, vocab), 2.0 / np.sqrt(hidden)),
             numpy_helper.from_array(np.array([0, 0, heads, head_dim], np.int64), "heads_shape"),
             numpy_helper.from_array(np.array([0, 0, heads * head_dim], np.int64), "flat_shape"),
             numpy_helper.from_array(np.array(1.0 / np.sqrt(head_dim), np.float32), "scale"),
             numpy_helper.from_array(np.array(-1e9, np.float32), "minus_inf"),
             numpy_helper.from_array(np.array(0, np.int64), "zero"),
             numpy_helper.from_array(np.array(1, np.int64), "one_s"),
             numpy_helper.from_array(np.array([1], np.int64), "axes_1"),
             numpy_helper.from_array(np.array([2], np.int64), "axes_2")]
    nodes = [helper.make_node("Gather", ["embed", naming.INPUT_IDS_INPUT], ["tok"]),
             helper.make_node("Gather", ["pos_embed", naming.POSITION_IDS_INPUT], ["pos"]),
             helper.make_node("Add", ["tok", "pos"], ["h0"])]
    nodes += _mask_nodes(naming.dialect_name(naming.PAST_PRESENT, "past_key", 0))
    h = "h0"
    for i in range(layers):
        h = _attention_layer(i, rng, nodes, inits, h, hidden=hidden, heads=heads, head_dim=head_dim)
    nodes.append(helper.make_node("MatMul", [h, "lm_head"], [naming.LOGITS_OUTPUT]))
    tok = ["batch", "sequence_len"]
    inputs = [helper.make_tensor_value_info(naming.INPUT_IDS_INPUT, TensorProto.INT64, tok),
              helper.make_tensor_value_info(naming.ATTENTION_MASK_INPUT, TensorProto.INT64,
                                            ["batch", "past_sequence_len + sequence_len"]),
              helper.make_tensor_value_info(naming.POSITION_IDS_INPUT, TensorProto.INT64, tok)]
    outputs = [helper.make_tensor_value_info(naming.LOGITS_OUTPUT, TensorProto.FLOAT, tok + [vocab])]
    for i in range(layers):
        for stem in naming.EXPORT_STEMS:
            inputs.append(helper.make_tensor_value_info(naming.dialect_name(naming.PAST_PRESENT, stem, i),
                                                        TensorProto.FLOAT, ["batch", heads, "past_sequence_len",
                                                                            head_dim]))
            outputs.append(helper.make_tensor_value_info(
                naming.dialect_name(naming.PAST_PRESENT, stem, i, output=True), TensorProto.FLOAT,
                ["batch", heads, "past_sequence_len + sequence_len", head_dim]))
    graph = helper.make_graph(nodes, "growing_decoder", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    onnx.checker.check_model(model)
    onnx.save(model, Path(path))
    return Path(path)
