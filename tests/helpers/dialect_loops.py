"""Greedy loops over a decoder graph of any KV dialect, and a tiny static-cache graph (issue 49).

* :func:`greedy_loop` feeds a graph with plain onnxruntime (no qeff_kv runtime), one sequence: the whole prompt in
  one step, then one token per step. Retained state and shared-buffer past/present: ``[1, heads, capacity,
  head_dim]`` zero buffers fed and replaced by the step's outputs, ``position_ids`` = arange, ``attention_mask``
  (when taken) ``[1, positions held after the step]``; growing past/present: a 0-length past, the present fed back;
  static cache: ``[1, capacity, heads*head_dim]`` buffers, ``write_indices=[start]``,
  ``nonpad_kv_seqlen=[start+len]``.
* :func:`static_cache_graph` writes a tiny seeded-random decoder in the static-cache dialect exactly as mobius-onnx
  ``--static-cache`` wires it: ``TensorScatter(cache, new, write_indices, axis=1)`` into ``updated_*_cache.<i>``,
  then ai.onnx ``Attention(q, updated_key, updated_value, '', '', '', nonpad_kv_seqlen)`` (opset 24, ``is_causal``,
  ``q_num_heads``/``kv_num_heads``/``scale``); a learned positional embedding gathered at ``position_ids`` stands in
  for RoPE, so position matters.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from qeff_kv.contract import naming

_NP = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64}


def _kv_dialect(inputs) -> str:
    for i in inputs:
        parsed = naming.parse_any_kv_name(i.name)
        if parsed is not None:
            return parsed.dialect
    raise ValueError("graph has no KV inputs")


def _grows(sess: ort.InferenceSession) -> bool:
    """past/present whose present's positions axis differs from the past's (concat), not a shared buffer."""
    outs = {o.name: o.shape for o in sess.get_outputs()}
    for i in sess.get_inputs():
        parsed = naming.parse_any_kv_name(i.name)
        if parsed is not None and parsed.dialect == naming.PAST_PRESENT:
            return outs.get(parsed.output, [None] * 4)[2] != i.shape[2]
    return False


def _zeros(info, dialect: str, capacity: int, grows: bool) -> np.ndarray:
    dtype = _NP.get(info.type, np.float32)
    if dialect == naming.STATIC_CACHE:
        return np.zeros((1, capacity, int(info.shape[2])), dtype)
    heads, head_dim = int(info.shape[1]), int(info.shape[3])
    return np.zeros((1, heads, 0 if grows else capacity, head_dim), dtype)


def _feeds(sess, dialect: str, state: dict, ids: Sequence[int], start: int) -> dict:
    n = len(ids)
    feeds = dict(state)
    for i in sess.get_inputs():
        if i.name in feeds:
            continue
        if i.name == naming.INPUT_IDS_INPUT:
            feeds[i.name] = np.asarray([ids], np.int64)
        elif i.name == naming.POSITION_IDS_INPUT:
            feeds[i.name] = np.arange(start, start + n, dtype=np.int64)[None, :]
        elif i.name == naming.ATTENTION_MASK_INPUT:
            feeds[i.name] = np.ones((1, start + n), np.int64)
        elif i.name == naming.WRITE_INDICES_INPUT:
            feeds[i.name] = np.asarray([start], np.int64)
        elif i.name == naming.NONPAD_KV_SEQLEN_INPUT:
            feeds[i.name] = np.asarray([start + n], np.int64)
        else:
            raise ValueError(f"greedy_loop does not know how to feed input {i.name!r}")
    return feeds


def greedy_loop(onnx_path, prompt_ids: Sequence[int], n_tokens: int, *, capacity: int) -> list[int]:
    """Greedy-decode ``n_tokens`` after ``prompt_ids`` with ``onnx_path`` (any KV dialect), one sequence."""
    opts = ort.SessionOptions()
    opts.log_severity_level = 3   # TensorScatter's "in-place optimization not activated" warning, once a node a step
    sess = ort.InferenceSession(str(onnx_path), opts, providers=["CPUExecutionProvider"])
    dialect = _kv_dialect(sess.get_inputs())
    grows = _grows(sess)
    state = {i.name: _zeros(i, dialect, capacity, grows) for i in sess.get_inputs()
             if naming.parse_any_kv_name(i.name) is not None}
    out_names = [o.name for o in sess.get_outputs()]
    ids, start, tokens = list(prompt_ids), 0, []
    for _ in range(n_tokens):
        results = dict(zip(out_names, sess.run(None, _feeds(sess, dialect, state, ids, start))))
        token = int(np.argmax(results[naming.LOGITS_OUTPUT][0, -1]))
        tokens.append(token)
        for name in state:
            state[name] = results[naming.parse_any_kv_name(name).output]
        start += len(ids)
        ids = [token]
    return tokens


def convert(src, dst, to: str):
    """``src`` converted to dialect ``to`` (:func:`qeff_kv.graph.passes.dialects.to_dialect.conversion_pass`) and saved
    at ``dst``; returns the converted model."""
    from qeff_kv.graph import graphio
    from qeff_kv.graph.passes.dialects.to_dialect import conversion_pass

    model = graphio.load(src)
    conversion_pass(model, to)(model)
    graphio.save(model, dst, source_dir=Path(src).parent)
    return model


def session_greedy(session, prompt, n: int, seq=None) -> list[int]:
    """``n`` greedy tokens after ``prompt`` from a qeff-kv ``Session`` (the first from the prefill's logits), by
    ``prefill`` and ``decode`` one sequence at a time: what the runtime tests compare with :func:`greedy_loop`."""
    seq = seq if seq is not None else session.add_sequence()
    tok = int(np.argmax(session.prefill(seq, prompt)))
    out = [tok]
    while len(out) < n:
        tok = int(np.argmax(session.decode({seq: tok})[seq]))
        out.append(tok)
    return out


# ------------------------------------------------------------------ the handmade static-cache graph
def _init(rng, name: str, shape, scale: float):
    return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)


def _layer(i: int, rng, nodes: list, inits: list, h: str, *, hidden, q_heads, kv_heads, head_dim) -> str:
    kv_dim, q_dim = kv_heads * head_dim, q_heads * head_dim
    p = f"layers.{i}"
    for w, shape in (("wq", (hidden, q_dim)), ("wk", (hidden, kv_dim)), ("wv", (hidden, kv_dim)),
                     ("wo", (q_dim, hidden))):
        inits.append(_init(rng, f"{p}.{w}", shape, 1.0 / np.sqrt(shape[0])))
    key_in = naming.dialect_name(naming.STATIC_CACHE, "past_key", i)
    value_in = naming.dialect_name(naming.STATIC_CACHE, "past_value", i)
    key_out = naming.dialect_name(naming.STATIC_CACHE, "past_key", i, output=True)
    value_out = naming.dialect_name(naming.STATIC_CACHE, "past_value", i, output=True)
    nodes += [
        helper.make_node("MatMul", [h, f"{p}.wq"], [f"{p}/q"]),
        helper.make_node("MatMul", [h, f"{p}.wk"], [f"{p}/k"]),
        helper.make_node("MatMul", [h, f"{p}.wv"], [f"{p}/v"]),
        helper.make_node("TensorScatter", [key_in, f"{p}/k", naming.WRITE_INDICES_INPUT], [key_out], axis=1,
                         name=f"{p}/TensorScatter_key"),
        helper.make_node("TensorScatter", [value_in, f"{p}/v", naming.WRITE_INDICES_INPUT], [value_out], axis=1,
                         name=f"{p}/TensorScatter_value"),
        helper.make_node("Attention", [f"{p}/q", key_out, value_out, "", "", "", naming.NONPAD_KV_SEQLEN_INPUT],
                         [f"{p}/attn"], name=f"{p}/Attention", kv_num_heads=kv_heads, q_num_heads=q_heads,
                         scale=float(1.0 / np.sqrt(head_dim)), is_causal=1, softcap=0.0),
        helper.make_node("MatMul", [f"{p}/attn", f"{p}.wo"], [f"{p}/o"]),
        helper.make_node("Add", [h, f"{p}/o"], [f"{p}/res"]),
        helper.make_node("Tanh", [f"{p}/res"], [f"{p}/h"]),
    ]
    return f"{p}/h"


def static_cache_graph(path, *, layers: int = 2, seed: int = 0, capacity: int = 32, vocab: int = 64,
                       hidden: int = 32, q_heads: int = 4, kv_heads: int = 2, head_dim: int = 8,
                       prefix: str | None = None) -> Path:
    """Write a tiny seeded-random static-cache decoder to ``path`` (see the module docstring); returns ``path``."""
    rng = np.random.default_rng(seed)
    kv_dim = kv_heads * head_dim
    inits = [_init(rng, "embed", (vocab, hidden), 1.0), _init(rng, "pos_embed", (capacity, hidden), 1.0),
             _init(rng, "lm_head", (hidden, vocab), 2.0 / np.sqrt(hidden))]
    nodes = [helper.make_node("Gather", ["embed", naming.INPUT_IDS_INPUT], ["tok"]),
             helper.make_node("Gather", ["pos_embed", naming.POSITION_IDS_INPUT], ["pos"]),
             helper.make_node("Add", ["tok", "pos"], ["h0"])]
    h = "h0"
    for i in range(layers):
        h = _layer(i, rng, nodes, inits, h, hidden=hidden, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim)
    nodes.append(helper.make_node("MatMul", [h, "lm_head"], [naming.LOGITS_OUTPUT]))
    tok_shape = ["batch", "sequence_len"]
    inputs = [helper.make_tensor_value_info(naming.INPUT_IDS_INPUT, TensorProto.INT64, tok_shape),
              helper.make_tensor_value_info(naming.POSITION_IDS_INPUT, TensorProto.INT64, tok_shape)]
    outputs = [helper.make_tensor_value_info(naming.LOGITS_OUTPUT, TensorProto.FLOAT, tok_shape + [vocab])]
    for i in range(layers):
        for stem in naming.EXPORT_STEMS:
            for output, values in ((False, inputs), (True, outputs)):
                values.append(helper.make_tensor_value_info(
                    naming.dialect_name(naming.STATIC_CACHE, stem, i, output=output), TensorProto.FLOAT,
                    ["batch", capacity, kv_dim]))
    inputs += [helper.make_tensor_value_info(n, TensorProto.INT64, ["batch"])
               for n in (naming.WRITE_INDICES_INPUT, naming.NONPAD_KV_SEQLEN_INPUT)]
    graph = helper.make_graph(nodes, "static_cache_decoder", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24)], ir_version=10)
    onnx.checker.check_model(model)
    path = Path(path)
    onnx.save(model, path)
    if prefix is not None:
        from qeff_kv.tools.rewrite import rewrite

        rewrite(path, in_place=True, prefix=prefix)
    return path


def step_logits(onnx_path, chunks: Sequence[Sequence[int]], *, capacity: int) -> list[np.ndarray]:
    """The logits of each step when ``chunks`` are fed one after another (a chunked prefill), one sequence, fed as
    :func:`greedy_loop` feeds the graph's dialect."""
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    sess = ort.InferenceSession(str(onnx_path), opts, providers=["CPUExecutionProvider"])
    dialect, grows = _kv_dialect(sess.get_inputs()), _grows(sess)
    state = {i.name: _zeros(i, dialect, capacity, grows) for i in sess.get_inputs()
             if naming.parse_any_kv_name(i.name) is not None}
    out_names = [o.name for o in sess.get_outputs()]
    start, logits = 0, []
    for ids in chunks:
        results = dict(zip(out_names, sess.run(None, _feeds(sess, dialect, state, list(ids), start))))
        logits.append(results[naming.LOGITS_OUTPUT][0])
        for name in state:
            state[name] = results[naming.parse_any_kv_name(name).output]
        start += len(ids)
    return logits


# ------------------------------------------------------------------ the handmade growing (mobius default) graph
def _mask_nodes() -> list:
    """mobius-onnx's default mask: ``attention_mask`` cast to bool, broadcast to ``[batch, 1, seq, total]``."""
    m, ids = naming.ATTENTION_MASK_INPUT, naming.INPUT_IDS_INPUT
    return [helper.make_node("Cast", [m], ["mask/bool"], to=TensorProto.BOOL),
            helper.make_node("Unsqueeze", ["mask/bool", "axis1"], ["mask/rows"]),
            helper.make_node("Shape", [ids], ["mask/batch"], start=0, end=1),
            helper.make_node("Shape", [ids], ["mask/seq"], start=1, end=2),
            helper.make_node("Shape", [m], ["mask/total"], start=1, end=2),
            helper.make_node("Concat", ["mask/batch", "mask/seq", "mask/total"], ["mask/shape"], axis=0),
            helper.make_node("Expand", ["mask/rows", "mask/shape"], ["mask/expanded"]),
            helper.make_node("Unsqueeze", ["mask/expanded", "axis1"], ["mask/4d"])]


def _growing_layer(i: int, rng, nodes: list, inits: list, h: str, *, hidden, q_heads, kv_heads, head_dim,
                   four_d: bool) -> str:
    kv_dim, q_dim = kv_heads * head_dim, q_heads * head_dim
    p = f"layers.{i}"
    for w, shape in (("wq", (hidden, q_dim)), ("wk", (hidden, kv_dim)), ("wv", (hidden, kv_dim)),
                     ("wo", (q_dim, hidden))):
        inits.append(_init(rng, f"{p}.{w}", shape, 1.0 / np.sqrt(shape[0])))
    nodes += [helper.make_node("MatMul", [h, f"{p}.{w}"], [f"{p}/{w[1]}"]) for w in ("wq", "wk", "wv")]
    qkv = [f"{p}/q", f"{p}/k", f"{p}/v"]
    if four_d:   # [batch, seq, heads*head_dim] -> [batch, heads, seq, head_dim]
        for name, heads in zip(list(qkv), (q_heads, kv_heads, kv_heads)):
            nodes += [helper.make_node("Reshape", [name, f"split{heads}"], [f"{name}/split"]),
                      helper.make_node("Transpose", [f"{name}/split"], [f"{name}/4d"], perm=[0, 2, 1, 3])]
        qkv = [f"{n}/4d" for n in qkv]
    past = [naming.dialect_name(naming.PAST_PRESENT, s, i) for s in naming.EXPORT_STEMS]
    present = [naming.dialect_name(naming.PAST_PRESENT, s, i, output=True) for s in naming.EXPORT_STEMS]
    attn = f"{p}/attn"
    nodes.append(helper.make_node("Attention", qkv + ["mask/4d"] + past, [attn] + present, name=f"{p}/Attention",
                                  kv_num_heads=kv_heads, q_num_heads=q_heads, scale=float(1.0 / np.sqrt(head_dim)),
                                  is_causal=1, softcap=0.0))
    if four_d:
        nodes += [helper.make_node("Transpose", [attn], [f"{attn}/seq_first"], perm=[0, 2, 1, 3]),
                  helper.make_node("Reshape", [f"{attn}/seq_first", "packed"], [f"{attn}/packed"])]
        attn = f"{attn}/packed"
    nodes += [helper.make_node("MatMul", [attn, f"{p}.wo"], [f"{p}/o"]),
              helper.make_node("Add", [h, f"{p}/o"], [f"{p}/res"]),
              helper.make_node("Tanh", [f"{p}/res"], [f"{p}/h"])]
    return f"{p}/h"


def growing_attention_graph(path, *, layers: int = 2, seed: int = 0, positions: int = 64, vocab: int = 64,
                            hidden: int = 32, q_heads: int = 4, kv_heads: int = 2, head_dim: int = 8,
                            four_d: bool = False) -> Path:
    """Write a tiny seeded-random growing past/present decoder as mobius-onnx's default build wires it: ai.onnx
    ``Attention(q, k, v, mask, past_key_values.<i>.key, past_key_values.<i>.value) -> (y, present.<i>.key,
    present.<i>.value)`` (opset 24, 3-D q/k/v; ``four_d``: 4-D), the mask built from ``attention_mask``; the same
    blocks as :func:`static_cache_graph` (its twin for one seed)."""
    rng = np.random.default_rng(seed)
    inits = [_init(rng, "embed", (vocab, hidden), 1.0), _init(rng, "pos_embed", (positions, hidden), 1.0),
             _init(rng, "lm_head", (hidden, vocab), 2.0 / np.sqrt(hidden)),
             numpy_helper.from_array(np.array([1], np.int64), "axis1"),
             numpy_helper.from_array(np.array([0, 0, q_heads * head_dim], np.int64), "packed")]
    inits += [numpy_helper.from_array(np.array([0, 0, n, head_dim], np.int64), f"split{n}")
              for n in sorted({q_heads, kv_heads})]
    nodes = [helper.make_node("Gather", ["embed", naming.INPUT_IDS_INPUT], ["tok"]),
             helper.make_node("Gather", ["pos_embed", naming.POSITION_IDS_INPUT], ["pos"]),
             helper.make_node("Add", ["tok", "pos"], ["h0"])] + _mask_nodes()
    h = "h0"
    for i in range(layers):
        h = _growing_layer(i, rng, nodes, inits, h, hidden=hidden, q_heads=q_heads, kv_heads=kv_heads,
                           head_dim=head_dim, four_d=four_d)
    nodes.append(helper.make_node("MatMul", [h, "lm_head"], [naming.LOGITS_OUTPUT]))
    tok_shape = ["batch", "sequence_len"]
    inputs = [helper.make_tensor_value_info(naming.INPUT_IDS_INPUT, TensorProto.INT64, tok_shape),
              helper.make_tensor_value_info(naming.ATTENTION_MASK_INPUT, TensorProto.INT64, ["batch", "total"]),
              helper.make_tensor_value_info(naming.POSITION_IDS_INPUT, TensorProto.INT64, tok_shape)]
    outputs = [helper.make_tensor_value_info(naming.LOGITS_OUTPUT, TensorProto.FLOAT, tok_shape + [vocab])]
    for i in range(layers):
        for stem in naming.EXPORT_STEMS:
            for output, values, n in ((False, inputs, "past"), (True, outputs, "past + sequence_len")):
                values.append(helper.make_tensor_value_info(
                    naming.dialect_name(naming.PAST_PRESENT, stem, i, output=output), TensorProto.FLOAT,
                    ["batch", kv_heads, n, head_dim]))
    model = helper.make_model(helper.make_graph(nodes, "growing_decoder", inputs, outputs, inits),
                              opset_imports=[helper.make_opsetid("", 24)], ir_version=10)
    model = onnx.shape_inference.infer_shapes(model)
    onnx.checker.check_model(model)
    onnx.save(model, Path(path))
    return Path(path)
