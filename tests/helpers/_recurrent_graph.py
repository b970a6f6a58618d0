"""A tiny synthetic *hybrid* language-model graph (an attention layer and a recurrent layer), built with
onnx.helper, for the runtime tests of recurrent memory (checkpoints, truncate, copy, state files, hand-off,
prompt reuse) before, and besides, real recurrent exports.

Layer 0 keeps an attention KV pair ``past_key.0`` / ``past_value.0`` ``[full_batch_size, 1, ctx_len, D]`` (the
peer's ``CtxScatter`` pattern: ``ScatterND`` at ``[batch_index, 0, position]``; a padding row at ``position_ids
= -1`` writes slot ``ctx_len - 1``, as the peer's graphs do). Layer 1 keeps a recurrent state (contract section 12):

* ``conv_state.1`` ``[full_batch_size, C, K]``: the last ``K`` token embeddings (a shift register);
* ``recurrent_state.1`` ``[full_batch_size, H, Dh, S]``: ``state' = decay_h * state + k_t (x) v_t`` per token.

Both are read by ``GatherND(X, batch_index)`` and written back by ``ScatterND(X, batch_index, new)`` (in-place
safe: the update depends on the read). A chunk's update runs in closed form (a cumulative sum of log decays, no
loop); padded rows (``position_ids == -1``) have decay 1 and no input, so they leave the state untouched, and they
never enter the shift register (valid tokens are a prefix of each row).

The logits ``[batch, 1, vocab]`` at each row's last valid token depend on the whole history through both kinds:
attention of the last token's query over positions ``[0, p]`` of the KV pair, plus a read-out of the new
recurrent and conv states; so greedy tokens vary, and a wrong state gives other tokens.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

VOCAB, D, C, K, H, DH, S = 48, 8, 6, 3, 2, 4, 3


def build(seed: int = 0, *, decay=(0.9, 0.6), ctx_dim: str = "ctx_len", short_conv: bool = False,
          attention: bool = True, cb: bool = True) -> onnx.ModelProto:
    """The hybrid graph (continuous batching: ``batch_index [batch_size, 1]``). ``short_conv``: layer 1 keeps
    ``conv_state`` alone (an LFM2-style short-conv layer); ``attention=False``: no layer 0 (a pure recurrent model,
    Mamba2-style: no position axis anywhere); ``cb=False``: no ``batch_index`` (row ``b`` of the buffers is input row
    ``b``, the KV batch axis ``batch_size``)."""
    rng = np.random.default_rng(seed)
    w = lambda *shape: (rng.standard_normal(shape) * 1.0).astype(np.float32)  # noqa: E731
    inits = {
        "Eq": w(VOCAB, D), "Ek": w(VOCAB, D), "Ev": w(VOCAB, D),
        "Ec": w(VOCAB, C), "Erk": w(VOCAB, H * DH), "Erv": w(VOCAB, H * S),
        "Wr": w(H * DH * S, D) * 0.5, "Wc": w(C * K, D) * 0.5, "Wout": w(D, VOCAB) * 2.0,
        "log_decay": np.log(np.array(decay, np.float32)).reshape(1, 1, H),
        "zero_i": np.array(0, np.int64), "one_i": np.array(1, np.int64), "neg_big": np.array(-1e9, np.float32),
        "karange": np.arange(K, dtype=np.int64).reshape(1, 1, K),
        "ax0": np.array([0], np.int64), "ax1": np.array([1], np.int64), "ax2": np.array([2], np.int64),
        "ax_1": np.array([-1], np.int64), "shape_rk": np.array([0, 0, H, DH, 1], np.int64),
        "shape_rv": np.array([0, 0, H, 1, S], np.int64), "shape_w": np.array([0, 0, H, 1, 1], np.int64),
        "flat_r": np.array([0, H * DH * S], np.int64), "flat_c": np.array([0, C * K], np.int64),
        "s3": np.array([3], np.int64),
    }
    n = []
    N = helper.make_node
    bi = "batch_index" if cb else "row_index"
    if not cb:   # row b of every buffer for input row b
        n += [N("Shape", ["input_ids"], ["rows"], start=0, end=1), N("Squeeze", ["rows", "ax0"], ["rows_s"]),
              N("Range", ["zero_i", "rows_s", "one_i"], ["row_range"]),
              N("Unsqueeze", ["row_range", "ax1"], ["row_index"])]
    # ---- masks and positions
    n += [N("GreaterOrEqual", ["position_ids", "zero_i"], ["valid"]),               # [b, s]
          N("Cast", ["valid"], ["valid_f"], to=TensorProto.FLOAT),
          N("Cast", ["valid"], ["valid_i"], to=TensorProto.INT64),
          N("ReduceSum", ["valid_i", "ax1"], ["nvalid"], keepdims=1),              # [b, 1]
          N("Sub", ["nvalid", "one_i"], ["last_idx"]),                              # [b, 1]
          N("ReduceMax", ["position_ids"], ["p_last"], axes=[1], keepdims=1),          # [b, 1]
          N("GatherElements", ["input_ids", "last_idx"], ["last_tok"], axis=1)]     # [b, 1]
    # ---- layer 0: attention KV (peer-style scatter at [batch_index, 0, position])
    attn = [N("Shape", ["position_ids"], ["pshape"]),
          N("Expand", [bi, "pshape"], ["bi_s"]),                          # [b, s]
          N("Mul", ["bi_s", "zero_i"], ["zeros_s"]),
          N("Unsqueeze", ["bi_s", "ax_1"], ["bi_u"]), N("Unsqueeze", ["zeros_s", "ax_1"], ["z_u"]),
          N("Unsqueeze", ["position_ids", "ax_1"], ["p_u"]),
          N("Concat", ["bi_u", "z_u", "p_u"], ["idx3"], axis=-1),                    # [b, s, 3]
          N("Unsqueeze", ["idx3", "ax1"], ["kv_idx"]),                               # [b, 1, s, 3]
          N("Gather", ["Ek", "input_ids"], ["k_new"]), N("Gather", ["Ev", "input_ids"], ["v_new"]),
          N("Unsqueeze", ["k_new", "ax1"], ["k_upd"]), N("Unsqueeze", ["v_new", "ax1"], ["v_upd"]),
          N("ScatterND", ["past_key.0", "kv_idx", "k_upd"], ["past_key.0_RetainedState"]),
          N("ScatterND", ["past_value.0", "kv_idx", "v_upd"], ["past_value.0_RetainedState"]),
          N("GatherND", ["past_key.0_RetainedState", bi], ["k_all4"]),    # [b, 1, ctx, D]
          N("GatherND", ["past_value.0_RetainedState", bi], ["v_all4"]),
          N("Squeeze", ["k_all4", "ax1"], ["k_all"]), N("Squeeze", ["v_all4", "ax1"], ["v_all"]),
          N("Gather", ["Eq", "last_tok"], ["q"]),                                    # [b, 1, D]
          N("Transpose", ["k_all"], ["k_t"], perm=[0, 2, 1]),
          N("MatMul", ["q", "k_t"], ["scores"]),                                     # [b, 1, ctx]
          N("Shape", ["past_key.0"], ["ctx"], start=2, end=3),
          N("Squeeze", ["ctx", "ax0"], ["ctx_s"]),
          N("Range", ["zero_i", "ctx_s", "one_i"], ["ctx_pos"]),                     # [ctx]
          N("LessOrEqual", ["ctx_pos", "p_last"], ["allowed"]),                     # [b, ctx]
          N("Unsqueeze", ["allowed", "ax1"], ["allowed_u"]),
          N("Where", ["allowed_u", "scores", "neg_big"], ["masked"]),
          N("Softmax", ["masked"], ["attn"], axis=-1),
          N("MatMul", ["attn", "v_all"], ["attn_out"])]                              # [b, 1, D]
    n += attn if attention else []
    # ---- layer 1: conv shift register
    n += [N("GatherND", ["conv_state.1", bi], ["conv_old"]),              # [b, C, K]
          N("Gather", ["Ec", "input_ids"], ["xc"]),                                  # [b, s, C]
          N("Transpose", ["xc"], ["xc_t"], perm=[0, 2, 1]),                          # [b, C, s]
          N("Concat", ["conv_old", "xc_t"], ["conv_cat"], axis=2),                   # [b, C, K + s]
          N("Unsqueeze", ["nvalid", "ax_1"], ["nvalid_u"]),                          # [b, 1, 1]
          N("Add", ["nvalid_u", "karange"], ["cidx1"]),                              # [b, 1, K]
          N("Shape", ["conv_old"], ["conv_shape"]),
          N("Expand", ["cidx1", "conv_shape"], ["cidx"]),                            # [b, C, K]
          N("GatherElements", ["conv_cat", "cidx"], ["conv_new"], axis=2),
          N("ScatterND", ["conv_state.1", bi, "conv_new"], ["conv_state.1_RetainedState"]),
          N("Reshape", ["conv_new", "flat_c"], ["conv_flat"]),
          N("MatMul", ["conv_flat", "Wc"], ["conv_read"])]                           # [b, D]
    readout = ["conv_read"]
    if not short_conv:
        # ---- layer 1: recurrent state, closed form over the chunk
        n += [N("GatherND", ["recurrent_state.1", bi], ["rec_old"]),      # [b, H, Dh, S]
              N("Unsqueeze", ["valid_f", "ax_1"], ["valid_u"]),                      # [b, s, 1]
              N("Mul", ["valid_u", "log_decay"], ["loga"]),                          # [b, s, H]
              N("CumSum", ["loga", "one_i"], ["L"]),                                 # inclusive
              N("ReduceSum", ["loga", "ax1"], ["LT"], keepdims=1),                   # [b, 1, H]
              N("Sub", ["LT", "L"], ["wlog"]), N("Exp", ["wlog"], ["wt"]),           # [b, s, H]
              N("Mul", ["wt", "valid_u"], ["wtm"]),
              N("Exp", ["LT"], ["decay_all"]),                                       # [b, 1, H]
              N("Gather", ["Erk", "input_ids"], ["rk"]), N("Gather", ["Erv", "input_ids"], ["rv"]),
              N("Reshape", ["rk", "shape_rk"], ["rk5"]), N("Reshape", ["rv", "shape_rv"], ["rv5"]),
              N("Mul", ["rk5", "rv5"], ["u"]),                                       # [b, s, H, Dh, S]
              N("Reshape", ["wtm", "shape_w"], ["w5"]),
              N("Mul", ["u", "w5"], ["uw"]),
              N("ReduceSum", ["uw", "ax1"], ["usum"], keepdims=0),                   # [b, H, Dh, S]
              N("Transpose", ["decay_all"], ["dec_t"], perm=[0, 2, 1])]             # [b, H, 1]
        n += [N("Unsqueeze", ["dec_t", "s3"], ["dec4"]),                             # [b, H, 1, 1]
              N("Mul", ["rec_old", "dec4"], ["rec_decayed"]),
              N("Add", ["rec_decayed", "usum"], ["rec_new"]),
              N("ScatterND", ["recurrent_state.1", bi, "rec_new"], ["recurrent_state.1_RetainedState"]),
              N("Reshape", ["rec_new", "flat_r"], ["rec_flat"]),
              N("MatMul", ["rec_flat", "Wr"], ["rec_read"])]
        readout.append("rec_read")
    # ---- logits
    if attention:
        n += [N("Squeeze", ["attn_out", "ax1"], ["attn_flat"])]
        readout.insert(0, "attn_flat")
    acc = readout[0]
    for i, r in enumerate(readout[1:]):
        n.append(N("Add", [acc, r], [f"h{i}"]))
        acc = f"h{i}"
    n += [N("Tanh", [acc], ["h"]), N("MatMul", ["h", "Wout"], ["logits2"]),
          N("Unsqueeze", ["logits2", "ax1"], ["logits"])]

    T = helper.make_tensor_value_info
    f = TensorProto.FLOAT
    fb = "full_batch_size" if cb else "batch_size"
    inputs = [T("input_ids", TensorProto.INT64, ["batch_size", "seq_len"]),
              T("position_ids", TensorProto.INT64, ["batch_size", "seq_len"])]
    outputs = [T("logits", f, ["batch_size", 1, VOCAB])]
    buffers = [("conv_state.1", [fb, C, K])] + ([] if short_conv else [("recurrent_state.1", [fb, H, DH, S])])
    if attention:
        buffers = [("past_key.0", [fb, 1, ctx_dim, D]), ("past_value.0", [fb, 1, ctx_dim, D])] + buffers
    for name, dims in buffers:
        inputs.append(T(name, f, dims))
        outputs.append(T(name + "_RetainedState", f, dims))
    if cb:
        inputs.append(T("batch_index", TensorProto.INT64, ["batch_size", 1]))
    graph = helper.make_graph(n, "hybrid_test", inputs, outputs,
                              initializer=[numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="qeff-kv-tests")
    model.ir_version = 8
    helper.set_model_props(model, {"origin": "tests"})
    return model


def save(path: Path, **kw) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(build(**kw), str(path))
    return path
