"""What an export with adapters adapts (docs/lora.md), decided before torch is imported: :class:`LoraPlan`.

``--lora name=PEFT_DIR ...``: the adapters are read (:func:`qeff_kv.tools.adapters.read_adapter`, one-line
refusals for what cannot be read or is not plain LoRA), the graph adapts the union of their modules at the largest
of their ranks, or at ``--max-lora-rank`` (an adapter above it refused). ``--max-lora-rank R`` alone: the graph
adapts the modules named by ``--lora-targets`` (default: the attention and MLP projections) and takes any adapter
of rank up to ``R`` on them at run time.
"""

from __future__ import annotations

from dataclasses import dataclass

from qeff_kv.errors import ExportError
from qeff_kv.tools import adapters as adapters_mod


@dataclass(frozen=True)
class LoraPlan:
    """``modules``: the exact module paths the adapters adapt (``None``: every module whose last name is in
    ``targets``, ``None`` for the default projections); ``max_rank``; the adapters read (the export is proved with
    each)."""

    max_rank: int
    modules: tuple[str, ...] | None
    targets: tuple[str, ...] | None
    adapters: tuple = ()

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.adapters)

    @classmethod
    def of(cls, options) -> "LoraPlan | None":
        """The plan of an :class:`~qeff_kv.export.options.ExportOptions`, or ``None`` without adapters."""
        if not options.adapts:
            return None
        read = tuple(adapters_mod.read_adapter(folder, name=name) for name, folder in options.lora or ())
        if not read:
            targets = None if options.lora_targets is None else \
                tuple(t.strip() for t in options.lora_targets.split(","))
            return cls(int(options.max_lora_rank), None, targets)
        rank = max(a.rank for a in read)
        if options.max_lora_rank is not None and rank > options.max_lora_rank:
            big = next(a for a in read if a.rank == rank)
            raise ExportError(f"adapter {big.name!r} has rank {rank}, above --max-lora-rank {options.max_lora_rank}")
        modules = tuple(sorted({m for a in read for m in a.modules}))
        return cls(int(options.max_lora_rank or rank), modules, None, read)

