"""GateVisionEncoderPass: a single-layout vision-language graph runs its vision encoder only when it merges images.

The single layout (contract section 6) computes the image rows from ``pixel_values`` inside the language graph, on
every call: a decode step would rerun the whole vision encoder to merge nothing. This pass moves the encoder
(every node computed from ``pixel_values`` and constants alone, except the retained ``pixel_values`` output's own
copy) into the ``then`` branch of an ``If`` on ``image_idx >= 0``; the ``else`` branch gives zeros of one row in
the rows' place. The merge reads image rows only where ``image_idx >= 0`` (a negative ``image_idx`` merges
nothing: :func:`qeff_kv.export.modeling.vlm.merge_image_rows`), so the zeros are never read.

Invariant: graph inputs and outputs (names, dtypes, shapes, order) are unchanged, and so is every output the
graph computes: exactly for ``image_idx >= 0`` (the ``then`` branch holds the original nodes), and for
``image_idx < 0`` every output (only the unread rows differ). The encoder must end in one value (the rows, in the
model's dtype) that is the merge's flattening ``Reshape(x, [-1, W])`` (possibly cast), or is read only through
it; the ``else`` branch gives one zero row ``[1, W]``, which the merge's ``Gather`` at index 0 reads and its
``Where`` drops. Any other graph is left unchanged (zeros could not stand in
for a value read otherwise), as is one whose encoder output is read inside another node's subgraph.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from qeff_kv.contract import naming
from qeff_kv.graph.passes._invariants import InvariantPass
from qeff_kv.graph.passes._patterns import const_array as _const


class GateVisionEncoderPass(InvariantPass):
    """See the module docstring. ``gated`` is the number of nodes moved into the ``If``. ``ensures``: the graph
    inputs and outputs are unchanged and, where it gated, one ``If`` on ``image_idx`` holds the ``gated`` nodes,
    its two branches give rows of one dtype, and the graph reads them."""

    def __init__(self):
        super().__init__()
        self.gated = 0

    def check(self, model: ir.Model) -> None:
        if not self.gated:
            return
        gates = [n for n in model.graph if n.op_type == "If" and n.name == "vision_encoder_gate"]
        if len(gates) != 1:
            self.violated(f"{len(gates)} vision_encoder_gate nodes, expected one")
        gate = gates[0]
        cond = gate.inputs[0].producer()
        then, other = gate.attributes["then_branch"].value, gate.attributes["else_branch"].value
        if cond is None or cond.inputs[0] is None or cond.inputs[0].name != naming.IMAGE_IDX:
            self.violated(f"the gate's condition does not read {naming.IMAGE_IDX}")
        rows, zeros, gated = then.outputs[0].dtype, other.outputs[0].dtype, gate.outputs[0].dtype
        if len(then) != self.gated or zeros != gated or rows not in (None, gated):
            self.violated(f"the then branch holds {len(then)} nodes (gated {self.gated}), its rows {rows}, the else "
                          f"branch's {zeros}, the gate's {gated}")
        if not gate.outputs[0].uses():
            self.violated("nothing reads the gated rows")

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        g = model.graph
        inputs = {v.name: v for v in g.inputs}
        pixels, image_idx = inputs.get(naming.PIXEL_VALUES), inputs.get(naming.IMAGE_IDX)
        if pixels is None or image_idx is None:
            return ir.passes.PassResult(model, modified=False)
        cone = _encoder_cone(g, pixels)
        plan = _gate_plan(g, cone, pixels) if cone else None
        if plan is None:
            return ir.passes.PassResult(model, modified=False)
        _insert_gate(g, cone, image_idx, *plan)
        self.gated = len(cone)
        return ir.passes.PassResult(model, modified=True)


def _encoder_cone(g: ir.Graph, pixels: ir.Value) -> list[ir.Node]:
    """The nodes computed from ``pixels`` and constants alone, in graph order, less what a graph output is computed
    from (the retained pixels' copies stay outside, ancestors included)."""
    # values that depend on no graph input: initializers and what constant nodes compute from them
    static = set(id(v) for v in g.initializers.values())
    cone_values = {id(pixels)}
    cone: list[ir.Node] = []
    for n in g:
        ins = [v for v in n.inputs if v is not None]
        if any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in n.attributes.values()):
            continue   # a node with subgraphs is neither constant nor moved
        if all(id(v) in static for v in ins):   # no inputs, or constant ones
            static.update(id(o) for o in n.outputs)
            continue
        if any(id(v) in cone_values for v in ins) and all(id(v) in cone_values or id(v) in static for v in ins):
            cone.append(n)
            cone_values.update(id(o) for o in n.outputs)
    in_cone = set(id(n) for n in cone)
    stack = [o.producer() for o in g.outputs if o.producer() is not None and id(o.producer()) in in_cone]
    in_cone.difference_update(id(n) for n in stack)
    while stack:
        n = stack.pop()
        for v in n.inputs:
            p = v.producer() if v is not None else None
            if p is not None and id(p) in in_cone:
                in_cone.discard(id(p))
                stack.append(p)
    return [n for n in cone if id(n) in in_cone]


def _gate_plan(g: ir.Graph, cone: list[ir.Node], pixels: ir.Value):
    """``(rows, first reader, W, dtype)`` when the encoder ends in one value of flattened width ``W`` read only
    after the encoder, else ``None`` (the graph is left unchanged)."""
    order = {id(n): i for i, n in enumerate(g)}
    outputs = set(id(v) for v in g.outputs)
    in_cone = set(id(n) for n in cone)
    boundary = [o for n in cone for o in n.outputs
                if any(id(u.node) not in in_cone for u in o.uses()) or id(o) in outputs]
    consumers = [u.node for b in boundary for u in b.uses() if id(u.node) not in in_cone]
    if not boundary or not consumers or any(id(n) not in order for n in consumers):
        return None   # (a reader inside another node's subgraph)
    first = min(consumers, key=lambda n: order[id(n)])
    if max(order[id(n)] for n in cone) > order[id(first)]:
        return None
    if len(boundary) != 1:
        return None
    [rows] = boundary
    shape = _flat_width(rows)
    dtype = _cast_to(rows) or pixels.dtype
    if shape is None:   # else every reader flattens them: Reshape(rows, [-1, W])
        widths = {_reshape_width(n) for n in consumers}
        shape = widths.pop() if len(widths) == 1 else None
        dtype = pixels.dtype
    if shape is None or dtype is None or not dtype.is_floating_point():
        return None
    return rows, first, shape, dtype


def _insert_gate(g: ir.Graph, cone: list[ir.Node], image_idx: ir.Value, rows: ir.Value, first: ir.Node,
                 shape: int, dtype) -> None:
    """Move ``cone`` into the ``then`` branch of an ``If`` on ``image_idx >= 0`` (``else``: one zero row), read in
    the rows' place, before ``first``."""
    in_cone = set(id(n) for n in cone)
    zeros = np.zeros((1, shape), dtype=dtype.numpy())
    g.remove(cone, safe=False)
    then_branch = ir.Graph((), [rows], nodes=cone, name="vision_encoder")
    fill = ir.node("Constant", [], attributes={"value": ir.tensor(zeros)}, name="no_image_rows")
    fill.outputs[0].name, fill.outputs[0].dtype = f"{rows.name}_none", dtype
    else_branch = ir.Graph((), [fill.outputs[0]], nodes=[fill], name="no_image")
    zero = ir.node("Constant", [], attributes={"value": ir.tensor(np.zeros((1, 1), np.int64))},
                   name="image_idx_zero")
    cond = ir.node("GreaterOrEqual", [image_idx, zero.outputs[0]], name="merges_images")
    gate = ir.node("If", [cond.outputs[0]], attributes={"then_branch": then_branch, "else_branch": else_branch},
                   num_outputs=1, name="vision_encoder_gate")
    gated = gate.outputs[0]
    gated.name, gated.dtype = f"{rows.name}_gated", dtype
    for u in list(rows.uses()):
        if id(u.node) not in in_cone and u.node is not gate:
            u.node.replace_input_with(u.idx, gated)
    g.insert_before(first, [zero, cond, gate])


def _reshape_width(node: ir.Node) -> int | None:
    """``W`` of ``Reshape(x, [-1, W])`` (a constant shape), else ``None``."""
    if node.op_type != "Reshape" or len(node.inputs) < 2:
        return None
    shape = _const(node.inputs[1])
    if shape is None or shape.ndim != 1 or len(shape) != 2 or shape[0] != -1 or shape[1] <= 0:
        return None
    return int(shape[1])


def _flat_width(v: ir.Value) -> int | None:
    """``W`` when ``v`` is ``Reshape(x, [-1, W])``, possibly behind a ``Cast`` or ``Identity``."""
    p = v.producer()
    if p is not None and p.op_type in ("Cast", "Identity") and p.inputs:
        p = p.inputs[0].producer() if p.inputs[0] is not None else None
    return _reshape_width(p) if p is not None else None


def _cast_to(v: ir.Value) -> ir.DataType | None:
    p = v.producer()
    if p is not None and p.op_type == "Cast" and "to" in p.attributes:
        return ir.DataType(p.attributes["to"].value)
    return None
