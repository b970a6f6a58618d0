"""FuseSkipRMSNormPass: a residual ``Add`` followed by an RMSNorm becomes one onnxruntime
``com.microsoft::SkipSimplifiedLayerNormalization`` node.

Invariant: the graph computes the same values. Apply it to float32 graphs only. A match is exactly the float32
RMSNorm that transformers' decoders export, applied to the sum of two tensors::

    s = Add(a, b); c = Cast(s, float)                     # c is also the residual for the next layer
    y = Mul(w, Cast(Mul(c, Div(1, Sqrt(Add(ReduceMean(Pow(c, 2), axes=[-1]), eps)))), float))

with ``w`` a constant 1-D weight and ``eps`` a constant scalar. It is replaced by
``SkipSimplifiedLayerNormalization(a, b, w, epsilon=eps) -> (y, -, -, s)``: every other reader of ``s`` or ``c``
reads the fused node's sum output. Anything else (other dtypes, other epsilon placements, norms of a tensor that
is not a sum) is left for onnxruntime's own RMSNorm fusion. Graph inputs and outputs are untouched.
"""

from __future__ import annotations

import onnx_ir as ir
import onnx_ir.passes.common as common_passes

from qeff_kv.graph.passes._invariants import InvariantPass, label
from qeff_kv.graph.passes._patterns import const_array as _const
from qeff_kv.graph.passes._patterns import const_info as _info
from qeff_kv.graph.passes._patterns import producer_op as _op

_FLOAT = ir.DataType.FLOAT


def _other(node: ir.Node, known: ir.Value) -> ir.Value | None:
    a, b = node.inputs[0], node.inputs[1]
    return b if a is known else a if b is known else None


def _is_float_cast(node: ir.Node | None) -> bool:
    """A Cast to float32 of a float32 (or unannotated) value. The caller applies the pass to float32 graphs
    only, and the weight is checked to be float32, so an unannotated input is float32 too."""
    return (node is not None and node.attributes.get("to") is not None
            and node.attributes["to"].value == _FLOAT.value and node.inputs[0] is not None
            and node.inputs[0].dtype in (None, _FLOAT))


def _match(out_mul: ir.Node):
    """Return ``(add, eps, weight, [nodes to remove])`` if ``out_mul`` ends the pattern above."""
    for i in (0, 1):
        weight = out_mul.inputs[i]
        w = _info(weight)
        cast1 = _op(out_mul.inputs[1 - i], "Cast")
        if w is None or w.ndim != 1 or w.dtype != "float32" or not _is_float_cast(cast1):
            continue
        mul = _op(cast1.inputs[0], "Mul")
        if mul is None:
            return None
        for j in (0, 1):
            c_val, div = mul.inputs[j], _op(mul.inputs[1 - j], "Div")
            cast0 = _op(c_val, "Cast")
            if div is None or not _is_float_cast(cast0):
                continue
            one = _const(div.inputs[0])
            sqrt = _op(div.inputs[1], "Sqrt")
            if one is None or one.size != 1 or float(one.reshape(-1)[0]) != 1.0 or sqrt is None:
                return None
            add_eps = _op(sqrt.inputs[0], "Add")
            if add_eps is None:
                return None
            for k in (0, 1):
                eps = _const(add_eps.inputs[k])
                rm = _op(add_eps.inputs[1 - k], "ReduceMean")
                if eps is None or eps.size != 1 or rm is None:
                    continue
                axes = rm.attributes.get("axes")
                keepdims = rm.attributes.get("keepdims")
                if axes is None or list(axes.value) != [-1] or (keepdims is not None and keepdims.value != 1):
                    return None
                pow_ = _op(rm.inputs[0], "Pow")
                two = _const(pow_.inputs[1]) if pow_ is not None else None
                if pow_ is None or pow_.inputs[0] is not c_val or two is None or float(two.reshape(-1)[0]) != 2.0:
                    return None
                add = _op(cast0.inputs[0], "Add")
                if add is None or add.inputs[0] is None or add.inputs[1] is None:
                    return None
                return add, float(eps.reshape(-1)[0]), weight, cast0, [out_mul, cast1, mul, div, sqrt, add_eps, rm, pow_]
            return None
    return None


def _matches(graph: ir.Graph):
    """``(Mul node, match)`` for every node of ``graph`` (not its subgraphs) that ends the pattern."""
    for node in list(graph):
        if node.op_type != "Mul" or node.domain not in ("", "ai.onnx") or node.graph is None:
            continue
        found = _match(node)
        if found is not None:
            yield node, found


class FuseSkipRMSNormPass(InvariantPass):
    """Fuse residual add + float32 RMSNorm into SkipSimplifiedLayerNormalization (onnxruntime contrib op).

    ``ensures``: the graph inputs and outputs are unchanged and no node of the graph still ends the pattern."""

    dtypes = ("float32",)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        modified = False
        for node, found in _matches(graph):   # lazily: each match is made on the graph as fused so far
            add, eps, weight, cast0, _pattern = found
            y, s = node.outputs[0], add.outputs[0]
            # Outputs 1 and 2 (mean, inverse standard deviation) are optional and not produced.
            outs = [ir.Value(name=f"{y.name}_skipnorm", type=y.type, shape=y.shape), ir.Value(name=""),
                    ir.Value(name=""), ir.Value(name=f"{s.name}_sum", type=s.type, shape=s.shape)]
            fused = ir.node("SkipSimplifiedLayerNormalization", [add.inputs[0], add.inputs[1], weight],
                            attributes={"epsilon": eps}, domain="com.microsoft", outputs=outs,
                            name=f"{node.name}_skip_rmsnorm")
            graph.insert_before(node, fused)
            total = fused.outputs[3]
            y.replace_all_uses_with(fused.outputs[0], replace_graph_outputs=True)
            cast0.outputs[0].replace_all_uses_with(total, replace_graph_outputs=True)
            add.outputs[0].replace_all_uses_with(total, replace_graph_outputs=True)
            modified = True
        if modified:
            # a graph without any other com.microsoft node (a pure recurrent model: no GroupQueryAttention)
            model.opset_imports.setdefault("com.microsoft", 1)
            common_passes.RemoveUnusedNodesPass()(model)
            common_passes.TopologicalSortPass()(model)
        return ir.passes.PassResult(model, modified=modified)

    def check(self, model: ir.Model) -> None:
        left = [label(node) for node, _ in _matches(model.graph)]
        if left:
            self.violated(f"the RMSNorm ending in {', '.join(left)} is still unfused")

