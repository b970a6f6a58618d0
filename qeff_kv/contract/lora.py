"""What a graph's LoRA inputs are (docs/lora.md): :class:`LoraGeometry`, read from the graph's inputs and metadata.

An export with adapters (``qeff-kv export --lora name=PEFT_DIR`` or ``--max-lora-rank R``) adds, beside the token
inputs, the per-row adapter slot and scale and, per adapted module, its stacked A and B weights (the names:
:mod:`qeff_kv.contract.naming`). Row ``r`` of a step computes ``base(x) + scale[r] * (x @ A[slot[r]]) @
B[slot[r]]`` on every adapted module: one graph serves any adapter of rank up to ``max_rank`` on those modules,
a different one on each row. Slot 0 is the zero adapter (a base row also has scale 0).

This module reads and checks that layout; the adapters themselves (PEFT folders) are read by
:mod:`qeff_kv.tools.adapters`.
"""

from __future__ import annotations

import json
import re
import re
from dataclasses import dataclass
from typing import Iterable, Mapping

import numpy as np

from qeff_kv.contract import naming
from qeff_kv.errors import ContractError


#: what starts like an adapter input (``lora_ids``, ``lora_scales``, ``lora_A.``/``lora_B.``), whether or not it is one
_LORA_LIKE_RE = re.compile(r"lora_(?:ids|scales|[AB]\.)")
#: the float types an adapter's weights and scales may have (numpy spelling)
FLOAT_TYPES = ("float32", "float16", "bfloat16")


def looks_like_lora(name: str) -> bool:
    """Whether ``name`` starts like an adapter input (``lora_ids_VLLM``, ``lora_A.01.q``: ``check`` reports those
    that :func:`~qeff_kv.contract.naming.is_lora_input` does not take)."""
    return _LORA_LIKE_RE.match(name) is not None


_ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def adapter_name_problem(name: object) -> str | None:
    """Why ``name`` cannot name an adapter (``None``: it can): 1-64 letters, digits, ``.``, ``_`` or ``-``, starting
    with a letter or digit (the export's and ``generate``'s ``--lora``; a served adapter's name is a model id, with
    the server's own rule: :mod:`qeff_kv.serve.engine.lora`)."""
    if isinstance(name, str) and _ADAPTER_NAME.fullmatch(name):
        return None
    return f"adapter name {name!r}: 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"


@dataclass(frozen=True)
class LoraModule:
    """One adapted module of one layer: ``x [.., in_features] -> [.., out_features]``."""

    layer: int
    module: str
    in_features: int
    out_features: int

    @property
    def a_name(self) -> str:
        return naming.lora_input_name("A", self.layer, self.module)

    @property
    def b_name(self) -> str:
        return naming.lora_input_name("B", self.layer, self.module)


@dataclass(frozen=True)
class LoraGeometry:
    """A graph's adapter inputs: its adapted modules (in graph order), the largest rank it takes (``max_rank``:
    the metadata's, else ``None`` when another exporter's graph does not say), the float type of the weights and
    scales (numpy spelling) and the adapters its export was proved with (names)."""

    modules: tuple[LoraModule, ...]
    dtype: str
    max_rank: int | None = None
    proved_with: tuple[str, ...] = ()

    @property
    def module_names(self) -> tuple[str, ...]:
        """The adapted module paths inside a decoder layer (``self_attn.q_proj``...), sorted."""
        return tuple(sorted({m.module for m in self.modules}))

    @property
    def num_layers(self) -> int:
        return 1 + max(m.layer for m in self.modules)

    def get(self, layer: int, module: str) -> LoraModule | None:
        return next((m for m in self.modules if m.layer == layer and m.module == module), None)

    def zero_feeds(self, rows: int) -> dict[str, np.ndarray]:
        """Every adapter input of a ``rows``-row step with no adapter: one zero slot of rank 1, slot 0, scale 0
        (the base model exactly)."""
        dt = np.dtype(self.dtype)
        feeds = {naming.LORA_IDS_INPUT: np.zeros(rows, np.int64), naming.LORA_SCALES_INPUT: np.zeros(rows, dt)}
        for m in self.modules:
            feeds[m.a_name] = np.zeros((1, m.in_features, 1), dt)
            feeds[m.b_name] = np.zeros((1, 1, m.out_features), dt)
        return feeds

    def metadata(self) -> str:
        """The :data:`~qeff_kv.contract.naming.LORA_META` value an export writes."""
        return json.dumps({"max_rank": self.max_rank, "modules": list(self.module_names),
                           "adapters": list(self.proved_with)}, sort_keys=True)

    def to_json(self) -> dict:
        return {"max_rank": self.max_rank, "dtype": self.dtype, "modules": list(self.module_names),
                "adapted": len(self.modules), "proved_with": list(self.proved_with)}

    @classmethod
    def from_io(cls, inputs: Iterable, metadata: Mapping[str, str] | None = None) -> "LoraGeometry | None":
        """The geometry of a graph whose inputs are ``inputs`` (objects with ``name``, ``dtype``, ``shape``: the
        layout's :class:`~qeff_kv.contract.layout.TensorInfo`); ``None`` for a graph without adapter inputs.
        Raises :class:`~qeff_kv.errors.ContractError` (one line) for a malformed set."""
        inputs = list(inputs)
        by_name = {t.name: t for t in inputs}
        weights = {naming.parse_lora_name(t.name): t for t in inputs if naming.parse_lora_name(t.name)}
        control = [n for n in (naming.LORA_IDS_INPUT, naming.LORA_SCALES_INPUT) if n in by_name]
        if not weights and not control:
            return None
        if len(control) != 2:
            missing = {naming.LORA_IDS_INPUT, naming.LORA_SCALES_INPUT} - set(control)
            raise ContractError(f"the graph has LoRA inputs but no {sorted(missing)[0]} input")
        if not weights:
            raise ContractError("the graph has lora_ids and lora_scales but no lora_A/lora_B weight inputs")
        modules, dtypes = [], {by_name[naming.LORA_SCALES_INPUT].dtype}
        for (part, layer, module), info in sorted(weights.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
            if part == "B":
                continue
            other = weights.get(("B", layer, module))
            if other is None:
                raise ContractError(f"{info.name} has no {naming.lora_input_name('B', layer, module)} input")
            modules.append(_module(info, other, layer, module))
            dtypes.update((info.dtype, other.dtype))
        lonely = [t.name for (p, l, m), t in weights.items() if p == "B" and ("A", l, m) not in weights]
        if lonely:
            _, layer, module = naming.parse_lora_name(lonely[0])
            raise ContractError(f"{lonely[0]} has no {naming.lora_input_name('A', layer, module)} input")
        if len(dtypes) != 1:
            raise ContractError(f"the LoRA weights and lora_scales must share one float type, not {sorted(dtypes)}")
        meta = _metadata(metadata)
        return cls(tuple(modules), dtypes.pop(), meta.get("max_rank"), tuple(meta.get("adapters") or ()))


def _module(a, b, layer: int, module: str) -> LoraModule:
    """The module whose A input is ``a`` and B input ``b``, shapes checked: ``[slots, in, rank]`` and
    ``[slots, rank, out]``."""
    for info in (a, b):
        if info.shape is None or len(info.shape) != 3:
            raise ContractError(f"{info.name} must be rank 3 ([lora_slots, ..., ...]), not {info.shape}")
    fan_in, fan_out = a.shape[1], b.shape[2]
    if not isinstance(fan_in, int) or not isinstance(fan_out, int):
        raise ContractError(f"{a.name}/{b.name}: the module's in and out features must be fixed, not "
                            f"{fan_in!r} and {fan_out!r}")
    if a.shape[2] != b.shape[1]:
        raise ContractError(f"{a.name} has rank axis {a.shape[2]!r} but {b.name} has {b.shape[1]!r}")
    return LoraModule(layer, module, fan_in, fan_out)


def _metadata(metadata: Mapping[str, str] | None) -> dict:
    raw = (metadata or {}).get(naming.LORA_META)
    if raw is None:
        return {}
    try:
        meta = json.loads(raw)
    except ValueError:
        raise ContractError(f"graph metadata {naming.LORA_META} is not JSON") from None
    if not isinstance(meta, dict):
        raise ContractError(f"graph metadata {naming.LORA_META} is not a JSON object")
    rank = meta.get("max_rank")
    if rank is not None and (not isinstance(rank, int) or rank < 1):
        raise ContractError(f"graph metadata {naming.LORA_META}: max_rank must be a positive integer, not {rank!r}")
    return meta
