"""GrowingToStaticPass: rebuild a growing past/present graph (mobius-onnx's default build) as a static cache.

Invariant: afterwards every KV pair ``past_key_values.<i>.<role>[_P]`` -> ``present.<i>.<role>[_P]`` (``[batch,
kv_heads, past, head_dim]`` growing to ``past + seq``) is ``<role>_cache.<i>[_P]`` -> ``updated_<role>_cache.<i>[_P]``
of shape ``[batch, capacity, kv_heads*head_dim]`` (same dtype, same batch dim, prefix kept, same place among the
inputs and outputs), written by one ``TensorScatter(cache, new, write_indices, axis=1)`` of the step's new keys or
values (packed ``[batch, seq, kv_heads*head_dim]``), and the layer's ai.onnx ``Attention`` reads the updated caches
with ``nonpad_kv_seqlen`` (input 6) instead of its past inputs, with its attributes as they were and no present
outputs: exactly how mobius-onnx ``--static-cache`` writes the same model. The inputs ``write_indices`` and
``nonpad_kv_seqlen`` (int64 ``[batch]``) are appended; ``attention_mask`` is gone with the nodes that turned it into
the attention's boolean mask (and what only they used); every other input and output (name, dtype, shape, order) and
every other node is as it was.

Exact for a sequence whose ``attention_mask`` is all ones (no padding), fed ``write_indices = past length`` and
``nonpad_kv_seqlen = past length + seq``: the growing graph attends (causally) over its ``past + seq`` positions, the
static one over the first ``nonpad_kv_seqlen`` slots of its cache, which hold the same keys and values; the static
form has no mask input, so padding rows are not expressible in it.

Recognised, or refused in one line (:class:`~qeff_kv.errors.DialectError`) before anything changes: each past input
is read only by one ai.onnx ``Attention`` (opset >= 24, the one that has ``TensorScatter`` and ``nonpad_kv_seqlen``)
as its ``past_key``/``past_value`` whose ``present`` outputs are the paired graph outputs and nothing else, with new
keys and values of known rank (3: packed; 4: ``[batch, heads, seq, head_dim]``, packed here by Transpose/Reshape and
read back unpacked); its ``attn_mask``, if any, is ``attention_mask`` cast to bool and only broadcast (Unsqueeze,
Expand, Reshape; shapes from Shape/Concat...), and ``attention_mask`` feeds nothing else. A plain ``Concat`` cache,
GroupQueryAttention, or a mask used for anything else (positions from padding rows, sliding windows) is refused.
Values are created, rewired and renamed as ``ir.Value`` objects, never strings.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from qeff_kv.contract import naming
from qeff_kv.contract.layout import KVLayout
from qeff_kv.errors import DialectError
from qeff_kv.graph.graphio import layout_of
from qeff_kv.graph.passes._patterns import named_const
from qeff_kv.graph.passes.dialects.base import ConversionPass

#: TensorScatter and Attention's ``nonpad_kv_seqlen`` input are ai.onnx 24
MIN_OPSET = 24
_PERM = [0, 2, 1, 3]   # [batch, heads, seq, head_dim] <-> [batch, seq, heads, head_dim]
_ROLE_SLOT = {"past_key": 4, "past_value": 5}   # the Attention input of each past; its present is output slot - 3
#: ops that only move or broadcast the mask's values, and those that only compute shapes from its length
_BROADCAST = frozenset({"Unsqueeze", "Squeeze", "Identity", "Expand", "Reshape"})
_SHAPE_MATH = frozenset({"Shape", "Concat", "Gather", "Slice", "Unsqueeze", "Squeeze", "Cast", "Identity", "Add",
                         "Sub", "Mul", "Max", "Min"})
_TAG = "qeff_kv.to_static"


def _refuse(what: str) -> DialectError:
    """A refusal's reason (the caller says into what: :func:`refusal`, :meth:`GrowingToStaticPass.call`)."""
    return DialectError(what)


def _attr(node: ir.Node, name: str, default=None):
    a = node.attributes.get(name)
    return default if a is None else a.value


@dataclass
class _Buffer:
    """One growing buffer: its past input, the Attention node and slot that read it, and its static geometry."""

    past: ir.Value
    parsed: naming.KVName
    node: ir.Node
    slot: int
    heads: int
    head_dim: int
    rank: int


def _is_attention(node: ir.Node) -> bool:
    return node.op_type == "Attention" and node.domain in ("", "ai.onnx")


def _plan_buffer(graph: ir.Graph, x: ir.Value, parsed: naming.KVName) -> _Buffer:
    """The buffer of past input ``x``, or a one-line :class:`DialectError`."""
    uses = list(x.uses())
    slot = _ROLE_SLOT[parsed.stem]
    if len(uses) != 1 or not _is_attention(uses[0][0]) or uses[0][1] != slot:
        ops = ", ".join(sorted({n.op_type for n, _ in uses})) or "nothing"
        raise _refuse(f"grows by concatenation: {x.name} feeds {ops}, not only the {parsed.stem} input of an ai.onnx "
                      "Attention; only that attention can be rebuilt over a fixed-capacity cache")
    node = uses[0][0]
    present = node.outputs[slot - 3] if len(node.outputs) > slot - 3 else None
    if present is None or present.name != parsed.output or present.uses() or not present.is_graph_output():
        raise _refuse(f"the Attention that reads {x.name} does not write {parsed.output} as a graph output alone")
    if len(node.inputs) > 6 and node.inputs[6] is not None:
        raise _refuse(f"the Attention that reads {x.name} already takes {naming.NONPAD_KV_SEQLEN_INPUT}")
    if len(node.outputs) > 3 and node.outputs[3].uses():
        raise _refuse(f"the Attention that reads {x.name} has its qk_matmul_output read")
    shape, new = x.shape, node.inputs[slot - 3]
    if shape is None or len(shape) != 4 or not all(isinstance(d, int) for d in (shape[1], shape[3])):
        raise _refuse(f"{x.name} is not [batch, heads, positions, head_dim] with known heads and head_dim")
    heads, head_dim = int(shape[1]), int(shape[3])
    if new is None or new.shape is None or len(new.shape) not in (3, 4) or new.dtype not in (None, x.dtype):
        raise _refuse(f"the new {parsed.stem} of {x.name}'s Attention has no known rank (3 or 4) or another dtype")
    want = (heads * head_dim,) if len(new.shape) == 3 else (heads, None, head_dim)
    got = tuple(new.shape)[2:] if len(new.shape) == 3 else tuple(new.shape)[1:]
    if any(isinstance(g, int) and w is not None and g != w for g, w in zip(got, want)) or \
            _attr(node, "kv_num_heads", heads) != heads:
        raise _refuse(f"the new {parsed.stem} of {x.name}'s Attention does not have its {heads} heads of {head_dim}")
    return _Buffer(x, parsed, node, slot, heads, head_dim, len(new.shape))


def _mask_step(node: ir.Node, idx: int, data: bool) -> bool:
    """Whether ``node``'s outputs carry the mask's values (``True``) or only shapes (``False``), reached at input
    ``idx`` by a value that carries values (``data``) or a shape; a one-line refusal for any other use."""
    op = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}"
    if data and op == "Cast" and idx == 0 and _attr(node, "to") == ir.DataType.BOOL.value:
        return True
    if data and op in _BROADCAST and idx == 0:
        return True
    if op == "Shape" or (not data and op in _SHAPE_MATH):
        return False
    if not data and op in ("Expand", "Reshape") and idx == 1:
        return True
    raise _refuse(f"{naming.ATTENTION_MASK_INPUT} feeds {op} ({node.name or op}), not only the attention's mask")


def _mask_nodes(mask: ir.Value | None, attentions: dict[int, ir.Node]) -> list[ir.Node]:
    """The nodes that turn ``attention_mask`` into the converted attentions' boolean masks (nothing else uses
    them), or a one-line refusal; each attention's ``attn_mask`` must be one of their results (or absent)."""
    carries: dict[int, bool] = {} if mask is None else {id(mask): True}
    nodes: dict[int, ir.Node] = {}
    stack = [] if mask is None else [mask]
    while stack:
        v = stack.pop()
        if v.is_graph_output():
            raise _refuse(f"{v.name}, computed from {naming.ATTENTION_MASK_INPUT}, is a graph output")
        for node, idx in v.uses():
            if carries[id(v)] and id(node) in attentions and idx == 3:
                continue
            data = _mask_step(node, idx, carries[id(v)])
            nodes[id(node)] = node
            for out in node.outputs:
                if carries.get(id(out)) is None or (data and not carries[id(out)]):
                    carries[id(out)] = data
                    stack.append(out)
    for node in nodes.values():
        if node.op_type in ("Expand", "Reshape") and not carries.get(id(node.inputs[0]), False):
            raise _refuse(f"{node.name or node.op_type} shapes a tensor by {naming.ATTENTION_MASK_INPUT}'s length")
    for node in attentions.values():
        m = node.inputs[3] if len(node.inputs) > 3 else None
        if m is not None and (not carries.get(id(m), False) or m.dtype != ir.DataType.BOOL):
            raise _refuse(f"the attn_mask of {node.name or 'an Attention'} is not {naming.ATTENTION_MASK_INPUT} "
                          "cast to bool and broadcast")
    return list(nodes.values())


@dataclass
class _Plan:
    buffers: list[_Buffer]
    mask: ir.Value | None
    mask_nodes: list[ir.Node]


def plan(model: ir.Model) -> _Plan:
    """What the pass will change, or a one-line :class:`DialectError` (nothing changed)."""
    graph = model.graph
    layout = layout_of(model)
    layout.require_valid()
    if not layout.grows or layout.dialect != naming.PAST_PRESENT:
        raise _refuse("not a growing past/present graph")
    buffers = [_plan_buffer(graph, x, parsed) for x in graph.inputs
               for parsed in [naming.parse_any_kv_name(x.name or "")] if parsed is not None]
    opset = model.opset_imports.get("", model.opset_imports.get("ai.onnx", 0))
    if opset < MIN_OPSET:
        raise _refuse(f"the graph imports ai.onnx {opset}; TensorScatter and nonpad_kv_seqlen need {MIN_OPSET}")
    by_node: dict[int, list[_Buffer]] = {}
    for b in buffers:
        by_node.setdefault(id(b.node), []).append(b)
    for group in by_node.values():
        if len({(b.parsed.layer, b.parsed.prefix) for b in group}) != 1 or len(group) != 2:
            raise _refuse(f"{group[0].past.name}'s Attention does not read one layer's key and value pasts")
    inputs = {v.name: v for v in graph.inputs}
    taken = {v.name for v in ir.convenience.create_value_mapping(graph).values()}
    for name in _new_names(buffers):
        if name in taken:
            raise _refuse(f"converting would produce {name!r}, a name that already exists in the graph")
    mask = inputs.get(naming.ATTENTION_MASK_INPUT)
    attentions = {id(b.node): b.node for b in buffers}
    return _Plan(buffers, mask, _mask_nodes(mask, attentions))


def refusal(model: ir.Model) -> str | None:
    """Why :class:`GrowingToStaticPass` cannot convert ``model`` (one line), or ``None`` if it can."""
    try:
        plan(model)
    except DialectError as exc:
        return str(exc)
    return None


def packs_heads(model: ir.Model) -> bool:
    """Whether some converted attention takes 4-D keys or values: its static form reads the cache through
    Reshape/Transpose, not straight from the ``Attention`` (call after :func:`refusal` said ``None``)."""
    return any(b.rank == 4 for b in plan(model).buffers)


def _new_names(buffers: list[_Buffer]) -> list[str]:
    out = [naming.WRITE_INDICES_INPUT, naming.NONPAD_KV_SEQLEN_INPUT]
    for b in buffers:
        static = b.parsed.in_dialect(naming.STATIC_CACHE)
        out += [static.name, static.output]
    return out


class GrowingToStaticPass(ConversionPass):
    """Rebuild every growing ``Attention`` with past inputs over a static cache of ``capacity`` positions (see the
    module docstring)."""

    target = naming.STATIC_CACHE

    def __init__(self, capacity: int):
        super().__init__()
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise DialectError(f"GrowingToStaticPass needs a positive int capacity, got {capacity!r}")
        self.capacity = capacity

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        try:
            todo = plan(model)
        except DialectError as exc:
            raise DialectError(f"cannot convert to {naming.STATIC_CACHE}: {exc}") from None
        batch = todo.buffers[0].past.shape[0]
        write_idx = ir.Value(name=naming.WRITE_INDICES_INPUT, shape=ir.Shape([batch]), type=ir.TensorType(
            ir.DataType.INT64))
        nonpad = ir.Value(name=naming.NONPAD_KV_SEQLEN_INPUT, shape=ir.Shape([batch]),
                          type=ir.TensorType(ir.DataType.INT64))
        reads = {}
        for b in todo.buffers:
            reads[(id(b.node), b.slot)] = _convert_buffer(graph, b, self.capacity, write_idx)
        for node in {id(b.node): b.node for b in todo.buffers}.values():
            _rewire_attention(node, reads[(id(node), 4)], reads[(id(node), 5)], nonpad)
        _remove_mask(graph, todo)
        graph.inputs.extend([write_idx, nonpad])
        return ir.passes.PassResult(model, modified=True)

    def check_more(self, model: ir.Model, layout: KVLayout) -> None:
        outputs = {v.name: v for v in model.graph.outputs}
        for x in model.graph.inputs:
            parsed = naming.parse_any_kv_name(x.name or "")
            out = None if parsed is None else outputs.get(parsed.output)
            if parsed is None or out is None:
                continue
            scatter = out.producer()
            if x.shape is None or x.shape[1] != self.capacity or scatter is None or \
                    scatter.op_type != "TensorScatter" or scatter.inputs[0] is not x:
                self.violated(f"{x.name} is not a [batch, {self.capacity}, width] cache scattered into {out.name}")


def _op(op: str, inputs, name: str, **attrs) -> ir.Node:
    node = ir.node(op, inputs, attributes=attrs, name=name, num_outputs=1)
    node.outputs[0].name = name
    return node


def _convert_buffer(graph: ir.Graph, b: _Buffer, capacity: int, write_idx: ir.Value) -> ir.Value:
    """Replace ``b``'s past input by its static cache and its present output by the scatter of the new keys or values
    into it (nodes inserted before the attention); returns what the attention reads in place of the grown buffer."""
    static = b.parsed.in_dialect(naming.STATIC_CACHE)
    tag, width = f"{_TAG}/{static.name}", b.heads * b.head_dim
    batch = b.past.shape[0]
    cache = ir.Value(name=static.name, shape=ir.Shape([batch, capacity, width]), type=b.past.type)
    graph.inputs[graph.inputs.index(b.past)] = cache
    new, nodes = b.node.inputs[b.slot - 3], []
    if b.rank == 4:
        packed_shape = named_const(graph, f"{_TAG}.packed.{width}", np.array([0, 0, width], np.int64))
        nodes.append(_op("Transpose", [new], f"{tag}/positions_first", perm=_PERM))
        nodes.append(_op("Reshape", [nodes[-1].outputs[0], packed_shape], f"{tag}/packed_new"))
        new = nodes[-1].outputs[0]
    scatter = ir.node("TensorScatter", [cache, new, write_idx], attributes={"axis": 1}, num_outputs=1,
                      name=f"{tag}/TensorScatter")
    out = scatter.outputs[0]
    out.name, out.shape, out.type = static.output, ir.Shape([batch, capacity, width]), b.past.type
    nodes.append(scatter)
    read = out
    if b.rank == 4:
        split = named_const(graph, f"{_TAG}.split.{b.heads}x{b.head_dim}",
                            np.array([0, 0, b.heads, b.head_dim], np.int64))
        nodes.append(_op("Reshape", [out, split], f"{tag}/heads"))
        nodes.append(_op("Transpose", [nodes[-1].outputs[0]], f"{tag}/heads_first", perm=_PERM))
        read = nodes[-1].outputs[0]
    graph.insert_before(b.node, nodes)
    present = b.node.outputs[b.slot - 3]
    graph.outputs[graph.outputs.index(present)] = out
    return read


def _rewire_attention(node: ir.Node, key: ir.Value, value: ir.Value, nonpad: ir.Value) -> None:
    """``Attention(Q, key, value, '', '', '', nonpad_kv_seqlen) -> Y``: attributes kept, present outputs dropped."""
    node.replace_input_with(1, key)
    node.replace_input_with(2, value)
    for i in (3, 4, 5):
        node.replace_input_with(i, None)
    node.resize_inputs(7)
    node.replace_input_with(6, nonpad)
    node.resize_outputs(1)


def _remove_mask(graph: ir.Graph, todo: _Plan) -> None:
    """Remove the mask's nodes, then what only they used, then ``attention_mask`` itself."""
    doomed = {id(n) for n in todo.mask_nodes}
    order = [n for n in graph if id(n) in doomed]
    feeders = [v.producer() for n in order for v in n.inputs if v is not None and v.producer() is not None]
    graph.remove(list(reversed(order)), safe=True)
    while feeders:
        node = feeders.pop()
        if node.graph is graph and not any(o.uses() or o.is_graph_output() for o in node.outputs):
            feeders += [v.producer() for v in node.inputs if v is not None and v.producer() is not None]
            graph.remove(node, safe=True)
    if todo.mask is not None and not todo.mask.uses():
        graph.inputs.remove(todo.mask)
