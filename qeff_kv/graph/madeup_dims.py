"""Symbolic dims an exporter made up on retained outputs, matched to the graph's inputs.

torch's ONNX exporter names an output dim it could not tie to an input after the node that produced it
(``CtxScatterpast_key.3_RetainedState_dim_0``, ``Whererecurrent_state.0_RetainedState_dim_1``): the peer's
hybrid graphs declare their retained outputs so, although each is the same shape as its input. Such a dim is
*made up*: a name ending in ``_RetainedState_dim_<axis>`` that no graph input uses. This module replaces each
made-up dim of a retained output by what the graph itself says it is, from two sources, in order:

1. **the scatter structure**: an output written by ``ScatterND``/``ScatterElements`` (or a function call whose
   body does so, the peer's ``CtxScatter``) from its paired input has that input's shape;
2. **shape inference** (``onnx.shape_inference``, with the made-up declarations cleared): a dim it infers as an
   int, or as a name a graph input uses, replaces the made-up one.

What neither resolves is *unknown*: a name that says nothing about the size. It takes the paired input's dim where
that dim binds both buffers at run time, whatever the graph computes: a fixed size (the peer's compile step
specializes the output to it; TorchScript's ``Reshape<name>_dim_<k>`` on a recurrent state's ``[batch, 128, 4]``)
or the batch axis (axis 0, bound to the runtime's own buffer). Against any other named axis of
the input (``ctx_len``, ``sliding_window``: a size each run chooses) only the graph's structure can tie the output
to it, so the made-up name stays. This is the one rule every ``check`` rule sees, for every state kind: the
layout's outputs carry the taken dims. :func:`resolve` reports the axes the graph itself did not match (output
name -> axes): taken from the input where the output now has the input's dim, still made up (``check`` fails
them) where not. Nothing here changes the file: it only corrects the I/O descriptors the layout is built from.
Graphs without made-up dims cost nothing.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from qeff_kv.contract import naming
from qeff_kv.contract.layout import TensorInfo

SCATTER_OPS = frozenset({"ScatterND", "ScatterElements"})


def _input_dim_names(inputs: list[TensorInfo]) -> set[str]:
    return {d for t in inputs if t.shape is not None for d in t.shape if isinstance(d, str)}


def made_up_axes(t: TensorInfo, known: set[str]) -> list[int]:
    """Axes of ``t`` whose dim is the exporter's made-up name for it (``<op><retained output name>_dim_<axis>``,
    the output's name as exported: a prefix rewrite renames the output, not its dims) and no graph input uses it.
    Any other name is the graph's word and stays as it is (a mismatch is a mismatch)."""
    if t.shape is None:
        return []
    return [i for i, d in enumerate(t.shape)
            if isinstance(d, str) and d not in known and d.endswith(f"{naming.RETAINED_SUFFIX}_dim_{i}")]


def _scatter_source(model: ir.Model, out: ir.Value) -> ir.Value | None:
    """The value ``out`` was scattered from (input 0 of the scatter writing it, through one function call)."""
    node = out.producer()
    if node is None:
        return None
    if node.domain in ("", "ai.onnx") and node.op_type in SCATTER_OPS:
        return node.inputs[0] if node.inputs else None
    fn = model.functions.get((node.domain, node.op_type, node.overload or ""))
    if fn is None:
        return None
    j = next(i for i, o in enumerate(node.outputs) if o is out)
    inner = fn.outputs[j].producer() if j < len(fn.outputs) else None
    if inner is None or inner.op_type not in SCATTER_OPS or not inner.inputs:
        return None
    k = next((i for i, p in enumerate(fn.inputs) if p is inner.inputs[0]), None)
    return node.inputs[k] if k is not None and k < len(node.inputs) else None


def _weights_as_inputs(graph) -> None:
    """Large initializers become typed graph inputs: inference needs their shapes, not their bytes (no copy of the
    weights is kept); small ones (shape constants, axes) stay values."""
    from onnx import helper

    big = [t for t in graph.initializer if int(np.prod(t.dims)) > 1024]
    for t in big:
        graph.input.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    keep = [t for t in graph.initializer if int(np.prod(t.dims)) <= 1024]
    del graph.initializer[:]
    graph.initializer.extend(keep)


def _inferred_shapes(model: ir.Model, names: set[str]) -> dict[str, tuple]:
    """Shape inference's dims of the outputs ``names``, their declared shapes cleared first."""
    import onnx

    proto = ir.serde.serialize_model(model)
    _weights_as_inputs(proto.graph)
    for o in proto.graph.output:
        if o.name in names:
            o.type.tensor_type.ClearField("shape")
    del proto.graph.value_info[:]
    try:
        inferred = onnx.shape_inference.infer_shapes(proto, strict_mode=False, data_prop=True)
    except Exception:  # noqa: BLE001 - inference is best effort: what it cannot say stays unresolved
        return {}
    out = {}
    for o in inferred.graph.output:
        if o.name in names and o.type.tensor_type.HasField("shape"):
            out[o.name] = tuple(d.dim_value if d.HasField("dim_value") else d.dim_param or None
                                for d in o.type.tensor_type.shape.dim)
    return out


def resolve(model: ir.Model, inputs: list[TensorInfo],
            outputs: list[TensorInfo]) -> tuple[list[TensorInfo], dict[str, tuple[int, ...]]]:
    """``(outputs with made-up dims matched, {output name: axes the graph did not match})`` for the retained
    outputs: of those axes, the ones the paired input binds (axis 0, a fixed size) carry the input's dim in the
    returned outputs; the others keep their made-up name."""
    known = _input_dim_names(inputs)
    in_by_name = {t.name: t for t in inputs}
    todo = {t.name: made_up_axes(t, known) for t in outputs
            if naming.retained_source(t.name) in in_by_name and made_up_axes(t, known)}
    if not todo:
        return outputs, {}
    values = {v.name: v for v in model.graph.outputs}
    graph_inputs = {v.name: v for v in model.graph.inputs}
    shapes: dict[str, list] = {n: list(t.shape) for t in outputs for n in [t.name] if n in todo}
    for name in list(todo):
        src = _scatter_source(model, values[name]) if name in values else None
        paired = in_by_name[naming.retained_source(name)]
        if src is not None and src is graph_inputs.get(paired.name) and paired.shape is not None \
                and len(paired.shape) == len(shapes[name]):
            for i in todo[name]:
                shapes[name][i] = paired.shape[i]
            todo[name] = []
    left = {n for n, axes in todo.items() if axes}
    inferred = _inferred_shapes(model, left) if left else {}
    for name in left:
        got = inferred.get(name)
        if got is None or len(got) != len(shapes[name]):
            continue
        still = []
        for i in todo[name]:
            d = got[i]
            if isinstance(d, int) and d > 0 or isinstance(d, str) and d in known:
                shapes[name][i] = d
            else:
                still.append(i)
        todo[name] = still
    for name, axes in todo.items():   # what the graph does not say: the input's dim where the input binds it
        paired = in_by_name[naming.retained_source(name)].shape
        if paired is not None and len(paired) == len(shapes[name]):
            for i in axes:
                if i == 0 or isinstance(paired[i], int):
                    shapes[name][i] = paired[i]
    fixed = [TensorInfo(t.name, t.dtype, tuple(shapes[t.name])) if t.name in shapes else t for t in outputs]
    return fixed, {n: tuple(a) for n, a in todo.items() if a}
