"""PackGQAQKVPass: one packed Q/K/V projection per GroupQueryAttention, as onnxruntime's own builders make.

Invariant: every ``com.microsoft::GroupQueryAttention`` node computes exactly what it computed before. A node
is rewritten only when its query, key and value inputs are each ``Reshape(Reshape(MatMul(h, W) [+ b],
[dim0(h), dim1(h), -1, D]), [0, 0, -1])`` - a layout round trip that is provably the identity - with the same
``h`` and constant weights (and constant biases for all three or none). Then ``MatMul(h, concat(Wq, Wk, Wv))
[+ concat(bq, bk, bv)]`` feeds the query input and the key/value inputs become empty (GQA's packed form).
Graph inputs, outputs and their names are untouched; nodes and initializers left unused are removed.
Anything that does not match (query/key norms between projection and attention, fused projections split by
slices) is left as it is.
"""

from __future__ import annotations

import onnx_ir as ir
import onnx_ir.passes.common as common_passes

from qeff_kv.graph.passes._invariants import InvariantPass, label
from qeff_kv.graph.passes._patterns import concat_tensor
from qeff_kv.graph.passes._patterns import const_array as _const
from qeff_kv.graph.passes._patterns import const_info as _info
from qeff_kv.graph.passes._patterns import producer_op as _op


def _dim_of_shape(v: ir.Value, h: ir.Value, index: int) -> bool:
    """``v`` is ``Unsqueeze(Gather(Shape(h), index))``: the ``index``-th dim of ``h`` as a 1-D tensor."""
    unsq = _op(v, "Unsqueeze")
    gather = _op(unsq.inputs[0], "Gather") if unsq is not None else None
    shape = _op(gather.inputs[0], "Shape") if gather is not None else None
    if shape is None or shape.inputs[0] is not h or shape.attributes:
        return False
    idx = _const(gather.inputs[1])
    return idx is not None and idx.size == 1 and int(idx.reshape(-1)[0]) == index


def _projection(v: ir.Value) -> tuple[ir.Value, ir.Value, ir.Value | None, ir.Node] | None:
    """Match the identity round trip above; return ``(h, W, bias or None, matmul)``."""
    outer = _op(v, "Reshape")
    if outer is None or _const(outer.inputs[1]) is None or _const(outer.inputs[1]).tolist() != [0, 0, -1]:
        return None
    inner = _op(outer.inputs[0], "Reshape")
    if inner is None or len(inner.outputs[0].uses()) != 1:
        return None
    src = inner.inputs[0]
    bias = None
    add = _op(src, "Add")
    if add is not None:
        for i in (0, 1):
            if _const(add.inputs[1 - i]) is not None and _op(add.inputs[i], "MatMul") is not None:
                bias, src = add.inputs[1 - i], add.inputs[i]
                break
        else:
            return None
    matmul = _op(src, "MatMul")
    if matmul is None or _info(matmul.inputs[1]) is None or _info(matmul.inputs[1]).ndim != 2:
        return None
    h = matmul.inputs[0]
    concat = _op(inner.inputs[1], "Concat")
    if concat is None or len(concat.inputs) != 4:
        return None
    if not (_dim_of_shape(concat.inputs[0], h, 0) and _dim_of_shape(concat.inputs[1], h, 1)):
        return None
    tail = [_const(concat.inputs[2]), _const(concat.inputs[3])]
    if any(t is None or t.size != 1 for t in tail) or int(tail[0].reshape(-1)[0]) != -1:
        return None
    return h, matmul.inputs[1], bias, matmul


def _packable(node: ir.Node) -> list | None:
    """The three projections of a GroupQueryAttention node the pass packs (one ``h``, weights of one ``K`` and
    dtype, biases on all three or none), else ``None``."""
    if node.domain != "com.microsoft" or node.op_type != "GroupQueryAttention" or len(node.inputs) < 3:
        return None
    parts = [_projection(v) for v in node.inputs[:3]]
    if any(p is None for p in parts):
        return None
    biases = [p[2] for p in parts]
    if len({id(p[0]) for p in parts}) != 1 or (any(b is None for b in biases) and any(b is not None for b in biases)):
        return None
    weights = [_info(p[1]) for p in parts]
    if len({w.shape[0] for w in weights}) != 1 or len({w.dtype for w in weights}) != 1:
        return None
    return parts


class PackGQAQKVPass(InvariantPass):
    """Pack the three projections of each matching GroupQueryAttention node into one MatMul.

    ``ensures``: the graph inputs and outputs are unchanged and no GroupQueryAttention node is left that the pass
    would pack."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        modified = False
        for node in list(graph):
            parts = _packable(node)
            if parts is None:
                continue
            h, biases = parts[0][0], [p[2] for p in parts]
            wname = f"{node.name or 'gqa'}.qkv_weight"
            packed_w = ir.Value(name=wname, const_value=concat_tensor([p[1] for p in parts], 1, wname))
            graph.register_initializer(packed_w)
            base = parts[0][3]
            matmul = ir.node("MatMul", [h, packed_w], name=f"{base.name}_qkv")
            graph.insert_before(node, matmul)
            packed = matmul.outputs[0]
            if biases[0] is not None:
                bname = f"{node.name or 'gqa'}.qkv_bias"
                packed_b = ir.Value(name=bname, const_value=concat_tensor(biases, 0, bname))
                graph.register_initializer(packed_b)
                add = ir.node("Add", [packed, packed_b], name=f"{base.name}_qkv_bias")
                graph.insert_before(node, add)
                packed = add.outputs[0]
            node.replace_input_with(0, packed)
            node.replace_input_with(1, None)
            node.replace_input_with(2, None)
            modified = True
        if modified:
            common_passes.RemoveUnusedNodesPass()(model)
            common_passes.RemoveUnusedFunctionsPass()(model)
            common_passes.TopologicalSortPass()(model)
        return ir.passes.PassResult(model, modified=modified)

    def check(self, model: ir.Model) -> None:
        left = [label(n) for n in model.graph if _packable(n) is not None]
        if left:
            self.violated(f"GroupQueryAttention {', '.join(left)} still reads three separate projections")
