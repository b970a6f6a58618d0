"""``check``'s ``lora`` rule: a graph's LoRA adapter inputs (docs/lora.md) form one well-formed set.

The names are the naming contract's (:mod:`qeff_kv.contract.naming`), read back by
:class:`~qeff_kv.contract.lora.LoraGeometry`. The rule passes when :meth:`LoraGeometry.from_io` takes the set (the two
per-row inputs, every ``lora_A`` with its ``lora_B``, each module's rank axes equal, one type) and besides:

* ``lora_ids`` is int64 and ``lora_scales`` a float type, both rank 1 over the same (batch) axis;
* every weight's axis 0 is the one slots axis (``lora_slots``, or one fixed size), and every rank axis the one rank axis
  (``lora_rank``, or one fixed size): a compiler gives each a value, so no other name and no unknown dim;
* a fixed rank axis equals the metadata's ``max_rank`` when the graph records one, and the metadata names every
  adapted module;
* no adapter input is prefixed, retained, spelled almost like one (``lora_ids_VLLM``, ``lora_A.01.q_proj``) or selected
  by the graph's KV serving regexes (adapter inputs are not buffers).

``skip`` on a graph without adapter inputs. Every finding goes to the :class:`~qeff_kv.tools.check.report.RuleResult`
it is given.
"""

from __future__ import annotations

import json

from qeff_kv.contract import naming
from qeff_kv.contract.layout import KVLayout
from qeff_kv.contract.lora import FLOAT_TYPES, LoraGeometry, looks_like_lora
from qeff_kv.errors import ContractError


def rule_lora(layout: KVLayout, r) -> None:
    """Run the ``lora`` rule on ``layout`` into ``r``."""
    names = [t.name for t in layout.inputs if naming.is_lora_input(t.name) or looks_like_lora(t.name)]
    retained = [t.name for t in layout.outputs if _adapter_output(t.name)]
    if not names and not retained:
        r.skip("no LoRA adapter inputs")
        return
    prefixed = _misspelt(layout, names, r)
    for name in retained:
        r.fail(name, f"output {name} retains an adapter input; adapter inputs are never retained (not KV buffers)")
    try:
        geo = LoraGeometry.from_io(layout.inputs, layout.metadata)
    except ContractError as exc:
        r.fail(None, str(exc))
        geo = None
    slots = rank = None
    if geo is not None:
        _control_inputs(layout, r)
        slots, rank = _weight_axes(layout, geo, r)
        _against_metadata(layout, geo, rank, prefixed, r)
    _regex_selection(layout, names, r)
    if geo is not None and r.status != "fail":
        r.note = _describe(geo, slots, rank)


def _adapter_output(name: str) -> bool:
    src = naming.retained_source(name)
    return naming.is_lora_input(name) or (src is not None and naming.is_lora_input(src))


def _misspelt(layout: KVLayout, names: list[str], r) -> set[str]:
    """Names that start like an adapter input but are none, and adapter inputs that carry the KV prefix (returned)."""
    prefixes = [p for p in layout.prefixes if p is not None]
    modules = _meta_modules(layout)
    prefixed: set[str] = set()
    for name in names:
        prefix = next((p for p in prefixes if name.endswith("_" + p)), None)
        bare = name[:-len(prefix) - 1] if prefix is not None else name
        parsed = naming.parse_lora_name(name)
        if prefix is not None and parsed is not None and modules is not None:   # the metadata tells module names
            prefix = prefix if parsed[2] not in modules and naming.parse_lora_name(bare)[2] in modules else None
        if prefix is not None:
            prefixed.add(name)
            r.fail(name, f"adapter input {name} carries the KV prefix {prefix!r}; adapter inputs are never prefixed "
                         f"(the contract's name is {bare})")
        elif not naming.is_lora_input(name):
            r.fail(name, f"{name} starts like an adapter input but is not one of the contract's names "
                         f"({naming.LORA_IDS_INPUT}, {naming.LORA_SCALES_INPUT}, lora_A|lora_B.<layer>.<module>)")
    return prefixed


def _meta_modules(layout: KVLayout) -> list | None:
    """The adapted modules graph metadata ``qeff_kv.lora`` names (``None``: no such metadata, or not a list)."""
    try:
        meta = json.loads(layout.metadata.get(naming.LORA_META) or "null")
    except ValueError:
        return None
    modules = meta.get("modules") if isinstance(meta, dict) else None
    return modules if isinstance(modules, list) else None


def _control_inputs(layout: KVLayout, r) -> None:
    ids, scales = layout.input(naming.LORA_IDS_INPUT), layout.input(naming.LORA_SCALES_INPUT)
    assert ids is not None and scales is not None   # LoraGeometry.from_io requires both
    if ids.dtype != "int64":
        r.fail(ids.name, f"{ids.name} is {ids.dtype}; the adapter slot of each row is int64")
    if scales.dtype not in FLOAT_TYPES:
        r.fail(scales.name, f"{scales.name} is {scales.dtype}; adapter scales and weights are a float type "
                            f"({', '.join(FLOAT_TYPES)})")
    for t in (ids, scales):
        if t.shape is None or len(t.shape) != 1:
            r.fail(t.name, f"{t.name} has shape {_fmt_shape(t.shape)}; it is rank 1 ([batch_size]: one per row)")
    if ids.shape and scales.shape and len(ids.shape) == len(scales.shape) == 1 and ids.shape != scales.shape:
        r.fail(scales.name, f"{ids.name} is {_fmt_shape(ids.shape)} but {scales.name} is {_fmt_shape(scales.shape)}; "
                            "both have one value per row")


def _weight_axes(layout: KVLayout, geo: LoraGeometry, r) -> tuple[object, object]:
    """The one slots axis and the one rank axis of every ``lora_A``/``lora_B`` input (what :meth:`from_io` checked
    per module, across modules and against the contract's axis names)."""
    slots: dict[object, str] = {}
    ranks: dict[object, str] = {}
    for m in geo.modules:
        a, b = layout.input(m.a_name), layout.input(m.b_name)
        for t in (a, b):
            slots.setdefault(t.shape[0], t.name)
        ranks.setdefault(a.shape[2], a.name)
    slot = _one_axis(slots, naming.LORA_SLOTS_DIM, "slots axis (axis 0)", r)
    rank = _one_axis(ranks, naming.LORA_RANK_DIM, "rank axis", r)
    return slot, rank


def _one_axis(seen: dict[object, str], dim: str, label: str, r) -> object:
    """The axis every weight shares: ``dim`` (dynamic) or one fixed positive size; ``None`` after a failure."""
    for value, name in seen.items():
        if not (value == dim or (isinstance(value, int) and not isinstance(value, bool) and value >= 1)):
            r.fail(name, f"{name} has {label} {_fmt_dim(value)}; it is {dim!r} (dynamic) or a fixed size, so a "
                         "compiler can give it a value")
            return None
    if len(seen) > 1:
        (v1, n1), (v2, n2) = list(seen.items())[:2]
        r.fail(n2, f"{n1} has {label} {_fmt_dim(v1)} but {n2} has {_fmt_dim(v2)}; every adapter weight shares one")
        return None
    return next(iter(seen))


def _against_metadata(layout: KVLayout, geo: LoraGeometry, rank: object, prefixed: set[str], r) -> None:
    """A fixed rank axis equals the metadata's ``max_rank``; the metadata names every adapted module (but those of
    the ``prefixed`` inputs, already reported)."""
    if isinstance(rank, int) and geo.max_rank is not None and rank != geo.max_rank:
        r.fail(geo.modules[0].a_name, f"the rank axis is fixed at {rank} but graph metadata {naming.LORA_META} "
                                      f"records max_rank {geo.max_rank}")
    modules = _meta_modules(layout)
    if modules is None:
        return
    for m in geo.modules:
        if m.module not in modules and m.a_name not in prefixed:
            r.fail(m.a_name, f"{m.a_name} adapts module {m.module!r}, which graph metadata {naming.LORA_META} does "
                             f"not name (modules: {', '.join(map(str, modules))})")
            return


def _regex_selection(layout: KVLayout, names: list[str], r) -> None:
    """The graph's KV serving regexes select no adapter input (one prefix, one dialect: as the regex rules)."""
    if len(layout.prefixes) != 1 or layout.dialect is None or len(layout.dialects) > 1:
        return
    prefix = layout.prefixes[0]
    stems = layout.stems or list(naming.EXPORT_STEMS)
    regexes = naming.canonical_regexes(prefix, stems, layout.dialect)
    for label, value in regexes.items():
        for rx in value if isinstance(value, list) else [value]:
            caught = naming.select(rx, names)
            if caught:
                r.fail(caught[0], f"the {label} KV regex {rx} selects adapter input {caught[0]}; adapter inputs "
                                  "are never selected as KV (choose a prefix no adapter name contains)")


def _describe(geo: LoraGeometry, slots: object, rank: object) -> str:
    layers = sorted({m.layer for m in geo.modules})
    rank_text = f"rank axis {_fmt_dim(rank)}" + (f", max rank {geo.max_rank}" if geo.max_rank is not None else "")
    proved = f"; proved with {', '.join(geo.proved_with)}" if geo.proved_with else ""
    return (f"{len(geo.modules)} adapted modules over {len(layers)} layers ({', '.join(geo.module_names)}); "
            f"slots axis {_fmt_dim(slots)}, {rank_text}, {geo.dtype}{proved}")


def _fmt_dim(d) -> str:
    return "?" if d is None else (repr(d) if isinstance(d, str) else str(d))


def _fmt_shape(s: "tuple | None") -> str:
    return "unknown" if s is None else "[" + ", ".join(_fmt_dim(d) for d in s) + "]"

