"""In-place safety of a retained-state graph.

A KV pair ``X`` / ``X_RetainedState`` is *in-place safe* when one buffer can be bound as both: the data of
input ``X`` is read by exactly one node, an *updater* whose output is the graph output ``X_RetainedState``
itself (no Transpose, Copy or Identity between), and by nothing else. Updaters (:data:`IN_PLACE_UPDATERS`):
``ScatterND`` (data input 0 -> output 0), and onnxruntime's ``com.microsoft::GroupQueryAttention``
(past key/value inputs 3/4 -> present outputs 1/2), which appends in place and reads the shared buffer
itself when past and present are the same buffer.
Readers of the shape alone (``Shape``, ``Size``) are harmless. Function calls are followed: a parameter
that carries ``X`` into a function (the peer's ``CtxScatter``, or whole decoder layers as functions) is
checked in the body by the same rule, against the function output that becomes ``X_RetainedState``.

onnxruntime's CPU ``ScatterND`` skips its input-to-output copy when both are the same buffer, so a safe graph
updates its cache in place; any other reader of ``X`` would see already-updated data.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir

from .layout import KVLayout

SHAPE_ONLY_OPS = frozenset({"Shape", "Size"})
#: (domain, op_type) -> {input index: output index} of ops that update that input's buffer in place.
IN_PLACE_UPDATERS: dict[tuple[str, str], dict[int, int]] = {
    ("", "ScatterND"): {0: 0},
    ("com.microsoft", "GroupQueryAttention"): {3: 1, 4: 2},
}


@dataclass(frozen=True)
class InplaceIssue:
    buffer: str
    message: str


def _function_of(model: ir.Model, node: ir.Node) -> ir.Function | None:
    return model.functions.get((node.domain, node.op_type, node.overload or ""))


def _follow(model: ir.Model, value: ir.Value, target: ir.Value, where: str, depth: int = 0) -> tuple[int, list[str]]:
    """Count the updates of ``value`` into ``target`` and list every other data reader."""
    updates = 0
    problems: list[str] = []
    if depth > 32:
        return 0, [f"function nesting deeper than 32 at {where}"]
    for usage in value.uses():
        node, idx = usage.node, usage.idx
        label = f"{node.op_type} node {node.name or '(unnamed)'!r}{where}"
        if node.domain in ("", "ai.onnx") and node.op_type in SHAPE_ONLY_OPS:
            continue
        updater = IN_PLACE_UPDATERS.get(("" if node.domain == "ai.onnx" else node.domain, node.op_type))
        if updater is not None:
            out_idx = updater.get(idx)
            if out_idx is not None and out_idx < len(node.outputs) and node.outputs[out_idx] is target:
                updates += 1
            elif out_idx is not None:
                problems.append(f"updated by {label}, whose output is not the retained output itself")
            else:
                problems.append(f"read as input {idx} by {label}, not as the buffer it updates")
            continue
        fn = _function_of(model, node)
        if fn is not None:
            outs = [j for j, o in enumerate(node.outputs) if o is target]
            if not outs:
                problems.append(f"read by function call {label}, which does not produce the retained output")
                continue
            if idx >= len(fn.inputs):
                problems.append(f"passed to {label} beyond its declared inputs")
                continue
            sub_updates, sub_problems = _follow(model, fn.inputs[idx], fn.outputs[outs[0]],
                                                f" in function {fn.name}", depth + 1)
            updates += sub_updates
            problems.extend(sub_problems)
            continue
        problems.append(f"read by {label} besides its update")
    if value.is_graph_output() and value is not target:
        problems.append(f"is itself a graph output{where}")
    return updates, problems


def inplace_issues(model: ir.Model, layout: KVLayout) -> list[InplaceIssue]:
    """Every violation of in-place safety, one per KV input that breaks the rule (empty: all safe)."""
    graph = model.graph
    by_name_in = {v.name: v for v in graph.inputs}
    by_name_out = {v.name: v for v in graph.outputs}
    issues: list[InplaceIssue] = []
    for pair in layout.pairs:
        x, y = by_name_in.get(pair.input_name), by_name_out.get(pair.output_name)
        if x is None or y is None:  # pragma: no cover - layout built from this model
            continue
        updates, problems = _follow(model, x, y, "")
        for p in problems:
            issues.append(InplaceIssue(pair.input_name, f"{pair.input_name} is {p}"))
        if updates == 0:
            producer = y.producer()
            via = f"{producer.op_type} node {producer.name!r}" if producer is not None else "no node"
            issues.append(InplaceIssue(
                pair.input_name,
                f"{pair.output_name} is not written by an in-place update (ScatterND) that reads {pair.input_name} directly "
                f"(produced by {via})"))
        elif updates > 1:
            issues.append(InplaceIssue(pair.input_name, f"{pair.input_name} is updated {updates} times"))
    return issues
