"""The cache objects of the ScatterND targets (portable, onnxruntime) and of the shape probe.

* :class:`RetainedStateCache`: ``update()`` scatters the new keys/values into the fixed-capacity buffer with a
  single ``ScatterND`` that reads the graph input and produces the graph output (in-place safe), and returns
  the scattered buffer for attention (optionally only its first ``attend_length`` slots: the valid length on
  the onnxruntime target, ``comp_ctx_lengths`` with CCL), with every slot the sequence has not written selected
  to zero (:func:`zero_unwritten`);
* ring buffers of sliding layers (contract section 7), planned once per step by :class:`RingStep`;
* DeepSeek sparse attention's indexer keys (``update_indexer``): one more full-length buffer of an indexed layer
  (``index_key.{i}`` ``[B, 1, ctx_len, index_head_dim]``), scattered and read as its keys are;
* :class:`RecordingCache` / :func:`probe_kv_shapes`: what each layer really writes, before anything is traced.

The fused target's cache (GroupQueryAttention appends in place) lives with its target,
:mod:`qeff_kv.export.targets.fused`.
"""

from __future__ import annotations

import torch

from qeff_kv.export import transformers_adapter as hf
from qeff_kv.export.modeling.graph_ops import RingConcat, ScatterKV, SliceSlots, dequantize_int8, quantize_int8
from qeff_kv.export.modeling.masks import build_attention_mask


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
        #: ``[B, 1, R + S, 1]``: the slots attention reads that the sequence wrote (old ring slots holding a position
        #: >= 0, and the chunk's own rows); the others are selected to zero (:func:`zero_unwritten`)
        fresh = torch.ones_like(position_ids, dtype=torch.bool)
        self.written = torch.cat([held >= 0, fresh], dim=-1).unsqueeze(1).unsqueeze(-1)


def zero_unwritten(states: torch.Tensor, written: torch.Tensor) -> torch.Tensor:
    """``Where(written, states, 0)``: the keys or values attention reads, with every slot the sequence has not
    written selected to zero.

    The slots the sequence never wrote hold whatever the runtime left there (a buffer allocated without zeroing,
    another sequence's data): NaN or inf included. A mask *added* to the scores cannot remove those (``NaN + bias`` is
    NaN; a softmax weight of 0 times a NaN value row is NaN), so they are selected away before any arithmetic reads
    them: scores of those slots are then exactly 0 plus the mask, their softmax weight exactly 0, their value rows
    0. Slots the sequence wrote keep their data (a written slot the mask hides holds the model's own finite keys).
    """
    return torch.where(written, states, torch.zeros((), dtype=states.dtype))


def attended_length(position_ids: torch.Tensor) -> torch.Tensor:
    """1 + the largest position in the batch (at least 1), as a 1-D int64 tensor: the slots attention needs."""
    return torch.clamp(position_ids.max() + 1, min=1).reshape(1)


class RetainedStateCache(hf.CacheProtocol):
    """A cache object for transformers models: scatter-update into fixed-capacity buffers.

    Models call ``update(key, value, layer_idx, ...)`` (:class:`~qeff_kv.export.transformers_adapter.CacheProtocol`).
    After the forward pass, :attr:`retained` holds one updated (key, value) per layer, in layer order (and, for
    an indexed layer, its indexer keys third: :meth:`update_indexer`).
    """

    def __init__(self, past: list[tuple[torch.Tensor, torch.Tensor]], position_ids: torch.Tensor,
                 batch_index: torch.Tensor | None, attend_length: torch.Tensor | None = None,
                 ring: RingStep | None = None, ring_layers: tuple[int, ...] = ()):
        super().__init__(len(past))
        self.past = past
        self.attend_length = attend_length
        self.position_ids = position_ids
        self.batch_index = batch_index
        self.ring = ring
        self.ring_layers = frozenset(ring_layers)
        self.retained: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(past)
        self._plans: dict[tuple[int, bool], torch.Tensor] = {}
        self._written: torch.Tensor | None = None
        #: ``--kv-cache-dtype int8``: per layer ``(k_scale, v_scale)`` (:mod:`.kv_quant`; set by the target): the chunk
        #: is quantized before the ScatterND and what attention reads dequantized after it
        self.kv_scales: list | None = None

    def _written_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """``[B, 1, L, 1]``: slot ``j`` of the ``L`` read (``slots``: the buffer's axis 2) was written by the row's
        sequence, ``j <= `` its largest position (a row holds its positions ``[0, p]``), built once for every
        full-length layer."""
        if self._written is None:
            length = slots.shape[2] if self.attend_length is None else self.attend_length[0]
            last = self.position_ids.max(dim=1).values.reshape(-1, 1, 1, 1)          # [B, 1, 1, 1]
            self._written = torch.arange(length, dtype=torch.int64).reshape(1, 1, -1, 1) <= last
        return self._written

    def get_mask_sizes(self, *args, **kwargs):  # pragma: no cover - masks are passed ready-made
        raise NotImplementedError("RetainedStateCache is used with a ready 4D attention mask")

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
        past_k, past_v = self.past[layer_idx][:2]
        indices = self._indices(int(key_states.shape[1]), ring=True)
        att, new = [], []
        for past, states in ((past_k, key_states), (past_v, value_states)):
            old = past[self.batch_index.reshape(-1)] if self.batch_index is not None else past
            if self.ring.read is not None:
                old = SliceSlots.apply(old, self.ring.read)
            cat, upd = RingConcat.apply(old, states.to(past.dtype))
            att.append(zero_unwritten(cat, self.ring.written))
            new.append(ScatterKV.apply(past, indices, upd))
        self.retained[layer_idx] = (new[0], new[1])
        return att[0], att[1]

    def write(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int):
        if layer_idx in self.ring_layers:
            return self._update_ring(layer_idx, key_states, value_states)
        past_k, past_v = self.past[layer_idx][:2]
        indices = self._indices(int(key_states.shape[1]))
        dtype, scales = key_states.dtype, None if self.kv_scales is None else self.kv_scales[layer_idx]
        if scales is not None:
            key_states, value_states = quantize_int8(key_states, scales[0]), quantize_int8(value_states, scales[1])
        new_k = ScatterKV.apply(past_k, indices, key_states.to(past_k.dtype))
        new_v = ScatterKV.apply(past_v, indices, value_states.to(past_v.dtype))
        self.retained[layer_idx] = (new_k, new_v)
        att_k, att_v = new_k, new_v
        if self.attend_length is not None:
            att_k = SliceSlots.apply(new_k, self.attend_length)
            att_v = SliceSlots.apply(new_v, self.attend_length)
        if self.batch_index is not None:
            rows = self.batch_index.reshape(-1)
            att_k, att_v = att_k[rows], att_v[rows]
        if scales is not None:
            att_k, att_v = dequantize_int8(att_k, scales[0], dtype), dequantize_int8(att_v, scales[1], dtype)
        written = self._written_slots(att_k)
        return zero_unwritten(att_k, written), zero_unwritten(att_v, written)

    def _attended(self, states: torch.Tensor) -> torch.Tensor:
        """The slots attention reads of a scattered full-length buffer: the first ``attend_length`` (when set), the
        step's rows (``batch_index``), every slot the sequence has not written selected to zero."""
        if self.attend_length is not None:
            states = SliceSlots.apply(states, self.attend_length)
        if self.batch_index is not None:
            states = states[self.batch_index.reshape(-1)]
        return zero_unwritten(states, self._written_slots(states))

    def update_indexer(self, index_keys: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """DeepSeek sparse attention: the layer's new indexer keys ``[B, S, index_head_dim]`` scattered into its
        ``index_key`` buffer (the third of ``past[layer_idx]``, ``[B, 1, ctx_len, index_head_dim]``) at their
        positions, as keys are; returns what the indexer scores, ``[B, T, index_head_dim]`` (unwritten slots zero,
        so their scores are exactly 0 plus the mask)."""
        layer_idx = int(layer_idx)
        past = self.past[layer_idx]
        if len(past) < 3 or self.retained[layer_idx] is None or len(self.retained[layer_idx]) != 2:
            raise RuntimeError(f"layer {layer_idx} runs an indexer the state spec gives no index_key buffer")
        new = ScatterKV.apply(past[2], self._indices(1), index_keys.unsqueeze(1).to(past[2].dtype))
        self.retained[layer_idx] = (*self.retained[layer_idx], new)
        return self._attended(new).squeeze(1)


class RecordingCache(hf.CacheProtocol):
    """A cache that records each layer's new key/value shapes and attends over them only."""

    def __init__(self, num_layers: int):
        super().__init__(num_layers)
        self.shapes: list[tuple[tuple[int, ...], tuple[int, ...]] | None] = [None] * num_layers
        #: layer -> the shape of the indexer keys it wrote (DeepSeek sparse attention), ``[B, S, index_head_dim]``
        self.index_shapes: dict[int, tuple[int, ...]] = {}

    def write(self, key_states, value_states, layer_idx):
        self.shapes[layer_idx] = (tuple(key_states.shape), tuple(value_states.shape))
        return key_states, value_states

    def update_indexer(self, index_keys, layer_idx):
        self.index_shapes[int(layer_idx)] = tuple(index_keys.shape)
        return index_keys


def probe_kv_shapes(model: torch.nn.Module, num_layers: int, attention_layers: tuple[int, ...] | None = None
                    ) -> list[tuple[tuple[int, int], tuple[int, int]] | None]:
    """Run the decoder once on two tokens and record, per layer, ``((key_heads, key_dim), (value_heads,
    value_dim))`` as the model itself produces them, and a third ``(1, index_head_dim)`` for a layer that writes
    indexer keys (DeepSeek sparse attention). ``attention_layers`` (a hybrid model): only these must write
    through the cache, and only they do; the other layers' entries are ``None``.

    The cache buffers are shaped from what the model really writes, not from config fields whose meaning
    differs between families (Falcon's ``multi_query`` ignores ``num_kv_heads``; MLA keys and values have
    different head sizes)."""
    cache = RecordingCache(num_layers)
    ids = torch.tensor([[1, 2]], dtype=torch.int64)
    pos = torch.arange(2, dtype=torch.int64).unsqueeze(0)
    dtype = next(model.parameters()).dtype
    mask = build_attention_mask(pos, 2, dtype)
    with torch.no_grad():
        decoder = hf.decoder(model)
        decoder(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=True, **hf.with_cache(decoder, cache))
    out = []
    for i, kv in enumerate(cache.shapes):
        if attention_layers is not None and i not in attention_layers:
            if kv is not None:
                raise RuntimeError(f"layer {i} wrote keys/values but the config says it does not attend")
            out.append(None)
            continue
        if kv is None:
            raise RuntimeError(f"layer {i} wrote no keys/values through the cache")
        (kb, kh, ks, kd), (vb, vh, vs, vd) = kv
        index = cache.index_shapes.get(i)
        out.append(((int(kh), int(kd)), (int(vh), int(vd))) + (() if index is None else ((1, int(index[-1])),)))
    return out


class SlidingPlan:
    """How the sliding-window layers keep and mask their cache in one export, shared by every target.

    ``ring_layers``: sliding layers whose cache is a ring of ``window`` slots (ScatterND targets, ``ctx_len >
    window``); ``windowed_layers``: full-length sliding layers whose window binds, so their mask applies it
    (``--sliding-cache full``); ``window``: the config's sliding window (``None`` without one); ``unmasked_types``:
    layer types of recurrent mixer layers (``ModelFacts.mixer_layer_types``), which a per-type mask dict maps to
    ``None``."""

    def __init__(self, num_layers: int, window: int | None, ring_layers: tuple[int, ...] = (),
                 windowed_layers: tuple[int, ...] = (), chunk: int | None = None,
                 unmasked_types: tuple[str, ...] = ()):
        self.num_layers = num_layers
        self.unmasked_types = tuple(unmasked_types)
        #: chunked attention (Llama4): the chunk size, when the model has chunked layers (full-length buffers; their
        #: mask keeps each query within its chunk)
        self.chunk = int(chunk) if chunk else None
        self.window = int(window) if window else None
        self.ring_layers = tuple(ring_layers)
        #: every layer is a ring layer: the model takes one mask (Mistral, Phi-3); else one per layer type
        self.all_ring = len(self.ring_layers) == num_layers
        self.windowed_layers = tuple(windowed_layers)

    def full_capacity(self, past) -> int:
        """``ctx_len``: axis 2 of a full-length (non-ring) layer's KV input (``past[layer] = (key, value)``,
        ``None`` for a layer that does not attend); 1 when no layer attends (a pure recurrent model: no mask is
        read)."""
        i = next((i for i in range(self.num_layers) if i not in self.ring_layers and past[i] is not None), None)
        return 1 if i is None else past[i][0].shape[2]

    def ring_step(self, position_ids, is_pad, dtype, blocks=None, read: bool = False) -> RingStep | None:
        """This step's :class:`RingStep`, or ``None`` without ring layers. ``read`` (the onnxruntime target):
        attention reads only the ring slots that can hold a position, ``min(window, max(p0))`` (at least 1)."""
        if not self.ring_layers:
            return None
        n = None
        if read:
            n = torch.clamp(torch.clamp(position_ids[:, 0].max(), max=self.window), min=1).reshape(1)
        return RingStep(self.window, position_ids, is_pad, n, dtype, blocks)

    def masks(self, full, ring: RingStep | None, windowed=None, chunked=None):
        """What the decoder gets as ``attention_mask``: the full-length mask; the ring mask (or, with full-length
        sliding layers whose window binds, the ``windowed()`` mask) when every layer is sliding; else
        ``{layer_type: mask}`` (transformers then gives each layer the mask of its type), with the ``chunked()``
        mask of the chunked layers when the model has them and ``None`` for the recurrent mixer layers' types
        (their traced step masks padding itself)."""
        masks = self._masks(full, ring, windowed)
        if self.chunk is not None:
            if not isinstance(masks, dict):
                masks = {"full_attention": masks}
            masks = {**masks, "chunked_attention": chunked()}
        if isinstance(masks, dict):
            masks = {**masks, **{t: None for t in self.unmasked_types}}
        return masks

    def _masks(self, full, ring: RingStep | None, windowed=None):
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
