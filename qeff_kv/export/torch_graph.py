"""The torch side of export: wrap a transformers causal LM so that tracing it gives a retained-state graph.

One generic mechanism for every architecture, through transformers' own interfaces:

* a cache object passed as ``past_key_values`` whose ``update()`` scatters the new keys/values into the
  fixed-capacity buffer with a single ``ScatterND`` that reads the graph input and produces the graph
  output (in-place safe), and returns the scattered buffer for attention;
* a ready 4D additive attention mask built from ``position_ids`` (transformers returns a 4D mask as-is),
  so slot ``j`` is visible to a query at position ``p`` iff ``0 <= j <= p``; padded queries
  (``p = -1``) see a fully masked row with a finite mask value, so softmax stays finite;
* optionally (the onnxruntime target), attention over only the first ``max(position_ids) + 1`` slots: a
  data-dependent ``Slice`` of the scattered buffer, so a step costs time in proportion to the valid length,
  not the capacity (accelerator compilers need static shapes, so the portable default attends over all);
* optionally (``export --ccl``, contract section 9), attention over the first ``len(comp_ctx_lengths)`` slots:
  a ``Slice`` of the scattered buffer whose end is ``Shape(comp_ctx_lengths)`` (on the onnxruntime target the
  smaller of that and the valid length), the mask with as many columns;
* logits only at the last valid position of each row (``[batch, 1, vocab]``), through the model's own
  output head and its logit scaling/soft-capping.

Padding (right-padded prompt, ``position_ids = -1``): before anything else, a padded row takes the token and
the position of its sequence's last valid row, so in every layer it computes exactly that row's key and value
and writes them to the same slot: padding can never corrupt a slot, and no index is negative or beyond
``ctx_len``. This costs a few nodes once per step, nothing per layer. (A row made of padding only has no
valid slot; the runtime never sends one.)

This module imports torch; nothing outside :mod:`qeff_kv.export` imports it.
"""

from __future__ import annotations

import contextlib
import inspect
import sys

import torch


class _ScatterKV(torch.autograd.Function):
    """``ScatterND(data, indices, updates)`` with exactly that ONNX form (no copies around it)."""

    @staticmethod
    def forward(ctx, data, indices, updates):  # noqa: D401
        out = data.clone()
        out[indices[..., 0], indices[..., 1], indices[..., 2]] = updates
        return out

    @staticmethod
    def symbolic(g, data, indices, updates):
        return g.op("ScatterND", data, indices, updates)


class _SliceSlots(torch.autograd.Function):
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


class _LengthOf(torch.autograd.Function):
    """``Shape(x)`` of a 1-D tensor: ``[len(x)]`` as a 1-D int64 tensor (the CCL input's length, contract
    section 9: only the length of ``comp_ctx_lengths`` matters, never its contents)."""

    @staticmethod
    def forward(ctx, x):  # noqa: D401
        return torch.tensor([x.shape[0]], dtype=torch.int64)

    @staticmethod
    def symbolic(g, x):
        return g.op("Shape", x)


class _RingConcat(torch.autograd.Function):
    """``cat = Concat(ring, new, axis=2)`` and ``upd = Slice(cat, starts=Shape(ring)[2], axis 2)``.

    ``cat`` is what a sliding layer attends over: the ring buffer as it was *before* this step, then the
    step's new keys/values. ``upd`` equals ``new`` but is computed from ``cat``, and it is the ``updates`` input
    of the ring's ScatterND: so the update depends on the copy of the old ring and onnxruntime cannot run the
    in-place update before that copy is made (see :mod:`qeff_kv.inplace`)."""

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


class RingStep:
    """One step's plan for the sliding layers' ring buffers (contract section 7), shared by every such layer.

    A ring of ``window`` slots holds position ``p`` of a sequence in slot ``p % window``. Before this step a
    row's ring holds its positions ``[p0 - window, p0)`` (``p0``: the row's first position in the chunk; slots
    of positions below 0 are empty), so slot ``j`` holds position ``x_j = (p0 - 1) - ((p0 - 1 - j) mod window)``.
    Attention reads that old ring (first ``read`` slots) followed by the chunk's own keys, so no key a query of
    the chunk needs is lost when a later position of the same chunk overwrites its slot; the additive mask
    ``[B, 1, S, read + S]`` lets the query at ``p`` see ``x_j`` when ``0 <= x_j`` and ``x_j > p - window``, and
    chunk position ``q`` when ``p - window < q <= p`` and it is not padding. Then the chunk is scattered into
    ``p % window``; a chunk holds at most ``window`` positions, so no two of its rows share a slot except
    padding, which repeats its row's last valid key and value bit for bit.
    """

    def __init__(self, window: int, position_ids: torch.Tensor, is_pad: torch.Tensor, read: torch.Tensor | None,
                 dtype: torch.dtype, blocks: torch.Tensor | None = None):
        self.window = int(window)
        self.read = read          # [1] int64: slots of the old ring read (onnxruntime target), None: all
        self.position_ids = position_ids
        w = self.window
        p0 = position_ids[:, :1]                                                     # [B, 1]
        slots = torch.arange(w, dtype=torch.int64) if read is None else torch.arange(read[0], dtype=torch.int64)
        held = (p0 - 1) - torch.remainder(p0 - 1 - slots.reshape(1, -1), w)          # [B, R]
        q = position_ids.unsqueeze(-1)                                               # [B, S, 1]
        ring_vis = (held.unsqueeze(1) >= 0) & (held.unsqueeze(1) > q - w)            # [B, S, R]
        k = position_ids.unsqueeze(1)                                                # [B, 1, S]
        causal = k <= q
        if blocks is not None:   # bidirectional image blocks (see build_attention_mask)
            causal = causal | ((blocks.unsqueeze(-1) >= 0) & (blocks.unsqueeze(-1) == blocks.unsqueeze(1)))
        new_vis = causal & (k > q - w) & (~is_pad).unsqueeze(1)                     # [B, S, S]
        visible = torch.cat([ring_vis, new_vis], dim=-1).unsqueeze(1)                # [B, 1, S, R + S]
        neg = torch.tensor(torch.finfo(dtype).min / 2, dtype=dtype)
        self.mask = torch.where(visible, torch.tensor(0, dtype=dtype), neg)


def attended_length(position_ids: torch.Tensor) -> torch.Tensor:
    """1 + the largest position in the batch (at least 1), as a 1-D int64 tensor: the slots attention needs."""
    return torch.clamp(position_ids.max() + 1, min=1).reshape(1)


class RetainedStateCache:
    """A ``past_key_values`` object for transformers models: scatter-update into fixed-capacity buffers.

    Duck-types transformers' ``Cache``: models call ``update(key, value, layer_idx, cache_kwargs)``.
    After the forward pass, :attr:`retained` holds one updated (key, value) per layer, in layer order.
    """

    is_compileable = False

    def __init__(self, past: list[tuple[torch.Tensor, torch.Tensor]], position_ids: torch.Tensor,
                 batch_index: torch.Tensor | None, attend_length: torch.Tensor | None = None,
                 ring: RingStep | None = None, ring_layers: tuple[int, ...] = ()):
        self.past = past
        self.attend_length = attend_length
        self.position_ids = position_ids
        self.batch_index = batch_index
        self.ring = ring
        self.ring_layers = frozenset(ring_layers)
        self.retained: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(past)
        self._plans: dict[tuple[int, bool], torch.Tensor] = {}
        self.layers = []  # some helpers inspect cache.layers; we hold no transformers layers
        # Attention is limited by the ready-made mask, never by a sliding cache layer.
        self.is_sliding = [False] * len(past)

    # -- transformers Cache protocol (the parts models use) --------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def get_mask_sizes(self, *args, **kwargs):  # pragma: no cover - masks are passed ready-made
        raise NotImplementedError("RetainedStateCache is used with a ready 4D attention mask")

    def __len__(self) -> int:
        return len(self.past)

    def _indices(self, num_heads: int, ring: bool = False) -> torch.Tensor:
        """ScatterND indices ``[B, H, S, 3]`` (batch row, head, slot), built once for every layer: the slot is
        the position, or ``position % window`` in a ring buffer."""
        key = (num_heads, ring)
        if key in self._plans:
            return self._plans[key]
        pos = self.position_ids
        if ring:
            pos = torch.remainder(pos, self.ring.window)
        bsz, seq = pos.shape
        if self.batch_index is not None:
            b_idx = self.batch_index.reshape(bsz, 1, 1)
        else:
            b_idx = torch.arange(bsz, dtype=torch.int64).reshape(bsz, 1, 1)
        shape = (bsz, num_heads, seq)
        h_idx = torch.arange(num_heads, dtype=torch.int64).reshape(1, num_heads, 1)
        plan = torch.stack([b_idx.expand(shape), h_idx.expand(shape), pos.unsqueeze(1).expand(shape)], dim=-1)
        self._plans[key] = plan
        return plan

    def _update_ring(self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor):
        """A sliding layer's ring buffer: attend over the old ring plus the chunk, then scatter the chunk into
        ``position % window`` (see :class:`RingStep`)."""
        past_k, past_v = self.past[layer_idx]
        indices = self._indices(int(key_states.shape[1]), ring=True)
        att, new = [], []
        for past, states in ((past_k, key_states), (past_v, value_states)):
            old = past[self.batch_index.reshape(-1)] if self.batch_index is not None else past
            if self.ring.read is not None:
                old = _SliceSlots.apply(old, self.ring.read)
            cat, upd = _RingConcat.apply(old, states.to(past.dtype))
            att.append(cat)
            new.append(_ScatterKV.apply(past, indices, upd))
        self.retained[layer_idx] = (new[0], new[1])
        return att[0], att[1]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               cache_kwargs: dict | None = None):
        if layer_idx in self.ring_layers:
            return self._update_ring(layer_idx, key_states, value_states)
        past_k, past_v = self.past[layer_idx]
        indices = self._indices(int(key_states.shape[1]))
        new_k = _ScatterKV.apply(past_k, indices, key_states.to(past_k.dtype))
        new_v = _ScatterKV.apply(past_v, indices, value_states.to(past_v.dtype))
        self.retained[layer_idx] = (new_k, new_v)
        att_k, att_v = new_k, new_v
        if self.attend_length is not None:
            att_k = _SliceSlots.apply(new_k, self.attend_length)
            att_v = _SliceSlots.apply(new_v, self.attend_length)
        if self.batch_index is not None:
            rows = self.batch_index.reshape(-1)
            return att_k[rows], att_v[rows]
        return att_k, att_v


class _RecordingCache:
    """A ``past_key_values`` that records each layer's new key/value shapes and attends over them only."""

    is_compileable = False

    def __init__(self, num_layers: int):
        self.shapes: list[tuple[tuple[int, ...], tuple[int, ...]] | None] = [None] * num_layers
        self.is_sliding = [False] * num_layers
        self.layers = []

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def __len__(self) -> int:
        return len(self.shapes)

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        self.shapes[layer_idx] = (tuple(key_states.shape), tuple(value_states.shape))
        return key_states, value_states


def probe_kv_shapes(model: torch.nn.Module, num_layers: int) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Run the decoder once on two tokens and record, per layer, ``((key_heads, key_dim), (value_heads,
    value_dim))`` as the model itself produces them.

    The cache buffers are shaped from what the model really writes, not from config fields whose meaning
    differs between families (Falcon's ``multi_query`` ignores ``num_kv_heads``; MLA keys and values have
    different head sizes)."""
    cache = _RecordingCache(num_layers)
    ids = torch.tensor([[1, 2]], dtype=torch.int64)
    pos = torch.arange(2, dtype=torch.int64).unsqueeze(0)
    dtype = next(model.parameters()).dtype
    mask = build_attention_mask(pos, 2, dtype)
    with torch.no_grad():
        model.get_decoder()(input_ids=ids, position_ids=pos, attention_mask=mask, past_key_values=cache,
                            use_cache=True)
    out = []
    for i, kv in enumerate(cache.shapes):
        if kv is None:
            raise RuntimeError(f"layer {i} wrote no keys/values through the cache")
        (kb, kh, ks, kd), (vb, vh, vs, vd) = kv
        out.append(((int(kh), int(kd)), (int(vh), int(vd))))
    return out


def fill_padding(input_ids: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Give every padded row (position -1) the token and position of its sequence's last valid row.

    The padded row then computes, in every layer, exactly the key and value of that last valid row and writes
    them to the same slot: padding can never corrupt a slot, and no index is negative or out of range.
    """
    is_pad = position_ids < 0
    last_row = position_ids.argmax(dim=1, keepdim=True)                        # [B, 1]
    last_pos = torch.gather(position_ids, 1, last_row)
    last_tok = torch.gather(input_ids, 1, last_row)
    return torch.where(is_pad, last_tok, input_ids), torch.where(is_pad, last_pos, position_ids)


def fill_padding_rows(x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """``x [B, S, ...]`` with every padded row (position -1) replaced by its sequence's last valid row (the
    embedding counterpart of :func:`fill_padding`)."""
    last_row = position_ids.argmax(dim=1, keepdim=True)                        # [B, 1]
    rows = torch.arange(position_ids.shape[1], dtype=torch.int64).unsqueeze(0)  # [1, S]
    src = torch.where(position_ids < 0, last_row, rows)                        # [B, S]
    index = src.reshape(src.shape[0], src.shape[1], *([1] * (x.dim() - 2))).expand(x.shape)
    return torch.gather(x, 1, index)


class _GroupedAttention(torch.autograd.Function):
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
        return out.transpose(1, 2)

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
        if not _absent(sinks):
            sink = g.op("Reshape", sinks if dtype == torch.float32 else g.op("Cast", sinks, to_i=1),
                        const([1, hkv, hq // hkv, 1, 1]))
            lse = g.op("ReduceLogSumExp", scores, axes_i=[-1], keepdims_i=1)
            probs = g.op("Mul", probs, g.op("Sigmoid", g.op("Sub", lse, sink)))
        if dtype != torch.float32:
            probs = g.op("Cast", probs, to_i=10 if dtype == torch.float16 else 16)
        out = g.op("Reshape", g.op("MatMul", probs, v5), const([0, hq, -1, dv]))
        return g.op("Transpose", out, perm_i=[0, 2, 1, 3])


class _RotateHalf(torch.autograd.Function):
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


def _rotate_half(x):
    return _RotateHalf.apply(x, int(x.shape[-1]))


class _RotateHalfInterleaved(torch.autograd.Function):
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


def _rotate_half_interleaved(x):
    return _RotateHalfInterleaved.apply(x, int(x.dim()))


def rotate_half_kind(fn) -> str | None:
    """What a modeling module's ``rotate_half`` does, from its behaviour on a probe vector: ``"split-half"``
    (``cat(-x2, x1)`` of the two halves, Llama), ``"interleaved"`` (pairs ``(x0, x1) -> (-x1, x0)``, Cohere,
    GLM) or ``None`` (anything else, or it fails on the probe)."""
    x = torch.arange(1.0, 9.0).reshape(1, 1, 1, 8)
    try:
        with torch.no_grad():
            y = fn(x)
    except Exception:  # noqa: BLE001 - a helper that does not take one tensor is not a rotate_half
        return None
    if not isinstance(y, torch.Tensor) or y.shape != x.shape:
        return None
    if torch.equal(y, _RotateHalf.forward(None, x, 8)):
        return "split-half"
    if torch.equal(y, _RotateHalfInterleaved.forward(None, x, 4)):
        return "interleaved"
    return None


#: rotate_half kind -> its static-size equivalent used while tracing the onnxruntime targets.
_COMPACT_ROTATE_HALF = {"split-half": _rotate_half, "interleaved": _rotate_half_interleaved}


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


@contextlib.contextmanager
def export_symbolics():
    """While exporting: torch symbolics replaced where torch's own corrupt the graph (see
    :func:`_repeat_interleave_symbolic`); torch's are restored on exit."""
    from . import options as opt

    torch.onnx.register_custom_op_symbolic("aten::repeat_interleave", _repeat_interleave_symbolic, opt.OPSET)
    try:
        yield
    finally:
        torch.onnx.unregister_custom_op_symbolic("aten::repeat_interleave", opt.OPSET)


def _undecorated_rope_forward(fn):
    """The rotary ``forward`` inside transformers' ``dynamic_rope_update`` decorator, or ``None``."""
    from transformers.modeling_rope_utils import dynamic_rope_update

    decorator_code = dynamic_rope_update(lambda self, x, position_ids: None).__code__
    for _ in range(8):
        inner = getattr(fn, "__wrapped__", None)
        if inner is None:
            return None
        if getattr(fn, "__code__", None) is decorator_code:
            return inner
        fn = inner
    return None


def _longrope_forward(module: torch.nn.Module, inner, decorated):
    """A rotary module's forward computing transformers' longrope choice as a graph: both frequency sets as
    constants and ``Where(max(position_ids) + 1 > original_max_position_embeddings, long, short)``, exactly
    transformers' ``longrope_frequency_update`` without its in-place copy into the ``inv_freq`` buffer (which
    the TorchScript exporter cannot express)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    long_sets: dict = {}

    def forward(x, position_ids, layer_type=None):
        rope_type = module.rope_type if layer_type is None else module.rope_type[layer_type]
        kwargs = {} if layer_type is None else {"layer_type": layer_type}
        if rope_type != "longrope":
            return decorated(x, position_ids, **kwargs)
        prefix = "" if layer_type is None else f"{layer_type}_"
        params = module.config.rope_parameters if layer_type is None else module.config.rope_parameters[layer_type]
        limit = int(params["original_max_position_embeddings"])
        if layer_type not in long_sets:
            long_sets[layer_type] = getattr(module, f"{prefix}long_inv_freq", None)
            if long_sets[layer_type] is None:
                long_sets[layer_type] = ROPE_INIT_FUNCTIONS["longrope"](module.config, x.device, seq_len=limit + 1,
                                                                        **kwargs)[0]
        short = getattr(module, f"{prefix}original_inv_freq").to(x.device)
        chosen = torch.where(position_ids.max() + 1 > limit, long_sets[layer_type].to(x.device), short)
        name = f"{prefix}inv_freq"
        saved = getattr(module, name)
        setattr(module, name, chosen)   # the forward reads the traced choice instead of the buffer
        try:
            return inner(module, x, position_ids, **kwargs)
        finally:
            setattr(module, name, saved)

    return forward


@contextlib.contextmanager
def exact_longrope(model: torch.nn.Module):
    """While tracing, every longrope rotary module selects its short/long frequencies in the graph, per forward
    pass, from ``max(position_ids) + 1`` (as transformers does), so a graph is exact on both sides of
    ``original_max_position_embeddings``. Other rotary modules are left alone."""
    patched = []
    for m in model.modules():
        types = getattr(m, "rope_type", None)
        types = set(types.values()) if isinstance(types, dict) else {types}
        if "longrope" not in types or not hasattr(m, "config"):
            continue
        inner = _undecorated_rope_forward(type(m).forward)
        if inner is None:
            continue
        m.forward = _longrope_forward(m, inner, m.forward)
        patched.append(m)
    try:
        yield
    finally:
        for m in patched:
            del m.forward


@contextlib.contextmanager
def export_patches(model: torch.nn.Module):
    """Everything changed in torch and in the model while exporting, for every target: the symbolics of
    :func:`export_symbolics` and :func:`exact_longrope`; all restored on exit."""
    with export_symbolics(), exact_longrope(model):
        yield


def _modeling_modules(model: torch.nn.Module) -> list:
    """The Python modules that define the classes of ``model``'s submodules, in name order."""
    names = sorted({type(m).__module__ for m in model.modules()})
    return [sys.modules[n] for n in names if n in sys.modules]


def rope_layout(model: torch.nn.Module) -> str | None:
    """The kind of RoPE the model's modeling code applies, measured once from its own ``rotate_half``
    (:func:`rotate_half_kind`): ``"split-half"`` or ``"interleaved"`` when every modeling module that defines a
    ``rotate_half`` has that kind, else ``None`` (none defined, or mixed, or unrecognised)."""
    kinds = {rotate_half_kind(m.rotate_half) for m in _modeling_modules(model)
             if callable(getattr(m, "rotate_half", None))}
    return kinds.pop() if len(kinds) == 1 else None


@contextlib.contextmanager
def patch_modeling_function(model: torch.nn.Module, name: str, replacement=None, *, choose=None):
    """While tracing, replace the function ``name`` in every modeling module that ``model``'s layers come from.

    transformers' decoders define helpers such as ``rotate_half`` and ``apply_rotary_pos_emb`` in their
    modeling module and call them through the module's globals. Modules without ``name`` are left alone; the
    originals are restored on exit. ``choose(original)``, when given, picks the replacement per module from
    the module's own function (``None``: leave that module's function as it is).
    """
    patched = []
    for module in _modeling_modules(model):
        if callable(getattr(module, name, None)):
            original = getattr(module, name)
            new = choose(original) if choose is not None else replacement
            if new is None:
                continue
            patched.append((module, original))
            setattr(module, name, new)
    try:
        yield
    finally:
        for module, fn in patched:
            setattr(module, name, fn)


def compact_rotary(model: torch.nn.Module):
    """``rotate_half`` as its static-size equivalent while tracing: :func:`_rotate_half` where the model's own
    is the split-half kind, :func:`_rotate_half_interleaved` where it is the interleaved kind (decided by
    :func:`rotate_half_kind` from the module's own function); any other ``rotate_half`` is left as it is."""
    return patch_modeling_function(model, "rotate_half",
                                   choose=lambda fn: _COMPACT_ROTATE_HALF.get(rotate_half_kind(fn)))


def _rotary_pass_through(q, k, *args, **kwargs):
    """The fused target's ``apply_rotary_pos_emb``: returns q and k unrotated (GroupQueryAttention rotates them)
    and notes on the active :class:`FusedKVCache` that the calling layer applies RoPE, with the cos/sin it was
    given. Layers that never call it (NoPE layers) get no rotation in GQA either."""
    if not _ACTIVE_CACHE:
        raise RuntimeError("apply_rotary_pos_emb was called outside the traced forward pass")
    cos = args[0] if len(args) > 0 else kwargs.get("cos")
    sin = args[1] if len(args) > 1 else kwargs.get("sin")
    _ACTIVE_CACHE[-1].pending_rope = (cos, sin)
    return q, k


def skip_model_rotary(model: torch.nn.Module):
    """``apply_rotary_pos_emb`` as :func:`_rotary_pass_through` while tracing the fused target with GQA's own
    RoPE: GroupQueryAttention rotates q and k itself, in exactly the layers that called it. Only the language
    decoder's modeling modules are patched: a vision encoder's own RoPE (Pixtral's) keeps rotating."""
    return patch_modeling_function(model.get_decoder(), "apply_rotary_pos_emb", _rotary_pass_through)


def _absent(v) -> bool:
    """An optional argument of a symbolic function that was ``None`` at the call."""
    return v is None or (isinstance(v, torch._C.Value) and v.node().mustBeNone())


class _SplitHeads(torch.autograd.Function):
    """``[B, S, H*D] -> [B, S, H, D]`` as one ``Reshape`` by the constant ``[0, 0, -1, D]`` (no shape arithmetic:
    GroupQueryAttention's packed output in the layout every attention module reshapes itself)."""

    @staticmethod
    def forward(ctx, x, d: int):  # noqa: D401
        return x.reshape(x.shape[0], x.shape[1], -1, d)

    @staticmethod
    def symbolic(g, x, d):
        return g.op("Reshape", x, g.op("Constant", value_t=torch.tensor([0, 0, -1, d], dtype=torch.int64)))


class _GQA(torch.autograd.Function):
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
    exactly the node's, so the exporter keeps the retained outputs' static dims); :class:`_SplitHeads` then
    gives the attention-interface layout ``[B, S, Hq, D]``.
    """

    @staticmethod
    def forward(ctx, q, k, v, past_k, past_v, seqlens_k, total, cos, sin, sinks, hq: int, hkv: int, d: int,
                scale: float, softcap: float, rotary: bool, local_window: int = -1):
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
        pk[bi, hi, pi] = k.to(pk.dtype)
        pv[bi, hi, pi] = v.to(pv.dtype)
        q5 = q.reshape(b, hkv, hq // hkv, s, d)
        scores = (torch.matmul(q5, pk.unsqueeze(2).transpose(-1, -2)) * scale).float()  # [B, Hkv, G, S, ctx]
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
        out = torch.matmul(probs.to(q.dtype), pv.unsqueeze(2))                      # [B, Hkv, G, S, D]
        return out.reshape(b, hq, s, d).transpose(1, 2).reshape(b, s, hq * d), pk, pv

    @staticmethod
    def symbolic(g, q, k, v, past_k, past_v, seqlens_k, total, cos, sin, sinks, hq, hkv, d, scale, softcap,
                 rotary, local_window=-1):
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
        if not _absent(sinks):
            if not rotary:
                inputs += [empty(), empty()]
            inputs += [empty(), empty(), sinks]  # position_ids, attention_bias omitted; head_sink
            attrs["smooth_softmax_i"] = 1
        out, present_k, present_v = g.op("com.microsoft::GroupQueryAttention", *inputs, outputs=3, **attrs)
        out.setType(q.type().with_sizes([None, None, hq * d]))
        present_k.setType(past_k.type())
        present_v.setType(past_v.type())
        return out, present_k, present_v


#: The cache of the forward pass being traced, for the fused attention function (tracing is single-threaded).
_ACTIVE_CACHE: list = []


def fused_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention-interface function of the onnxruntime-fused target (``qeff_kv_fused``).

    ``key``/``value`` are this step's new keys and values, as returned by :meth:`FusedKVCache.update`;
    GroupQueryAttention appends them to the retained buffers itself. Soft-capping (``softcap``) and attention
    sinks (``s_aux``) map to GQA's ``softcap`` and ``head_sink``; ``attention_mask`` is not read (GQA masks
    causally; on sliding layers with the window, GQA's ``local_window_size``, see :meth:`FusedKVCache.attend`).
    """
    cache = _ACTIVE_CACHE[-1]
    window = kwargs.get("sliding_window")
    if (window is not None) != (module.layer_idx in cache.window_layers) or (
            window is not None and int(window) != cache.window):
        raise RuntimeError(f"layer {module.layer_idx}: the model's sliding window {window} is not the config's "
                           f"(window {cache.window} on layers {sorted(cache.window_layers)})")
    out = cache.attend(module.layer_idx, query, key, value, scaling, kwargs.get("softcap"), kwargs.get("s_aux"))
    return out, None


@contextlib.contextmanager
def sdpa_to_gqa():
    """While tracing, route ``torch.nn.functional.scaled_dot_product_attention`` calls on exactly the key and
    value tensors that :meth:`FusedKVCache.update` just handed out to GroupQueryAttention (families whose own
    attention code calls SDPA, such as Falcon); every other call runs the real SDPA."""
    functional = torch.nn.functional
    original = functional.scaled_dot_product_attention

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kwargs):
        cache = _ACTIVE_CACHE[-1] if _ACTIVE_CACHE else None
        pending = cache.pending_kv if cache is not None else None
        if pending is None or pending[1] is not key or pending[2] is not value:
            return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                            scale=scale, **kwargs)
        out = cache.attend(pending[0], query, key, value, scale, None, None)       # [B, S, Hq, D]
        return out.transpose(1, 2).contiguous()                                      # SDPA's [B, Hq, S, D]

    functional.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        functional.scaled_dot_product_attention = original


class FusedKVCache:
    """``past_key_values`` of the onnxruntime-fused target: hands the new keys/values to the attention
    function unchanged; GroupQueryAttention does the in-place append.

    :attr:`rotated` records, per layer, whether its GQA node applies RoPE (the layer called the model's
    ``apply_rotary_pos_emb``, see :func:`_rotary_pass_through`)."""

    is_compileable = False

    def __init__(self, past, position_ids: torch.Tensor, rotary: "RotaryCaches | None" = None,
                 window: int | None = None, window_layers: tuple[int, ...] = ()):
        self.past = past
        self.rotary = rotary
        self.window = window
        self.window_layers = frozenset(window_layers)
        self.position_ids = position_ids
        self.retained: list = [None] * len(past)
        self.rotated: list[bool | None] = [None] * len(past)
        self.is_sliding = [False] * len(past)
        self.layers = []
        self.pending_rope = None   # (cos, sin) the current layer passed to apply_rotary_pos_emb
        self.pending_kv = None     # (layer_idx, key, value) the current layer got back from update()
        seq = position_ids.shape[1]
        # The chunk fills slots [p0, p0 + S) of each row (padding rows land past the valid length and are
        # overwritten before they are ever read; the runtime never pads beyond the capacity).
        self.seqlens_k = (position_ids[:, 0] + seq - 1).to(torch.int32)
        self.total = (self.seqlens_k.max() + 1).reshape(1)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def __len__(self) -> int:
        return len(self.past)

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        self.pending_kv = (layer_idx, key_states, value_states)
        return key_states, value_states

    def attend(self, layer_idx: int, query, key, value, scaling, softcap, sinks) -> torch.Tensor:
        """Layer ``layer_idx``'s GroupQueryAttention: ``[B, S, Hq, D]``; records its retained buffers."""
        rope, self.pending_rope, self.pending_kv = self.pending_rope, None, None
        cos = sin = None
        if rope is not None:
            if self.rotary is None:
                raise RuntimeError(f"layer {layer_idx} applies RoPE but there are no rotary caches")
            self.rotary.check(layer_idx, rope[0], rope[1], self.position_ids)
            cos, sin = self.rotary.for_layer(layer_idx)
        self.rotated[layer_idx] = rope is not None
        hq, d, hkv = int(query.shape[1]), int(query.shape[3]), int(key.shape[1])
        if int(value.shape[-1]) != d:
            raise RuntimeError(f"layer {layer_idx}: keys and values of different head sizes ({d}, "
                               f"{int(value.shape[-1])}) do not fit GroupQueryAttention")
        scale = float(scaling if scaling is not None else d ** -0.5)
        past_k, past_v = self.past[layer_idx]
        # onnxruntime's local_window_size is the window itself: W keys, p - W + 1 .. p, as transformers' window
        local = self.window if layer_idx in self.window_layers else -1
        out, present_k, present_v = _GQA.apply(query, key, value, past_k, past_v, self.seqlens_k, self.total,
                                               cos, sin, sinks, hq, hkv, d, scale, float(softcap or 0.0),
                                               rope is not None, local)
        self.retained[layer_idx] = (present_k, present_v)
        return _SplitHeads.apply(out, d)


class RotaryCaches:
    """GroupQueryAttention's ``cos_cache``/``sin_cache`` ``[max_positions, D/2]`` per layer, from the model's own
    rotary embedding module: one pair for the whole model, or one pair per layer type where the module takes a
    ``layer_type`` (Gemma3's local and global RoPE bases)."""

    def __init__(self, tables: dict, layer_keys: list):
        self.tables = tables            # key -> (cos, sin)
        self.layer_keys = layer_keys    # layer index -> its key in tables

    def for_layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tables[self.layer_keys[layer_idx]]

    def check(self, layer_idx: int, cos, sin, position_ids: torch.Tensor) -> None:
        """Raise unless ``cos``/``sin``, the values the model passed to ``apply_rotary_pos_emb`` in layer
        ``layer_idx`` while tracing (batch 1), are this layer's caches at the traced positions (each frequency
        in both halves, rotate_half layout)."""
        pos = position_ids.reshape(-1)
        for got, table, name in zip((cos, sin), self.for_layer(layer_idx), ("cos", "sin")):
            want = table[pos].detach().float()                                           # [S, D/2]
            half = int(want.shape[-1])
            tol = 1e-5 if table.dtype == torch.float32 else 2e-3
            ok = isinstance(got, torch.Tensor) and int(got.shape[-1]) == 2 * half
            if ok:
                g = got.detach().float().reshape(-1, 2 * half)
                ok = g.shape[0] == want.shape[0] and bool(
                    torch.allclose(g[:, :half], want, rtol=0, atol=tol)
                    and torch.allclose(g[:, half:], want, rtol=0, atol=tol))
            if not ok:
                raise RuntimeError(f"layer {layer_idx}: the model's RoPE {name} values are not the "
                                   f"GroupQueryAttention {name} cache of this layer")


def _rope_param_sets(cfg) -> list[dict]:
    """The RoPE parameter dicts of a config: one, or one per layer type (``{layer_type: {...}}``)."""
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if rope and all(isinstance(v, dict) for v in rope.values()):
        return list(rope.values())
    return [rope]


def rotary_caches(model: torch.nn.Module, max_positions: int) -> RotaryCaches | None:
    """GroupQueryAttention's cos/sin caches for each layer from the model's own rotary embedding module, or
    ``None`` where GQA cannot apply this RoPE itself (partial rotary, interleaved or sequence-length-dependent
    scaling): the model's own rotary code then runs before GQA."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    for rope in _rope_param_sets(cfg):
        if rope.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0)) not in (None, 1, 1.0):
            return None
        if rope.get("rope_type", "default") in ("dynamic", "longrope") or "mrope_section" in rope:
            return None   # sequence-length-dependent or multimodal (3-row) positions: the model rotates
    rotary = getattr(model.get_decoder(), "rotary_emb", None)
    if rotary is None or rope_layout(model) != "split-half":  # GQA rotates split halves (interleaved: Cohere, GLM)
        return None
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    num_layers = int(cfg.num_hidden_layers)
    layer_keys: list = [None] * num_layers
    layer_types = list(getattr(cfg, "layer_types", None) or [])
    if "layer_type" in inspect.signature(rotary.forward).parameters and len(layer_types) >= num_layers:
        layer_keys = layer_types[:num_layers]         # one RoPE per layer type (Gemma3)
    pos = torch.arange(max_positions, dtype=torch.int64).unsqueeze(0)
    x = torch.zeros(1, dtype=next(model.parameters()).dtype)
    half = head_dim // 2
    tables = {}
    with torch.no_grad():
        for key in dict.fromkeys(layer_keys):
            try:
                cos, sin = rotary(x, pos) if key is None else rotary(x, pos, key)
            except Exception:  # a rotary module called some other way: the model keeps rotating itself
                return None
            if cos.shape[-1] != head_dim:
                return None
            # rotate_half RoPE repeats each frequency in both halves; GQA takes one half.
            if not torch.equal(cos[0, :, :half], cos[0, :, half:]):
                return None
            tables[key] = (cos[0, :, :half].contiguous(), sin[0, :, :half].contiguous())
    return RotaryCaches(tables, layer_keys)


GROUPED_ATTENTION = "qeff_kv_grouped"
FUSED_ATTENTION = "qeff_kv_fused"


def grouped_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention-interface function (registered as ``qeff_kv_grouped``).

    The mask passed by :class:`RetainedStateLM` already has exactly one column per attended slot.
    """
    hq, d = query.shape[1], query.shape[3]
    hkv = key.shape[1]
    if scaling is None:
        scaling = d ** -0.5
    out = _GroupedAttention.apply(query, key, value, attention_mask, float(scaling), int(hq), int(hkv), int(d),
                                  int(value.shape[-1]), float(kwargs.get("softcap") or 0.0), kwargs.get("s_aux"))
    return out, None


def use_grouped_attention(model: torch.nn.Module) -> None:
    """Route the model's attention through :func:`grouped_attention` (transformers' AttentionInterface)."""
    from transformers import AttentionInterface

    AttentionInterface.register(GROUPED_ATTENTION, grouped_attention)
    _decoder_module(model).set_attn_implementation(GROUPED_ATTENTION)


def _decoder_module(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose attention implementation the exporter sets: the language decoder of a vision-language
    model (its vision encoder keeps its own), else the model itself."""
    decoder = model.get_decoder()
    if decoder is not model and hasattr(decoder, "set_attn_implementation") and \
            getattr(model.config, "vision_config", None) is not None:
        return decoder
    return model


def build_attention_mask(position_ids: torch.Tensor, ctx_len: torch.Tensor | int, dtype: torch.dtype,
                         window: int | None = None, blocks: torch.Tensor | None = None) -> torch.Tensor:
    """Additive mask ``[B, 1, S, ctx_len]``: 0 where ``0 <= slot <= position`` (and ``slot > position - window``
    with a sliding ``window``), a large finite negative else.

    ``blocks [B, S]`` (bidirectional image blocks, see :func:`qeff_kv.export.vlm.image_blocks`): a query of
    block ``b >= 0`` also sees every slot of the chunk whose row is in block ``b``, later ones included (the
    chunk fills slots ``position_ids[:, 0] + row``, its positions being contiguous)."""
    slots = torch.arange(ctx_len, dtype=torch.int64).reshape(1, 1, 1, -1)
    pos = position_ids.unsqueeze(1).unsqueeze(-1)                                # [B, 1, S, 1]
    causal = slots <= pos
    if blocks is not None:
        seq = position_ids.shape[1]
        row = slots.reshape(1, -1) - position_ids[:, :1]                         # [B, L] chunk row of each slot
        in_chunk = (row >= 0) & (row < seq)
        key_block = torch.where(in_chunk, torch.gather(blocks, 1, row.clamp(0, seq - 1)), -1)
        q_block = blocks.unsqueeze(1).unsqueeze(-1)                              # [B, 1, S, 1]
        causal = causal | ((q_block >= 0) & (q_block == key_block.unsqueeze(1).unsqueeze(1)))
    visible = causal & (pos >= 0)
    if window is not None:
        visible = visible & (slots > pos - window)
    neg = torch.tensor(torch.finfo(dtype).min / 2, dtype=dtype)
    zero = torch.tensor(0, dtype=dtype)
    return torch.where(visible, zero, neg)


class _HeadGemm(torch.autograd.Function):
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


def output_head(head: torch.nn.Module, hidden_last: torch.Tensor) -> torch.Tensor:
    """``[B, 1, H] -> [B, 1, V]`` through the model's output head; a plain ``nn.Linear`` head becomes one
    ``Gemm(transB=1)`` on ``[B, H]`` (see :class:`_HeadGemm`), any other head module is called as is."""
    if type(head) is torch.nn.Linear:
        return _HeadGemm.apply(hidden_last[:, 0], head.weight, head.bias).unsqueeze(1)   # no If: static index
    return head(hidden_last)


class RetainedStateLM(torch.nn.Module):
    """``(input_ids, position_ids, *past, [batch_index]) -> (logits, *retained)`` around a causal LM."""

    def __init__(self, model: torch.nn.Module, num_layers: int, continuous_batching: bool,
                 valid_length_attention: bool = False, fused: bool = False, max_positions: int = 0,
                 facts=None, ccl: bool = False, ring_layers: tuple[int, ...] = (),
                 windowed_layers: tuple[int, ...] = ()):
        super().__init__()
        #: the graph takes ``comp_ctx_lengths`` (after the KV inputs, before ``batch_index``) and attends over
        #: its length only (onnxruntime target: the smaller of that and the valid length)
        self.ccl = ccl
        self._blocks = None
        if ccl and fused:
            raise ValueError("the fused target does not take comp_ctx_lengths")
        self.valid_length_attention = valid_length_attention
        self.fused = fused
        self.rotary = rotary_caches(model, max_positions) if fused else None
        self.sdpa_route = False
        if fused:
            if continuous_batching:
                raise ValueError("the fused target does not support continuous batching")
            from ..errors import ExportError
            from . import family

            if facts is None:
                facts = family.ModelFacts.from_config(model.config.to_dict())
            reason = facts.fused_refusal()
            if reason is not None:  # export refuses these from the config before loading; a safety net
                raise ExportError(reason)
            #: the layers whose GQA node applies RoPE must be the config's RoPE layers (cross-check)
            self.rope_layers = facts.rope_layers
            self.sdpa_route = facts.attention_code == "sdpa"
            if self.sdpa_route:
                # The model's own attention code calls torch SDPA when its config says "sdpa" (see sdpa_to_gqa);
                # such models refuse set_attn_implementation, so the config of this loaded copy is set.
                model.config._attn_implementation = "sdpa"
            else:
                from transformers import AttentionInterface

                AttentionInterface.register(FUSED_ATTENTION, fused_attention)
                _decoder_module(model).set_attn_implementation(FUSED_ATTENTION)
        elif valid_length_attention:
            use_grouped_attention(model)
        self.lm = model
        self.num_layers = num_layers
        self.continuous_batching = continuous_batching
        if facts is None:  # the exporter passes the facts it read from config.json
            from . import family

            facts = family.ModelFacts.from_config(model.config.to_dict())
        # What the model's own forward does to the head's output (see ModelFacts): Cohere multiplies by
        # logit_scale, Granite divides by logits_scaling, Gemma2 soft-caps.
        self.logit_scale = facts.logit_scale
        self.logits_scaling = facts.logits_scaling
        self.softcap = facts.final_logit_softcapping
        #: sliding layers whose cache is a ring of ``window`` slots (ScatterND targets, ``ctx_len > window``)
        self.ring_layers = tuple(ring_layers)
        self.window = int(facts.sliding_window) if facts.sliding_window else None
        #: every layer is a ring layer: the model takes one mask (Mistral, Phi-3); else one per layer type
        self.all_ring = len(self.ring_layers) == num_layers
        #: the fused target windows GroupQueryAttention (``local_window_size``) on these layers
        self.window_layers = tuple(facts.sliding_layers) if fused and self.window else ()
        #: full-length sliding layers whose window binds: their mask applies it (``--sliding-cache full``)
        self.windowed_layers = () if fused else tuple(windowed_layers)

    def forward(self, input_ids, position_ids, *rest):
        return self.run(input_ids, position_ids, rest)

    def run(self, input_ids, position_ids, rest, inputs_embeds=None, blocks=None, rope_rows=None):
        """The traced step: ``rest`` is the KV inputs (then ``comp_ctx_lengths``, then ``batch_index``).
        ``inputs_embeds`` ``[B, S, H]`` (vision-language graphs: text embeddings with image rows merged in)
        replaces the embedding of ``input_ids``; a padded row takes its sequence's last valid row's, as its id
        and position do (:func:`fill_padding`). ``blocks [B, S]``: bidirectional image blocks for every mask
        (:func:`build_attention_mask`). ``rope_rows [3, B, S]``: multimodal RoPE positions; the decoder then gets
        ``position_ids [4, B, S]`` (the text positions first, as transformers' Qwen2.5-VL takes them), padded rows
        repeating their sequence's last valid row."""
        self._blocks = blocks
        if rope_rows is not None and not self.fused:
            rope_rows = fill_padding_rows(rope_rows.permute(1, 2, 0), position_ids).permute(2, 0, 1)
        if self.continuous_batching:
            *flat, batch_index = rest
        else:
            flat, batch_index = list(rest), None
        ccl_length = _LengthOf.apply(flat.pop()) if self.ccl else None    # [L] = Shape(comp_ctx_lengths)
        past = [(flat[2 * i], flat[2 * i + 1]) for i in range(self.num_layers)]
        last = position_ids.argmax(dim=1, keepdim=True)                          # [B, 1] last valid row
        dtype = flat[0].dtype
        is_pad = position_ids < 0
        if inputs_embeds is not None and not self.fused:
            inputs_embeds = fill_padding_rows(inputs_embeds, position_ids)
        if self.fused:
            cache = FusedKVCache(past, position_ids, self.rotary, window=self.window,
                                 window_layers=self.window_layers)
            mask = torch.zeros((1, 1, 1, 1), dtype=dtype)  # GroupQueryAttention masks causally itself
            _ACTIVE_CACHE.append(cache)
        elif self.valid_length_attention:
            input_ids, position_ids = fill_padding(input_ids, position_ids)
            length = attended_length(position_ids)
            if ccl_length is not None:
                length = torch.minimum(length, ccl_length)
            ring = self._ring_step(position_ids, is_pad, dtype, read=True)
            cache = RetainedStateCache(past, position_ids, batch_index, length, ring, self.ring_layers)
            mask = self._masks(build_attention_mask(position_ids, length[0], dtype, blocks=blocks), ring,
                               lambda: build_attention_mask(position_ids, length[0], dtype, self.window, blocks))
        elif ccl_length is not None:
            # CCL on the portable target: attention reads the first L slots of the scattered buffer (Slice on
            # axis 2, ends = Shape(comp_ctx_lengths)); the mask has L columns. The ScatterND still reads the
            # graph input and writes the graph output, so in-place safety is unchanged.
            input_ids, position_ids = fill_padding(input_ids, position_ids)
            ring = self._ring_step(position_ids, is_pad, dtype)
            cache = RetainedStateCache(past, position_ids, batch_index, ccl_length, ring, self.ring_layers)
            mask = self._masks(build_attention_mask(position_ids, ccl_length[0], dtype, blocks=blocks), ring,
                               lambda: build_attention_mask(position_ids, ccl_length[0], dtype, self.window, blocks))
        else:
            input_ids, position_ids = fill_padding(input_ids, position_ids)
            ring = self._ring_step(position_ids, is_pad, dtype)
            cache = RetainedStateCache(past, position_ids, batch_index, ring=ring, ring_layers=self.ring_layers)
            full = None if self.all_ring else self._full_capacity(flat)
            mask = self._masks(None if full is None else build_attention_mask(position_ids, full, dtype,
                                                                             blocks=blocks), ring,
                               lambda: build_attention_mask(position_ids, full, dtype, self.window, blocks))
        base = self.lm.get_decoder()
        try:
            with sdpa_to_gqa() if self.sdpa_route else contextlib.nullcontext():
                tokens = dict(input_ids=input_ids) if inputs_embeds is None else dict(inputs_embeds=inputs_embeds)
                model_pos = position_ids if rope_rows is None else torch.cat([position_ids.unsqueeze(0), rope_rows])
                out = base(**tokens, position_ids=model_pos, attention_mask=mask, past_key_values=cache,
                           use_cache=True)
        finally:
            if self.fused:
                _ACTIVE_CACHE.pop()
        if self.fused:
            self._check_rope_layers(cache)
        hidden = out[0] if isinstance(out, tuple) else out.last_hidden_state
        idx = last.unsqueeze(-1).expand(hidden.shape[0], 1, hidden.shape[-1])
        hidden_last = torch.gather(hidden, 1, idx)                              # [B, 1, H]
        logits = output_head(self.lm.get_output_embeddings(), hidden_last)     # [B, 1, V]
        if self.logit_scale is not None:
            logits = logits * self.logit_scale
        if self.logits_scaling is not None:
            logits = logits / self.logits_scaling
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        retained = []
        for i, kv in enumerate(cache.retained):
            if kv is None:
                raise RuntimeError(f"layer {i} did not update its cache")
            retained.extend(kv)
        return (logits, *retained)

    def _full_capacity(self, flat) -> int:
        """``ctx_len``: axis 2 of a full-length (non-ring) layer's KV input."""
        i = next(i for i in range(self.num_layers) if i not in self.ring_layers)
        return flat[2 * i].shape[2]

    def _ring_step(self, position_ids, is_pad, dtype, read: bool = False) -> RingStep | None:
        """This step's :class:`RingStep`, or ``None`` without ring layers. ``read`` (the onnxruntime target):
        attention reads only the ring slots that can hold a position, ``min(window, max(p0))`` (at least 1)."""
        if not self.ring_layers:
            return None
        n = None
        if read:
            n = torch.clamp(torch.clamp(position_ids[:, 0].max(), max=self.window), min=1).reshape(1)
        return RingStep(self.window, position_ids, is_pad, n, dtype, self._blocks)

    def _masks(self, full, ring: RingStep | None, windowed=None):
        """What the decoder gets as ``attention_mask``: the full-length mask; the ring mask (or, with full-length
        sliding layers whose window binds, the ``windowed()`` mask) when every layer is sliding; else
        ``{layer_type: mask}`` (transformers then gives each layer the mask of its type)."""
        if ring is None and self.windowed_layers:
            sliding = windowed()
            if len(self.windowed_layers) == self.num_layers:
                return sliding
            return {"full_attention": full, "sliding_attention": sliding}
        if ring is None:
            return full
        if self.all_ring:
            return ring.mask
        return {"full_attention": full, "sliding_attention": ring.mask}

    def _check_rope_layers(self, cache: FusedKVCache) -> None:
        """GQA rotates exactly the layers that called the model's ``apply_rotary_pos_emb``; when any does, they
        must be the config's RoPE layers (``ModelFacts.rope_layers``), else the export stops."""
        rotated = tuple(i for i, r in enumerate(cache.rotated) if r)
        if rotated and rotated != tuple(self.rope_layers):
            raise RuntimeError(f"GroupQueryAttention would apply RoPE in layers {list(rotated)} but the config's "
                               f"RoPE layers are {list(self.rope_layers)}")
