"""The exporter's own operators: ``torch.autograd.Function`` classes whose ``symbolic`` writes exactly the ONNX
nodes the retained-state contract needs (the ``ScatterND`` that reads a KV input and writes its retained output,
the ``Slice`` of the attended slots, grouped-query attention in standard ops, onnxruntime's GroupQueryAttention,
static-size ``rotate_half``, the output head's ``Gemm``), and the torch symbolics replaced while exporting.

Each ``forward`` computes in PyTorch what the node computes in onnxruntime, so the traced model and the graph
agree. Nothing here knows about models, targets or caches: the rooms that do (:mod:`.caches`, :mod:`.rope`,
:mod:`.targets`, :mod:`.wrapper`) call these.
"""

from __future__ import annotations

import contextlib

import torch

from qeff_kv.export.versions import OPSET


class ScatterKV(torch.autograd.Function):
    """``ScatterND(data, indices, updates)`` with exactly that ONNX form (no copies around it)."""

    @staticmethod
    def forward(ctx, data, indices, updates):  # noqa: D401
        out = data.clone()
        out[indices[..., 0], indices[..., 1], indices[..., 2]] = updates
        return out

    @staticmethod
    def symbolic(g, data, indices, updates):
        return g.op("ScatterND", data, indices, updates)


class ScatterRows(torch.autograd.Function):
    """``ScatterND(data, indices [B, 1], updates)``: whole rows of axis 0 replaced (a recurrent state's rows of the
    step), with exactly that ONNX form."""

    @staticmethod
    def forward(ctx, data, indices, updates):  # noqa: D401
        out = data.clone()
        out[indices[:, 0]] = updates
        return out

    @staticmethod
    def symbolic(g, data, indices, updates):
        return g.op("ScatterND", data, indices, updates)


class SliceSlots(torch.autograd.Function):
    """``Slice(data, starts=[0], ends=length, axes=[2])``: the first ``length`` cache slots, where ``length`` is
    a data-dependent 1-D tensor (the onnxruntime target's valid-length attention)."""

    @staticmethod
    def forward(ctx, data, length):  # noqa: D401
        return data[:, :, : int(length.reshape(-1)[0])]

    @staticmethod
    def symbolic(g, data, length):
        starts = g.op("Constant", value_t=torch.tensor([0], dtype=torch.int64))
        axes = g.op("Constant", value_t=torch.tensor([2], dtype=torch.int64))
        return g.op("Slice", data, starts, length, axes)


class LengthOf(torch.autograd.Function):
    """``Shape(x)`` of a 1-D tensor: ``[len(x)]`` as a 1-D int64 tensor (the CCL input's length, contract
    section 9: only the length of ``comp_ctx_lengths`` matters, never its contents)."""

    @staticmethod
    def forward(ctx, x):  # noqa: D401
        return torch.tensor([x.shape[0]], dtype=torch.int64)

    @staticmethod
    def symbolic(g, x):
        return g.op("Shape", x)


class RingConcat(torch.autograd.Function):
    """``cat = Concat(ring, new, axis=2)`` and ``upd = Slice(cat, starts=Shape(ring)[2], axis 2)``.

    ``cat`` is what a sliding layer attends over: the ring buffer as it was *before* this step, then the
    step's new keys/values. ``upd`` equals ``new`` but is computed from ``cat``, and it is the ``updates`` input
    of the ring's ScatterND: so the update depends on the copy of the old ring and onnxruntime cannot run the
    in-place update before that copy is made (see :mod:`qeff_kv.graph.inplace`)."""

    @staticmethod
    def forward(ctx, ring, new):  # noqa: D401
        cat = torch.cat([ring, new], dim=2)
        return cat, cat[:, :, ring.shape[2]:].clone()

    @staticmethod
    def symbolic(g, ring, new):
        cat = g.op("Concat", ring, new, axis_i=2)
        start = g.op("Shape", ring, start_i=2, end_i=3)
        end = g.op("Constant", value_t=torch.tensor([2**62], dtype=torch.int64))
        axes = g.op("Constant", value_t=torch.tensor([2], dtype=torch.int64))
        upd = g.op("Slice", cat, start, end, axes)
        upd.setType(new.type())
        return cat, upd


class GroupedAttentionOp(torch.autograd.Function):
    """Grouped-query attention in a dozen standard ONNX ops, for the onnxruntime target.

    ``q [B, Hq, S, D]``, ``k, v [B, Hkv, L, D]``, additive ``mask [B, 1, S, L]`` -> ``[B, S, Hq, D]``.
    Queries are grouped per KV head (``[B, Hkv, Hq/Hkv, S, D]``) so keys and values are never repeated, and
    every Reshape uses constant 0/-1 dims, so no shape arithmetic runs per step.

    ``softcap`` > 0 soft-caps the scaled scores, ``tanh(s / softcap) * softcap``, before the mask (Gemma2).
    ``sinks [Hq]`` (GPT-OSS) add one logit per head to the softmax denominator: the probabilities are scaled
    by ``sigmoid(logsumexp(scores) - sink)``, which equals a softmax over the scores plus a sink column.
    """

    @staticmethod
    def forward(ctx, q, k, v, mask, scaling: float, hq: int, hkv: int, d: int, dv: int,  # noqa: D401
                softcap: float = 0.0, sinks=None):
        b, _, s, _ = q.shape
        q5 = q.reshape(b, hkv, hq // hkv, s, d)
        scores = torch.matmul(q5, k.unsqueeze(2).transpose(-1, -2)) * scaling
        if softcap > 0:
            scores = torch.tanh(scores / softcap) * softcap
        scores = (scores + mask.unsqueeze(1)).float()
        probs = torch.softmax(scores, dim=-1)
        if sinks is not None:
            lse = torch.logsumexp(scores, dim=-1, keepdim=True)
            probs = probs * torch.sigmoid(lse - sinks.float().reshape(1, hkv, hq // hkv, 1, 1))
        probs = probs.to(q.dtype)
        out = torch.matmul(probs, v.unsqueeze(2)).reshape(b, hq, s, dv)   # values may be narrower (MLA)
        return out.transpose(1, 2).contiguous()     # as eager attention returns it (JetMoe then views it)

    @staticmethod
    def symbolic(g, q, k, v, mask, scaling, hq, hkv, d, dv, softcap=0.0, sinks=None):
        def const(values):
            return g.op("Constant", value_t=torch.tensor(values, dtype=torch.int64))

        q5 = g.op("Reshape", q, const([0, hkv, hq // hkv, -1, d]))
        k5 = g.op("Unsqueeze", k, const([2]))
        v5 = g.op("Unsqueeze", v, const([2]))
        scores = g.op("MatMul", q5, g.op("Transpose", k5, perm_i=[0, 1, 2, 4, 3]))
        dtype = q.type().dtype() if q.type().dtype() is not None else torch.float32
        scores = g.op("Mul", scores, g.op("Constant", value_t=torch.tensor(scaling, dtype=dtype)))
        if softcap > 0:
            scores = g.op("Tanh", g.op("Mul", scores, g.op("Constant", value_t=torch.tensor(1.0 / softcap,
                                                                                             dtype=dtype))))
            scores = g.op("Mul", scores, g.op("Constant", value_t=torch.tensor(softcap, dtype=dtype)))
        scores = g.op("Add", scores, g.op("Unsqueeze", mask, const([1])))
        if dtype != torch.float32:
            scores = g.op("Cast", scores, to_i=1)
        probs = g.op("Softmax", scores, axis_i=-1)
        if not absent(sinks):
            sink = g.op("Reshape", sinks if dtype == torch.float32 else g.op("Cast", sinks, to_i=1),
                        const([1, hkv, hq // hkv, 1, 1]))
            lse = g.op("ReduceLogSumExp", scores, axes_i=[-1], keepdims_i=1)
            probs = g.op("Mul", probs, g.op("Sigmoid", g.op("Sub", lse, sink)))
        if dtype != torch.float32:
            probs = g.op("Cast", probs, to_i=10 if dtype == torch.float16 else 16)
        out = g.op("Reshape", g.op("MatMul", probs, v5), const([0, hq, -1, dv]))
        return g.op("Transpose", out, perm_i=[0, 2, 1, 3])


class RotateHalf(torch.autograd.Function):
    """RoPE's ``rotate_half`` (``cat(-x2, x1)``) as Split, Neg, Concat with static sizes (no shape arithmetic)."""

    @staticmethod
    def forward(ctx, x, dim: int):  # noqa: D401
        x1, x2 = x[..., : dim // 2], x[..., dim // 2:]
        return torch.cat((-x2, x1), dim=-1)

    @staticmethod
    def symbolic(g, x, dim):
        split = g.op("Constant", value_t=torch.tensor([dim // 2, dim - dim // 2], dtype=torch.int64))
        x1, x2 = g.op("Split", x, split, axis_i=-1, outputs=2)
        return g.op("Concat", g.op("Neg", x2), x1, axis_i=-1)


def rotate_half(x):
    return RotateHalf.apply(x, int(x.shape[-1]))


class RotateHalfInterleaved(torch.autograd.Function):
    """Interleaved RoPE's ``rotate_half`` (pairs ``(x0, x1) -> (-x1, x0)``, Cohere, GLM) with static sizes:
    Reshape to pairs, Split, Neg, Concat, Reshape back (constant 0/-1 shapes, no shape arithmetic)."""

    @staticmethod
    def forward(ctx, x, rank: int):  # noqa: D401
        return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)

    @staticmethod
    def symbolic(g, x, rank):
        def const(values):
            return g.op("Constant", value_t=torch.tensor(values, dtype=torch.int64))

        pairs = g.op("Reshape", x, const([0] * (rank - 1) + [-1, 2]))
        x1, x2 = g.op("Split", pairs, const([1, 1]), axis_i=-1, outputs=2)
        return g.op("Reshape", g.op("Concat", g.op("Neg", x2), x1, axis_i=-1), const([0] * (rank - 1) + [-1]))


def rotate_half_interleaved(x):
    return RotateHalfInterleaved.apply(x, int(x.dim()))


def _const_int(v) -> int | None:
    """The integer value of a TorchScript constant (``onnx::Constant``/``prim::Constant``), else ``None``."""
    if isinstance(v, int):
        return v
    if not isinstance(v, torch._C.Value):
        return None
    node = v.node()
    if node.kind() not in ("onnx::Constant", "prim::Constant") or not node.hasAttribute("value"):
        return None
    kind = node.kindOf("value")
    if kind == "i":
        return int(node.i("value"))
    if kind == "t":
        t = node.t("value")
        if t.numel() == 1 and not t.is_floating_point():
            return int(t.reshape(-1)[0])
    return None


def _repeat_interleave_symbolic(g, x, repeats, dim=None, output_size=None):
    """``repeat_interleave`` with a constant repeat count along a constant dim as Unsqueeze, Tile, Reshape with
    constant 0/-1 shapes; anything else goes to torch's own symbolic with a private copy of ``dim``.

    torch's TorchScript symbolic adds the rank to a negative ``dim`` *in place*, on the tensor of the constant
    node it was given; constants are shared in a traced graph, so a later ``stack(dim=-1)`` (interleaved
    ``rotate_half``) silently becomes ``stack(dim=2)``. Nothing here modifies a node it did not create."""
    rank = x.type().dim() if x.type() is not None and hasattr(x.type(), "dim") else None
    n, d = _const_int(repeats), _const_int(dim)
    sizes = x.type().varyingSizes() if rank is not None else None
    if n is not None and d is not None and rank is not None and sizes is not None:
        d = d + rank if d < 0 else d
        trailing = sizes[d + 1:]
        if all(isinstance(s, int) for s in trailing):
            def const(values):
                return g.op("Constant", value_t=torch.tensor(values, dtype=torch.int64))

            reps = [1] * (rank + 1)
            reps[d + 1] = n
            tiled = g.op("Tile", g.op("Unsqueeze", x, const([d + 1])), const(reps))
            return g.op("Reshape", tiled, const([0] * d + [-1] + list(trailing)))
    from torch.onnx._internal.torchscript_exporter import symbolic_opset13

    if d is not None:
        dim = g.op("Constant", value_t=torch.tensor(d, dtype=torch.int64))
    return symbolic_opset13.repeat_interleave(g, x, repeats, dim, output_size)


def _expm1_symbolic(g, x):
    """``expm1(x)`` as ``Exp(x) - 1`` (ONNX has no expm1; the float32 difference is at most one ulp of 1, far
    inside the verification tolerance: Apertus' xIELU)."""
    one = g.op("Constant", value_t=torch.tensor(1.0, dtype=_dtype_of(x)))
    return g.op("Sub", g.op("Exp", x), one)


def _dtype_of(x) -> torch.dtype:
    t = x.type()
    scalar = t.scalarType() if t is not None and hasattr(t, "scalarType") else None
    return getattr(torch, {"Float": "float32", "Half": "float16", "BFloat16": "bfloat16",
                           "Double": "float64"}.get(scalar, "float32"))


def _rms_norm_symbolic(g, x, normalized_shape, weight, eps):
    """``aten::rms_norm`` (``torch.nn.RMSNorm``, DiffLlama's head norm) in standard ops, as torch computes it:
    ``x * 1/sqrt(mean(x^2 over the normalized dims) + eps) * weight``; ``eps`` defaults to the dtype's
    machine epsilon, as in torch."""
    from torch.onnx._internal.torchscript_exporter import symbolic_helper as sh

    dims = sh._get_const(normalized_shape, "is", "normalized_shape")
    dtype = _dtype_of(x)
    value = None if sh._is_none(eps) else sh._maybe_get_const(eps, "f")
    value = torch.finfo(dtype).eps if value is None else float(value)
    axes = list(range(-len(dims), 0))
    mean = g.op("ReduceMean", g.op("Mul", x, x), axes_i=axes, keepdims_i=1)
    denom = g.op("Sqrt", g.op("Add", mean, g.op("Constant", value_t=torch.tensor(value, dtype=dtype))))
    out = g.op("Div", x, denom)
    return out if sh._is_none(weight) else g.op("Mul", out, weight)


#: torch symbolics replaced or added while exporting: name -> symbolic
_SYMBOLICS = {"aten::repeat_interleave": _repeat_interleave_symbolic, "aten::expm1": _expm1_symbolic,
              "aten::rms_norm": _rms_norm_symbolic}


@contextlib.contextmanager
def export_symbolics():
    """While exporting: torch symbolics replaced where torch's own corrupt the graph (see
    :func:`_repeat_interleave_symbolic`) or added where torch has none for opset 17 (``aten::expm1``,
    ``aten::rms_norm``); torch's are restored on exit."""
    for name, fn in _SYMBOLICS.items():
        torch.onnx.register_custom_op_symbolic(name, fn, OPSET)
    try:
        yield
    finally:
        for name in _SYMBOLICS:
            torch.onnx.unregister_custom_op_symbolic(name, OPSET)


def absent(v) -> bool:
    """An optional argument of a symbolic function that was ``None`` at the call."""
    return v is None or (isinstance(v, torch._C.Value) and v.node().mustBeNone())


class SplitHeads(torch.autograd.Function):
    """``[B, S, H*D] -> [B, S, H, D]`` as one ``Reshape`` by the constant ``[0, 0, -1, D]`` (no shape arithmetic:
    GroupQueryAttention's packed output in the layout every attention module reshapes itself)."""

    @staticmethod
    def forward(ctx, x, d: int):  # noqa: D401
        return x.reshape(x.shape[0], x.shape[1], -1, d)

    @staticmethod
    def symbolic(g, x, d):
        return g.op("Reshape", x, g.op("Constant", value_t=torch.tensor([0, 0, -1, d], dtype=torch.int64)))


def quantize_int8(x, scale):
    """``x`` to int8 as GroupQueryAttention's quantized cache (and ``QuantizeLinear``) writes it: ``x / scale``
    rounded half to even, saturated to [-128, 127] (:mod:`.kv_quant`)."""
    return torch.clamp(torch.round(x.float() / scale), -128, 127).to(torch.int8)


def dequantize_int8(q, scale, dtype):
    return (q.float() * scale).to(dtype)


def quantize_int4(x, scale):
    """``x [..., D]`` to GroupQueryAttention's 4-bit cache (``kv_cache_bit_width=4``), uint8 ``[..., D/2]``: ``x /
    scale`` rounded half to even, saturated to [-8, 7], offset by 8; element ``2i`` in the low nibble of byte ``i``,
    ``2i + 1`` in the high one (measured on onnxruntime 1.32's CPU kernel, docs/export.md)."""
    q = (torch.clamp(torch.round(x.float() / scale), -8, 7) + 8).to(torch.uint8)
    return q[..., 0::2] | (q[..., 1::2] << 4)


def dequantize_int4(packed, scale, dtype):
    """:func:`quantize_int4`'s bytes ``[..., D/2]`` back to ``(nibble - 8) * scale`` ``[..., D]``."""
    nibbles = torch.stack([packed & 15, packed >> 4], -1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
    return ((nibbles.float() - 8) * scale).to(dtype)


def kv_codec(bits: int):
    """``(quantize, dequantize)`` of the ``bits``-wide quantized KV cache (8: int8, 4: packed int4)."""
    return (quantize_int8, dequantize_int8) if bits == 8 else (quantize_int4, dequantize_int4)


class GroupQueryAttentionOp(torch.autograd.Function):
    """onnxruntime's ``com.microsoft::GroupQueryAttention`` over a shared past/present buffer.

    Inputs: ``q [B, Hq, S, D]``, ``k, v [B, Hkv, S, D]`` (as transformers' attention code holds them), the
    retained buffers ``past_k, past_v [B, Hkv, ctx, D]``, ``seqlens_k [B]`` int32 (last slot the chunk fills),
    ``total [1]`` int32, the cos/sin caches ``[max_pos, D/2]`` when ``rotary`` (GQA then applies RoPE to q
    and k itself; otherwise they arrive rotated, or the layer has no RoPE), and optionally per-head attention
    ``sinks [Hq]`` (``head_sink``: softmax as if one more key with that score were present, GPT-OSS). Scores
    are soft-capped ``tanh(s / softcap) * softcap`` after scaling when ``softcap`` > 0 (Gemma2). The chunk
    occupies slots ``[seqlens_k - S + 1, seqlens_k]``; GQA appends it to the buffer in place (when the
    runtime binds one buffer as past and present) and attends causally over the filled slots only.

    Returns ``(attention [B, S, Hq*D], present_k, present_v)``, GQA's own outputs (the symbolic's outputs are
    exactly the node's, so the exporter keeps the retained outputs' static dims); :class:`SplitHeads` then
    gives the attention-interface layout ``[B, S, Hq, D]``.
    """

    @staticmethod
    def forward(ctx, q, k, v, past_k, past_v, seqlens_k, total, cos, sin, sinks, hq: int, hkv: int, d: int,
                scale: float, softcap: float, rotary: bool, local_window: int = -1, k_scale=None, v_scale=None,
                kv_bits: int = 8):
        b, _, s, _ = q.shape
        start = (seqlens_k.long() - s + 1).reshape(b, 1)
        pos = start + torch.arange(s).reshape(1, s)                                  # [B, S]
        if rotary:
            c = torch.cat([cos[pos], cos[pos]], -1).unsqueeze(1)                     # [B, 1, S, D]
            sn = torch.cat([sin[pos], sin[pos]], -1).unsqueeze(1)

            def rot(x):
                return x * c + torch.cat((-x[..., d // 2:], x[..., : d // 2]), -1) * sn

            q, k = rot(q), rot(k)
        bi = torch.arange(b).reshape(b, 1, 1).expand(b, hkv, s)
        hi = torch.arange(hkv).reshape(1, hkv, 1).expand(b, hkv, s)
        pi = pos.reshape(b, 1, s).expand(b, hkv, s)
        pk, pv = past_k.clone(), past_v.clone()
        if k_scale is None:
            pk[bi, hi, pi] = k.to(pk.dtype)
            pv[bi, hi, pi] = v.to(pv.dtype)
            keys, values = pk, pv
        else:   # the int8/int4 cache (kv_quant): written quantized, read dequantized, the prompt's own keys included
            quantize, dequantize = kv_codec(kv_bits)
            pk[bi, hi, pi] = quantize(k, k_scale)
            pv[bi, hi, pi] = quantize(v, v_scale)
            keys, values = dequantize(pk, k_scale, q.dtype), dequantize(pv, v_scale, q.dtype)
        q5 = q.reshape(b, hkv, hq // hkv, s, d)
        scores = (torch.matmul(q5, keys.unsqueeze(2).transpose(-1, -2)) * scale).float()  # [B, Hkv, G, S, ctx]
        if softcap > 0:
            scores = torch.tanh(scores / softcap) * softcap
        slots = torch.arange(pk.shape[2]).reshape(1, 1, 1, 1, -1)
        visible = slots <= pos.reshape(b, 1, 1, s, 1)
        if local_window >= 0:   # GQA's local_window_size W: the query at p sees keys p - W + 1 .. p (measured)
            visible = visible & (slots > pos.reshape(b, 1, 1, s, 1) - local_window)
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            sink = sinks.float().reshape(1, hkv, hq // hkv, 1, 1).expand(b, hkv, hq // hkv, s, 1)
            probs = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
        else:
            probs = torch.softmax(scores, -1)
        out = torch.matmul(probs.to(q.dtype), values.unsqueeze(2))                  # [B, Hkv, G, S, D]
        return out.reshape(b, hq, s, d).transpose(1, 2).reshape(b, s, hq * d), pk, pv

    @staticmethod
    def symbolic(g, q, k, v, past_k, past_v, seqlens_k, total, cos, sin, sinks, hq, hkv, d, scale, softcap,
                 rotary, local_window=-1, k_scale=None, v_scale=None, kv_bits=8):
        def const(values):
            return g.op("Constant", value_t=torch.tensor(values, dtype=torch.int64))

        def packed(x):  # [B, H, S, D] -> [B, S, H*D]
            return g.op("Reshape", g.op("Transpose", x, perm_i=[0, 2, 1, 3]), const([0, 0, -1]))

        def empty():  # an omitted optional input
            none = g.op("prim::Constant")
            none.setType(torch._C.OptionalType.ofTensor())
            return none

        inputs = [packed(q), packed(k), packed(v), past_k, past_v, seqlens_k, total]
        attrs = dict(num_heads_i=hq, kv_num_heads_i=hkv, scale_f=scale, do_rotary_i=int(rotary))
        if rotary:
            inputs += [cos, sin]
        if softcap > 0:
            attrs["softcap_f"] = softcap
        if local_window >= 0:
            attrs["local_window_size_i"] = local_window
        if not absent(sinks):
            if not rotary:
                inputs += [empty(), empty()]
            inputs += [empty(), empty(), sinks]  # position_ids, attention_bias omitted; head_sink
            attrs["smooth_softmax_i"] = 1
        if not absent(k_scale):   # inputs 12, 13; the int8 (int4) cache with per-channel static scales
            inputs += [empty() for _ in range(12 - len(inputs))] + [k_scale, v_scale]
            attrs.update(kv_cache_bit_width_i=int(kv_bits), k_quant_type_s="PER_CHANNEL", v_quant_type_s="PER_CHANNEL")
        out, present_k, present_v = g.op("com.microsoft::GroupQueryAttention", *inputs, outputs=3, **attrs)
        out.setType(q.type().with_sizes([None, None, hq * d]))
        present_k.setType(past_k.type())
        present_v.setType(past_v.type())
        return out, present_k, present_v


class HeadGemm(torch.autograd.Function):
    """``Gemm(hidden, weight[, bias], transB=1)``: a linear output head that reads its ``[vocab, hidden]`` weight
    as stored. The TorchScript exporter writes ``linear`` as ``MatMul(x, Transpose(W))`` and constant folding
    then stores a transposed copy of ``W``; with tied embeddings that copy duplicates the embedding matrix.
    This form keeps one initializer, read by the embedding ``Gather`` and by this ``Gemm``."""

    @staticmethod
    def forward(ctx, hidden, weight, bias=None):  # noqa: D401
        return torch.nn.functional.linear(hidden, weight, bias)

    @staticmethod
    def symbolic(g, hidden, weight, bias=None):
        inputs = [hidden, weight] if bias is None else [hidden, weight, bias]
        return g.op("Gemm", *inputs, transB_i=1)
