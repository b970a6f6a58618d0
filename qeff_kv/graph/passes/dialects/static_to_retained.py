"""StaticToRetainedPass: turn a static-cache graph (mobius-onnx ``--static-cache``) into retained state.

Invariant: afterwards every KV pair ``key_cache.<i>[_P]`` -> ``updated_key_cache.<i>[_P]`` (packed
``[batch, capacity, kv_heads*head_dim]``) is ``past_key.<i>[_P]`` -> ``past_key.<i>[_P]_RetainedState`` of shape
``[batch, kv_heads, capacity, head_dim]`` (same dtype, same batch dim, prefix kept), written in place by one
``TensorScatter`` (axis 2) straight into the retained output; what read the packed updated cache (the attention)
reads ``Reshape(Transpose(retained output))``, the same values it read before; the inputs ``write_indices`` and
``nonpad_kv_seqlen`` are gone, derived inside the graph as ``position_ids[:, 0]`` and
``ReduceMax(position_ids, axis 1) + 1`` (exact for a row whose positions are contiguous, padding, ``-1``, only after
them); every other input and output (name, dtype, shape, order) is as it was.

``kv_heads`` comes from the ``kv_num_heads`` attribute of the ``Attention`` that reads the updated cache (or from the
``Reshape(updated cache, [0, 0, kv_heads, head_dim])`` heads view of a graph converted from retained state, whose
shape views ``Reshape(cache, [0, kv_heads, -1, head_dim])`` read by ``Shape`` alone then read the retained buffer, of
that same shape); a buffer not updated by one ``TensorScatter`` at axis 1 from the cache input itself (or read
otherwise), or whose heads cannot be read, is
refused in one line before anything changes. Values are renamed and rewired as ``ir.Value`` objects, never strings.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from qeff_kv.contract import naming
from qeff_kv.errors import DialectError
from qeff_kv.graph.graphio import layout_of
from qeff_kv.graph.passes.dialects.base import ConversionPass
from qeff_kv.graph.passes._patterns import append_node, const_array, named_const

_PERM = [0, 2, 1, 3]   # [batch, capacity, heads, head_dim] <-> [batch, heads, capacity, head_dim]


def _attr(node: ir.Node, name: str, default=None):
    a = node.attributes.get(name)
    return default if a is None else a.value


def _plan_pair(graph: ir.Graph, x: ir.Value, parsed: naming.KVName) -> tuple:
    """(input, TensorScatter, kv_heads, head_dim) of one static buffer, or :class:`DialectError`."""
    name = x.name
    users = [(n, i) for n, i in x.uses() if n.op_type == "TensorScatter" and n.domain in ("", "ai.onnx") and i == 0]
    out_names = {v.name for v in graph.outputs}
    views = [n for n, i in x.uses() if i == 0 and _shape_view(n) is not None]
    if len(users) != 1 or len(x.uses()) != 1 + len(views) or users[0][0].outputs[0].name != parsed.output or \
            parsed.output not in out_names:
        raise DialectError(f"cannot convert {name}: it is not updated by exactly one TensorScatter into {parsed.output}")
    node = users[0][0]
    shape = x.shape
    if shape is None or len(shape) != 3 or _attr(node, "axis", -2) not in (1, -2):
        raise DialectError(f"cannot convert {name}: not a [batch, capacity, heads*head_dim] cache scattered at axis 1")
    width = shape[2]
    heads = {_attr(n, "kv_num_heads") for n, _ in node.outputs[0].uses() if n.op_type == "Attention"}
    heads |= {_split_heads(n, width) for n, i in node.outputs[0].uses() if n.op_type == "Reshape" and i == 0}
    heads.discard(None)
    if len(heads) != 1 or not isinstance(width, int) or width % next(iter(heads)):
        raise DialectError(f"cannot convert {name}: its kv_heads are unknown (no Attention with kv_num_heads reads "
                           f"{parsed.output}, or {width} is not a multiple of it)")
    kv_heads = int(next(iter(heads)))
    if any(_shape_view(n) != (kv_heads, width // kv_heads) for n in views):
        raise DialectError(f"cannot convert {name}: a shape view of it is not [batch, {kv_heads}, capacity, "
                           f"{width // kv_heads}]")
    return x, node, kv_heads, width // kv_heads


def _shape_view(node: ir.Node) -> tuple[int, int] | None:
    """``(h, d)`` of a ``Reshape(cache, [0, h, -1, d])`` that only ``Shape``/``Size`` read (how a graph converted by
    :class:`~qeff_kv.graph.passes.dialects.retained_to_static.RetainedToStaticPass` gives the old readers of the retained
    buffer's shape its ``[batch, heads, capacity, head_dim]`` shape), else ``None``."""
    shape = const_array(node.inputs[1]) if node.op_type == "Reshape" and len(node.inputs) > 1 else None
    if shape is None or shape.shape != (4,) or shape[0] != 0 or shape[2] != -1 or min(shape[1], shape[3]) <= 0:
        return None
    if any(n.op_type not in ("Shape", "Size") for n, _ in node.outputs[0].uses()):
        return None
    return int(shape[1]), int(shape[3])


def _split_heads(reshape: ir.Node, width) -> int | None:
    """``h`` of a ``Reshape(cache, [0, 0, h, d])`` with ``h * d == width`` (the heads view a graph converted by
    :class:`~qeff_kv.graph.passes.dialects.retained_to_static.RetainedToStaticPass` reads), else ``None``."""
    shape = const_array(reshape.inputs[1]) if len(reshape.inputs) > 1 else None
    if shape is None or shape.shape != (4,) or list(shape[:2]) != [0, 0] or not isinstance(width, int):
        return None
    return int(shape[2]) if shape[2] > 0 and shape[3] > 0 and int(shape[2]) * int(shape[3]) == width else None


class StaticToRetainedPass(ConversionPass):
    """Convert every static-cache KV pair to a retained-state pair (see the module docstring)."""

    target = naming.RETAINED_STATE

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        layout_of(model).require_valid()
        inputs = {v.name: v for v in graph.inputs}
        pos = inputs.get(naming.POSITION_IDS_INPUT)
        if pos is None:
            raise DialectError(f"cannot convert to {naming.RETAINED_STATE}: the graph takes no "
                               f"{naming.POSITION_IDS_INPUT} to derive {naming.WRITE_INDICES_INPUT} from")
        plan = []
        for x in list(graph.inputs):
            parsed = naming.parse_any_kv_name(x.name or "")
            if parsed is not None:
                plan.append((parsed,) + _plan_pair(graph, x, parsed))
        write_idx, nonpad = _derive_static_inputs(graph, pos)
        for parsed, x, node, kv_heads, head_dim in plan:
            _convert_pair(graph, parsed, x, node, kv_heads, head_dim, write_idx)
        for name, derived in ((naming.WRITE_INDICES_INPUT, write_idx), (naming.NONPAD_KV_SEQLEN_INPUT, nonpad)):
            old = inputs.get(name)
            if old is not None:
                old.replace_all_uses_with(derived)
                graph.inputs.remove(old)
        graph.sort()
        return ir.passes.PassResult(model, modified=True)



def _derive_static_inputs(graph: ir.Graph, pos: ir.Value) -> tuple[ir.Value, ir.Value]:
    """``write_indices = position_ids[:, 0]`` and ``nonpad_kv_seqlen = max(position_ids, axis 1) + 1``."""
    tag = "qeff_kv.to_retained"
    zero = named_const(graph, f"{tag}.zero", np.array(0, np.int64))
    axis1 = named_const(graph, f"{tag}.axis1", np.array([1], np.int64))
    one = named_const(graph, f"{tag}.one", np.array(1, np.int64))
    first = append_node(graph, "Gather", [pos, zero], f"{tag}/{naming.WRITE_INDICES_INPUT}", axis=1)
    last = append_node(graph, "ReduceMax", [pos, axis1], f"{tag}/max_position", keepdims=0)
    held = append_node(graph, "Add", [last, one], f"{tag}/{naming.NONPAD_KV_SEQLEN_INPUT}")
    return first, held


def _convert_pair(graph: ir.Graph, parsed: naming.KVName, x: ir.Value, node: ir.Node, kv_heads: int,
                  head_dim: int, write_idx: ir.Value) -> None:
    """Replace ``x`` (packed) by its 4-D retained buffer and ``node`` by a TensorScatter at axis 2 into the retained
    output; readers of the packed updated cache read a packed view of the retained output."""
    batch, capacity, width = x.shape.dims
    new = parsed.in_dialect(naming.RETAINED_STATE)
    tag = f"qeff_kv.to_retained/{new.name}"
    split = named_const(graph, f"qeff_kv.to_retained.split.{kv_heads}x{head_dim}",
                   np.array([0, 0, kv_heads, head_dim], np.int64))
    packed = named_const(graph, f"qeff_kv.to_retained.packed.{width}", np.array([0, 0, width], np.int64))
    buf = ir.Value(name=new.name, shape=ir.Shape([batch, kv_heads, capacity, head_dim]), type=x.type)
    graph.inputs[graph.inputs.index(x)] = buf
    for reader, idx in list(x.uses()):   # shape views Reshape(x, [0, heads, -1, head_dim]): the same shape of buf
        if reader is not node:
            reader.replace_input_with(idx, buf)
    heads = append_node(graph, "Reshape", [node.inputs[1], split], f"{tag}/update_heads")
    update = append_node(graph, "Transpose", [heads], f"{tag}/update", perm=_PERM)
    scatter = ir.node("TensorScatter", [buf, update, write_idx], attributes={"axis": 2}, num_outputs=1,
                      name=f"{tag}/TensorScatter")
    out = scatter.outputs[0]
    out.name, out.shape, out.type = new.output, ir.Shape([batch, kv_heads, capacity, head_dim]), x.type
    graph.append(scatter)
    back = append_node(graph, "Transpose", [out], f"{tag}/positions_first", perm=_PERM)
    view = append_node(graph, "Reshape", [back, packed], f"{tag}/packed")
    old_out = node.outputs[0]
    graph.outputs[graph.outputs.index(old_out)] = out
    old_out.replace_all_uses_with(view)
    graph.remove(node, safe=True)
