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
                 batch_index: torch.Tensor | None, attend_length: torch.Tensor | None = None):
        self.past = past
        self.attend_length = attend_length
        self.position_ids = position_ids
        self.batch_index = batch_index
        self.retained: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(past)
        self._plan: torch.Tensor | None = None
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

    def _indices(self, num_heads: int) -> torch.Tensor:
        """ScatterND indices ``[B, H, S, 3]`` (batch row, head, position), built once for every layer."""
        if self._plan is not None:
            return self._plan
        pos = self.position_ids
        bsz, seq = pos.shape
        if self.batch_index is not None:
            b_idx = self.batch_index.reshape(bsz, 1, 1)
        else:
            b_idx = torch.arange(bsz, dtype=torch.int64).reshape(bsz, 1, 1)
        shape = (bsz, num_heads, seq)
        h_idx = torch.arange(num_heads, dtype=torch.int64).reshape(1, num_heads, 1)
        self._plan = torch.stack([b_idx.expand(shape), h_idx.expand(shape), pos.unsqueeze(1).expand(shape)], dim=-1)
        return self._plan

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               cache_kwargs: dict | None = None):
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


class _GroupedAttention(torch.autograd.Function):
    """Grouped-query attention in a dozen standard ONNX ops, for the onnxruntime target.

    ``q [B, Hq, S, D]``, ``k, v [B, Hkv, L, D]``, additive ``mask [B, 1, S, L]`` -> ``[B, S, Hq, D]``.
    Queries are grouped per KV head (``[B, Hkv, Hq/Hkv, S, D]``) so keys and values are never repeated, and
    every Reshape uses constant 0/-1 dims, so no shape arithmetic runs per step.
    """

    @staticmethod
    def forward(ctx, q, k, v, mask, scaling: float, hq: int, hkv: int, d: int):  # noqa: D401
        b, _, s, _ = q.shape
        q5 = q.reshape(b, hkv, hq // hkv, s, d)
        scores = torch.matmul(q5, k.unsqueeze(2).transpose(-1, -2)) * scaling + mask.unsqueeze(1)
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        out = torch.matmul(probs, v.unsqueeze(2)).reshape(b, hq, s, d)
        return out.transpose(1, 2)

    @staticmethod
    def symbolic(g, q, k, v, mask, scaling, hq, hkv, d):
        def const(values):
            return g.op("Constant", value_t=torch.tensor(values, dtype=torch.int64))

        q5 = g.op("Reshape", q, const([0, hkv, hq // hkv, -1, d]))
        k5 = g.op("Unsqueeze", k, const([2]))
        v5 = g.op("Unsqueeze", v, const([2]))
        scores = g.op("MatMul", q5, g.op("Transpose", k5, perm_i=[0, 1, 2, 4, 3]))
        dtype = q.type().dtype() if q.type().dtype() is not None else torch.float32
        scores = g.op("Mul", scores, g.op("Constant", value_t=torch.tensor(scaling, dtype=dtype)))
        scores = g.op("Add", scores, g.op("Unsqueeze", mask, const([1])))
        if dtype != torch.float32:
            probs = g.op("Cast", g.op("Softmax", g.op("Cast", scores, to_i=1), axis_i=-1),
                         to_i=10 if dtype == torch.float16 else 16)
        else:
            probs = g.op("Softmax", scores, axis_i=-1)
        out = g.op("Reshape", g.op("MatMul", probs, v5), const([0, hq, -1, d]))
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


@contextlib.contextmanager
def patch_modeling_function(model: torch.nn.Module, name: str, replacement):
    """While tracing, replace the function ``name`` in every modeling module that ``model``'s layers come from.

    transformers' decoders define helpers such as ``rotate_half`` and ``apply_rotary_pos_emb`` in their
    modeling module and call them through the module's globals. Modules without ``name`` are left alone; the
    originals are restored on exit.
    """
    patched = []
    for mod_name in sorted({type(m).__module__ for m in model.modules()}):
        module = sys.modules.get(mod_name)
        if module is not None and callable(getattr(module, name, None)):
            patched.append((module, getattr(module, name)))
            setattr(module, name, replacement)
    try:
        yield
    finally:
        for module, fn in patched:
            setattr(module, name, fn)


def compact_rotary(model: torch.nn.Module):
    """``rotate_half`` as :func:`_rotate_half` (same values, static sizes) while tracing."""
    return patch_modeling_function(model, "rotate_half", _rotate_half)


def skip_model_rotary(model: torch.nn.Module):
    """``apply_rotary_pos_emb`` as a pass-through while tracing the fused target with GQA's own RoPE
    (GroupQueryAttention rotates q and k itself)."""
    return patch_modeling_function(model, "apply_rotary_pos_emb", lambda q, k, *args, **kwargs: (q, k))


class _GQA(torch.autograd.Function):
    """onnxruntime's ``com.microsoft::GroupQueryAttention`` over a shared past/present buffer.

    Inputs: ``q [B, Hq, S, D]``, ``k, v [B, Hkv, S, D]`` (as transformers' attention code holds them), the
    retained buffers ``past_k, past_v [B, Hkv, ctx, D]``, ``seqlens_k [B]`` int32 (last slot the chunk fills),
    ``total [1]`` int32 and, when ``rotary``, the cos/sin caches ``[max_pos, D/2]`` (GQA then applies RoPE
    to q and k itself; otherwise they arrive rotated). The chunk occupies slots ``[seqlens_k - S + 1,
    seqlens_k]``; GQA appends it to the buffer in place (when the runtime binds one buffer as past and
    present) and attends causally over the filled slots only. Returns ``(attention [B, S, Hq*D],
    present_k, present_v)``: transformers' attention modules reshape the attention output to
    ``[B, S, -1]`` next, so the packed form needs no reshape of its own. Layout changes use constant 0/-1 reshapes (no shape arithmetic per step).
    """

    @staticmethod
    def forward(ctx, q, k, v, past_k, past_v, seqlens_k, total, cos, sin, hq: int, hkv: int, d: int,
                scale: float, rotary: bool):
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
        scores = torch.matmul(q5, pk.unsqueeze(2).transpose(-1, -2)) * scale         # [B, Hkv, G, S, ctx]
        slots = torch.arange(pk.shape[2]).reshape(1, 1, 1, 1, -1)
        scores = scores.masked_fill(~(slots <= pos.reshape(b, 1, 1, s, 1)), float("-inf"))
        out = torch.matmul(torch.softmax(scores.float(), -1).to(q.dtype), pv.unsqueeze(2))  # [B, Hkv, G, S, D]
        return out.reshape(b, hq, s, d).transpose(1, 2).reshape(b, s, hq * d), pk, pv

    @staticmethod
    def symbolic(g, q, k, v, past_k, past_v, seqlens_k, total, cos, sin, hq, hkv, d, scale, rotary):
        def const(values):
            return g.op("Constant", value_t=torch.tensor(values, dtype=torch.int64))

        def packed(x):  # [B, H, S, D] -> [B, S, H*D]
            return g.op("Reshape", g.op("Transpose", x, perm_i=[0, 2, 1, 3]), const([0, 0, -1]))

        inputs = [packed(q), packed(k), packed(v), past_k, past_v, seqlens_k, total]
        if rotary:
            inputs += [cos, sin]
        out, present_k, present_v = g.op("com.microsoft::GroupQueryAttention", *inputs, num_heads_i=hq,
                                         kv_num_heads_i=hkv, scale_f=scale, do_rotary_i=int(rotary), outputs=3)
        out.setType(q.type().with_sizes([None, None, hq * d]))
        present_k.setType(past_k.type())
        present_v.setType(past_v.type())
        return out, present_k, present_v


#: The cache of the forward pass being traced, for the fused attention function (tracing is single-threaded).
_ACTIVE_CACHE: list = []


def fused_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention-interface function of the onnxruntime-fused target (``qeff_kv_fused``).

    ``key``/``value`` are this step's new (rotated) keys and values, as returned by
    :meth:`FusedKVCache.update`; GroupQueryAttention appends them to the retained buffers itself.
    """
    if kwargs.get("softcap") or kwargs.get("s_aux") is not None:
        raise NotImplementedError("attention soft-capping and sinks are not supported by the fused target")
    cache = _ACTIVE_CACHE[-1]
    hq, d, hkv = int(query.shape[1]), int(query.shape[3]), int(key.shape[1])
    scale = float(scaling if scaling is not None else d ** -0.5)
    past_k, past_v = cache.past[module.layer_idx]
    out, present_k, present_v = _GQA.apply(query, key, value, past_k, past_v, cache.seqlens_k, cache.total,
                                           cache.cos, cache.sin, hq, hkv, d, scale, cache.cos is not None)
    cache.retained[module.layer_idx] = (present_k, present_v)
    return out, None


class FusedKVCache:
    """``past_key_values`` of the onnxruntime-fused target: hands the new keys/values to the attention
    function unchanged; GroupQueryAttention does the in-place append."""

    is_compileable = False

    def __init__(self, past, position_ids: torch.Tensor, cos: torch.Tensor | None = None,
                 sin: torch.Tensor | None = None):
        self.past = past
        self.cos, self.sin = cos, sin
        self.retained: list = [None] * len(past)
        self.is_sliding = [False] * len(past)
        self.layers = []
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
        return key_states, value_states


def rotary_caches(model: torch.nn.Module, max_positions: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """GroupQueryAttention's ``cos_cache``/``sin_cache`` ``[max_positions, D/2]`` from the model's own rotary
    embedding module, or ``None`` where GQA cannot apply this RoPE itself (partial rotary, interleaved or
    sequence-length-dependent scaling): the model's own rotary code then runs before GQA."""
    cfg = model.config
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if rope.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0)) not in (None, 1, 1.0):
        return None
    if rope.get("rope_type", "default") in ("dynamic", "longrope"):
        return None
    rotary = getattr(model.get_decoder(), "rotary_emb", None)
    if rotary is None:
        return None
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    pos = torch.arange(max_positions, dtype=torch.int64).unsqueeze(0)
    dtype = next(model.parameters()).dtype
    with torch.no_grad():
        cos, sin = rotary(torch.zeros(1, dtype=dtype), pos)
    if cos.shape[-1] != head_dim:
        return None
    half = head_dim // 2
    # rotate_half RoPE repeats each frequency in both halves; GQA takes one half.
    if not torch.equal(cos[0, :, :half], cos[0, :, half:]):
        return None
    return cos[0, :, :half].contiguous(), sin[0, :, :half].contiguous()


GROUPED_ATTENTION = "qeff_kv_grouped"
FUSED_ATTENTION = "qeff_kv_fused"


def grouped_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention-interface function (registered as ``qeff_kv_grouped``).

    The mask passed by :class:`RetainedStateLM` already has exactly one column per attended slot.
    """
    if kwargs.get("softcap") or kwargs.get("s_aux") is not None:
        raise NotImplementedError("attention soft-capping and sinks are not supported by the onnxruntime target")
    hq, d = query.shape[1], query.shape[3]
    hkv = key.shape[1]
    if scaling is None:
        scaling = d ** -0.5
    out = _GroupedAttention.apply(query, key, value, attention_mask, float(scaling), int(hq), int(hkv), int(d))
    return out, None


def use_grouped_attention(model: torch.nn.Module) -> None:
    """Route the model's attention through :func:`grouped_attention` (transformers' AttentionInterface)."""
    from transformers import AttentionInterface

    AttentionInterface.register(GROUPED_ATTENTION, grouped_attention)
    model.set_attn_implementation(GROUPED_ATTENTION)


def build_attention_mask(position_ids: torch.Tensor, ctx_len: torch.Tensor | int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask ``[B, 1, S, ctx_len]``: 0 where ``0 <= slot <= position``, a large finite negative else."""
    slots = torch.arange(ctx_len, dtype=torch.int64).reshape(1, 1, 1, -1)
    pos = position_ids.unsqueeze(1).unsqueeze(-1)                                # [B, 1, S, 1]
    visible = (slots <= pos) & (pos >= 0)
    neg = torch.tensor(torch.finfo(dtype).min / 2, dtype=dtype)
    zero = torch.tensor(0, dtype=dtype)
    return torch.where(visible, zero, neg)


class RetainedStateLM(torch.nn.Module):
    """``(input_ids, position_ids, *past, [batch_index]) -> (logits, *retained)`` around a causal LM."""

    def __init__(self, model: torch.nn.Module, num_layers: int, continuous_batching: bool,
                 valid_length_attention: bool = False, fused: bool = False, max_positions: int = 0):
        super().__init__()
        self.valid_length_attention = valid_length_attention
        self.fused = fused
        self.rotary = rotary_caches(model, max_positions) if fused else None
        if fused:
            if continuous_batching:
                raise ValueError("the fused target does not support continuous batching")
            from transformers import AttentionInterface

            AttentionInterface.register(FUSED_ATTENTION, fused_attention)
            model.set_attn_implementation(FUSED_ATTENTION)
        elif valid_length_attention:
            use_grouped_attention(model)
        self.lm = model
        self.num_layers = num_layers
        self.continuous_batching = continuous_batching
        cfg = model.config
        self.logits_scaling = getattr(cfg, "logits_scaling", None)
        self.softcap = getattr(cfg, "final_logit_softcapping", None)

    def forward(self, input_ids, position_ids, *rest):
        if self.continuous_batching:
            *flat, batch_index = rest
        else:
            flat, batch_index = list(rest), None
        past = [(flat[2 * i], flat[2 * i + 1]) for i in range(self.num_layers)]
        last = position_ids.argmax(dim=1, keepdim=True)                          # [B, 1] last valid row
        dtype = flat[0].dtype
        if self.fused:
            cache = FusedKVCache(past, position_ids, *(self.rotary or (None, None)))
            mask = torch.zeros((1, 1, 1, 1), dtype=dtype)  # GroupQueryAttention masks causally itself
            _ACTIVE_CACHE.append(cache)
        elif self.valid_length_attention:
            input_ids, position_ids = fill_padding(input_ids, position_ids)
            length = attended_length(position_ids)
            cache = RetainedStateCache(past, position_ids, batch_index, length)
            mask = build_attention_mask(position_ids, length[0], dtype)
        else:
            input_ids, position_ids = fill_padding(input_ids, position_ids)
            cache = RetainedStateCache(past, position_ids, batch_index)
            mask = build_attention_mask(position_ids, flat[0].shape[2], dtype)
        base = self.lm.get_decoder()
        try:
            out = base(input_ids=input_ids, position_ids=position_ids, attention_mask=mask,
                       past_key_values=cache, use_cache=True)
        finally:
            if self.fused:
                _ACTIVE_CACHE.pop()
        hidden = out[0] if isinstance(out, tuple) else out.last_hidden_state
        idx = last.unsqueeze(-1).expand(hidden.shape[0], 1, hidden.shape[-1])
        hidden_last = torch.gather(hidden, 1, idx)                              # [B, 1, H]
        logits = self.lm.get_output_embeddings()(hidden_last)
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
