"""RetainedToStaticPass: turn a qeff-kv retained-state export (``portable`` or ``onnxruntime`` target; or the same
graph spelled as shared-buffer past/present) into the static-cache dialect (mobius-onnx ``--static-cache``).

Invariant: afterwards every KV pair ``past_key.<i>[_P]`` -> ``past_key.<i>[_P]_RetainedState`` of shape
``[batch, kv_heads, capacity, head_dim]`` is ``key_cache.<i>[_P]`` -> ``updated_key_cache.<i>[_P]`` (packed
``[batch, capacity, kv_heads*head_dim]``, same dtype, batch and capacity dims, prefix kept), written in place by one
``TensorScatter(key_cache, packed updates, write_indices, axis=1)`` straight into the graph output (the in-place
rule holds); what read the retained output (the attention) reads ``Transpose(Reshape(updated cache))``, the same
``[batch, kv_heads, capacity, head_dim]`` values; shape-only readers of the old input read a view of the packed
input of the old input's shape; the inputs ``write_indices`` and ``nonpad_kv_seqlen`` (``[batch]`` int64) are
appended, and every node that read ``position_ids`` reads ``where(write_indices[b] + j < nonpad_kv_seqlen[b],
position_ids[b, j], -1)`` (a token at or beyond ``nonpad_kv_seqlen`` is padding, position ``-1``); every other input
and output (name, dtype, shape, order) is as it was; the default opset becomes 24 (TensorScatter's), the ops whose
schema changed since the graph's opset carried over exactly (``Reduce*``: ``axes`` attribute -> input).

Exact under the static contract as mobius-onnx and onnxruntime-genai feed it: ``position_ids[b, j] =
write_indices[b] + j`` for every token before ``nonpad_kv_seqlen[b]`` (a retained-state graph's RoPE position is its
cache slot, so a feed that decouples them has no retained-state counterpart). Slots at or beyond
``nonpad_kv_seqlen`` may hold a padding token's key (the static dialect's own behaviour); the attention never reads
them (it masks every slot after the query's position).

Anything else is refused in one line (:class:`~qeff_kv.errors.DialectError`) before anything changes: another
exporter's graph or the ``onnxruntime-fused`` target (GroupQueryAttention updates the cache itself),
sliding-window rings, MLA latent caches, recurrent states, vision-language graphs, continuous batching
(``batch_index``) or any input with no static-cache counterpart, local functions, a cache not updated by exactly one
ScatterND (or TensorScatter at axis 2) at ``position_ids``. Values are renamed and rewired as ``ir.Value`` objects,
never strings.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir

from qeff_kv.contract import naming
from qeff_kv.contract.layout import KVLayout
from qeff_kv.errors import DialectError
from qeff_kv.graph.graphio import layout_of
from qeff_kv.graph.inplace import inplace_issues
from qeff_kv.graph.passes.dialects.base import ConversionPass
from qeff_kv.graph.passes._patterns import append_node, named_const

OPSET = 24   # TensorScatter's
_TARGETS = ("portable", "onnxruntime")
_PERM = [0, 2, 1, 3]   # [batch, heads, capacity, head_dim] <-> [batch, capacity, heads, head_dim]
_TAG = "qeff_kv.to_static"
#: ops whose ai.onnx schema changed between opset 17 and 24 only by new types or new optional inputs/attributes
#: whose defaults keep the old meaning: carried over as they are
_SAME_MEANING = frozenset({
    "Cast", "CastLike", "Constant", "ConstantOfShape", "Cos", "Sin", "Equal", "Identity", "Reshape", "ScatterND",
    "ScatterElements", "Shape", "Size", "Split", "Squeeze", "Unsqueeze", "Transpose", "Flatten", "Pad", "Dropout",
    "IsInf", "IsNaN"})
#: ops whose ``axes`` attribute became input 1 (opset 18): carried over by moving it
_AXES_TO_INPUT = frozenset({"ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceMax", "ReduceMean",
                            "ReduceMin", "ReduceProd", "ReduceSumSquare"})


def _refuse(why: str):
    raise DialectError(f"cannot convert to {naming.STATIC_CACHE}: {why}")


# ------------------------------------------------------------------ planning (reads only)
def _graph_refusal(model: ir.Model) -> str | None:
    """Why ``model`` as a whole cannot be converted (one line), or ``None``."""
    meta, layout = model.metadata_props, layout_of(model)
    target = meta.get(naming.TARGET_META)
    if any(n.op_type == "GroupQueryAttention" for n in ir.traversal.RecursiveGraphIterator(model.graph)):
        return "GroupQueryAttention updates the cache itself (target onnxruntime-fused); export --target onnxruntime"
    if target not in _TARGETS:
        return (f"not a qeff-kv export of target {' or '.join(_TARGETS)} (target {target!r}): how its attention "
                "reads the cache is not known")
    if layout.has_sliding or meta.get(naming.SLIDING_WINDOW_META):
        return "sliding-window layers (ring buffers written at position % window) have no static-cache form"
    if meta.get(naming.MLA_META) or any(p.stem in naming.LATENT_STEMS for p in layout.pairs):
        return "an MLA latent cache (compressed_kv, k_pe) has no static-cache form"
    if layout.recurrent_pairs or any(p.stem not in naming.EXPORT_STEMS for p in layout.pairs):
        return "recurrent states (conv_state, recurrent_state) have no static-cache form"
    if meta.get(naming.VISION_META):
        return "a vision-language graph (image rows) has no static-cache form"
    if meta.get(naming.CONTINUOUS_BATCHING_META) == "true":
        return "continuous batching (batch_index picks the cache row) has no static-cache form"
    lora = [v.name for v in model.graph.inputs if naming.is_lora_input(v.name)]
    if lora:
        return (f"the LoRA adapter inputs ({', '.join(lora[:3])}{', ...' if len(lora) > 3 else ''}: {len(lora)}) have "
                f"no static-cache form and would be dropped; {naming.RETAINED_STATE} and shared-past-present keep them")
    known = {naming.INPUT_IDS_INPUT, naming.POSITION_IDS_INPUT}
    extra = [v.name for v in model.graph.inputs if v.name not in known and naming.parse_any_kv_name(v.name) is None]
    if extra:
        return f"input {extra[0]!r} has no static-cache counterpart"
    if naming.POSITION_IDS_INPUT not in {v.name for v in model.graph.inputs}:
        return f"the graph takes no {naming.POSITION_IDS_INPUT}"
    if model.functions:
        return "local functions (their opset would have to be converted too)"
    return _opset_refusal(model)


def _opset_refusal(model: ir.Model) -> str | None:
    old = model.opset_imports.get("", None)
    if old is None or not 17 <= old <= OPSET:
        return f"ai.onnx opset {old} (converted from 17 to {OPSET} only)"
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.domain not in ("", "ai.onnx") or node.op_type in _SAME_MEANING:
            continue
        try:
            changed = (onnx.defs.get_schema(node.op_type, old).since_version
                       != onnx.defs.get_schema(node.op_type, OPSET).since_version)
        except onnx.defs.SchemaError:
            return f"unknown ai.onnx op {node.op_type}"
        if changed and node.op_type not in _AXES_TO_INPUT:
            return f"{node.op_type} changed between opset {old} and {OPSET}; not carried over"
    return None


def _depends_on(value: ir.Value, target: ir.Value) -> bool:
    seen, todo = set(), [value]
    while todo:
        v = todo.pop()
        if v is target:
            return True
        node = v.producer()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        todo.extend(i for i in node.inputs if i is not None)
    return False


def _updater(x: ir.Value, out: ir.Value, pos: ir.Value) -> ir.Node:
    """The one node that writes ``out`` in place from ``x``: ScatterND at positions derived from ``pos``, or
    TensorScatter at axis 2 (a graph converted from a static cache)."""
    node = out.producer()
    ok = node is not None and node.domain in ("", "ai.onnx") and len(node.inputs) >= 3 and node.inputs[0] is x
    if ok and node.op_type == "ScatterND":
        ok = node.attributes.get("reduction") is None and _depends_on(node.inputs[1], pos)
    elif ok and node.op_type == "TensorScatter":
        axis = node.attributes.get("axis")
        mode = node.attributes.get("mode")
        ok = axis is not None and axis.value in (2, -2) and (mode is None or mode.value == "linear")
    else:
        ok = False
    if not ok:
        _refuse(f"{out.name} is not written by one ScatterND at {naming.POSITION_IDS_INPUT} (or TensorScatter at "
                f"axis 2) that reads {x.name} itself")
    others = [n for n, _ in x.uses() if n is not node]
    if any(n.op_type not in ("Shape", "Size") for n in others):
        _refuse(f"{x.name} is read other than by its shape and its update")
    return node


def plan(model: ir.Model) -> list[tuple]:
    """(KVName, input, output, updater, heads, head_dim) per KV pair, or a one-line :class:`DialectError` (reads
    only: what :class:`RetainedToStaticPass` would refuse, before anything changes)."""
    why = _graph_refusal(model)
    if why is not None:
        _refuse(why)
    graph = model.graph
    outputs = {v.name: v for v in graph.outputs}
    pos = next(v for v in graph.inputs if v.name == naming.POSITION_IDS_INPUT)
    plan = []
    for x in graph.inputs:
        parsed = naming.parse_any_kv_name(x.name or "")
        if parsed is None:
            continue
        out = outputs.get(parsed.output)
        dims = () if x.shape is None else tuple(x.shape.dims)
        if out is None or len(dims) != 4 or not all(isinstance(d, int) for d in (dims[1], dims[3])):
            _refuse(f"{x.name} is not a [batch, heads, capacity, head_dim] buffer with known heads and head_dim")
        if out.shape is None or tuple(out.shape.dims) != dims or x.type != out.type:
            _refuse(f"{out.name} is not of {x.name}'s type and shape")
        plan.append((parsed, x, out, _updater(x, out, pos), dims[1], dims[3]))
    return plan


# ------------------------------------------------------------------ rewriting
def _static_inputs(graph: ir.Graph, pos: ir.Value) -> tuple[ir.Value, ir.Value]:
    """Append ``write_indices`` and ``nonpad_kv_seqlen`` and make every reader of ``pos`` read
    ``where(write_indices[b] + j < nonpad_kv_seqlen[b], pos[b, j], -1)``."""
    readers = list(pos.uses())
    batch = pos.shape.dims[0] if pos.shape is not None and len(pos.shape) == 2 else "batch"
    write_idx, nonpad = (ir.Value(name=n, shape=ir.Shape([batch]), type=ir.TensorType(ir.DataType.INT64))
                         for n in (naming.WRITE_INDICES_INPUT, naming.NONPAD_KV_SEQLEN_INPUT))
    graph.inputs.extend([write_idx, nonpad])
    zero = named_const(graph, f"{_TAG}.zero", np.array(0, np.int64))
    one = named_const(graph, f"{_TAG}.one", np.array(1, np.int64))
    axis1 = named_const(graph, f"{_TAG}.axis1", np.array([1], np.int64))
    pad = named_const(graph, f"{_TAG}.padding_position", np.array(-1, np.int64))
    shape = append_node(graph, "Shape", [pos], f"{_TAG}/positions_shape")
    seq = append_node(graph, "Gather", [shape, one], f"{_TAG}/seq_len", axis=0)
    steps = append_node(graph, "Range", [zero, seq, one], f"{_TAG}/steps")
    first = append_node(graph, "Unsqueeze", [write_idx, axis1], f"{_TAG}/first_slot")
    slots = append_node(graph, "Add", [first, steps], f"{_TAG}/slots")
    held = append_node(graph, "Unsqueeze", [nonpad, axis1], f"{_TAG}/held")
    valid = append_node(graph, "Less", [slots, held], f"{_TAG}/valid")
    masked = append_node(graph, "Where", [valid, pos, pad], f"{_TAG}/positions")
    for node, idx in readers:
        node.replace_input_with(idx, masked)
    return write_idx, nonpad


def _convert_pair(graph: ir.Graph, item: tuple, write_idx: ir.Value, fixed: int | None) -> None:
    """Replace ``x`` by its packed static buffer (``fixed`` positions, when given, for a symbolic positions axis)
    and its updater by a TensorScatter at axis 1 into the static output; readers of the old output read a 4-D view
    of the new one."""
    parsed, x, out, node, heads, head_dim = item
    batch, _, capacity, _ = x.shape.dims
    capacity = capacity if fixed is None or isinstance(capacity, int) else fixed
    new = parsed.in_dialect(naming.STATIC_CACHE)
    tag, width = f"{_TAG}/{new.name}", heads * head_dim
    packed_shape = ir.Shape([batch, capacity, width])
    buf = ir.Value(name=new.name, shape=packed_shape, type=x.type)
    graph.inputs[graph.inputs.index(x)] = buf
    packed = named_const(graph, f"{_TAG}.packed.{width}", np.array([0, 0, width], np.int64))
    split = named_const(graph, f"{_TAG}.split.{heads}x{head_dim}", np.array([0, 0, heads, head_dim], np.int64))
    # shape-only readers: a view of the packed buffer with the old [batch, heads, capacity, head_dim] shape
    shaped = named_const(graph, f"{_TAG}.heads_first.{heads}x{head_dim}", np.array([0, heads, -1, head_dim], np.int64))
    if x.uses():
        x.replace_all_uses_with(append_node(graph, "Reshape", [buf, shaped], f"{tag}/shape_view"))
    updates = node.inputs[2 if node.op_type == "ScatterND" else 1]   # ScatterND(data, indices, updates)
    update = append_node(graph, "Reshape", [append_node(graph, "Transpose", [updates], f"{tag}/update_positions_first",
                                          perm=_PERM), packed], f"{tag}/update")
    scatter = ir.node("TensorScatter", [buf, update, write_idx], attributes={"axis": 1}, num_outputs=1,
                      name=f"{tag}/TensorScatter")
    y = scatter.outputs[0]
    y.name, y.shape, y.type = new.output, packed_shape, x.type
    graph.append(scatter)
    heads = append_node(graph, "Reshape", [y, split], f"{tag}/heads")
    view = append_node(graph, "Transpose", [heads], f"{tag}/view", perm=_PERM)
    graph.outputs[graph.outputs.index(out)] = y
    out.replace_all_uses_with(view)
    graph.remove(node, safe=True)


def _to_opset(model: ir.Model) -> None:
    """Default opset -> :data:`OPSET`; ``Reduce*`` nodes' ``axes`` attribute becomes their input 1."""
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.domain in ("", "ai.onnx") and node.op_type in _AXES_TO_INPUT and "axes" in node.attributes:
            axes = np.array(node.attributes.pop("axes").value, np.int64)
            name = f"{_TAG}.axes.{'_'.join(map(str, axes.tolist()))}"
            node.resize_inputs(2)
            node.replace_input_with(1, named_const(model.graph, name, axes))
    model.opset_imports[""] = OPSET


class RetainedToStaticPass(ConversionPass):
    """Convert every retained-state (or shared past/present) KV pair of a portable/onnxruntime export to a
    static-cache pair (see the module docstring)."""

    target = naming.STATIC_CACHE

    def __init__(self, capacity: int | None = None):
        super().__init__()
        if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1):
            raise DialectError(f"RetainedToStaticPass needs a positive int capacity, got {capacity!r}")
        #: positions of the static buffers when the graph's axis is symbolic (``None``: kept symbolic)
        self.capacity = capacity

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        layout = layout_of(model)
        if layout.dialect not in (naming.RETAINED_STATE, naming.PAST_PRESENT) or layout.grows:
            _refuse(f"the KV cache is spelled {layout.dialect}{' and grows' if layout.grows else ''}")
        layout.require_valid()
        plan_ = plan(model)
        graph = model.graph
        pos = next(v for v in graph.inputs if v.name == naming.POSITION_IDS_INPUT)
        taken = {v.name for v in ir.convenience.create_value_mapping(graph).values()}
        clash = next((n for p in plan_ for n in (p[0].in_dialect(naming.STATIC_CACHE).name,
                                                p[0].in_dialect(naming.STATIC_CACHE).output) if n in taken), None)
        clash = clash or next((n for n in (naming.WRITE_INDICES_INPUT, naming.NONPAD_KV_SEQLEN_INPUT) if n in taken),
                              None)
        if clash is not None:
            _refuse(f"converting would produce {clash!r}, a name that already exists in the graph")
        _to_opset(model)
        write_idx, _ = _static_inputs(graph, pos)
        for item in plan_:
            _convert_pair(graph, item, write_idx, self.capacity)
        graph.sort()
        return ir.passes.PassResult(model, modified=True)

    def check_more(self, model: ir.Model, layout: KVLayout) -> None:
        issues = inplace_issues(model, layout)
        if issues:
            self.violated(f"{issues[0].buffer}: {issues[0].message}")


