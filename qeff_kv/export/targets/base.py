"""The target interface: what every export target provides to the traced wrapper
(:class:`~qeff_kv.export.wrapper.RetainedStateLM`).

One step of the traced graph runs, for every target, as: the wrapper splits the graph inputs
(:class:`StepInputs`), :meth:`Target.begin` returns the ids, positions, cache object and mask the decoder is called
with (:class:`Step`), the decoder runs inside :meth:`Target.tracing`, and :meth:`Target.finish` checks what the
cache recorded. Before tracing, :meth:`Target.__init__` routes the model's attention (transformers'
``AttentionInterface``) and :meth:`Target.rotary` says how RoPE is traced.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from qeff_kv.export.modeling.caches import SlidingPlan
from qeff_kv.export import transformers_adapter as hf


@dataclass
class StepInputs:
    """The graph inputs of one step, split by the wrapper."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    #: one ``(key, value)`` KV input per layer
    past: list
    #: the KV inputs in graph order (``past`` flattened)
    flat: list
    batch_index: torch.Tensor | None
    #: ``[1]`` = ``Shape(comp_ctx_lengths)`` with CCL, else ``None``
    ccl_length: torch.Tensor | None
    is_pad: torch.Tensor
    dtype: torch.dtype
    #: bidirectional image blocks ``[B, S]`` (Gemma3), else ``None``
    blocks: torch.Tensor | None


@dataclass
class Step:
    """What the decoder is called with."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cache: Any
    mask: Any


class Target:
    """One export target. Subclasses set :attr:`name` and implement :meth:`begin`."""

    name: ClassVar[str]
    #: padded rows take their sequence's last valid row (ids, positions, embeddings, RoPE rows) before the decoder
    fills_padding: ClassVar[bool] = True
    #: ``custom_opsets`` for ``torch.onnx.export``
    custom_opsets: ClassVar[dict | None] = None
    #: ``--kv-cache-dtype int8``: per layer ``(k_scale, v_scale)`` (:mod:`~qeff_kv.export.modeling.kv_quant`), set by
    #: the trace; ``None``: a float cache
    kv_scales: list | None = None
    #: the quantized cache's bit width (8; 4: ``--kv-cache-dtype int4``, the fused target only), set by the trace
    kv_bits: int = 8

    def __init__(self, model: torch.nn.Module, facts, sliding: SlidingPlan, *, max_positions: int,
                 continuous_batching: bool, ccl: bool):
        self.facts = facts
        self.sliding = sliding
        self.continuous_batching = continuous_batching
        self.ccl = ccl

    def rotary(self, model: torch.nn.Module):
        """A context manager: how the model's RoPE is traced (default: as the model computes it)."""
        return contextlib.nullcontext()

    def begin(self, inputs: StepInputs) -> Step:
        raise NotImplementedError

    def tracing(self, cache):
        """A context manager around the decoder call."""
        return contextlib.nullcontext()

    def finish(self, cache) -> None:
        """Checks after the decoder ran (default: none)."""


def decoder_module(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose attention implementation the exporter sets: the language decoder of a vision-language
    model (its vision encoder keeps its own), else the model itself."""
    decoder = hf.decoder(model)
    if decoder is not model and hasattr(decoder, "set_attn_implementation") and \
            getattr(model.config, "vision_config", None) is not None:
        return decoder
    return model
