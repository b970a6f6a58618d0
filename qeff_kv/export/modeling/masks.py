"""Padding and attention masks of the traced step (no model code here).

Padding (right-padded prompt, ``position_ids = -1``): before anything else, a padded row takes the token and
the position of its sequence's last valid row, so in every layer it computes exactly that row's key and value
and writes them to the same slot: padding can never corrupt a slot, and no index is negative or beyond
``ctx_len``. This costs a few nodes once per step, nothing per layer. (A row made of padding only has no
valid slot; the runtime never sends one.)

The mask is a ready 4D additive mask built from ``position_ids`` (transformers returns a 4D mask as-is), so
slot ``j`` is visible to a query at position ``p`` iff ``0 <= j <= p``; padded queries (``p = -1``) see a fully
masked row with a finite mask value, so softmax stays finite. :class:`SlidingPlan` composes it with the
sliding layers' ring mask (:class:`~qeff_kv.export.modeling.caches.RingStep`) or windowed mask.
"""

from __future__ import annotations

import torch


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


def build_attention_mask(position_ids: torch.Tensor, ctx_len: torch.Tensor | int, dtype: torch.dtype,
                         window: int | None = None, blocks: torch.Tensor | None = None,
                         chunk: int | None = None) -> torch.Tensor:
    """Additive mask ``[B, 1, S, ctx_len]``: 0 where ``0 <= slot <= position`` (and ``slot > position - window``
    with a sliding ``window``; ``slot >= (position // chunk) * chunk``, the query's own chunk, with chunked
    attention), a large finite negative else.

    ``blocks [B, S]`` (bidirectional image blocks, see :func:`qeff_kv.export.modeling.vlm.image_blocks`): a query of
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
    if chunk is not None:
        visible = visible & (slots >= torch.div(pos, chunk, rounding_mode="floor") * chunk)
    neg = torch.tensor(torch.finfo(dtype).min / 2, dtype=dtype)
    zero = torch.tensor(0, dtype=dtype)
    return torch.where(visible, zero, neg)
