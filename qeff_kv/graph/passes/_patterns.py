"""Small pattern-matching helpers shared by the graph passes (not a pass)."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir


def const_array(v: ir.Value | None) -> np.ndarray | None:
    """The constant value of ``v`` (an initializer or a Constant node, possibly behind Identity nodes)."""
    for _ in range(8):
        if v is None:
            return None
        if v.const_value is not None:
            return v.const_value.numpy()
        p = v.producer()
        if p is not None and p.op_type == "Constant" and "value" in p.attributes:
            return p.attributes["value"].value.numpy()
        if p is None or p.op_type != "Identity":
            return None
        v = p.inputs[0]
    return None


def producer_op(v: ir.Value | None, op_type: str) -> ir.Node | None:
    """The node of standard-domain type ``op_type`` that produces ``v``, or ``None``."""
    p = v.producer() if v is not None else None
    return p if p is not None and p.op_type == op_type and p.domain in ("", "ai.onnx") else None


class ConstInfo:
    """The shape and dtype of a constant without reading its data (a lazy initializer stays unread)."""

    def __init__(self, tensor):
        self.tensor = tensor
        self.shape = tuple(int(d) for d in tensor.shape)
        self.ndim = len(self.shape)
        self.size = int(np.prod(self.shape)) if self.shape else 1
        self.dtype = np.dtype(tensor.dtype.numpy())


def const_info(v: ir.Value | None) -> ConstInfo | None:
    """Like :func:`const_array`, but only the shape and dtype (see :class:`ConstInfo`)."""
    for _ in range(8):
        if v is None:
            return None
        if v.const_value is not None:
            return ConstInfo(v.const_value)
        p = v.producer()
        if p is not None and p.op_type == "Constant" and "value" in p.attributes:
            return ConstInfo(p.attributes["value"].value)
        if p is None or p.op_type != "Identity":
            return None
        v = p.inputs[0]
    return None


class ConcatTensor(ir.LazyTensor):
    """A lazy ``concatenate`` of ``parts`` (the tensors, as they were) along ``axis``: a consumer that computes
    per part (the streamed quantizer's packed blocks, per column) can concatenate its results instead."""

    __slots__ = ("parts", "axis")


def concat_tensor(values: list[ir.Value], axis: int, name: str, rows_of: list[int] | None = None) -> ir.TensorProtocol:
    """``concatenate`` of the constants of ``values`` along ``axis`` as a tensor named ``name``; read only when
    its data is needed (when the graph is written) if any part is itself read lazily. ``rows_of``: per part, the
    ``N`` by which a 1-D part is viewed as ``[N, -1]`` before concatenating along axis 0 (MatMulNBits' flat
    scales), the result then flattened again."""
    infos = [const_info(v) for v in values]   # the tensors now: the graph may change before they are read

    def compute():
        parts = [i.tensor.numpy() for i in infos]
        if rows_of is not None:
            one_d = parts[0].ndim == 1
            parts = [p.reshape(n, -1) if p.ndim == 1 else p for p, n in zip(parts, rows_of)]
            out = np.concatenate(parts, axis=axis)
            return ir.tensor(np.ascontiguousarray(out.reshape(-1) if one_d else out), name=name)
        return ir.tensor(np.ascontiguousarray(np.concatenate(parts, axis=axis)), name=name)

    if not any(isinstance(i.tensor, ir.LazyTensor) for i in infos):
        return compute()
    shape = list(infos[0].shape)
    if rows_of is None:
        shape[axis] = sum(i.shape[axis] for i in infos)
    else:
        shape = [sum(i.size for i in infos)] if infos[0].ndim == 1 else \
            [sum(i.shape[0] for i in infos)] + list(infos[0].shape[1:])
    if rows_of is not None:
        return ir.LazyTensor(compute, dtype=infos[0].tensor.dtype, shape=ir.Shape(shape), name=name)
    out = ConcatTensor(compute, dtype=infos[0].tensor.dtype, shape=ir.Shape(shape), name=name)
    out.parts, out.axis = tuple(i.tensor for i in infos), axis
    return out


def named_const(graph: ir.Graph, name: str, arr: np.ndarray) -> ir.Value:
    """The initializer ``name`` of ``graph``, registered with ``arr`` when it is not there yet."""
    v = graph.initializers.get(name)
    if v is None:
        v = ir.Value(name=name, const_value=ir.tensor(arr))
        graph.register_initializer(v)
    return v


def append_node(graph: ir.Graph, op: str, inputs, name: str, **attrs) -> ir.Value:
    """A one-output node ``op`` appended to ``graph``, node and output both named ``name``; its output."""
    node = ir.node(op, inputs, attributes=attrs, name=name, num_outputs=1)
    node.outputs[0].name = name
    graph.append(node)
    return node.outputs[0]
