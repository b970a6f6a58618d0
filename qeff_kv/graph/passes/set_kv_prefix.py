"""SetKVPrefixPass: add, change or strip the KV-cache prefix of a graph's KV buffers, in its own dialect.

Invariant: afterwards every KV buffer (every stem of the naming contract, input and its output together; in the
graph's dialect: retained state, past/present or static cache) is named with exactly the requested prefix
(``None``: none), and nothing else changes: every other value and node name, every dim_param, dtype, shape,
initializer, function and metadata entry is as it was, and every pair still pairs by its dialect's rule
(``<input>_RetainedState``, ``present.<i>.key_P``, ``updated_key_cache.<i>_P``). Non-KV retained buffers
(``vision_embeds``, ``pixel_values``, ``image_idx``/``image_idx_output``...) are never renamed; a graph where one
of them is unpaired or carries a prefix is refused (:func:`qeff_kv.contract.multimodal.first_pairing_problem`).

The pass renames ``ir.Value`` objects, never strings, so every reference to a buffer (nodes of the main
graph, subgraphs, the call sites of functions such as the peer's decoder-layer subfunctions) follows.

All checks run before the first rename: a refused rewrite leaves the model untouched.
"""

from __future__ import annotations

import onnx_ir as ir

from qeff_kv.contract import multimodal, naming
from qeff_kv.errors import ContractError, RewriteError
from qeff_kv.contract.layout import NO_KV
from qeff_kv.graph.graphio import layout_of
from qeff_kv.graph.passes._invariants import InvariantPass, io_signature


class SetKVPrefixPass(InvariantPass):
    """Rename the KV buffers of the main graph to carry ``prefix`` (``None`` strips any prefix).

    Args:
        prefix: the new prefix, validated by :func:`qeff_kv.contract.naming.validate_prefix`; ``None`` to strip.
        allow_mixed: accept a graph whose KV buffers carry different prefixes (the rewrite makes them
            uniform). Off by default: mixed prefixes usually mean a graph was already edited by hand.

    ``ensures``: every KV buffer is paired and carries exactly the prefix, and every other graph input and output
    is as it was (name, dtype, shape, order).
    """

    keeps_io = False   # the KV buffers are renamed; every other input and output is checked by :meth:`check`
    _others: tuple | None = None

    def __init__(self, prefix: str | None, *, allow_mixed: bool = False):
        super().__init__()
        self.prefix = None if prefix is None else naming.validate_prefix(prefix)
        self.allow_mixed = allow_mixed

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        layout = layout_of(model)
        if not layout.kv_names:
            if multimodal.graph_kind(layout) == multimodal.VISION_ENCODER:
                raise ContractError(f"graph is a {multimodal.describe_kind(multimodal.VISION_ENCODER)}; "
                                    "the KV-cache prefix belongs to the language graph beside it")
            raise ContractError(NO_KV)
        if layout.unpaired_inputs or layout.unpaired_outputs:
            layout.require_valid()  # raises the precise unpaired-buffer message
        problem = multimodal.first_pairing_problem(layout)  # vision/multimodal buffers: never renamed, must pair
        if problem is not None:
            raise ContractError(problem)
        prefixes = layout.prefixes
        if len(prefixes) > 1 and not self.allow_mixed:
            raise ContractError(
                "KV buffers carry mixed prefixes: "
                + ", ".join("(none)" if p is None else repr(p) for p in prefixes)
                + "; pass --allow-mixed-prefixes to make them uniform")

        # Plan every rename first.
        kv_values: list[tuple[ir.Value, str]] = []
        for v in list(graph.inputs) + list(graph.outputs):
            parsed = naming.parse_any_kv_name(v.name or "")
            if parsed is None:
                continue
            new = parsed.with_prefix(self.prefix).name
            if new != v.name:
                kv_values.append((v, new))

        if self.prefix is not None:
            # Every graph input (initializers listed as inputs included) and output: the serving regex ``.*P.*``
            # is applied to all of them.
            for kind, values in (("input", graph.inputs), ("output", graph.outputs)):
                for v in values:
                    name = v.name or ""
                    if naming.parse_any_kv_name(name) is None and self.prefix in name:
                        raise RewriteError(
                            f"prefix {self.prefix!r} occurs in the non-KV {kind} {name!r}, so the serving regex "
                            f"{naming.substring_regex(self.prefix)!r} would select it")

        renamed = {id(v) for v, _ in kv_values}
        taken = {n for n in _all_value_names(graph, exclude=renamed)}
        new_names = [n for _, n in kv_values]
        for n in new_names:
            if n in taken:
                raise RewriteError(f"renaming would produce {n!r}, a name that already exists in the graph")
        if len(set(new_names)) != len(new_names):  # pragma: no cover - impossible for parsed KV names
            raise RewriteError("renaming would give two buffers the same name")

        for v, new in kv_values:
            v.name = new
        return ir.passes.PassResult(model, modified=bool(kv_values))

    def requires(self, model: ir.Model) -> None:
        super().requires(model)
        self._others = _non_kv(model)

    def check(self, model: ir.Model) -> None:
        layout = layout_of(model)
        if layout.unpaired_inputs or layout.unpaired_outputs or layout.prefixes != [self.prefix]:
            self.violated(f"prefixes {layout.prefixes}, unpaired {layout.unpaired_inputs + layout.unpaired_outputs}")
        if self._others is not None and _non_kv(model) != self._others:
            self.violated("it changed a graph input or output that is not a KV buffer")


def _non_kv(model: ir.Model) -> tuple:
    """The graph inputs and outputs that are not KV buffers, as :func:`io_signature` gives them."""
    return tuple(tuple(v for v in values if naming.parse_any_kv_name(v[0] or "") is None)
                 for values in io_signature(model))


def _all_value_names(graph: ir.Graph, exclude: set[int]) -> set[str]:
    """Names of every value visible in ``graph`` and its subgraphs (function bodies are separate scopes)."""
    names: set[str] = set()

    def add(v: ir.Value | None) -> None:
        if v is not None and v.name and id(v) not in exclude:
            names.add(v.name)

    for v in graph.inputs:
        add(v)
    for v in graph.initializers.values():
        add(v)
    for node in ir.traversal.RecursiveGraphIterator(graph):
        for v in node.inputs:
            add(v)
        for v in node.outputs:
            add(v)
    for v in graph.outputs:
        add(v)
    return names
