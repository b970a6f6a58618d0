"""RemovePassThroughPass: no-op nodes between a KV update and its retained graph output are removed, so the
update (``ScatterND``) writes the graph output ``X_RetainedState`` directly and the pair is in-place safe.

The TorchScript tracer records an aliasing no-op such as ``key.to(torch.float32)`` on a float32 tensor (GPT-J
casts its keys to float32 for attention) and maps the retained tensor to the no-op's output, so the graph
output is ``Cast(ScatterND(past, ...))``. A runtime that binds one buffer as ``X`` and ``X_RetainedState``
then loses the in-place update (and ``qeff-kv check`` fails the ``inplace`` rule).

Invariant: graph inputs and outputs (names, dtypes, shapes, order) and every value the graph computes are
unchanged; only nodes that provably return their input are removed, and only on the producer chain of a
retained KV output (``X_RetainedState`` paired with a KV input ``X``). A node provably returns its input when
it is one of:

* ``Identity``;
* ``Cast`` to the dtype its input is known to have;
* ``Reshape`` (``allowzero`` 0) by a constant shape of the input's rank whose every entry is ``0``, the
  input's own static size there, or a single ``-1`` (which then must equal the remaining dim);
* ``Transpose`` by the identity permutation;
* ``Expand`` by a constant shape of ones no longer than the input's rank;
* ``Dropout`` without a training-mode input (or a constant false one) and without a used mask output.

An input's dtype and shape are its annotations, else those of the buffer a ``ScatterND`` updates, followed
through nodes already known to return their input. Every other reader of a removed node's output reads its
input instead. A node is kept when its input cannot take the graph output's place (it is a graph input, an
initializer or already another graph output).
"""

from __future__ import annotations

import onnx_ir as ir

from qeff_kv.graph.graphio import layout_of
from qeff_kv.graph.passes._invariants import InvariantPass
from qeff_kv.graph.passes._patterns import const_array as _const

_STANDARD = ("", "ai.onnx")


def _dtype_of(v: ir.Value | None, depth: int = 0) -> ir.DataType | None:
    """The element type of ``v``: annotated, or followed through ops whose output type is their input's."""
    if v is None or depth > 16:
        return None
    if v.dtype is not None:
        return v.dtype
    p = v.producer()
    if p is None or p.domain not in _STANDARD:
        return None
    if p.op_type == "Cast" and "to" in p.attributes:
        return ir.DataType(p.attributes["to"].value)
    if p.op_type in ("ScatterND", "ScatterElements", "Identity", "Reshape", "Transpose", "Expand", "Squeeze",
                     "Unsqueeze", "Dropout") and p.inputs and p.outputs[0] is v:
        return _dtype_of(p.inputs[0], depth + 1)
    return None


def _shape_of(v: ir.Value | None, depth: int = 0) -> ir.Shape | None:
    """The shape of ``v``: annotated, else that of the data ``ScatterND`` updates, or of the input of a node that
    provably returns its input."""
    if v is None or depth > 16:
        return None
    if v.shape is not None:
        return v.shape
    p = v.producer()
    if p is None or p.domain not in _STANDARD or not p.inputs or p.outputs[0] is not v:
        return None
    if p.op_type == "ScatterND" or _is_passthrough(p, depth + 1):
        return _shape_of(p.inputs[0], depth + 1)
    return None


def _static_dims(v: ir.Value, depth: int) -> list[int | None] | None:
    shape = _shape_of(v, depth)
    if shape is None:
        return None
    return [d if isinstance(d, int) else None for d in shape]


def _reshape_is_identity(node: ir.Node, depth: int) -> bool:
    allowzero = node.attributes.get("allowzero")
    if allowzero is not None and allowzero.value != 0:
        return False
    shape = _const(node.inputs[1]) if len(node.inputs) > 1 else None
    dims = _static_dims(node.inputs[0], depth)
    if shape is None or dims is None or shape.ndim != 1 or len(shape) != len(dims):
        return False
    minus_one = 0
    for want, have in zip(shape.tolist(), dims):
        if want == -1:
            minus_one += 1
        elif want != 0 and want != have:
            return False
    return minus_one <= 1


def _is_passthrough(node: ir.Node, depth: int = 0) -> bool:
    """``node`` provably returns its first input as its first output (see the module docstring)."""
    if node.domain not in _STANDARD or not node.inputs or node.inputs[0] is None or depth > 16:
        return False
    op, x = node.op_type, node.inputs[0]
    if op == "Identity":
        return True
    if op == "Cast":
        to = node.attributes.get("to")
        src = _dtype_of(x)
        return to is not None and src is not None and int(to.value) == src.value
    if op == "Reshape":
        return _reshape_is_identity(node, depth)
    if op == "Transpose":
        perm = node.attributes.get("perm")
        return perm is not None and list(perm.value) == list(range(len(perm.value)))
    if op == "Expand":
        shape = _const(node.inputs[1]) if len(node.inputs) > 1 else None
        x_shape = _shape_of(x, depth)
        rank = len(x_shape) if x_shape is not None else None
        return (shape is not None and shape.ndim == 1 and rank is not None and len(shape) <= rank
                and bool((shape == 1).all()))
    if op == "Dropout":
        if len(node.inputs) > 2 and node.inputs[2] is not None:
            training = _const(node.inputs[2])
            if training is None or bool(training.reshape(-1)[0]):
                return False
        return all(not o.uses() and not o.is_graph_output() for o in node.outputs[1:])
    return False


def _removable(out: ir.Value, graph: ir.Graph) -> ir.Node | None:
    """The node producing graph output ``out`` when it provably returns an input that can take its place."""
    node = out.producer()
    if node is None or node.graph is not graph or not _is_passthrough(node):
        return None
    src = node.inputs[0]
    if src.is_graph_input() or src.is_graph_output() or src.is_initializer() or src.const_value is not None:
        return None
    return node


class RemovePassThroughPass(InvariantPass):
    """Remove provable no-op nodes between KV updates and their retained graph outputs.

    After :meth:`call`, :attr:`removed` counts the nodes removed. ``ensures``: the graph inputs and outputs are
    unchanged and no retained KV output is still produced by a removable no-op.
    """

    def __init__(self) -> None:
        super().__init__()
        self.removed = 0

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        self.removed = 0
        retained = {p.output_name for p in layout_of(model).pairs}
        for index, out in enumerate(list(graph.outputs)):
            if out.name not in retained:
                continue
            while (node := _removable(out, graph)) is not None:
                src = node.inputs[0]
                name, dtype, shape = out.name, out.dtype, out.shape
                graph.outputs[index] = src
                out.replace_all_uses_with(src)        # every other reader reads the input instead
                out.name = None
                graph.remove(node, safe=True)
                src.name = name
                src.dtype = dtype if dtype is not None else src.dtype
                src.shape = shape if shape is not None else src.shape
                out = src
                self.removed += 1
        return ir.passes.PassResult(model, modified=self.removed > 0)

    def check(self, model: ir.Model) -> None:
        retained = {p.output_name for p in layout_of(model).pairs}
        left = [out.name for out in model.graph.outputs if out.name in retained and _removable(out, model.graph)]
        if left:
            self.violated(f"the retained outputs {', '.join(left)} are still produced by a no-op node")
