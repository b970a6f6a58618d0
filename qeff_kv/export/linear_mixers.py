"""Recurrent mixers whose transformers code does not trace, run while tracing by qeff-kv's own step.

One interface per kind of mixer (:class:`MixerKind`): how to recognise the module, which retained states it keeps
(stems and shapes, contract section 12) and one step over a chunk that continues from them. The kinds:

* ``gated_delta`` (:mod:`.gated_delta`): Qwen3-Next's and Qwen3.5's gated delta net, ``conv_state`` and
  ``recurrent_state``;
* ``short_conv`` (:mod:`.short_conv`): LFM2's (and LFM2-MoE's, LFM3's) short convolution, ``conv_state`` only.

:func:`traced_mixers` swaps every such module's ``forward`` for its kind's step while the decoder runs: the step
reads the layer's states from a :class:`MixerStates` (the export plumbing's: it owns the graph inputs, batch
rows under continuous batching and the retained outputs) and writes the new ones back to it, so the model's own
code around the mixer (norms, MLP/MoE, attention layers) is what transformers wrote.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from . import gated_delta, short_conv


class MixerStates(Protocol):
    """Where a traced step reads and writes a recurrent layer's states."""

    #: ``[B, T]`` bool: the step's real tokens (false on padding, ``position_ids == -1``)
    valid: torch.Tensor

    def read(self, layer: int) -> dict[str, torch.Tensor]:
        """Layer ``layer``'s states for this step's rows, by stem (``conv_state``, ``recurrent_state``)."""

    def write(self, layer: int, states: dict[str, torch.Tensor]) -> None:
        """The states after this step, by stem."""


@dataclass(frozen=True)
class MixerKind:
    name: str
    #: the stems the kind retains, in graph order
    stems: tuple[str, ...]
    matches: Callable[[torch.nn.Module], bool]
    #: ``(module, batch) -> {stem: shape}``
    state_shapes: Callable[..., dict[str, tuple[int, ...]]]
    #: ``(module, hidden_states, states, valid, max_len) -> (output, states)``
    step: Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]


def _gated_delta_step(module, hidden, states, valid, max_len):
    out, conv, rec = gated_delta.gated_delta_step(module, hidden, states["conv_state"], states["recurrent_state"],
                                                  valid, max_len=max_len)
    return out, {"conv_state": conv, "recurrent_state": rec}


def _short_conv_step(module, hidden, states, valid, max_len):
    out, conv = short_conv.short_conv_step(module, hidden, states["conv_state"], valid)
    return out, {"conv_state": conv}


KINDS: tuple[MixerKind, ...] = (
    MixerKind("gated_delta", ("conv_state", "recurrent_state"), gated_delta.is_gated_delta_mixer,
              gated_delta.state_shapes, _gated_delta_step),
    MixerKind("short_conv", ("conv_state",), short_conv.is_short_conv_mixer, short_conv.state_shapes,
              _short_conv_step),
)


def kind_of(module: torch.nn.Module) -> MixerKind | None:
    return next((k for k in KINDS if k.matches(module)), None)


def find_mixers(model: torch.nn.Module) -> dict[int, tuple[torch.nn.Module, MixerKind]]:
    """Every recurrent mixer of ``model`` this module steps, by its ``layer_idx``."""
    found = {}
    for module in model.modules():
        kind = kind_of(module)
        if kind is not None:
            found[int(module.layer_idx)] = (module, kind)
    return found


def state_shapes(model: torch.nn.Module, batch: int = 1) -> dict[int, dict[str, tuple[int, ...]]]:
    """Per recurrent layer, its retained states' shapes by stem (``[batch, ...]``; only axis 0 varies)."""
    return {layer: kind.state_shapes(module, batch) for layer, (module, kind) in sorted(find_mixers(model).items())}


@contextlib.contextmanager
def traced_mixers(model: torch.nn.Module, states: MixerStates, max_len: int):
    """While inside, every mixer of ``model`` of a known kind runs its kind's step on ``states`` (its other
    arguments, transformers' cache and mask, are not read); ``max_len``: the longest chunk the graph runs (the
    export's prefill length)."""
    mixers = find_mixers(model)
    for layer, (module, kind) in mixers.items():
        def forward(hidden_states, *args, _module=module, _kind=kind, _layer=layer, **kwargs):
            out, new = _kind.step(_module, hidden_states, states.read(_layer), states.valid, max_len)
            states.write(_layer, new)
            return out

        module.forward = forward
    try:
        yield mixers
    finally:
        for module, _ in mixers.values():
            module.__dict__.pop("forward", None)
