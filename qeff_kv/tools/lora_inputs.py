"""What the graph tools say of a graph's LoRA adapter inputs (docs/lora.md), beside its KV buffers.

* :func:`lora_summary` and :func:`lora_lines`: ``qeff-kv buffers``'s account of them (the adapted modules, the rank
  the graph takes, the bytes one adapter slot takes at that rank), kept apart from the KV buffers: they are inputs,
  never prefixed, never retained.
* :func:`lora_symbols`: the values ``compile-config`` gives the dynamic axes ``lora_slots`` and ``lora_rank`` (an
  accelerator compiles fixed shapes): slots ``1 +`` the adapters the export was proved with (the zero slot and one
  per adapter; ``1 + 1`` when it records none), rank the metadata's ``max_rank``; each may be given instead.

Reads the :class:`~qeff_kv.contract.lora.LoraGeometry` of a layout; a malformed set raises its one-line
:class:`~qeff_kv.errors.ContractError` (``check``'s rule ``lora`` reports it in full).
"""

from __future__ import annotations

from qeff_kv.contract import naming
from qeff_kv.contract.layout import KVLayout, itemsize
from qeff_kv.contract.lora import LoraGeometry
from qeff_kv.errors import ContractError, RuntimeInputError
from qeff_kv.support.limits import positive_int


def axes(layout: KVLayout, geo: LoraGeometry) -> tuple[object, object]:
    """The slots axis and the rank axis of the adapter weights (a name or a fixed size; the first module's: rule
    ``lora`` checks that every weight shares them)."""
    a = layout.input(geo.modules[0].a_name)
    assert a is not None and a.shape is not None   # LoraGeometry.from_io read its shape
    return a.shape[0], a.shape[2]


def graph_rank(layout: KVLayout, geo: LoraGeometry) -> int | None:
    """The largest rank the graph takes: its fixed rank axis, else the metadata's ``max_rank`` (``None``: unknown)."""
    rank = axes(layout, geo)[1]
    return rank if isinstance(rank, int) and not isinstance(rank, bool) else geo.max_rank


def bytes_per_slot(geo: LoraGeometry, rank: int) -> int:
    """Bytes one adapter slot takes in the stacked inputs at ``rank``: ``(in + out) * rank`` values per module."""
    return sum((m.in_features + m.out_features) * rank for m in geo.modules) * itemsize(geo.dtype)


def lora_summary(layout: KVLayout) -> dict | None:
    """``qeff-kv buffers --json``'s ``"lora"`` entry (``None`` without adapter inputs; ``{"error": ...}`` for a
    malformed set)."""
    try:
        geo = layout.lora
    except ContractError as exc:
        return {"error": str(exc)}
    if geo is None:
        return None
    slots, rank_axis = axes(layout, geo)
    rank = graph_rank(layout, geo)
    return {"inputs": [naming.LORA_IDS_INPUT, naming.LORA_SCALES_INPUT]
                      + [n for m in geo.modules for n in (m.a_name, m.b_name)],
            "modules": list(geo.module_names), "adapted": len(geo.modules), "layers": geo.num_layers,
            "slots_axis": slots, "rank_axis": rank_axis, "max_rank": rank, "dtype": geo.dtype,
            "bytes_per_slot": None if rank is None else bytes_per_slot(geo, rank),
            "proved_with": list(geo.proved_with)}


def lora_lines(layout: KVLayout, human) -> list[str]:
    """The lines ``qeff-kv buffers`` prints of the adapter inputs (none without them); ``human``: bytes as text."""
    s = lora_summary(layout)
    if s is None:
        return []
    if "error" in s:
        return [f"LoRA adapter inputs: malformed ({s['error']}); see 'qeff-kv check' rule lora"]
    weights = len(s["inputs"]) - 2
    rank = s["max_rank"]
    slots, rank_axis = _fmt(s["slots_axis"]), _fmt(s["rank_axis"])
    lines = [f"LoRA adapter inputs (not KV: never prefixed, never retained): {naming.LORA_IDS_INPUT}, "
             f"{naming.LORA_SCALES_INPUT} and {weights} lora_A/lora_B weights "
             f"[{slots}, in, {rank_axis}] / [{slots}, {rank_axis}, out]",
             f"  adapted modules ({s['adapted']} over {s['layers']} layers): {', '.join(s['modules'])}; {s['dtype']}",
             "  max rank " + ("unknown (no qeff_kv.lora metadata, rank axis symbolic)" if rank is None else str(rank))
             + ("" if s["bytes_per_slot"] is None
                else f"; bytes per adapter slot at rank {rank}: {human(s['bytes_per_slot'])} ({s['bytes_per_slot']} "
                     "bytes)")]
    if s["proved_with"]:
        lines.append(f"  export proved with: {', '.join(s['proved_with'])}")
    return lines


def _fmt(d) -> str:
    return "?" if d is None else str(d)


def check_lora_settings(lora_slots, lora_rank) -> None:
    """``lora_slots``/``lora_rank`` are ``None`` or positive ints (one-line :class:`RuntimeInputError`)."""
    for label, v in ((naming.LORA_SLOTS_DIM, lora_slots), (naming.LORA_RANK_DIM, lora_rank)):
        if v is not None:
            positive_int(label, v)


def lora_symbols(layout: KVLayout, lora_slots: int | None = None,
                 lora_rank: int | None = None) -> dict[str, int] | None:
    """The values of the adapter weights' dynamic axes for the specializations (``{}`` when both are fixed, ``None``
    without adapter inputs). A given value must fit a fixed axis; a rank above the graph's is refused."""
    check_lora_settings(lora_slots, lora_rank)
    geo = layout.lora
    if geo is None:
        if lora_slots is not None or lora_rank is not None:
            raise RuntimeInputError("the graph has no LoRA adapter inputs; --lora-slots/--lora-rank do not apply")
        return None
    slot_axis, rank_axis = axes(layout, geo)
    out: dict[str, int] = {}
    default_slots = 1 + (len(geo.proved_with) or 1)
    slots = _axis_value(naming.LORA_SLOTS_DIM, slot_axis, lora_slots, default_slots)
    if slots is not None:
        out[naming.LORA_SLOTS_DIM] = slots
    if geo.max_rank is not None and lora_rank is not None and lora_rank > geo.max_rank:
        raise RuntimeInputError(f"{naming.LORA_RANK_DIM} {lora_rank} is above the graph's max_rank {geo.max_rank} "
                                f"({naming.LORA_META}): its adapters were fitted at most that rank")
    if not isinstance(rank_axis, int) and lora_rank is None and geo.max_rank is None:
        raise RuntimeInputError(f"the graph's {naming.LORA_RANK_DIM} axis is dynamic and no {naming.LORA_META} "
                                "metadata records max_rank; give --lora-rank R")
    rank = _axis_value(naming.LORA_RANK_DIM, rank_axis, lora_rank, geo.max_rank)
    if rank is not None:
        out[naming.LORA_RANK_DIM] = rank
    return out


def _axis_value(label: str, axis: object, given: int | None, default: int | None) -> int | None:
    """The value of a dynamic axis (``given``, else ``default``); ``None`` for a fixed one, which ``given`` must
    equal."""
    if isinstance(axis, int) and not isinstance(axis, bool):
        if given is not None and given != axis:
            raise RuntimeInputError(f"{label} {given} differs from the graph's fixed {label} axis {axis}")
        return None
    return given if given is not None else default
