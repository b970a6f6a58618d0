"""``--target onnxruntime-fused``: onnxruntime's ``com.microsoft::GroupQueryAttention`` per layer.

GQA appends the step's keys and values to the retained buffers in place (when the runtime binds one buffer as
past and present), masks causally over the filled slots itself (``local_window_size`` on sliding layers) and,
where the model's RoPE is one it can express (:func:`~qeff_kv.export.modeling.rope.rotary_caches`), rotates q and k
itself: the model's ``apply_rotary_pos_emb`` then passes them through unrotated
(:func:`rotary_pass_through`). Families whose attention code calls torch SDPA directly (Falcon) reach GQA
through :func:`sdpa_to_gqa`. No continuous batching (GQA has no ``batch_index``), no CCL, no ring buffers;
padded rows are not rewritten (they land past the valid length and are overwritten before they are read).
"""

from __future__ import annotations

import contextlib

import torch

from qeff_kv.errors import ExportError
from qeff_kv.export import transformers_adapter as hf
from qeff_kv.export.modeling.caches import zero_unwritten
from qeff_kv.export.modeling.graph_ops import GroupedAttentionOp, GroupQueryAttentionOp, SliceSlots, SplitHeads
from qeff_kv.export.modeling.rope import RotaryCaches, compact_rotary, patch_modeling_function, rotary_caches
from qeff_kv.export.targets.base import Step, StepInputs, Target, decoder_module

FUSED_ATTENTION = "qeff_kv_fused"


def rotary_pass_through(q, k, *args, **kwargs):
    """The fused target's ``apply_rotary_pos_emb``: returns q and k unrotated (GroupQueryAttention rotates them)
    and notes on the active :class:`FusedKVCache` that the calling layer applies RoPE, with the cos/sin it was
    given. Layers that never call it (NoPE layers) get no rotation in GQA either."""
    if not ACTIVE_CACHE:
        raise RuntimeError("apply_rotary_pos_emb was called outside the traced forward pass")
    cos = args[0] if len(args) > 0 else kwargs.get("cos")
    sin = args[1] if len(args) > 1 else kwargs.get("sin")
    ACTIVE_CACHE[-1].pending_rope = (cos, sin)
    return q, k


def skip_model_rotary(model: torch.nn.Module):
    """``apply_rotary_pos_emb`` as :func:`rotary_pass_through` while tracing the fused target with GQA's own
    RoPE: GroupQueryAttention rotates q and k itself, in exactly the layers that called it. Only the language
    decoder's modeling modules are patched: a vision encoder's own RoPE (Pixtral's) keeps rotating."""
    return patch_modeling_function(hf.decoder(model), "apply_rotary_pos_emb", rotary_pass_through)


ACTIVE_CACHE: list = []


def fused_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention-interface function of the onnxruntime-fused target (``qeff_kv_fused``).

    ``key``/``value`` are this step's new keys and values, as returned by :meth:`FusedKVCache.update`;
    GroupQueryAttention appends them to the retained buffers itself. Soft-capping (``softcap``) and attention
    sinks (``s_aux``) map to GQA's ``softcap`` and ``head_sink``; ``attention_mask`` is not read (GQA masks
    causally; on sliding layers with the window, GQA's ``local_window_size``, see :meth:`FusedKVCache.attend`).
    """
    cache = ACTIVE_CACHE[-1]
    window = kwargs.get("sliding_window")
    if (window is not None) != (module.layer_idx in cache.window_layers) or (
            window is not None and int(window) != cache.window):
        raise RuntimeError(f"layer {module.layer_idx}: the model's sliding window {window} is not the config's "
                           f"(window {cache.window} on layers {sorted(cache.window_layers)})")
    if module.layer_idx in cache.shared:   # a shared-KV layer: its source's present, no append
        return cache.attend_shared(module.layer_idx, query, scaling, kwargs.get("softcap"), kwargs.get("s_aux")), None
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
        cache = ACTIVE_CACHE[-1] if ACTIVE_CACHE else None
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


class FusedKVCache(hf.CacheProtocol):
    """The cache object of the onnxruntime-fused target: hands the new keys/values to the attention
    function unchanged; GroupQueryAttention does the in-place append.

    :attr:`rotated` records, per layer, whether its GQA node applies RoPE (the layer called the model's
    ``apply_rotary_pos_emb``, see :func:`rotary_pass_through`).

    ``shared``: shared-KV layers -> their source layer (:attr:`ModelFacts.kv_shared`); such a layer has no buffer
    and attends in standard ops over the source's GQA present output (:meth:`attend_shared`)."""

    def __init__(self, past, position_ids: torch.Tensor, rotary: RotaryCaches | None = None,
                 window: int | None = None, window_layers: tuple[int, ...] = (), shared: dict | None = None,
                 kv_scales: list | None = None, kv_bits: int = 8):
        super().__init__(len(past))
        #: ``--kv-cache-dtype int8``/``int4``: per layer ``(k_scale, v_scale)`` (:mod:`~qeff_kv.export.modeling.
        #: kv_quant`), and the cache's bit width
        self.kv_scales, self.kv_bits = kv_scales, kv_bits
        self.shared = dict(shared or {})
        self.past = past
        self.rotary = rotary
        self.window = window
        self.window_layers = frozenset(window_layers)
        self.position_ids = position_ids
        self.retained: list = [None] * len(past)
        self.rotated: list[bool | None] = [None] * len(past)
        self.pending_rope = None   # (cos, sin) the current layer passed to apply_rotary_pos_emb
        self.pending_kv = None     # (layer_idx, key, value) the current layer got back from update()
        seq = position_ids.shape[1]
        # The chunk fills slots [p0, p0 + S) of each row (padding rows land past the valid length and are
        # overwritten before they are ever read; the runtime never pads beyond the capacity).
        self.seqlens_k = (position_ids[:, 0] + seq - 1).to(torch.int32)
        self.total = (self.seqlens_k.max() + 1).reshape(1)

    def write(self, key_states, value_states, layer_idx):
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
        k_scale, v_scale = (None, None) if self.kv_scales is None else self.kv_scales[layer_idx]
        out, present_k, present_v = GroupQueryAttentionOp.apply(
            query, key, value, past_k, past_v, self.seqlens_k, self.total, cos, sin, sinks, hq, hkv, d, scale,
            float(softcap or 0.0), rope is not None, local, k_scale, v_scale, self.kv_bits)
        self.retained[layer_idx] = (present_k, present_v)
        return SplitHeads.apply(out, d)

    def attend_shared(self, layer_idx: int, query, scaling, softcap, sinks) -> torch.Tensor:
        """A shared-KV layer's attention ``[B, S, Hq, D]``: over the first ``total`` slots of its source layer's
        present buffers (what the source's GroupQueryAttention appended this step, never appended again), in
        standard ops (:class:`GroupedAttentionOp`): slot ``j`` is visible to the query at position ``p`` when
        ``j <= p`` (and ``j > p - window`` on a sliding layer); slots past a row's filled length are selected to
        zero first (:func:`zero_unwritten`)."""
        if self.pending_rope is not None:
            raise RuntimeError(f"layer {layer_idx} shares keys/values but leaves its queries to GroupQueryAttention's "
                               f"RoPE, which only a GQA node applies")
        self.pending_kv = None
        present = self.retained[self.shared[layer_idx]]
        if present is None:
            raise RuntimeError(f"layer {layer_idx} reads layer {self.shared[layer_idx]}'s keys/values before that "
                               f"layer wrote them")
        total = self.total.to(torch.int64)
        keys, values = (SliceSlots.apply(t, total) for t in present)
        slots = torch.arange(keys.shape[2], dtype=torch.int64)
        written = (slots.reshape(1, 1, -1, 1) <= self.seqlens_k.to(torch.int64).reshape(-1, 1, 1, 1))
        keys, values = zero_unwritten(keys, written), zero_unwritten(values, written)
        q = self.position_ids.unsqueeze(-1)                                          # [B, S, 1]
        visible = slots.reshape(1, 1, -1) <= q
        if layer_idx in self.window_layers:
            visible = visible & (slots.reshape(1, 1, -1) > q - self.window)
        neg = torch.tensor(torch.finfo(query.dtype).min / 2, dtype=query.dtype)
        mask = torch.where(visible.unsqueeze(1), torch.tensor(0, dtype=query.dtype), neg)
        hq, d, hkv = int(query.shape[1]), int(query.shape[3]), int(keys.shape[1])
        scale = float(scaling if scaling is not None else d ** -0.5)
        return GroupedAttentionOp.apply(query, keys, values, mask, scale, hq, hkv, d, int(values.shape[-1]),
                                        float(softcap or 0.0), sinks)


def slot_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """The positions the model computes with: a padded row (``-1``) takes the position of the slot GQA writes
    it to (``p0 + row``, after the chunk's valid rows), so code that reads ``position_ids`` itself stays finite
    there (Ministral3's ``1 + beta * log(1 + floor(p / n))`` query scale is ``-inf`` at ``p = -1``, and a
    non-finite padded query poisons the valid rows through ``0 * inf`` in GQA). Valid rows keep theirs."""
    rows = torch.arange(position_ids.shape[1], dtype=position_ids.dtype).unsqueeze(0)
    return torch.where(position_ids < 0, position_ids[:, :1] + rows, position_ids)


class FusedTarget(Target):
    name = "onnxruntime-fused"
    fills_padding = False
    custom_opsets = {"com.microsoft": 1}

    def __init__(self, model, facts, sliding, *, max_positions: int, continuous_batching: bool, ccl: bool):
        super().__init__(model, facts, sliding, max_positions=max_positions,
                         continuous_batching=continuous_batching, ccl=ccl)
        if ccl:
            raise ValueError("the fused target does not take comp_ctx_lengths")
        self.rotary_caches = rotary_caches(model, max_positions)
        if continuous_batching:
            raise ValueError("the fused target does not support continuous batching")
        reason = facts.fused_refusal()
        if reason is not None:  # export refuses these from the config before loading; a safety net
            raise ExportError(reason)
        #: the layers whose GQA node applies RoPE must be the config's RoPE layers (cross-check)
        self.rope_layers = facts.rope_layers
        self.sdpa_route = facts.attention_code == "sdpa"
        if self.sdpa_route:
            # The model's own attention code calls torch SDPA when its config says "sdpa" (see sdpa_to_gqa);
            # such models refuse set_attn_implementation, so the config of this loaded copy is set.
            hf.use_config_attention(model, "sdpa")
        else:
            hf.use_attention(decoder_module(model), FUSED_ATTENTION, fused_attention)
        #: GroupQueryAttention is windowed (``local_window_size``) on these layers
        self.window = sliding.window
        self.window_layers = tuple(facts.sliding_layers) if self.window else ()
        #: shared-KV layers -> their source (:attr:`ModelFacts.kv_shared`)
        self.shared = tuple(facts.kv_shared)

    def rotary(self, model):
        if self.rotary_caches is not None:
            return skip_model_rotary(model)
        return compact_rotary(model)

    def begin(self, x: StepInputs) -> Step:
        cache = FusedKVCache(x.past, x.position_ids, self.rotary_caches, window=self.window,
                             window_layers=self.window_layers, shared=dict(self.shared), kv_scales=self.kv_scales,
                             kv_bits=self.kv_bits)
        mask = torch.zeros((1, 1, 1, 1), dtype=x.dtype)  # GroupQueryAttention masks causally itself
        return Step(x.input_ids, slot_positions(x.position_ids), cache, mask)

    @contextlib.contextmanager
    def tracing(self, cache):
        ACTIVE_CACHE.append(cache)
        try:
            with sdpa_to_gqa() if self.sdpa_route else contextlib.nullcontext():
                yield
        finally:
            ACTIVE_CACHE.pop()

    def finish(self, cache) -> None:
        """GQA rotates exactly the layers that called the model's ``apply_rotary_pos_emb``; when any does, they
        must be the config's RoPE layers (``ModelFacts.rope_layers``), else the export stops."""
        rotated = tuple(i for i, r in enumerate(cache.rotated) if r)
        if rotated and rotated != tuple(self.rope_layers):
            raise RuntimeError(f"GroupQueryAttention would apply RoPE in layers {list(rotated)} but the config's "
                               f"RoPE layers are {list(self.rope_layers)}")


TARGET = FusedTarget
