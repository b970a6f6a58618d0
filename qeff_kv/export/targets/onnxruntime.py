"""``--target onnxruntime``: attention follows the valid length.

Attention reads only the first ``max(position_ids) + 1`` slots (with CCL, the smaller of that and
``len(comp_ctx_lengths)``): a data-dependent ``Slice`` of the scattered buffer, so a step costs time in proportion
to the valid length, not the capacity; ring layers read only the ring slots that can hold a position. Attention
runs as grouped-query attention in standard ops (:class:`~qeff_kv.export.modeling.graph_ops.GroupedAttentionOp`, keys and
values never repeated) and ``rotate_half`` with static sizes. Same names, pairing and in-place safety as portable.
"""

from __future__ import annotations

import torch

from qeff_kv.export import transformers_adapter as hf
from qeff_kv.export.modeling.caches import RetainedStateCache, attended_length
from qeff_kv.export.modeling.graph_ops import GroupedAttentionOp
from qeff_kv.export.modeling.masks import build_attention_mask, fill_padding
from qeff_kv.export.modeling.rope import compact_rotary
from qeff_kv.export.targets.base import Step, StepInputs, Target, decoder_module

GROUPED_ATTENTION = "qeff_kv_grouped"


def grouped_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention-interface function (registered as ``qeff_kv_grouped``).

    The mask passed by :class:`~qeff_kv.export.wrapper.RetainedStateLM` already has exactly one column per
    attended slot.
    """
    hq, d = query.shape[1], query.shape[3]
    hkv = key.shape[1]
    if scaling is None:
        scaling = d ** -0.5
    out = GroupedAttentionOp.apply(query, key, value, attention_mask, float(scaling), int(hq), int(hkv), int(d),
                                   int(value.shape[-1]), float(kwargs.get("softcap") or 0.0), kwargs.get("s_aux"))
    return out, None


def use_grouped_attention(model: torch.nn.Module) -> None:
    """Route the model's attention through :func:`grouped_attention` (transformers' AttentionInterface)."""
    hf.use_attention(decoder_module(model), GROUPED_ATTENTION, grouped_attention)


class OnnxruntimeTarget(Target):
    name = "onnxruntime"

    def __init__(self, model, facts, sliding, **kwargs):
        super().__init__(model, facts, sliding, **kwargs)
        use_grouped_attention(model)

    def rotary(self, model):
        return compact_rotary(model)

    def begin(self, x: StepInputs) -> Step:
        plan = self.sliding
        input_ids, position_ids = fill_padding(x.input_ids, x.position_ids)
        length = attended_length(position_ids)
        if x.ccl_length is not None:
            length = torch.minimum(length, x.ccl_length)
        ring = plan.ring_step(position_ids, x.is_pad, x.dtype, x.blocks, read=True)
        cache = RetainedStateCache(x.past, position_ids, x.batch_index, length, ring, plan.ring_layers)
        cache.kv_scales = self.kv_scales
        mask = plan.masks(build_attention_mask(position_ids, length[0], x.dtype, blocks=x.blocks), ring,
                          lambda: build_attention_mask(position_ids, length[0], x.dtype, plan.window, x.blocks),
                          lambda: build_attention_mask(position_ids, length[0], x.dtype, blocks=x.blocks,
                                                       chunk=plan.chunk))
        return Step(input_ids, position_ids, cache, mask)


TARGET = OnnxruntimeTarget
