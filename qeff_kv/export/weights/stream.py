"""Streaming export: the graph captured without the model's weights, each weight read from the checkpoint when
the graph is written (issue 39).

* :func:`skeleton`: the transformers model built from its config with every parameter a *stand-in*: a tensor of
  the parameter's shape and dtype over a tiny storage (``base[S0, ..., S(n-2), 1].expand(shape)``: one element
  per row), so that a 70B model's skeleton takes megabytes. Buffers (RoPE caches...) are computed as usual.
  :func:`plan` maps each parameter to its checkpoint key (the same name, the same shape; a tied parameter is the
  same object) or says why the checkpoint does not fit (the exporter then loads the model whole, as before).
* :func:`tag`: each stand-in's storage is filled with a number naming the *class* of its checkpoint tensor
  (equal bytes, dtype and shape: one class), so that the TorchScript exporter's deduplication of equal
  initializers merges exactly what it merges when the weights are real.
* :func:`capture`: ``torch.onnx.export(export_params=False)`` with the exporter's constant-folded parameter
  table recorded; each folded tensor is traced back to its stand-in by storage (a view: the same parameter, maybe
  permuted) or is a real buffer. Anything else (a folded arithmetic on a weight) is refused: the caller falls
  back to the whole-model path rather than write a wrong weight.
* :func:`attach_weights`: the raw graph's parameter inputs become initializers, each an ``onnx_ir.LazyTensor``
  that reads its checkpoint tensor (converted to the export dtype, permuted) only when the graph is saved.
* :func:`streamed_weights`: module hooks that load a module's own parameters from the checkpoint just before its
  forward and drop them right after, for the PyTorch reference run of verification: one module's weights at a
  time.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from qeff_kv.errors import ExportError


class StreamRefused(Exception):
    """The streaming path cannot export this model exactly (the reason is the message); load it whole."""


# ------------------------------------------------------------------------------------------------- skeleton
def stand_in(shape, dtype, value: float = 0.0):
    """A tensor of ``shape``/``dtype`` whose storage holds one element per row (all but the last axis)."""
    import torch

    shape = tuple(int(d) for d in shape)
    base_shape = shape[:-1] + (1,) if shape else ()
    return torch.full(base_shape, value, dtype=dtype).expand(shape)


@contextlib.contextmanager
def _meta_parameters():
    """Parameters created inside are on the meta device (no memory); buffers are created as usual."""
    import torch

    original = torch.nn.Module.register_parameter

    def register(module, name, param):
        if param is not None and param.device.type != "meta":
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    torch.nn.Module.register_parameter = register
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original


def skeleton(folder, dtype):
    """The causal LM (image-text-to-text model: :mod:`.vlm_stream`) of ``folder``'s config in ``dtype``, eager
    attention, eval mode, every parameter a stand-in (shared parameters stay shared)."""
    import torch

    from qeff_kv.export import transformers_adapter as hf
    from qeff_kv.export.weights.vlm_stream import auto_class

    _torch, transformers = hf.import_transformers()
    cfg = transformers.AutoConfig.from_pretrained(folder)
    with _meta_parameters(), torch.device("cpu"):
        model = auto_class(transformers, cfg).from_config(cfg, dtype=dtype, attn_implementation="eager")
    done: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) not in done:
                done[id(p)] = torch.nn.Parameter(stand_in(p.shape, p.dtype), requires_grad=False)
            module._parameters[name] = done[id(p)]
    return model.eval()


@dataclass
class Plan:
    """Which checkpoint key each stand-in reads: by the stand-in's storage address."""

    keys: dict[int, str] = field(default_factory=dict)          # storage data_ptr -> checkpoint key
    shapes: dict[int, tuple] = field(default_factory=dict)      # storage data_ptr -> the parameter's shape
    names: dict[int, str] = field(default_factory=dict)         # storage data_ptr -> first parameter name
    params: list = field(default_factory=list)                  # the stand-ins themselves
    dtype: object = None

    def key_of(self, tensor) -> str | None:
        return self.keys.get(tensor.untyped_storage().data_ptr()) if tensor.numel() else None


def plan(model, store, rename=None) -> Plan:
    """Each parameter's checkpoint key: its own name, or the key transformers loads into it
    (``rename(model, keys)``: :func:`.vlm_stream.checkpoint_names`), with the same shape. Refuses
    (:class:`StreamRefused`) a checkpoint whose names or shapes differ from the model's (renamed, fused or split
    tensors at load)."""
    out = Plan()
    have = store.keys()
    try:
        renamed = {} if rename is None else rename(model, have)
    except ValueError as exc:
        raise StreamRefused(str(exc)) from None
    for name, p in model.named_parameters(remove_duplicate=True):
        ptr = p.untyped_storage().data_ptr()
        key = renamed.get(name, name)
        if key not in have:
            raise StreamRefused(f"parameter {name} is not a tensor of the checkpoint under that name")
        if store.shape(key) != tuple(p.shape):
            raise StreamRefused(f"{name}: checkpoint shape {store.shape(key)}, model shape {tuple(p.shape)}")
        out.keys[ptr], out.shapes[ptr], out.names[ptr] = key, tuple(p.shape), name
        out.params.append(p)
        out.dtype = p.dtype
    return out


def is_stand_in(t, the_plan: Plan) -> bool:
    return t.numel() > 0 and t.untyped_storage().data_ptr() in the_plan.keys


def tag(model, the_plan: Plan, classes: dict[str, int]) -> None:
    """Fill each stand-in with the number of its checkpoint tensor's class (``classes``: key -> class)."""
    import torch

    limit = 2048 if the_plan.dtype == torch.float16 else 2 ** 24   # integers the dtype holds exactly
    if max(classes.values(), default=0) + 1 >= limit:
        raise StreamRefused(f"{len(classes)} distinct weights: more than the stand-ins can name in "
                            f"{the_plan.dtype}")
    for p in {id(p): p for p in model.parameters()}.values():
        key = the_plan.key_of(p)
        if key is not None:
            p.data.as_strided((p.untyped_storage().nbytes() // p.element_size(),), (1,), 0).fill_(classes[key] + 1)


# -------------------------------------------------------------------------------------------------- capture
def _negate(the_plan: Plan) -> None:
    """Every stand-in's storage negated in place (twice: as before)."""
    for p in the_plan.params:
        p.data.as_strided((p.untyped_storage().nbytes() // p.element_size(),), (1,), 0).neg_()


@contextlib.contextmanager
def recorded_parameters(the_plan: Plan):
    """While inside, the TorchScript exporter's constant-folded parameter table (name -> tensor) of the last
    export is kept in the yielded dict under ``"params"``, and under ``"derived"`` the names of folded tensors
    computed from a stand-in's values (not a view of it): the constant folding runs a second time on a copy of
    the graph with every stand-in negated, and a folded tensor that changes with them was computed from them."""
    import torch
    from torch.onnx._internal.torchscript_exporter import utils as ts_utils

    original = ts_utils._model_to_graph
    fold = torch._C._jit_pass_onnx_constant_fold
    infer = torch._C._jit_pass_onnx_graph_shape_type_inference
    box: dict = {"derived": []}

    def shapes_without_stand_ins(graph, params, opset):
        """ONNX shape inference never reads a weight's values, yet torch serializes every tensor it is given
        (an expanded stand-in as a whole contiguous copy: 7.6 GB at the 8B shape, after which the pass failed and
        torch ignored the failure); the stand-ins are left out (their shapes are on the graph's values already)."""
        return infer(graph, {k: v for k, v in params.items() if not is_stand_in(v, the_plan)}, opset)

    def recorded(*args, **kwargs):
        graph, params, out = original(*args, **kwargs)
        box["params"] = dict(params)
        return graph, params, out

    def checked_fold(graph, params, opset):
        copy = graph.copy()
        folded = fold(graph, params, opset)
        _negate(the_plan)
        try:
            other = fold(copy, dict(params), opset)
        finally:
            _negate(the_plan)
        box["derived"] += [name for name, t in folded.items()
                           if not is_stand_in(t, the_plan) and name in other
                           and (other[name].shape != t.shape or not torch.equal(other[name], t))]
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
    torch._C._jit_pass_onnx_constant_fold = checked_fold
    torch._C._jit_pass_onnx_graph_shape_type_inference = shapes_without_stand_ins
    torch.nn.functional.linear = linear_on_a_copy
    try:
        yield box
    finally:
        ts_utils._model_to_graph = original
        torch._C._jit_pass_onnx_constant_fold = fold
        torch._C._jit_pass_onnx_graph_shape_type_inference = infer
        torch.nn.functional.linear = linear


def _permutation(t, shape: tuple) -> tuple | None:
    """The axes of the stand-in of ``shape`` that ``t`` (a view of it) shows, in order; refuses another view."""
    import torch

    strides = torch.empty(shape[:-1] + (1,) if shape else (), device="meta").expand(shape).stride()
    if t.storage_offset() != 0 or t.dim() != len(shape):
        raise StreamRefused(f"a folded weight of shape {tuple(t.shape)} is not a view of its parameter {shape}")
    perm, free = [], list(range(len(shape)))
    for size, stride in zip(t.shape, t.stride()):
        match = next((j for j in free if shape[j] == size and (strides[j] == stride or size == 1)), None)
        if match is None:
            raise StreamRefused(f"a folded weight of shape {tuple(t.shape)} is not a permutation of {shape}")
        perm.append(match)
        free.remove(match)
    return None if perm == sorted(perm) else tuple(perm)


def lineage(params: dict, the_plan: Plan) -> dict:
    """Each traced parameter's source: ``(checkpoint key, permutation or None[, cut])`` for a (view of a) stand-in
    (``cut``: :func:`.vlm_stream.sliced_view`), or a numpy array for a real tensor (buffers and what was folded from
    them). Refuses two views of one parameter with one shape (the exporter would merge their equal stand-ins)."""
    from qeff_kv.export.weights.vlm_stream import sliced_view

    out, views = {}, {}
    for name, t in params.items():
        if is_stand_in(t, the_plan):
            ptr = t.untyped_storage().data_ptr()
            key, cut = the_plan.keys[ptr], sliced_view(t, the_plan.shapes[ptr])
            out[name] = (key, None, cut) if cut else (key, _permutation(t, the_plan.shapes[ptr]))
            if views.setdefault((ptr, tuple(t.shape)), out[name]) != out[name]:
                raise StreamRefused(f"two views of {key} of shape {tuple(t.shape)} are folded")
        else:
            out[name] = t.detach().contiguous().numpy().copy()
    return out


def attach_weights(model: ir.Model, sources: dict, store, torch_dtype) -> int:
    """The raw graph's parameter inputs (named in ``sources``) become initializers: real arrays as they are,
    checkpoint tensors as lazy tensors read at save time. Returns how many are lazy."""
    graph = model.graph
    lazy = 0
    for value in list(graph.inputs):
        src = sources.get(value.name)
        if src is None:
            continue
        graph.inputs.remove(value)
        if isinstance(src, np.ndarray):
            value.const_value = ir.tensor(src, name=value.name)
        else:
            value.const_value = lazy_tensor(store, src[0], src[1], torch_dtype, value.name, *src[2:])
            lazy += 1
        graph.register_initializer(value)
    return lazy


def lazy_tensor(store, key: str, perm, torch_dtype, name: str, cut=None) -> ir.LazyTensor:
    """The checkpoint tensor ``key`` in ``torch_dtype`` (cut to ``cut``'s ``(start, stop)`` per axis, axes permuted by
    ``perm``), read when evaluated."""
    shape = store.shape(key) if cut is None else tuple(b - a for a, b in cut)
    if perm is not None:
        shape = tuple(shape[p] for p in perm)
    np_dtype = {"torch.float32": np.float32, "torch.float16": np.float16}[str(torch_dtype)]

    def load():
        arr = store.array(key, torch_dtype)
        if cut is not None:
            arr = np.ascontiguousarray(arr[tuple(slice(a, b) for a, b in cut)])
        if perm is not None:
            arr = np.ascontiguousarray(arr.transpose(perm))
        return ir.tensor(arr, name=name)

    return ir.LazyTensor(load, dtype=ir.DataType.from_numpy(np.dtype(np_dtype)), shape=ir.Shape(shape), name=name)


# ------------------------------------------------------------------------------------ the streamed reference
@contextlib.contextmanager
def streamed_weights(model, the_plan: Plan, store, transform=None):
    """While inside, each module with parameters of its own reads them from the checkpoint right before its
    forward and drops them right after (the stand-ins come back): the model runs with one module's weights in
    memory at a time. ``transform(key, array)``: what the module computes with instead of the checkpoint's
    array (:func:`dequantizing`: the weights a quantized graph holds)."""
    import torch

    handles = []
    stand_ins: dict[int, dict] = {}   # id(module) -> its stand-ins while its forward runs
    tick = _pass_ticker(the_plan)

    def before(module, _args):
        stand_ins[id(module)] = dict(module._parameters)
        for name, p in stand_ins[id(module)].items():
            key = the_plan.key_of(p) if p is not None else None
            if key is not None:
                tick(p.numel() * p.element_size())
                arr = store.array(key, p.dtype)
                if transform is not None:
                    arr = transform(key, arr)
                module._parameters[name] = torch.nn.Parameter(torch.from_numpy(arr), requires_grad=False)

    def after(module, _args, _out):
        module._parameters.update(stand_ins.pop(id(module)))

    for module in model.modules():
        if any(p is not None for p in module._parameters.values()):
            handles.append(module.register_forward_pre_hook(before))
            handles.append(module.register_forward_hook(after))
    try:
        yield model
    finally:
        for h in handles:
            h.remove()


def _pass_ticker(the_plan: Plan):
    """``tick(nbytes)`` per weight a forward reads: the terminal's progress line of :func:`.publish.ticker` over
    one pass through the model's weights (a new line for each further pass; nothing off a terminal)."""
    from qeff_kv.export.publish import ticker

    total = sum(p.numel() * p.element_size() for p in the_plan.params)
    state = {"done": total, "passes": 0, "step": None}

    def tick(nbytes: int) -> None:
        if state["done"] >= total:   # a new pass over the weights
            state["passes"] += 1
            state["done"] = 0
            state["step"] = ticker(f"reference pass {state['passes']}", total, len(the_plan.params))
        state["done"] += nbytes
        state["step"](nbytes)

    return tick


def dequantizing(model, the_plan: Plan, scheme, min_k: int):
    """``transform`` for :func:`streamed_weights`: the PyTorch reference of a ``--weights int4|int8`` graph
    quantized as it streams (no float graph): each weight the quantizers of :mod:`.quantize_stream` pack is
    quantized then dequantized (:func:`.quantize_stream.dequantized`, onnxruntime's own kernel), the rest as read.

    Which weights, by the rule those quantizers follow on the traced graph: a ``Linear`` weight ``[out, in]``
    (the graph's MatMul weight ``[K=in, N=out]``) with ``in >= min_k``, float32 or float16; the vocabulary tables
    (the input and output embeddings: ``Gather`` and the head's ``Gemm``) where float32 with ``in`` a whole
    number of blocks, always symmetric. A weight on which the rule and the graph disagree differs by the
    quantization error, far above verification's tolerance: the export then fails verification, it does not
    pass wrongly."""
    import torch

    from qeff_kv.export.weights.quantize_stream import dequantized

    tables = {id(m.weight) for m in (model.get_input_embeddings(), model.get_output_embeddings())
              if m is not None and isinstance(getattr(m, "weight", None), torch.Tensor)}
    which: dict[str, bool | None] = {}   # key -> symmetric (None: the scheme's)
    for module in model.modules():
        w = module._parameters.get("weight") if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)) else None
        key = the_plan.key_of(w) if w is not None and w.dim() == 2 else None
        if key is None:
            continue
        k = int(w.shape[1])
        if id(w) in tables:
            if w.dtype == torch.float32 and k >= min_k and k % scheme.block_size == 0:
                which[key] = True
        elif isinstance(module, torch.nn.Linear) and k >= min_k and w.dtype in (torch.float32, torch.float16):
            which[key] = None

    def transform(key: str, arr: np.ndarray) -> np.ndarray:
        return dequantized(arr, scheme, which[key]) if key in which else arr

    transform.keys = which
    return transform


# ------------------------------------------------------------------------------------------- the load stage
#: ``QEFF_KV_EXPORT_STREAM=0`` exports with the whole model loaded, as before streaming (for comparisons).
STREAM_ENV = "QEFF_KV_EXPORT_STREAM"
#: ``model_type`` -> why its streamed graph is not the model's (found by the family matrix: the streamed graph failed
#: verification where the whole-model graph passes): these load whole, said in one line
NOT_STREAMED = {
    "diffllama": "its streamed graph's logits are not finite (differential attention's lambdas)",
    "jetmoe": "its streamed graph differs from the model (mixture of attention heads and experts)",
    "lfm2": "its streamed graph differs from the model (short-convolution mixer)",
}


@dataclass
class Streamed:
    """A skeleton model, its checkpoint and the plan between them (see the module docstring)."""

    model: object
    store: object
    plan: Plan
    record: dict

    def weights(self, transform=None):
        """Context: the skeleton runs with its weights streamed module by module (:func:`streamed_weights`)."""
        return streamed_weights(self.model, self.plan, self.store, transform)

    def dequantizing(self, scheme, min_k: int):
        """:func:`dequantizing` for this skeleton and plan."""
        return dequantizing(self.model, self.plan, scheme, min_k)

    def recorded(self):
        """Context: :func:`recorded_parameters` for this plan."""
        return recorded_parameters(self.plan)

    def attach(self, ir_model: ir.Model, recorded: dict) -> int:
        """The captured graph's parameters as initializers (lazy where they come from the checkpoint); refuses
        (:class:`StreamRefused`) a graph holding a weight folded by arithmetic (Gemma's ``1 + weight``)."""
        if recorded["derived"]:
            raise StreamRefused(f"the exporter folds arithmetic on weights ({recorded['derived'][0]} and "
                                f"{len(recorded['derived']) - 1} more)")
        return attach_weights(ir_model, lineage(recorded["params"], self.plan), self.store, self.plan.dtype)


def open_streamed(source, options, say) -> Streamed | None:
    """The streaming load stage for a safetensors folder: the skeleton, the plan, one read of the checkpoint
    (tensor by tensor) for its identity and the classes of equal tensors. ``None`` where the model must be loaded
    whole (the bundled model and GGUF files, ``QEFF_KV_EXPORT_STREAM=0``, or a
    checkpoint whose tensors are not the model's parameters by name and shape: said in one line)."""
    import os

    from qeff_kv.export import checkpoint as checkpoint_mod
    from qeff_kv.export import transformers_adapter as hf
    from qeff_kv.export.weights import vlm_stream
    from qeff_kv.export.weights.checkpoint_store import CheckpointStore

    if source.kind != "folder" or os.environ.get(STREAM_ENV, "1") == "0":
        return None
    why_not = NOT_STREAMED.get(str(source.config().get("model_type")))
    if why_not is not None:
        say(f"streaming is not possible ({source.config().get('model_type')}: {why_not}): loading the whole model")
        return None
    torch, _transformers = hf.import_transformers()   # the one-line refusal without the export extra
    dtype = {"float32": torch.float32, "float16": torch.float16}[options.dtype]
    say(f"building {source.name} without its weights (they stream from the checkpoint, {options.dtype})")
    try:
        store = CheckpointStore(source.path)
        model = skeleton(source.path, dtype)
        the_plan = plan(model, store,
                        vlm_stream.checkpoint_names if vlm_stream.is_vision_language(source.config()) else None)
    except (StreamRefused, ExportError) as exc:
        say(f"streaming is not possible ({exc}): loading the whole model")
        return None
    except Exception as exc:   # noqa: BLE001 - a model transformers cannot build from its config alone
        say(f"streaming is not possible ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}): "
            "loading the whole model")
        return None
    from qeff_kv.export.publish import ticker

    names = {name: the_plan.key_of(t) for name, t in model.state_dict(keep_vars=True).items()}
    step = ticker("identity", sum(p.numel() * p.element_size() for p in the_plan.params), len(the_plan.params))

    def resolve(name, t):
        if not is_stand_in(t, the_plan):
            return t
        step(t.numel() * t.element_size())
        return store.chunks(names[name], t.dtype)   # a few rows at a time: never a whole 2 GB table

    say(f"reading {len(set(the_plan.keys.values()))} checkpoint tensors one at a time (identity)")
    digests: dict[str, str] = {}
    record = checkpoint_mod.checkpoint_record(model, options.dtype, resolve=resolve, digests=digests)
    classes: dict[str, int] = {}
    by_digest: dict[str, int] = {}
    for name, digest in digests.items():
        key = names.get(name)
        if key is not None:
            classes[key] = by_digest.setdefault(digest, len(by_digest))
    try:
        tag(model, the_plan, classes)
    except StreamRefused as exc:
        say(f"streaming is not possible ({exc}): loading the whole model")
        return None
    return Streamed(model, store, the_plan, record)
