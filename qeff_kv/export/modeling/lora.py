"""LoRA adapters mixed per row, as traced (docs/lora.md): every adapted ``nn.Linear`` of the decoder layers adds
``scale[r] * (x @ A[slot[r]]) @ B[slot[r]]`` to its output, row ``r`` of the step taking its own adapter.

The adapters are graph inputs (:mod:`qeff_kv.contract.lora`): a stack of slots per module, the per-row slot
(``lora_ids``) and scale (``lora_scales``). The delta is added by a forward hook on the module, so the model's own
forward, its parameter names (the streamed export attaches weights by them) and every target's attention stay as
they are; the base projection (float, or quantized to MatMulNBits later) never sees the adapter.

A module's input is ``[B, S, in]``, or ``[B*S, in]`` where a family flattens the tokens (a shared expert): it is
seen as ``[B, -1, in]`` (the rows of ``lora_ids``) either way.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass

import torch

from qeff_kv.errors import ExportError

#: the module names adapted when no adapter names them (``--max-lora-rank`` alone): attention and MLP projections
#: (``qkv_proj`` and ``gate_up_proj`` where a family fuses them: Phi-3)
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "gate_proj", "up_proj", "down_proj",
                   "gate_up_proj")
#: modules never adapted: routers decide, experts are routed statically (their weights read directly)
_NEVER = re.compile(r"(?:^|\.)(?:experts|router|gate)(?:\.|$)")


@dataclass(frozen=True)
class Adapted:
    """One adapted module: its layer, its path inside the layer (PEFT's spelling) and the module."""

    layer: int
    module: str
    linear: torch.nn.Linear

    @property
    def in_features(self) -> int:
        return int(self.linear.in_features)

    @property
    def out_features(self) -> int:
        return int(self.linear.out_features)


def decoder_layers(model: torch.nn.Module, decoder: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder's ``layers`` (a ModuleList); refused in one line where the model keeps them elsewhere."""
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ExportError(f"LoRA adapters need a decoder whose layers are a ModuleList named 'layers'; "
                          f"{type(model).__name__} keeps them elsewhere")
    return layers


def find_modules(model: torch.nn.Module, decoder: torch.nn.Module, modules: tuple[str, ...] | None,
                 targets: tuple[str, ...] | None = None) -> list[Adapted]:
    """The adapted modules, layer by layer: exactly ``modules`` (paths inside a layer, as the adapters name them:
    each must be an ``nn.Linear`` in some layer, refused in one line otherwise), else every ``nn.Linear`` whose
    last name is in ``targets`` (default :data:`DEFAULT_TARGETS`)."""
    layers = decoder_layers(model, decoder)
    found: list[Adapted] = []
    wanted = set(modules or ())
    leaf = set(targets or DEFAULT_TARGETS)
    for i, layer in enumerate(layers):
        for path, sub in layer.named_modules():
            if not path or not isinstance(sub, torch.nn.Linear):
                continue
            if (path in wanted if modules else path.rsplit(".", 1)[-1] in leaf):
                if _NEVER.search(path):
                    raise ExportError(f"LoRA on {path} is not supported: routers and routed experts are not adapted "
                                      "(attention, dense MLP and shared-expert projections are)")
                found.append(Adapted(i, path, sub))
    missing = sorted(wanted - {a.module for a in found})
    if missing:
        linear = sorted({p for layer in layers for p, s in layer.named_modules() if isinstance(s, torch.nn.Linear)})
        raise ExportError(f"the adapters adapt {missing[0]}, which is not a Linear module of "
                          f"{type(model).__name__}'s layers (its Linear modules: {', '.join(linear)})")
    if not found:
        raise ExportError(f"no module of {type(model).__name__}'s layers is named "
                          f"{', '.join(sorted(leaf))}: nothing to adapt")
    return found


def delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, ids: torch.Tensor, scales: torch.Tensor
          ) -> torch.Tensor:
    """``scale[r] * (x[r] @ A[ids[r]]) @ B[ids[r]]`` for each row ``r``, shaped as the module's output."""
    rows = ids.shape[0]
    x3 = x.reshape(rows, -1, x.shape[-1])
    y = torch.matmul(torch.matmul(x3, a.index_select(0, ids)), b.index_select(0, ids))
    y = y * scales.reshape(rows, 1, 1)
    return y.reshape(*x.shape[:-1], y.shape[-1])


class Routing:
    """The hooks of one export: :meth:`active` adds each module's delta while the decoder runs."""

    def __init__(self, adapted: list[Adapted]):
        self.adapted = adapted

    def __len__(self) -> int:
        return len(self.adapted)

    @contextlib.contextmanager
    def active(self, ids: torch.Tensor, scales: torch.Tensor, weights: list[torch.Tensor]):
        """Hooks on every adapted module for one step: ``weights`` is ``[A_0, B_0, A_1, B_1, ...]`` in the order of
        :attr:`adapted`; ``ids`` ``[rows]`` int64, ``scales`` ``[rows]``."""
        handles = []
        try:
            for k, item in enumerate(self.adapted):
                a, b = weights[2 * k], weights[2 * k + 1]
                handles.append(item.linear.register_forward_hook(
                    lambda _m, args, out, a=a, b=b: out + delta(args[0], a, b, ids, scales)))
            yield
        finally:
            for h in handles:
                h.remove()
