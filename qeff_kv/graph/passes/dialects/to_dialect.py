"""ToDialectPass: respell a fixed-capacity KV cache between retained state and shared-buffer past/present.

Invariant: afterwards every KV buffer is named in the requested dialect (``past_key.<i>[_P]`` ->
``past_key.<i>[_P]_RetainedState``, or ``past_key_values.<i>.key[_P]`` -> ``present.<i>.key[_P]``) with the prefix
it had, and nothing else changes: every other input and output (name, dtype, shape, order), every node, dim_param,
initializer and metadata entry is as it was, and every pair still pairs. Both dialects hold the same
``[batch, kv_heads, capacity, head_dim]`` buffer updated in place at ``position_ids``, so the conversion is a pure
rename (of ``ir.Value`` objects, never strings).

A growing past/present graph is not renamed: its attention reads every position of a buffer that grows. It is
rebuilt over a static cache of a given capacity where its attention is mobius-onnx's (ai.onnx ``Attention`` with past
inputs: :class:`~qeff_kv.graph.passes.dialects.growing_to_static.GrowingToStaticPass`), and refused in one line
otherwise (``present = Concat(past, new)``, GroupQueryAttention...). :func:`conversion_pass` plans the conversion
between any two dialects (:class:`~qeff_kv.graph.passes.dialects.static_to_retained.StaticToRetainedPass` from a static
cache, :class:`~qeff_kv.graph.passes.dialects.retained_to_static.RetainedToStaticPass` into one, from retained state or
shared past/present; growing -> static -> retained as a :class:`ConversionChain`) and refuses, in one line, what is not
built or cannot be converted exactly.

All checks run before the first rename: a refused conversion leaves the model untouched.
"""

from __future__ import annotations

import onnx_ir as ir

from qeff_kv.contract import naming
from qeff_kv.contract.layout import NO_KV, KVLayout
from qeff_kv.errors import ContractError, DialectError
from qeff_kv.graph.graphio import layout_of
from qeff_kv.graph.passes._invariants import InvariantPass
from qeff_kv.graph.passes.dialects import growing_to_static, retained_to_static
from qeff_kv.graph.passes.dialects.base import ConversionPass
from qeff_kv.graph.passes.dialects.growing_to_static import GrowingToStaticPass
from qeff_kv.graph.passes.dialects.retained_to_static import RetainedToStaticPass
from qeff_kv.graph.passes.dialects.static_to_retained import StaticToRetainedPass

#: what ``rewrite --to`` takes: a dialect name of :data:`qeff_kv.contract.naming.DIALECTS`, or the shared-buffer
#: past/present spelled out
SHARED_PAST_PRESENT = "shared-past-present"
TARGETS: dict[str, str] = {naming.RETAINED_STATE: naming.RETAINED_STATE, naming.STATIC_CACHE: naming.STATIC_CACHE,
                           SHARED_PAST_PRESENT: naming.PAST_PRESENT, naming.PAST_PRESENT: naming.PAST_PRESENT}
_RENAMED = (naming.RETAINED_STATE, naming.PAST_PRESENT)


def target_dialect(to: object) -> str:
    """The dialect ``to`` names (:data:`TARGETS`), else :class:`DialectError`."""
    if not isinstance(to, str) or to not in TARGETS:
        raise DialectError(f"unknown KV dialect {to!r}; give one of "
                           f"{naming.RETAINED_STATE}, {naming.STATIC_CACHE}, {SHARED_PAST_PRESENT}")
    return TARGETS[to]


def refusal(layout: KVLayout, dialect: str) -> str | None:
    """Why the graph of ``layout`` cannot be converted to ``dialect`` exactly, or ``None`` if it can (a growing
    graph: ``None`` for the targets :class:`GrowingToStaticPass` builds, whose own :func:`growing_to_static.refusal`
    reads the graph)."""
    if not layout.kv_names:
        return NO_KV
    if len(set(layout.dialects)) > 1:
        return f"KV buffers are spelled in mixed dialects ({', '.join(sorted(set(layout.dialects)))})"
    if layout.grows:
        if dialect in (naming.STATIC_CACHE, naming.RETAINED_STATE):
            return None
        return (f"grows by concatenation: {layout.pairs[0].output_name} = Concat({layout.pairs[0].input_name}, new) "
                f"is not built into a fixed-capacity {SHARED_PAST_PRESENT} cache: convert to {naming.RETAINED_STATE} "
                f"first (with a capacity), then to {SHARED_PAST_PRESENT}")
    if dialect == naming.STATIC_CACHE and layout.quantized_kv is not None:
        return (f"its KV cache is {layout.quantized_kv} (--kv-cache-dtype), and the {naming.STATIC_CACHE} dialect's "
                f"runtimes (mobius-onnx, onnxruntime-genai) feed a float cache with no scales; keep it "
                f"{naming.RETAINED_STATE} or {SHARED_PAST_PRESENT}, or convert an export with a float cache")
    source = layout.dialect
    if source is None:
        return "KV buffers are named only by a sidecar; convert the graph those names come from"
    return None


def _growing_refusal(model: ir.Model, dialect: str, capacity: int | None) -> str | None:
    """Why a growing graph cannot be rebuilt into ``dialect`` (static cache, or retained state through it)."""
    if capacity is None:
        return ("grows by concatenation: a fixed-capacity cache needs a capacity (positions a sequence may hold; "
                "--capacity N)")
    why = growing_to_static.refusal(model)
    if why is not None or dialect != naming.RETAINED_STATE:
        return why
    if naming.POSITION_IDS_INPUT not in {v.name for v in model.graph.inputs}:
        return (f"the graph takes no {naming.POSITION_IDS_INPUT} to derive {naming.WRITE_INDICES_INPUT} from; "
                f"convert to {naming.STATIC_CACHE} only")
    if growing_to_static.packs_heads(model):
        return (f"its attention takes 4-D keys and values, whose {naming.STATIC_CACHE} form is not converted on to "
                f"{naming.RETAINED_STATE}; convert to {naming.STATIC_CACHE} only")
    return None


def _capacity_refusal(layout: KVLayout, capacity: int, dialect: str) -> str | None:
    """A capacity given for a fixed-capacity graph must be the one it has; a symbolic positions axis takes it only
    in a conversion to a static cache (whose buffers then hold ``capacity`` positions, as mobius writes them)."""
    sizes = {p.axis2 for p in layout.pairs if isinstance(p.axis2, int) and not isinstance(p.axis2, bool)}
    if not sizes:
        if dialect == naming.STATIC_CACHE and layout.dialect != naming.STATIC_CACHE:
            return None
        return (f"a capacity applies to a growing graph or to a conversion to {naming.STATIC_CACHE}; this graph's "
                "positions axis stays symbolic (bound at run time)")
    if max(sizes) != capacity:
        return f"the graph's cache already holds {max(sizes)} positions; capacity {capacity} cannot change that"
    return None


class ConversionChain:
    """Passes run in order on one model (growing -> static cache -> retained state); not a pass itself. Every
    refusal is planned before the first one runs (:func:`conversion_pass`)."""

    def __init__(self, *passes: InvariantPass):
        self.passes = passes

    def __call__(self, model: ir.Model) -> None:
        for p in self.passes:
            p(model)


def conversion_pass(model: ir.Model, to: str, capacity: int | None = None) -> InvariantPass | ConversionChain | None:
    """The pass (or chain) that converts ``model``'s KV cache to dialect ``to`` (:data:`TARGETS`); ``None`` when it
    is already in it. ``capacity``: the positions of the fixed-capacity cache a growing graph is rebuilt over (for
    any other graph, if given, the capacity it has). Raises :class:`DialectError` (one line) for a conversion that
    cannot be made exactly."""
    dialect = target_dialect(to)
    layout = layout_of(model)
    why = refusal(layout, dialect)
    if why is None and layout.grows:
        why = _growing_refusal(model, dialect, capacity)
    elif why is None and capacity is not None:
        why = _capacity_refusal(layout, capacity, dialect)
    if why is not None:
        raise (ContractError if why == NO_KV else DialectError)(
            why if why == NO_KV else f"cannot convert to {to}: {why}")
    if layout.grows:
        to_static = GrowingToStaticPass(capacity)
        return to_static if dialect == naming.STATIC_CACHE else ConversionChain(to_static, StaticToRetainedPass())
    if layout.dialect == dialect:
        return None
    if layout.dialect == naming.STATIC_CACHE:   # to past/present: through retained state, then renamed
        to_retained = StaticToRetainedPass()
        return to_retained if dialect == naming.RETAINED_STATE else ConversionChain(to_retained, ToDialectPass(dialect))
    if dialect == naming.STATIC_CACHE:
        retained_to_static.plan(model)   # refused (one line) before anything changes
        return RetainedToStaticPass(capacity)
    return ToDialectPass(dialect)


class ToDialectPass(ConversionPass):
    """Rename every KV buffer into ``dialect`` (retained state or past/present), prefixes kept.

    ``ensures``: every KV buffer is spelled in ``dialect`` and paired, the prefixes are as they were, and every
    non-KV input and output is as it was.
    """

    def __init__(self, dialect: str):
        super().__init__()
        if dialect not in _RENAMED:
            raise DialectError(f"ToDialectPass renames between {' and '.join(_RENAMED)}, not into {dialect}")
        self.dialect = self.target = dialect

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        layout = layout_of(model)
        why = refusal(layout, self.dialect) or ("a growing cache is not renamed" if layout.grows else None)
        if why is not None or layout.dialect not in _RENAMED:
            raise DialectError(f"cannot rename into {self.dialect}: {why or layout.dialect}")
        layout.require_valid()
        plan: list[tuple[ir.Value, str]] = []
        for v in list(model.graph.inputs) + list(model.graph.outputs):
            parsed = naming.parse_any_kv_name(v.name or "")
            if parsed is not None:
                plan.append((v, parsed.in_dialect(self.dialect).name))
        renamed = {id(v) for v, _ in plan}
        taken = {v.name for v in ir.convenience.create_value_mapping(model.graph).values() if id(v) not in renamed}
        clash = next((n for _, n in plan if n in taken), None)
        if clash is not None:
            raise DialectError(f"converting would produce {clash!r}, a name that already exists in the graph")
        for v, new in plan:
            v.name = new
        return ir.passes.PassResult(model, modified=bool(plan))
