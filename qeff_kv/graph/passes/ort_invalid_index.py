"""OrtInvalidIndexPass: make the peer's "invalid index" constants acceptable to onnxruntime.

QEfficient marks KV positions it wants ignored with the index ``INT32_MAX`` (2147483647): a per-layer
``Where(ctx_indices > limit, INT32_MAX, ctx_indices)`` feeds the ``GatherND`` of the cache read, and, in
continuous-batching graphs, a ``Where(position_ids < 0, INT32_MAX, position_ids)`` feeds the ``ScatterND`` of
the cache update. The AI 100 drops such accesses; onnxruntime's CPU kernels reject them
(``GatherND ... invalid index found, index = 2147483647``).

Invariant: afterwards no constant that reaches the *indices* input of a ``GatherND`` or ``ScatterND``
(followed through index-shaping ops and across function-call boundaries) holds ``INT32_MAX``, and
nothing else in the model changes. Constants are found by where their data goes, never by node names:

* **gather** constants become ``0``. A gather at an invalid position then reads slot 0; the graph masks every
  position past the row's current one (scores replaced by the mask value, values by zeros), so what slot 0
  holds never reaches the output.
* **scatter** constants become ``-1``. ``ScatterND`` wraps a negative index, so a padding row
  (``position_ids = -1``) writes its (possibly NaN) key/value into slot ``ctx_len - 1`` *of its own batch
  row* and nowhere else. Setting it to ``0`` instead (the peer's own workaround) overwrites position 0 of
  the sequence with NaN. The last slot is safe exactly while it holds no valid token of that row, before
  and after the padded chunk: the slot is beyond the row's valid length, so the graph never reads it (it is
  masked, and overwritten by the real token when decoding reaches position ``ctx_len - 1``). The runtime keeps
  that condition (see :mod:`qeff_kv.runtime.session`): a padded prefill chunk never ends at ``ctx_len``; the
  chunk that would fill the last slot runs unpadded at its exact length. A graph without the scatter
  constant (the peer's non-batching graphs) already sends ``-1`` straight into ``ScatterND``: the same rule
  covers it.

The runtime applies it only when it runs the graph on onnxruntime's CPU EP (the kernels it is made for): the
graphs it patches rely on what the ONNX spec leaves undefined (out-of-range indices; padded rows scattering into
one slot), so no other EP is proved on them
(:mod:`qeff_kv.runtime.execution.ep_proofs`). The pass modifies the in-memory model only. It replaces the *use* of a constant on an index path with a new
constant, so a constant value that also feeds something else keeps its value there. A constant that would
reach both a gather and a scatter index is refused (no single value is right for both).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from qeff_kv.errors import ContractError
from qeff_kv.graph.passes._invariants import InvariantPass

#: The peer's "invalid index" value.
INVALID_INDEX = 2**31 - 1
GATHER_REPLACEMENT = 0
SCATTER_REPLACEMENT = -1

# op_type -> the input positions through which index *values* flow (not shapes, not conditions).
_PASS_THROUGH: dict[str, tuple[int, ...] | None] = {
    "Where": (1, 2),
    "Concat": None,  # every input
    "Unsqueeze": (0,),
    "Squeeze": (0,),
    "Reshape": (0,),
    "Expand": (0,),
    "Cast": (0,),
    "Identity": (0,),
    "Flatten": (0,),
    "Transpose": (0,),
    "Tile": (0,),
    "Min": None,
    "Max": None,
}
_MAX_DEPTH = 64


@dataclass
class _Hit:
    graph: ir.Graph
    node: ir.Node  # consumer of the constant
    index: int  # input position on that node
    value: ir.Value
    kinds: set[str] = field(default_factory=set)


def _const_array(value: ir.Value) -> np.ndarray | None:
    """The numpy value of a Constant node's output or an initializer, if small and integer."""
    if value.const_value is not None and value.is_initializer():
        t = value.const_value
    else:
        prod = value.producer()
        if prod is None or prod.op_type != "Constant" or prod.domain not in ("", "ai.onnx"):
            return None
        attr = prod.attributes.get("value")
        if attr is not None:
            t = attr.value
        else:
            for name in ("value_int", "value_ints"):
                a = prod.attributes.get(name)
                if a is not None:
                    return np.asarray(a.value, dtype=np.int64)
            return None
    if t is None or t.size > 64:
        return None
    try:
        arr = t.numpy()
    except Exception:  # pragma: no cover - unreadable tensor
        return None
    if arr.dtype.kind not in "iu":
        return None
    return np.asarray(arr)


class OrtInvalidIndexPass(InvariantPass):
    """Replace INT32_MAX invalid-index constants on GatherND/ScatterND index paths (see module docstring).

    After :meth:`call`, :attr:`gather_constants` and :attr:`scatter_constants` count what was replaced.
    ``ensures``: the graph inputs and outputs are unchanged and no invalid-index constant reaches an index input.
    """

    def __init__(self) -> None:
        super().__init__()
        self.gather_constants = 0
        self.scatter_constants = 0

    # ------------------------------------------------------------------------------------ discovery
    def _call_sites(self, model: ir.Model) -> dict[tuple[str, str, str], list[tuple[ir.Graph, ir.Node]]]:
        sites: dict[tuple[str, str, str], list[tuple[ir.Graph, ir.Node]]] = {}
        graphs: list[ir.Graph | ir.Function] = [model.graph, *model.functions.values()]
        for g in graphs:
            body = g.graph if isinstance(g, ir.Function) else g
            for node in ir.traversal.RecursiveGraphIterator(body):
                key = (node.domain, node.op_type, node.overload or "")
                if key in model.functions:
                    sites.setdefault(key, []).append((node.graph or body, node))
        return sites

    def _trace(self, model, sites, graph, value, kind, hits, seen, depth=0) -> None:
        if value is None or depth > _MAX_DEPTH:
            return
        key = (id(value), kind)
        if key in seen:
            return
        seen.add(key)
        prod = value.producer()
        if prod is None:
            # A function parameter: continue at every call site with the matching argument.
            for fkey, fn in model.functions.items():
                if any(p is value for p in fn.inputs):
                    idx = next(i for i, p in enumerate(fn.inputs) if p is value)
                    for site_graph, site in sites.get(fkey, []):
                        if idx < len(site.inputs):
                            self._trace(model, sites, site_graph, site.inputs[idx], kind, hits, seen, depth + 1)
            return
        if prod.op_type == "Constant" and prod.domain in ("", "ai.onnx"):
            return  # reached from its consumer (see below)
        fkey = (prod.domain, prod.op_type, prod.overload or "")
        if fkey in model.functions:
            fn = model.functions[fkey]
            out_idx = next(i for i, o in enumerate(prod.outputs) if o is value)
            self._trace(model, sites, fn.graph, fn.outputs[out_idx], kind, hits, seen, depth + 1)
            return
        if prod.domain not in ("", "ai.onnx") or prod.op_type not in _PASS_THROUGH:
            return
        positions = _PASS_THROUGH[prod.op_type]
        idxs = range(len(prod.inputs)) if positions is None else positions
        for i in idxs:
            if i >= len(prod.inputs) or prod.inputs[i] is None:
                continue
            inp = prod.inputs[i]
            arr = _const_array(inp)
            if arr is not None:
                if np.any(arr == INVALID_INDEX):
                    hkey = (id(prod), i)
                    hit = hits.get(hkey)
                    if hit is None:
                        hit = hits[hkey] = _Hit(prod.graph or graph, prod, i, inp)
                    hit.kinds.add(kind)
                continue
            self._trace(model, sites, graph, inp, kind, hits, seen, depth + 1)

    def find(self, model: ir.Model) -> list[_Hit]:
        """Every (consumer, input) through which an INT32_MAX constant reaches GatherND/ScatterND indices."""
        sites = self._call_sites(model)
        hits: dict[tuple[int, int], _Hit] = {}
        seen: set = set()
        bodies = [model.graph, *(fn.graph for fn in model.functions.values())]
        for body in bodies:
            for node in ir.traversal.RecursiveGraphIterator(body):
                if node.domain not in ("", "ai.onnx") or len(node.inputs) < 2:
                    continue
                if node.op_type == "GatherND":
                    self._trace(model, sites, body, node.inputs[1], "gather", hits, seen)
                elif node.op_type == "ScatterND":
                    self._trace(model, sites, body, node.inputs[1], "scatter", hits, seen)
        return list(hits.values())

    # ------------------------------------------------------------------------------------ rewrite
    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.gather_constants = self.scatter_constants = 0
        hits = self.find(model)
        for hit in hits:
            if len(hit.kinds) > 1:
                raise ContractError(
                    f"constant {hit.value.name!r} (input {hit.index} of {hit.node.op_type} node "
                    f"{hit.node.name!r}) reaches both GatherND and ScatterND indices; cannot choose a "
                    "replacement for its invalid index")
        for hit in hits:
            kind = next(iter(hit.kinds))
            arr = _const_array(hit.value)
            assert arr is not None
            new = np.where(arr == INVALID_INDEX, GATHER_REPLACEMENT if kind == "gather" else SCATTER_REPLACEMENT,
                           arr).astype(arr.dtype)
            if kind == "scatter" and new.dtype.kind == "u":
                raise ContractError(
                    f"scatter index constant {hit.value.name!r} is unsigned; cannot hold {SCATTER_REPLACEMENT}")
            n_done = self.gather_constants + self.scatter_constants
            base = f"{hit.value.name or 'invalid_index'}_ort_{kind}_{n_done}"
            const_node = ir.node("Constant", inputs=[], attributes={"value": ir.tensor(new, name=base)},
                                 outputs=[ir.Value(name=base)])
            const_node.name = base
            const_node.outputs[0].dtype = ir.DataType.from_numpy(new.dtype)
            const_node.outputs[0].shape = ir.Shape(new.shape)
            graph = hit.node.graph if hit.node.graph is not None else hit.graph
            graph.insert_before(hit.node, const_node)
            old = hit.value
            hit.node.replace_input_with(hit.index, const_node.outputs[0])
            prod = old.producer()
            if prod is not None and prod.op_type == "Constant" and not old.uses() and not old.is_graph_output():
                prod.graph.remove(prod, safe=True)
            if kind == "gather":
                self.gather_constants += 1
            else:
                self.scatter_constants += 1
        return ir.passes.PassResult(model, modified=bool(hits))

    def check(self, model: ir.Model) -> None:
        left = self.find(model)
        if left:
            self.violated(f"{len(left)} invalid-index constants still reach GatherND/ScatterND indices")
