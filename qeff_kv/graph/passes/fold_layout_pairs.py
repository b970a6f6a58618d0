"""FoldLayoutPairsPass: back-to-back layout-only nodes (``Reshape -> Reshape``, ``Transpose -> Transpose``) are
folded into one node, or into nothing when the pair provably returns its input.

The fused target's attention output is such a pair: GroupQueryAttention returns ``[B, S, heads * head_dim]``, the
traced attention interface views it as ``[B, S, heads, head_dim]`` (``Reshape(x, [0, 0, -1, head_dim])``) and the
model's ``o_proj`` input is ``attn_output.reshape(*input_shape, -1)``: a ``Reshape`` to ``[Shape(h)[0],
Shape(h)[1], -1]`` of the layer's normalized hidden states ``h`` (whose rows the query was projected from).

Invariant: graph inputs and outputs (names, dtypes, shapes, order) and every value the graph computes are
unchanged. Only a pair whose intermediate value has that one reader and is not a graph output is touched:

* ``Reshape(Reshape(x, a), b)`` (both ``allowzero`` 0) is replaced by ``x`` when ``b`` provably gives ``x``'s own
  shape: ``b`` is a constant or a ``Concat`` of constants and ``Unsqueeze(Gather(Shape(y), i))``, of ``x``'s
  rank, with at most one ``-1``, every other entry either ``x``'s static size there or the dim ``i`` of a value
  ``y`` that is the same dim as ``x``'s there. Two dims are the same when their chains meet at one
  ``(value, axis)``; a chain follows a dim back through nodes that keep that axis: ``Identity``/``Cast``, (Skip)SimplifiedLayerNormalization, ``Reshape``
  with a constant ``0`` there, a ``MatMul`` by a 2-D constant (every axis but the last), an elementwise op with a
  constant of lower rank that does not reach that axis, and GroupQueryAttention's output (axes 0, 1: its
  query's). The element count then fixes the ``-1`` at ``x``'s size. Otherwise, when no entry of ``b`` is ``0``
  (or its ``0`` entries copy dims that ``a`` itself copied from ``x``), by ``Reshape(x, b)``: a reshape reads its
  input in row-major order, so one reshape to ``b`` gives what the two did.
* ``Transpose(Transpose(x, p), q)`` is replaced by ``x`` when ``p[q[i]] == i`` for every ``i``, else by
  ``Transpose(x, [p[q[i]] ...])``.

Values are followed as Values (never by name); nodes left without readers are removed, with the shape
computations (``Shape -> Gather -> Unsqueeze -> Concat``) that only fed a folded ``Reshape``.
"""

from __future__ import annotations

import onnx_ir as ir
import onnx_ir.passes.common as common_passes

from qeff_kv.graph.passes._invariants import InvariantPass, label
from qeff_kv.graph.passes._patterns import const_array as _const
from qeff_kv.graph.passes._patterns import const_info as _info

_STANDARD = ("", "ai.onnx")
_MS = "com.microsoft"
_SAME_SHAPE = {("", "Identity"), ("", "Cast"), (_MS, "SimplifiedLayerNormalization"),
               (_MS, "SkipSimplifiedLayerNormalization"), ("", "SimplifiedLayerNormalization")}
_ELEMENTWISE = ("Mul", "Add", "Sub", "Div")


def _domain(node: ir.Node) -> str:
    return "" if node.domain in _STANDARD else node.domain


def _rank(v: ir.Value, depth: int = 0) -> int | None:
    """``v``'s rank: annotated, else that of the input of a node whose output has its input's rank (the
    same-shape ops, ``MatMul`` by a 2-D constant, an elementwise op with a constant of lower rank)."""
    if v.shape is not None:
        return len(v.shape)
    p = v.producer()
    if p is None or depth > 32 or not p.inputs or p.inputs[0] is None or p.outputs[0] is not v:
        return None
    key = (_domain(p), p.op_type)
    if key in _SAME_SHAPE:
        return _rank(p.inputs[0], depth + 1)
    if key == ("", "MatMul") and len(p.inputs) > 1:
        w = _info(p.inputs[1])
        a = _rank(p.inputs[0], depth + 1)
        return a if w is not None and w.ndim == 2 and a is not None and a >= 2 else None
    if key[0] == "" and p.op_type in _ELEMENTWISE and len(p.inputs) == 2:
        for mine, other in ((p.inputs[0], p.inputs[1]), (p.inputs[1], p.inputs[0])):
            c = _info(other)
            r = _rank(mine, depth + 1) if c is not None and mine is not None else None
            if r is not None and c.ndim <= r:
                return r
    return None


def _chain(v: ir.Value, axis: int, rank: int | None) -> list[tuple[ir.Value, int]]:
    """Every ``(value, axis)`` whose dim provably equals dim ``axis`` of ``v``, followed back (see the module
    docstring), ``v`` first. ``rank``: ``v``'s rank where known."""
    out = [(v, axis)]
    rank = _rank(v) if rank is None else rank
    for _ in range(64):
        p = v.producer()
        if p is None or not p.inputs or p.inputs[0] is None or p.outputs[0] is not v:
            break
        key, src, nxt = (_domain(p), p.op_type), p.inputs[0], None
        if key in _SAME_SHAPE:
            nxt = (src, axis, rank)
        elif key == ("", "Reshape"):
            shape = _const(p.inputs[1]) if len(p.inputs) > 1 else None
            allowzero = p.attributes.get("allowzero")
            if (shape is not None and shape.ndim == 1 and axis < len(shape) and int(shape[axis]) == 0
                    and (allowzero is None or allowzero.value == 0)):
                nxt = (src, axis, None)
        elif key == ("", "MatMul") and rank is not None and axis < rank - 1 and len(p.inputs) > 1:
            w = _info(p.inputs[1])
            if w is not None and w.ndim == 2:   # [..., M, K] @ [K, N]: every axis but the last is A's
                nxt = (src, axis, rank)
        elif key == (_MS, "GroupQueryAttention") and axis < 2:   # [B, S, ...] of its query
            nxt = (src, axis, 3)
        elif key[0] == "" and p.op_type in _ELEMENTWISE and rank is not None and len(p.inputs) == 2:
            for mine, other in ((p.inputs[0], p.inputs[1]), (p.inputs[1], p.inputs[0])):
                c = _info(other)
                if c is not None and mine is not None and c.ndim < rank and axis < rank - c.ndim:
                    nxt = (mine, axis, rank)
                    break
        if nxt is None:
            break
        v, axis, rank = nxt
        rank = _rank(v) if rank is None else rank
        out.append((v, axis))
    return out


def _same_dim(a: list[tuple[ir.Value, int]], b: list[tuple[ir.Value, int]]) -> bool:
    """Two chains of equal dims meet: the dims they start from are equal."""
    return any(va is vb and ia == ib for va, ia in a for vb, ib in b)


def _entries(b: ir.Value) -> list | None:
    """``b`` as a list of entries: ints, or ``(value, axis)`` for ``Unsqueeze(Gather(Shape(y), i))``."""
    c = _const(b)
    if c is not None:
        return [int(x) for x in c.reshape(-1)] if c.ndim == 1 else None
    p = b.producer()
    if p is None or p.op_type != "Concat" or p.domain not in _STANDARD:
        return None
    out: list = []
    for part in p.inputs:
        c = _const(part)
        if c is not None:
            if c.ndim != 1:
                return None
            out += [int(x) for x in c]
            continue
        u = part.producer() if part is not None else None
        g = u.inputs[0].producer() if u is not None and u.op_type == "Unsqueeze" and u.inputs[0] is not None else None
        s = g.inputs[0].producer() if g is not None and g.op_type == "Gather" and g.inputs[0] is not None else None
        idx = _const(g.inputs[1]) if g is not None and len(g.inputs) > 1 else None
        if s is None or s.op_type != "Shape" or idx is None or idx.size != 1 or s.attributes.get("start") \
                or s.attributes.get("end"):
            return None
        ax = _const(u.inputs[1]) if len(u.inputs) > 1 else None
        if ax is None or ax.reshape(-1).tolist() != [0]:
            return None
        i = int(idx.reshape(-1)[0])
        if i < 0:
            return None
        out.append((s.inputs[0], i))
    return out


def _reshape_returns_input(x: ir.Value, entries: list) -> bool:
    rank = _rank(x)
    if rank is None or len(entries) != rank or sum(1 for e in entries if e == -1) > 1:
        return False
    for j, e in enumerate(entries):
        if e == -1:
            continue
        if isinstance(e, int):
            if x.shape is None or e != x.shape[j]:
                return False
        elif not _same_dim(_chain(e[0], e[1], None), _chain(x, j, rank)):
            return False
    return True


def _plain_reshape(node: ir.Node) -> bool:
    allowzero = node.attributes.get("allowzero")
    return (node.op_type == "Reshape" and node.domain in _STANDARD and len(node.inputs) == 2
            and (allowzero is None or allowzero.value == 0))


def _pair(second: ir.Node, graph: ir.Graph) -> ir.Node | None:
    """The node ``first`` of a pair ``first -> second`` of one op type in ``graph`` whose intermediate value has
    ``second`` as its one reader and is not a graph output, else ``None``."""
    if second.graph is not graph or not second.inputs or second.inputs[0] is None:
        return None
    mid = second.inputs[0]
    first = mid.producer()
    if (first is None or first.graph is not graph or mid.is_graph_output() or len(mid.uses()) != 1
            or first.op_type != second.op_type or first.inputs[0] is None):
        return None
    return first


def _transpose_pair(first: ir.Node | None, second: ir.Node) -> bool:
    """A ``Transpose -> Transpose`` pair of standard ops with permutations of one rank: always folded."""
    if first is None or second.op_type != "Transpose" or first.domain not in _STANDARD or \
            second.domain not in _STANDARD:
        return False
    p, q = first.attributes.get("perm"), second.attributes.get("perm")
    return p is not None and q is not None and len(p.value) == len(q.value)


class FoldLayoutPairsPass(InvariantPass):
    """Fold ``Reshape -> Reshape`` and ``Transpose -> Transpose`` pairs (see the module docstring).

    After :meth:`call`, :attr:`removed` counts the pairs that became their input and :attr:`merged` the pairs
    that became one node. ``ensures``: the graph inputs and outputs are unchanged and no ``Transpose -> Transpose``
    pair is left (a ``Reshape`` pair is folded only where provable, so one may stay)."""

    def __init__(self) -> None:
        super().__init__()
        self.removed = 0
        self.merged = 0

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.removed = self.merged = 0
        graph = model.graph
        for second in list(graph):
            first = _pair(second, graph)
            if first is None:
                continue
            if second.op_type == "Reshape" and _plain_reshape(first) and _plain_reshape(second):
                self._reshapes(graph, first, second)
            elif second.op_type == "Transpose" and first.domain in _STANDARD and second.domain in _STANDARD:
                self._transposes(graph, first, second)
        if self.removed + self.merged:   # the shape chains that fed a folded Reshape have no reader left
            common_passes.RemoveUnusedNodesPass()(model)
        return ir.passes.PassResult(model, modified=(self.removed + self.merged) > 0)

    def check(self, model: ir.Model) -> None:
        graph = model.graph
        left = [label(n) for n in graph if _transpose_pair(_pair(n, graph), n)]
        if left:
            self.violated(f"the Transpose pairs ending in {', '.join(left)} are left unfolded")

    def _reshapes(self, graph: ir.Graph, first: ir.Node, second: ir.Node) -> None:
        x, b = first.inputs[0], second.inputs[1]
        entries = _entries(b)
        if entries is None:
            return
        if not second.outputs[0].is_graph_output() and _reshape_returns_input(x, entries):
            self._bypass(graph, first, second, x)
            return
        a = _const(first.inputs[1])
        for j, e in enumerate(entries):   # a 0 copies the intermediate's dim: fine only where a copied x's
            if e == 0 and (a is None or a.ndim != 1 or j >= len(a) or int(a[j]) != 0):
                return
        second.replace_input_with(0, x)
        graph.remove(first, safe=True)
        self.merged += 1

    def _transposes(self, graph: ir.Graph, first: ir.Node, second: ir.Node) -> None:
        p, q = first.attributes.get("perm"), second.attributes.get("perm")
        if p is None or q is None or len(p.value) != len(q.value):
            return
        p, q = list(p.value), list(q.value)
        combined = [p[i] for i in q]
        x = first.inputs[0]
        if combined == list(range(len(combined))) and not second.outputs[0].is_graph_output():
            self._bypass(graph, first, second, x)
            return
        second.replace_input_with(0, x)
        second.attributes["perm"] = ir.AttrInt64s("perm", combined)
        graph.remove(first, safe=True)
        self.merged += 1

    def _bypass(self, graph: ir.Graph, first: ir.Node, second: ir.Node, x: ir.Value) -> None:
        out = second.outputs[0]
        out.replace_all_uses_with(x)
        graph.remove(second, safe=True)
        graph.remove(first, safe=True)
        self.removed += 1
