"""In-place safety of a retained-state graph.

A KV pair ``X`` / ``X_RetainedState`` is *in-place safe* when one buffer can be bound as both. The invariant:

1. **One updater.** Exactly one node ``U`` (the *updater*) reads ``X`` itself (not a view of it) as the buffer it
   updates and writes the graph output ``X_RetainedState`` itself (no Transpose, Copy or Identity between).
   Updaters (:data:`IN_PLACE_UPDATERS`): ``ScatterND`` (data input 0 -> output 0), ``TensorScatter`` (opset 24,
   the static cache's: past cache 0 -> present cache 0), and onnxruntime's
   ``com.microsoft::GroupQueryAttention`` (past key/value inputs 3/4 -> present outputs 1/2), which appends in
   place and reads the shared buffer itself when past and present are the same buffer.
2. **Views are followed.** onnxruntime may alias the output of a view op (:data:`VIEW_OPS`: ``Reshape``,
   ``Squeeze``, ``Unsqueeze``, ``Flatten``, ``Identity``, at their data input 0) to its input, so the values
   reachable from ``X`` through view ops are ``X``'s memory too. Neither ``X`` nor a view of it is a graph output
   (a view op whose output is a graph output, the retained output included, is refused).
3. **Every other reader runs before the update.** Each other consumer of ``X`` or of one of its views (a
   *reader*: any op not in :data:`VIEW_OPS`, which writes a fresh buffer) is a node ``U`` depends on: one of
   the reader's outputs is an ancestor of one of ``U``'s inputs, so onnxruntime necessarily runs it (and has
   copied what it needs of the old contents) before ``U`` overwrites the buffer. A sliding layer's attention
   reads its ring this way (``Concat(X, new)``, and the ScatterND's ``updates`` are sliced from that Concat).
   Readers of the shape alone (``Shape``, ``Size``) are harmless wherever they are. ``U`` reading ``X`` at
   another input as well is not allowed (``U`` does not depend on itself).
4. **Functions.** A call that carries ``X`` (or a view of it) into a function and returns ``X_RetainedState``
   (the peer's ``CtxScatter``, or whole decoder layers as functions) is checked in the body by the same rule,
   against the function output that becomes ``X_RetainedState``; a reader in the caller must then feed an
   argument of the call on which the body's updater depends. A call that reads ``X`` but does not return
   ``X_RetainedState`` is refused (its body may return a view of ``X``). Dependencies through a call node are
   taken from its body (an output depends on the parameters it is computed from); nodes inside subgraphs
   (``If``, ``Loop``) never count as readers that ``U`` depends on.

A recurrent state (no position axis, :attr:`~qeff_kv.contract.layout.KVPair.recurrent`) that no updater writes at all is
*replaced* whole: its issue says so (``replaced``), and the runtime gives that buffer a second one instead of
binding it in place; it does not make the graph unsafe.

onnxruntime's CPU ``ScatterND`` skips its input-to-output copy when both are the same buffer, so a safe graph
updates its cache in place; a reader that could run after the update would see already-updated data.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir

from qeff_kv.contract.layout import KVLayout

SHAPE_ONLY_OPS = frozenset({"Shape", "Size"})
#: Ops whose output onnxruntime may alias to their data input (input 0): walked through, never readers.
VIEW_OPS = frozenset({"Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity"})
#: (domain, op_type) -> {input index: output index} of ops that update that input's buffer in place.
IN_PLACE_UPDATERS: dict[tuple[str, str], dict[int, int]] = {
    ("", "ScatterND"): {0: 0},
    # ai.onnx opset 24: the static cache's update (past cache 0 -> present cache 0, at write_indices)
    ("", "TensorScatter"): {0: 0},
    ("com.microsoft", "GroupQueryAttention"): {3: 1, 4: 2},
}
MAX_FUNCTION_DEPTH = 32


@dataclass(frozen=True)
class InplaceIssue:
    buffer: str
    message: str
    #: a recurrent state the graph replaces whole (no in-place updater at all: the peer's gated-delta-net layers
    #: compute a fresh state): not an error, but that buffer needs a second one (the runtime double-buffers it)
    replaced: bool = False


def _function_of(model: ir.Model, node: ir.Node) -> ir.Function | None:
    return model.functions.get((node.domain, node.op_type, node.overload or ""))


def _std(node: ir.Node) -> bool:
    return node.domain in ("", "ai.onnx")


def _label(node: ir.Node) -> str:
    return f"{node.op_type} node {node.name or '(unnamed)'!r}"


# ------------------------------------------------------------------------------------------- dependencies
def _ancestors(model: ir.Model, values, depth: int = 0, _cache: dict | None = None) -> tuple[set[int], set[int]]:
    """Nodes (by id) that ``values`` depend on, and the ids of the values reached (inputs, parameters...).

    Through a function call, an output depends only on the parameters its body computes it from."""
    cache = {} if _cache is None else _cache
    nodes: set[int] = set()
    seen: set[int] = set()
    stack = [v for v in values if v is not None]
    while stack:
        v = stack.pop()
        if id(v) in seen:
            continue
        seen.add(id(v))
        node = v.producer()
        if node is None:
            continue
        nodes.add(id(node))
        fn = _function_of(model, node)
        if fn is not None:
            j = next(i for i, o in enumerate(node.outputs) if o is v)
            params = _output_params(model, fn, j, depth + 1, cache)
            stack.extend(node.inputs[k] for k in params if k < len(node.inputs) and node.inputs[k] is not None)
        else:
            stack.extend(x for x in node.inputs if x is not None)
    return nodes, seen


def _output_params(model: ir.Model, fn: ir.Function, j: int, depth: int, cache: dict) -> set[int]:
    """Indices of ``fn``'s parameters that its output ``j`` is computed from (none past the depth limit:
    a missing dependency only makes the check stricter)."""
    key = (id(fn), j)
    if key in cache:
        return cache[key]
    cache[key] = set()  # recursion guard
    if depth > MAX_FUNCTION_DEPTH or j >= len(fn.outputs):
        return set()
    _, reached = _ancestors(model, [fn.outputs[j]], depth, cache)
    out = {k for k, p in enumerate(fn.inputs) if id(p) in reached}
    cache[key] = out
    return out


# ------------------------------------------------------------------------------------------- the walk
@dataclass
class _Walk:
    updates: int
    problems: list[str]
    #: values of this graph that the updater reads (or, for an update in a function, the call's arguments
    #: the body's updater depends on): a reader must be an ancestor of one of them
    deps: list


def _follow(model: ir.Model, x: ir.Value, target: ir.Value, where: str, depth: int = 0) -> _Walk:
    """Find the update of ``x`` into ``target`` and check every other reader of ``x`` and of its views."""
    if depth > MAX_FUNCTION_DEPTH:
        return _Walk(0, [f"function nesting deeper than {MAX_FUNCTION_DEPTH} at {where}"], [])
    updates = 0
    deps: list = []
    # (message, reader node or None): a reader's message is dropped if the updater depends on the reader
    entries: list[tuple[str, ir.Node | None]] = []
    queue: list[tuple[ir.Value, tuple[str, ...]]] = [(x, ())]
    seen: set[int] = set()
    while queue:
        value, via = queue.pop(0)
        if id(value) in seen:
            continue
        seen.add(id(value))
        through = f" through {' and '.join(via)}" if via else ""
        for usage in value.uses():
            node, idx = usage.node, usage.idx
            label = f"{_label(node)}{where}"
            if _std(node) and node.op_type in SHAPE_ONLY_OPS:
                continue
            if _std(node) and node.op_type in VIEW_OPS and idx == 0 and node.outputs:
                if any(o.is_graph_output() for o in node.outputs):
                    # a view of X returned by the graph (the retained output included): never safe
                    entries.append((f"read by {label}{through} besides its update", None))
                else:
                    queue.append((node.outputs[0], via + (_label(node),)))
                continue
            updater = IN_PLACE_UPDATERS.get(("" if _std(node) else node.domain, node.op_type))
            if updater is not None:
                updates += _updater_use(node, idx, updater, target, label, through, entries, deps)
                continue
            fn = _function_of(model, node)
            if fn is not None:
                updates += _function_use(model, node, fn, idx, target, label, through, where, depth, entries, deps)
                continue
            entries.append((f"read by {label}{through} besides its update", node))
        if value.is_graph_output() and value is not target:
            entries.append((f"is itself a graph output{where}", None))
    before_update: set[int] = set()
    if updates == 1:
        before_update, _ = _ancestors(model, deps, depth)
    problems = [msg for msg, reader in entries if reader is None or id(reader) not in before_update]
    return _Walk(updates, problems, deps if updates == 1 else [])


def _updater_use(node: ir.Node, idx: int, updater: dict, target: ir.Value, label: str, through: str,
                 entries: list, deps: list) -> int:
    """An in-place updater reading the buffer (or a view of it, ``through``): 1 when it is the buffer's own update
    into ``target`` (its inputs join ``deps``), else 0 and an entry saying why not."""
    out_idx = updater.get(idx)
    if out_idx is not None and out_idx < len(node.outputs) and node.outputs[out_idx] is target:
        if through:
            entries.append((f"updated by {label}{through}, not directly", None))
            return 0
        deps.extend(v for v in node.inputs if v is not None)
        return 1
    if out_idx is not None:
        entries.append((f"updated by {label}{through}, whose output is not the retained output itself", node))
    else:
        entries.append((f"read as input {idx} by {label}{through}, not as the buffer it updates", node))
    return 0


def _function_use(model: ir.Model, node: ir.Node, fn, idx: int, target: ir.Value, label: str, through: str,
                  where: str, depth: int, entries: list, deps: list) -> int:
    """A function call reading the buffer: the body is followed from the parameter to the output that is
    ``target``; returns the updates found there (the caller's arguments the body's updater depends on join
    ``deps``)."""
    outs = [j for j, o in enumerate(node.outputs) if o is target]
    if not outs:
        entries.append((f"read by function call {label}{through}, which does not produce the retained output", None))
        return 0
    if idx >= len(fn.inputs):
        entries.append((f"passed to {label}{through} beyond its declared inputs", None))
        return 0
    if through:
        entries.append((f"updated by {label}{through}, not directly", None))
        return 0
    sub = _follow(model, fn.inputs[idx], fn.outputs[outs[0]], f" in function {fn.name}", depth + 1)
    entries.extend((p, None) for p in sub.problems)
    if sub.deps:
        # the caller's arguments whose parameters the body's updater depends on
        _, reached = _ancestors(model, sub.deps, depth + 1)
        deps.extend(node.inputs[k] for k, p in enumerate(fn.inputs)
                    if id(p) in reached and k < len(node.inputs) and node.inputs[k] is not None)
    return sub.updates


def inplace_issues(model: ir.Model, layout: KVLayout) -> list[InplaceIssue]:
    """Every violation of in-place safety, one per KV input that breaks the rule (empty: all safe); a replaced
    recurrent state's entry has ``replaced`` set."""
    graph = model.graph
    by_name_in = {v.name: v for v in graph.inputs}
    by_name_out = {v.name: v for v in graph.outputs}
    issues: list[InplaceIssue] = []
    for pair in layout.pairs:
        x, y = by_name_in.get(pair.input_name), by_name_out.get(pair.output_name)
        if x is None or y is None:  # pragma: no cover - layout built from this model
            continue
        walk = _follow(model, x, y, "")
        if pair.recurrent and walk.updates == 0:
            issues.append(InplaceIssue(pair.input_name, f"{pair.output_name} is a fresh value, not an in-place "
                                                        f"update of {pair.input_name}", replaced=True))
            continue
        for p in walk.problems:
            issues.append(InplaceIssue(pair.input_name, f"{pair.input_name} is {p}"))
        if walk.updates == 0:
            producer = y.producer()
            via = f"{producer.op_type} node {producer.name!r}" if producer is not None else "no node"
            issues.append(InplaceIssue(
                pair.input_name,
                f"{pair.output_name} is not written by an in-place update (ScatterND) that reads {pair.input_name} directly "
                f"(produced by {via})"))
        elif walk.updates > 1:
            issues.append(InplaceIssue(pair.input_name, f"{pair.input_name} is updated {walk.updates} times"))
    return issues
