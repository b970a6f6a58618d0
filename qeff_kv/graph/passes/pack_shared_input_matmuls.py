"""PackSharedInputMatMulsPass: projections that read the same input become one wider projection, split after.

A decoder layer's MLP reads its normalized hidden states ``h`` twice (``gate_proj`` and ``up_proj``), and a layer
without a fused attention op reads it three times (``q_proj``, ``k_proj``, ``v_proj``). One wider matrix-vector
product reads the same weight bytes as the separate ones but costs one kernel launch (one thread-pool dispatch)
instead of two or three: on a decode step, where every kernel is short, that is the saving.

Two kinds of node are packed, each only with its own kind:

* ``MatMul(h, W_i)`` with every ``W_i`` a 2-D constant of the same dtype and the same ``K`` (rows):
  ``MatMul(h, concat(W_1 .. W_n, axis=1))``;
* ``com.microsoft::MatMulNBits(h, B_i, scales_i[, zero_points_i])`` with equal ``K``, ``bits``, ``block_size``,
  ``accuracy_level``, constant ``B``/``scales``/``zero_points`` of one layout each (all with zero points or none;
  no ``g_idx``, no bias): ``B``, ``scales`` and ``zero_points`` concatenated along their first axis (``N``: the
  quantized rows of each output column are stored column after column, so a column's blocks, scale and zero
  point are the same bytes in the packed tensors), ``N`` the sum.

Then ``Split(axis=-1, split=[N_1 .. N_n])`` gives back one Value per original node, and every reader of an
original output reads the matching Split output instead (Values are replaced, names are not looked up).

Invariant: graph inputs and outputs (names, dtypes, shapes, order) are unchanged, and each Split output equals
the output of the node it replaces: column ``j`` of a product depends only on column ``j`` of the weight (and, for
MatMulNBits, on that column's own blocks, scales and zero points), so concatenating along ``N`` and splitting
at the same offsets gives each original product. A node whose output is a graph output, or whose output
dtype/rank is unknown to differ, is left alone; a group of one is left alone. Nodes and initializers left unused
are removed.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common as common_passes

from qeff_kv.graph.passes._invariants import InvariantPass, label
from qeff_kv.graph.passes._patterns import concat_tensor
from qeff_kv.graph.passes._patterns import const_info as _const

_STANDARD = ("", "ai.onnx")
_MS = "com.microsoft"


def _attr(node: ir.Node, name: str, default=None):
    a = node.attributes.get(name)
    return default if a is None else a.value


def _matmul_key(node: ir.Node):
    """Group key of a packable float ``MatMul`` (``None`` when it is not packable)."""
    if len(node.inputs) != 2 or node.inputs[0] is None or node.inputs[1] is None:
        return None
    w = _const(node.inputs[1])
    if w is None or w.ndim != 2:
        return None
    return ("MatMul", int(w.shape[0]), str(w.dtype))


def _nbits_key(node: ir.Node):
    """Group key of a packable ``MatMulNBits`` (``None`` when it is not packable)."""
    ins = list(node.inputs)
    while ins and ins[-1] is None:
        ins.pop()
    if len(ins) not in (3, 4) or ins[0] is None or any(v is None for v in ins):
        return None   # no g_idx / bias; zero points optional
    arrays = [_const(v) for v in ins[1:]]
    if any(a is None for a in arrays) or _attr(node, "N") is None or _attr(node, "K") is None:
        return None
    n = int(_attr(node, "N"))
    b, scales = arrays[0], arrays[1]
    if b.ndim != 3 or b.shape[0] != n or not all(_column_major(a, n) for a in arrays[1:]):
        return None
    return ("MatMulNBits", int(_attr(node, "K")), int(_attr(node, "bits", 4)), int(_attr(node, "block_size")),
            int(_attr(node, "accuracy_level", 0)), len(ins), str(b.dtype), b.shape[1:], str(scales.dtype),
            scales.ndim, None if len(arrays) < 3 else (str(arrays[2].dtype), arrays[2].ndim))


def _column_major(a: np.ndarray, n: int) -> bool:
    """``a`` holds ``N`` equal runs, one per output column: ``[N, ...]`` or a flat ``[N * k]``."""
    return (a.ndim >= 2 and a.shape[0] == n) or (a.ndim == 1 and a.size % n == 0)


def _groups(graph: ir.Graph) -> list[list[ir.Node]]:
    """The packable nodes of ``graph`` grouped by the input they read and their kind (groups of one included)."""
    groups: dict[tuple, list[ir.Node]] = {}
    for node in graph:
        if node.op_type == "MatMul" and node.domain in _STANDARD:
            key = _matmul_key(node)
        elif node.op_type == "MatMulNBits" and node.domain == _MS:
            key = _nbits_key(node)
        else:
            continue
        out = node.outputs[0]
        if key is None or out.is_graph_output() or not out.uses():
            continue
        groups.setdefault((id(node.inputs[0]),) + key, []).append(node)
    return list(groups.values())


class PackSharedInputMatMulsPass(InvariantPass):
    """Pack ``MatMul`` / ``MatMulNBits`` nodes that read the same input (see the module docstring).

    After :meth:`call`, :attr:`packed` lists the number of nodes in each packed group. ``ensures``: the graph
    inputs and outputs are unchanged and no two packable nodes read the same input."""

    def __init__(self) -> None:
        super().__init__()
        self.packed: list[int] = []

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.packed = []
        graph = model.graph
        for nodes in _groups(graph):
            if len(nodes) < 2:
                continue
            if nodes[0].op_type == "MatMul":
                self._pack_matmuls(graph, nodes)
            else:
                self._pack_nbits(graph, nodes)
            self.packed.append(len(nodes))
        if self.packed:
            common_passes.RemoveUnusedNodesPass()(model)
            common_passes.TopologicalSortPass()(model)
        return ir.passes.PassResult(model, modified=bool(self.packed))

    def check(self, model: ir.Model) -> None:
        left = [", ".join(label(n) for n in nodes) for nodes in _groups(model.graph) if len(nodes) > 1]
        if left:
            self.violated(f"the nodes {'; '.join(left)} still read one input separately")

    def _register(self, graph: ir.Graph, name: str, array) -> ir.Value:
        tensor = ir.tensor(np.ascontiguousarray(array)) if isinstance(array, np.ndarray) else array
        v = ir.Value(name=name, const_value=tensor)
        graph.register_initializer(v)
        return v

    def _split(self, graph: ir.Graph, nodes: list[ir.Node], packed: ir.Node, widths: list[int]) -> None:
        sizes = self._register(graph, f"{packed.name}_split", np.array(widths, np.int64))
        split = ir.node("Split", [packed.outputs[0], sizes], {"axis": -1}, num_outputs=len(nodes),
                        name=f"{packed.name}_split")
        graph.insert_after(packed, split)
        for node, out in zip(nodes, split.outputs):
            old = node.outputs[0]
            if old.dtype is not None:
                out.dtype, out.shape = old.dtype, old.shape
            old.replace_all_uses_with(out)

    def _pack_matmuls(self, graph: ir.Graph, nodes: list[ir.Node]) -> None:
        weights = [_const(n.inputs[1]) for n in nodes]
        base = nodes[0].name or "MatMul"
        w = self._register(graph, f"{base}_packed_weight",
                           concat_tensor([n.inputs[1] for n in nodes], 1, f"{base}_packed_weight"))
        packed = ir.node("MatMul", [nodes[0].inputs[0], w], name=f"{base}_packed")
        graph.insert_before(nodes[0], packed)
        self._split(graph, nodes, packed, [int(a.shape[1]) for a in weights])

    def _pack_nbits(self, graph: ir.Graph, nodes: list[ir.Node]) -> None:
        ns = [int(_attr(n, "N")) for n in nodes]
        base = nodes[0].name or "MatMulNBits"
        inputs = [nodes[0].inputs[0]]
        for j, label in ((1, "B"), (2, "scales"), (3, "zero_points")):
            if j >= len(nodes[0].inputs) or nodes[0].inputs[j] is None:
                break
            name = f"{base}_packed_{label}"
            inputs.append(self._register(graph, name, concat_tensor([n.inputs[j] for n in nodes], 0, name,
                                                                    rows_of=ns)))
        attrs = {a.name: a.value for a in nodes[0].attributes.values()}
        attrs["N"] = sum(ns)
        packed = ir.node("MatMulNBits", inputs, attrs, domain=_MS, name=f"{base}_packed")
        graph.insert_before(nodes[0], packed)
        self._split(graph, nodes, packed, ns)
