"""The stand-ins' guards: nothing a streamed export writes may carry a stand-in's value (issue 51).

A streamed export (:mod:`.stream`) traces a skeleton whose parameters are *stand-ins*: tensors of the right shape over
one element per row, filled with a number naming their class. A stand-in's value is never a weight's; three
channels could carry it into a result, the first two closed here, the third in :mod:`.stream`:

* **Constant folding** (:func:`recorded_parameters`). The TorchScript exporter folds nodes whose inputs are all
  constant. A fold of a stand-in that is a *view* (``Transpose``: a Linear's ``W.T``; a reshape by axes of size 1;
  a cut along leading axes; a cast to its own dtype) is the same storage, written from the checkpoint as that view;
  any other fold (Gemma's ``1 + w``, DiffLlama's ``exp(sum(lq * lk))``, a cast to another dtype) would compute
  with the stand-in's value. So a stand-in that such a computation would read is not offered to the folding at
  all (:func:`computed_from`): the computation stays in the graph as nodes over the weight's initializer
  (onnxruntime folds them when the session loads, from the real weight). Then the **guard**: the folding runs once
  more on a copy of the graph with no stand-in offered; a folded tensor of the first run that is neither a (view
  of a) stand-in nor folded identically without any stand-in depends on one, and the capture is refused
  (:class:`StandInValue`), whatever the verification would say (``--no-verify`` cannot write it). It is
  structural: the negation test it replaces missed ``lq * lk`` (unchanged when both change sign) and any fold that
  overflows either way.
* **Python reads while tracing** (:func:`traced_reads`): ``.item()``, ``bool()``, ``.tolist()``... of a stand-in
  (or of a value computed from stand-ins alone) bake its value into the traced graph: refused.
* **The streamed reference** (:func:`.stream.streamed_weights`) gives a module its weights for its own forward; a
  model that reads a child's weight from the parent's forward (LFM2's short convolution reads ``conv.weight`` in
  its decode step, JetMoe's attention experts are called through ``map``/``reduce``, LongcatFlash's router reads
  ``classifier.weight``) is given the checkpoint's tensor when it reads it. That, not the graph, was why LFM2 and
  JetMoe "streamed to wrong graphs": their streamed graphs were the whole-model graphs byte for byte, their
  references were not.
"""

from __future__ import annotations

import contextlib

from qeff_kv.errors import ExportError


class StandInValue(ExportError):
    """A streamed capture would carry a stand-in's value (the message names where)."""


def is_stand_in(t, the_plan) -> bool:
    """Whether tensor ``t`` lies over a stand-in's storage (the stand-in itself or a view of it)."""
    return t.untyped_storage().data_ptr() in the_plan.keys   # (an empty storage's address is 0: never a key)


# ----------------------------------------------------------------------------------------------- constant folding
#: the ONNX nodes whose fold of a stand-in may be a view of it (written from the checkpoint permuted, reshaped by axes
#: of size 1: :mod:`.views`, or cut: :func:`.views.sliced_view`); a fold that is not a view is a new tensor,
#: which the guard refuses
VIEW_NODES = frozenset({"onnx::Transpose", "onnx::Reshape", "onnx::Unsqueeze", "onnx::Squeeze", "onnx::Slice"})


#: ONNX ``Cast``'s ``to`` of each torch dtype a stand-in may have
_ONNX_DTYPE = {"torch.float32": 1, "torch.float16": 10, "torch.bfloat16": 16}


def _identity_cast(node, params: dict) -> bool:
    """A ``Cast`` of a parameter to its own dtype (a router's ``weight.float()`` in a float32 export): folded, it is
    the parameter itself (the same storage), so a ``Transpose`` after it is still a view, as with real weights."""
    if node.kind() != "onnx::Cast":
        return False
    t = params.get(node.inputsAt(0).debugName())
    return t is not None and _ONNX_DTYPE.get(str(t.dtype)) == node.i("to")


def _sizes(value) -> tuple | None:
    try:
        sizes = value.type().sizes()
    except RuntimeError:   # not a complete tensor type
        return None
    return None if sizes is None or any(d is None for d in sizes) else tuple(int(d) for d in sizes)


def _view(node, params: dict) -> bool:
    """Whether folding ``node`` over a stand-in gives a view :mod:`.views` can read back from the checkpoint: a
    transpose, a cut, a cast to its own dtype, or a reshape that only adds or drops axes of size 1 or reshapes the
    leading axes (another reshape (GPT-OSS's sinks ``[4] -> [2, 2]`` for GroupQueryAttention) is computed in the
    graph: a stand-in's values cannot tell its row-major order along its last axis)."""
    kind = node.kind()
    if kind == "onnx::Reshape":   # by size-1 axes, or of the leading axes (the last, a stand-in's stride 0, kept)
        src, dst = _sizes(node.inputsAt(0)), _sizes(node.output())
        return src is not None and dst is not None and (
            tuple(d for d in src if d != 1) == tuple(d for d in dst if d != 1) or (src and dst and src[-1] == dst[-1]))
    return kind in VIEW_NODES or _identity_cast(node, params)


def computed_from(graph, params: dict, the_plan) -> set[str]:
    """The names of the stand-in parameters that a folded computation other than a view would read: every stand-in
    among the inputs (through any chain of nodes) of a node that is not a view and whose inputs are all constant
    (parameters, ``Constant`` nodes and what is computed from them alone: what the folding folds). A stand-in whose
    every reader is a view feeding a node with a runtime input (``MatMul(x, Transpose(W))``) stays foldable."""
    names = {v.debugName() for v in graph.inputs()}
    constant: set[str] = {n for n in names if n in params}
    stand_ins = {name for name, t in params.items() if is_stand_in(t, the_plan)}
    sources: dict[str, set[str]] = {n: ({n} if n in stand_ins else set()) for n in constant}
    out: set[str] = set()
    for node in graph.nodes():
        ins = [v.debugName() for v in node.inputs()]
        if not all(i in constant for i in ins):
            continue
        reads = set().union(*(sources[i] for i in ins)) if ins else set()
        if reads and not _view(node, params):
            out |= reads   # arithmetic the folding would compute from these stand-ins
        for v in node.outputs():
            constant.add(v.debugName())
            sources[v.debugName()] = reads
    return out


def dependent_folds(folded: dict, clean: dict, the_plan) -> list[str]:
    """The folded tensors that depend on a stand-in: not a (view of a) stand-in and not folded identically from the
    real tensors alone (``clean``: the folding without any stand-in; by name, or by value where the folding named a
    new constant differently in the two runs)."""
    import torch

    def key(t):
        return str(t.dtype), tuple(t.shape), t.detach().contiguous().numpy().tobytes()

    by_value = None
    out = []
    for name, t in folded.items():
        if is_stand_in(t, the_plan):
            continue
        if name in clean and clean[name].shape == t.shape and torch.equal(clean[name], t):
            continue
        if by_value is None:
            by_value = {key(c) for c in clean.values() if c.numel() <= 1 << 20}
        if t.numel() > 1 << 20 or key(t) not in by_value:
            out.append(name)
    return out


@contextlib.contextmanager
def recorded_parameters(the_plan):
    """While inside, the TorchScript exporter's constant-folded parameter table (name -> tensor) of the last export
    is kept in the yielded dict under ``"params"``; the folding leaves arithmetic on stand-ins in the graph and
    refuses (:class:`StandInValue`) a folded tensor that still depends on one (the module docstring)."""
    import torch
    from torch.onnx._internal.torchscript_exporter import utils as ts_utils

    original = ts_utils._model_to_graph
    fold = torch._C._jit_pass_onnx_constant_fold
    infer = torch._C._jit_pass_onnx_graph_shape_type_inference
    box: dict = {}

    def shapes_without_stand_ins(graph, params, opset):
        """ONNX shape inference never reads a weight's values, yet torch serializes every tensor it is given
        (an expanded stand-in as a whole contiguous copy: 7.6 GB at the 8B shape, after which the pass failed and
        torch ignored the failure); the stand-ins are left out (their shapes are on the graph's values already)."""
        return infer(graph, {k: v for k, v in params.items() if not is_stand_in(v, the_plan)}, opset)

    def recorded(*args, **kwargs):
        graph, params, out = original(*args, **kwargs)
        box["params"] = dict(params)
        return graph, params, out

    def guarded_fold(graph, params, opset):
        kept = computed_from(graph, params, the_plan)
        copy = graph.copy()
        folded = fold(graph, {k: v for k, v in params.items() if k not in kept}, opset)
        clean = fold(copy, {k: v for k, v in params.items() if not is_stand_in(v, the_plan)}, opset)
        derived = dependent_folds(folded, clean, the_plan)
        if derived:
            raise StandInValue(f"the constant folding computed {derived[0]} (and {len(derived) - 1} more) from a "
                               "weight's stand-in")
        folded.update({k: params[k] for k in kept})   # still parameters: their arithmetic stays in the graph
        return folded

    linear = torch.nn.functional.linear

    def linear_on_a_copy(x, weight, bias=None):
        """A half-precision stand-in multiplied as a contiguous copy: torch's CPU kernel for an expanded float16
        weight is ~90x slower than for a contiguous one (14.4 s against 0.16 s for one 14336x4096 MLP weight and
        32 tokens: an hour of tracing at 8B); ``contiguous`` leaves no node in the ONNX graph."""
        if weight.dtype in (torch.float16, torch.bfloat16) and is_stand_in(weight, the_plan):
            weight = weight.contiguous()
        return linear(x, weight, bias)

    ts_utils._model_to_graph = recorded
    torch._C._jit_pass_onnx_constant_fold = guarded_fold
    torch._C._jit_pass_onnx_graph_shape_type_inference = shapes_without_stand_ins
    torch.nn.functional.linear = linear_on_a_copy
    try:
        with traced_reads(the_plan):
            yield box
    finally:
        ts_utils._model_to_graph = original
        torch._C._jit_pass_onnx_constant_fold = fold
        torch._C._jit_pass_onnx_graph_shape_type_inference = infer
        torch.nn.functional.linear = linear


def _key(the_plan, t) -> str:
    return the_plan.keys[t.untyped_storage().data_ptr()]


# ------------------------------------------------------------------------------------------- reads of values
#: the tensor methods that hand a tensor's values to Python (baked into a trace as constants)
VALUE_READS = frozenset({"item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__", "__complex__"})


def _tensors(tree):
    import torch

    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for x in tree:
            yield from _tensors(x)
    elif isinstance(tree, dict):
        for x in tree.values():
            yield from _tensors(x)


#: what a tensor function tells of a stand-in without its values (under tracing ``weight.shape[0]`` is a tensor:
#: reading it into Python reads a shape, not a weight)
_SHAPE_ATTRIBUTES = frozenset({"shape", "dtype", "device", "ndim", "layout", "requires_grad", "is_cuda", "itemsize",
                               "nbytes", "names"})
_SHAPE_METHODS = frozenset({"size", "dim", "numel", "stride", "element_size", "__len__", "nelement", "ndimension",
                            "storage_offset", "is_contiguous", "data_ptr", "untyped_storage"})


def _metadata(func) -> bool:
    name = getattr(func, "__name__", "")
    if name == "__get__":
        return getattr(getattr(func, "__self__", None), "__name__", "") in _SHAPE_ATTRIBUTES
    return name in _SHAPE_METHODS


#: the attribute that marks a tensor computed from stand-ins alone while tracing
TAINT = "_qeff_kv_from_stand_ins"


@contextlib.contextmanager
def traced_reads(the_plan):
    """While inside, a value computed from stand-ins alone (a stand-in, a view of one, or the result of an operation
    whose tensor inputs all are such values: ``w.sum()``, ``exp(lq * lk)``) read into Python (:data:`VALUE_READS`)
    raises :class:`StandInValue`. (A value that mixes in an activation is not followed: a Python read of it makes
    the trace input-dependent whatever the weights are, and is the modeling code's concern.)"""
    import torch
    from torch.overrides import TorchFunctionMode

    def from_stand_ins(t) -> bool:
        return getattr(t, TAINT, None) is not None or is_stand_in(t, the_plan)

    class Reads(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            ins = list(_tensors((args, kwargs)))
            tainted = [t for t in ins if from_stand_ins(t)]
            if tainted and getattr(func, "__name__", "") in VALUE_READS:
                key = getattr(tainted[0], TAINT, None) or _key(the_plan, tainted[0])
                raise StandInValue(f"the model reads a value computed from {key} in Python while it is traced")
            out = func(*args, **kwargs)
            if tainted and len(tainted) == len(ins) and not _metadata(func):
                key = getattr(tainted[0], TAINT, None) or _key(the_plan, tainted[0])
                for t in _tensors(out):
                    if isinstance(t, torch.Tensor) and not is_stand_in(t, the_plan):
                        setattr(t, TAINT, key)
            return out

    with Reads():
        yield
