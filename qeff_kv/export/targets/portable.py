"""``--target portable``: static shapes and standard ops for accelerator compilers.

Attention reads every slot of the scattered buffer (the model's own attention code, a mask of ``ctx_len``
columns); with CCL, the first ``len(comp_ctx_lengths)`` slots: a ``Slice`` of the scattered buffer whose end is
``Shape(comp_ctx_lengths)``, the mask with as many columns. The ScatterND still reads the graph input and writes
the graph output, so in-place safety is unchanged.
"""

from __future__ import annotations

from qeff_kv.export.modeling.caches import RetainedStateCache
from qeff_kv.export.modeling.masks import build_attention_mask, fill_padding
from qeff_kv.export.targets.base import Step, StepInputs, Target


class PortableTarget(Target):
    name = "portable"

    def begin(self, x: StepInputs) -> Step:
        plan = self.sliding
        input_ids, position_ids = fill_padding(x.input_ids, x.position_ids)
        ring = plan.ring_step(position_ids, x.is_pad, x.dtype, x.blocks)
        if x.ccl_length is not None:
            cache = RetainedStateCache(x.past, position_ids, x.batch_index, x.ccl_length, ring, plan.ring_layers)
            full = build_attention_mask(position_ids, x.ccl_length[0], x.dtype, blocks=x.blocks)
            mask = plan.masks(full, ring, lambda: build_attention_mask(position_ids, x.ccl_length[0], x.dtype,
                                                                       plan.window, x.blocks),
                              lambda: build_attention_mask(position_ids, x.ccl_length[0], x.dtype, blocks=x.blocks,
                                                           chunk=plan.chunk))
        else:
            cache = RetainedStateCache(x.past, position_ids, x.batch_index, ring=ring, ring_layers=plan.ring_layers)
            columns = None if plan.all_ring else plan.full_capacity(x.past)
            full = None if columns is None else build_attention_mask(position_ids, columns, x.dtype, blocks=x.blocks)
            mask = plan.masks(full, ring, lambda: build_attention_mask(position_ids, columns, x.dtype, plan.window,
                                                                       x.blocks),
                              lambda: build_attention_mask(position_ids, columns, x.dtype, blocks=x.blocks,
                                                           chunk=plan.chunk))
        cache.kv_scales = self.kv_scales   # --kv-cache-dtype int8 (kv_quant), else None
        return Step(input_ids, position_ids, cache, mask)


TARGET = PortableTarget
