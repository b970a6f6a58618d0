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

Padding (right-padded prompt, ``position_ids = -1``): a padded query row writes the key/value of the last
valid row of its sequence to the last valid position, i.e. the same data to the same slot as the valid
write, so it can never corrupt a slot and no out-of-range or wrapping index is produced. (A row made of
padding only has no valid slot; the runtime never sends one.)

This module imports torch; nothing outside :mod:`qeff_kv.export` imports it.
"""

from __future__ import annotations

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
        self._plan: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
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

    def _indices(self, num_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(ScatterND indices [B, H, S, 3], source row [B, H, S, D]) shared by every layer of this head count."""
        if num_heads in self._plan:
            return self._plan[num_heads]
        pos = self.position_ids
        bsz, seq = pos.shape
        is_pad = pos < 0
        last_row = pos.argmax(dim=1, keepdim=True)                              # [B, 1]
        last_pos = torch.gather(pos, 1, last_row)                               # [B, 1]
        write_pos = torch.where(is_pad, last_pos, pos)                          # [B, S]
        rows = torch.arange(seq, dtype=torch.int64).unsqueeze(0)
        src_row = torch.where(is_pad, last_row, rows)                           # [B, S]
        if self.batch_index is not None:
            b_idx = self.batch_index.reshape(bsz, 1, 1)
        else:
            b_idx = torch.arange(bsz, dtype=torch.int64).reshape(bsz, 1, 1)
        shape = (bsz, num_heads, seq)
        h_idx = torch.arange(num_heads, dtype=torch.int64).reshape(1, num_heads, 1)
        indices = torch.stack([b_idx.expand(shape), h_idx.expand(shape),
                               write_pos.unsqueeze(1).expand(shape)], dim=-1)
        gather_idx = src_row.reshape(bsz, 1, seq, 1).expand(bsz, num_heads, seq, head_dim)
        self._plan[num_heads] = (indices, gather_idx)
        return indices, gather_idx

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               cache_kwargs: dict | None = None):
        past_k, past_v = self.past[layer_idx]
        indices, src = self._indices(key_states.shape[1], key_states.shape[3])
        k_upd = torch.gather(key_states, 2, src)
        v_upd = torch.gather(value_states, 2, src)
        new_k = _ScatterKV.apply(past_k, indices, k_upd.to(past_k.dtype))
        new_v = _ScatterKV.apply(past_v, indices, v_upd.to(past_v.dtype))
        self.retained[layer_idx] = (new_k, new_v)
        att_k, att_v = new_k, new_v
        if self.attend_length is not None:
            att_k = _SliceSlots.apply(new_k, self.attend_length)
            att_v = _SliceSlots.apply(new_v, self.attend_length)
        if self.batch_index is not None:
            rows = self.batch_index.reshape(-1)
            return att_k[rows], att_v[rows]
        return att_k, att_v


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
                 valid_length_attention: bool = False):
        super().__init__()
        self.valid_length_attention = valid_length_attention
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
        dtype = flat[0].dtype
        if self.valid_length_attention:
            length = attended_length(position_ids)
            cache = RetainedStateCache(past, position_ids, batch_index, length)
            mask = build_attention_mask(position_ids, length[0], dtype)
        else:
            cache = RetainedStateCache(past, position_ids, batch_index)
            mask = build_attention_mask(position_ids, flat[0].shape[2], dtype)
        base = self.lm.get_decoder()
        out = base(input_ids=input_ids, position_ids=position_ids, attention_mask=mask,
                   past_key_values=cache, use_cache=True)
        hidden = out[0] if isinstance(out, tuple) else out.last_hidden_state
        last = position_ids.argmax(dim=1, keepdim=True)                          # [B, 1]
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
