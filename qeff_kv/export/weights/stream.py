"""Streaming export: the graph captured without the model's weights, each weight read from the checkpoint when
the graph is written (issue 39).

* :func:`skeleton`: the transformers model built from its config with every parameter a *stand-in*: a tensor of
  the parameter's shape and dtype over a tiny storage (``base[S0, ..., S(n-2), 1].expand(shape)``: one element
  per row), so that a 70B model's skeleton takes megabytes. Buffers (RoPE caches...) are computed as usual.
  :func:`plan` maps each parameter to its checkpoint key (the same name, the same shape; a tied parameter is the
  same object; per-expert tensors stacked as transformers converts them: :mod:`.expert_keys`) or says why the
  checkpoint does not fit (the exporter then loads the model whole, as before).
* :func:`tag`: each stand-in's storage is filled with a number naming the *class* of its checkpoint tensor
  (equal bytes, dtype and shape: one class), so that the TorchScript exporter's deduplication of equal
  initializers merges exactly what it merges when the weights are real.
* capture (:func:`.stand_ins.recorded_parameters`): ``torch.onnx.export(export_params=False)`` with the
  exporter's constant-folded parameter table recorded; each folded tensor is traced back to its stand-in by storage
  (a view: the same parameter, maybe permuted) or is a real buffer. Arithmetic on a weight is not folded (it stays
  in the graph), and a folded tensor that depends on a stand-in refuses the capture (:mod:`.stand_ins`).
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

from qeff_kv.errors import CheckpointError, ExportError
from qeff_kv.export.weights.stand_ins import is_stand_in, recorded_parameters  # noqa: F401


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


def is_vision_language(config) -> bool:
    """Whether a config (``config.json`` as a dict, or a transformers config) describes a vision-language model:
    it has a vision config (the test the whole-model load makes)."""
    if isinstance(config, dict):
        return isinstance(config.get("vision_config"), dict)
    vision = getattr(config, "vision_config", None)
    return vision is not None and not isinstance(vision, (str, int, float, bool))


def auto_class(transformers, cfg):
    """The auto class the whole path loads ``cfg`` with: image-text-to-text for a vision-language model, else the
    causal LM's (:func:`~qeff_kv.export.transformers_adapter.causal_lm_loader`)."""
    from qeff_kv.export import transformers_adapter as hf

    return transformers.AutoModelForImageTextToText if is_vision_language(cfg) else hf.causal_lm_loader(transformers, cfg)


def skeleton(folder, dtype, config=None):
    """The causal LM (image-text-to-text model for a vision-language config: :func:`auto_class`) of ``folder``'s config (or of the config object
    ``config``: a GGUF's) in ``dtype``, eager
    attention, eval mode, every parameter a stand-in (shared parameters stay shared)."""
    import torch

    from qeff_kv.export import transformers_adapter as hf

    _torch, transformers = hf.import_transformers()
    cfg = config if config is not None else transformers.AutoConfig.from_pretrained(folder)
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
    #: the narrowest parameter dtype (the export dtype; what the stand-ins' class numbers must fit)
    dtype: object = None
    #: checkpoint key -> its parameter's dtype (a module kept in float32 in a float16 model keeps its weights so)
    key_dtypes: dict = field(default_factory=dict)

    def key_of(self, tensor) -> str | None:
        return self.keys.get(tensor.untyped_storage().data_ptr()) if tensor.numel() else None


def plan(model, store) -> Plan:
    """Each parameter's checkpoint key: its own name with the same shape (``store``: a checkpoint as the model names
    its parameters, :func:`.expert_keys.converted_store`). Refuses (:class:`StreamRefused`) a checkpoint whose names
    or shapes differ from the model's."""
    out = Plan()
    have = store.keys()
    for name, p in model.named_parameters(remove_duplicate=True):
        ptr = p.untyped_storage().data_ptr()
        if name not in have:
            raise StreamRefused(f"parameter {name} is not a tensor of the checkpoint under that name")
        if store.shape(name) != tuple(p.shape):
            raise StreamRefused(f"{name}: checkpoint shape {store.shape(name)}, model shape {tuple(p.shape)}")
        out.keys[ptr], out.shapes[ptr], out.names[ptr] = name, tuple(p.shape), name
        out.params.append(p)
        out.key_dtypes[name] = p.dtype
        if out.dtype is None or p.element_size() < out.dtype.itemsize:
            out.dtype = p.dtype
    return out


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


def lineage(params: dict, the_plan: Plan) -> dict:
    """Each traced parameter's source: ``(checkpoint key, permutation or None, reshaped or None, cut or None)`` for a
    (view of a) stand-in (:func:`.views.view_of`; ``cut``: :func:`.views.sliced_view`), or a numpy array for a
    real tensor (buffers and what was folded from them). Refuses two views of one parameter with one shape (the
    exporter would merge their equal stand-ins)."""
    from qeff_kv.export.weights.views import NotAView, row_view, sliced_view, view_of

    out, views = {}, {}
    for name, t in params.items():
        if is_stand_in(t, the_plan):
            ptr = t.untyped_storage().data_ptr()
            key, cut = the_plan.keys[ptr], sliced_view(t, the_plan.shapes[ptr])
            try:
                out[name] = (key, None, None, cut) if cut else (key, *view_of(t, the_plan.shapes[ptr]), None)
            except NotAView as exc:
                rows = row_view(t, the_plan.shapes[ptr])   # a strided choice of rows (MLA's per-head halves)
                if rows is None:
                    raise StreamRefused(str(exc)) from None
                out[name] = (key, None, None, None, rows)
            if views.setdefault((ptr, tuple(t.shape)), out[name]) != out[name]:
                raise StreamRefused(f"two views of {key} of shape {tuple(t.shape)} are folded")
        else:
            out[name] = t.detach().contiguous().numpy().copy()
    return out


def attach_weights(model: ir.Model, sources: dict, store, torch_dtype, key_dtypes: dict | None = None) -> int:
    """The raw graph's parameter inputs (named in ``sources``) become initializers: real arrays as they are,
    checkpoint tensors as lazy tensors read at save time, in ``torch_dtype`` or their parameter's own dtype
    (``key_dtypes``: checkpoint key -> dtype, as the trace saw it). Returns how many are lazy."""
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
            dtype = (key_dtypes or {}).get(src[0], torch_dtype)
            value.const_value = lazy_tensor(store, src[0], src[1], dtype, value.name, *src[2:])
            lazy += 1
        graph.register_initializer(value)
    return lazy


def lazy_tensor(store, key: str, perm, torch_dtype, name: str, reshaped: tuple | None = None,
                cut=None, rows=None) -> ir.LazyTensor:
    """The checkpoint tensor ``key`` in ``torch_dtype`` (cut to ``cut``'s ``(start, stop)`` per axis; axes permuted by
    ``perm``; with ``reshaped``, its axes of size 1 dropped before and the result given that shape:
    :func:`.views.view_of`), read when evaluated (a :class:`.packed_spill.CheckpointTensor`: the writer finds the
    blocks the reference packed by its key)."""
    from qeff_kv.export.weights.packed_spill import checkpoint_tensor

    if rows is not None:   # (:func:`.views.row_view`: never a MatMul weight the spill packed)
        from qeff_kv.export.weights.views import read_rows

        offset, other, _strides, col = rows
        full = tuple(other[:col]) + (store.shape(key)[-1],) + tuple(other[col:])
        np_dtype = {"torch.float32": np.float32, "torch.float16": np.float16}[str(torch_dtype)]
        return ir.LazyTensor(lambda: ir.tensor(read_rows(store.array(key, torch_dtype), rows), name=name),
                             dtype=ir.DataType.from_numpy(np.dtype(np_dtype)), shape=ir.Shape(full), name=name)
    shape = store.shape(key) if cut is None else tuple(b - a for a, b in cut)
    kept = tuple(d for d in shape if d != 1) if reshaped is not None else shape
    if perm is not None:
        shape = tuple(kept[p] for p in perm)
    shape = reshaped if reshaped is not None else shape
    np_dtype = {"torch.float32": np.float32, "torch.float16": np.float16}[str(torch_dtype)]

    def load():
        arr = store.array(key, torch_dtype)
        if cut is not None:
            arr = np.ascontiguousarray(arr[tuple(slice(a, b) for a, b in cut)])
        arr = arr.reshape(kept)
        if perm is not None:
            arr = np.ascontiguousarray(arr.transpose(perm))
        return ir.tensor(arr.reshape(shape), name=name)

    return checkpoint_tensor(load, ir.DataType.from_numpy(np.dtype(np_dtype)), ir.Shape(shape), name, key, perm)


# ------------------------------------------------------------------------------------ the streamed reference
@contextlib.contextmanager
def streamed_weights(model, the_plan: Plan, store, transform=None):
    """While inside, each module with parameters of its own reads them from the checkpoint right before its
    forward and drops them right after (the stand-ins come back): the model runs with one module's weights in
    memory at a time. A parameter read outside its own module's forward (a router's
    ``F.linear(x, self.classifier.weight)``, a short-convolution mixer's ``self.conv.weight``) is read when it is
    accessed and dropped after the forward of the module running then. ``transform(key, array)``: what the module
    computes with instead of the checkpoint's array (:func:`dequantizing`: the weights a quantized graph holds)."""
    import torch

    handles = []
    stand_ins: dict[int, dict] = {}   # id(module) -> its stand-ins while its forward runs
    running: list[list] = []          # per module running (innermost last): (owner, name, stand-in) read on access
    ours = {id(m) for m in model.modules()}
    tick = _pass_ticker(the_plan)

    def real(p):
        key = the_plan.key_of(p) if isinstance(p, torch.Tensor) else None
        if key is None:
            return None
        tick(p.numel() * p.element_size())
        arr = store.array(key, p.dtype)
        return torch.nn.Parameter(torch.from_numpy(arr if transform is None else transform(key, arr)),
                                  requires_grad=False)

    def before(module, _args):
        stand_ins[id(module)] = dict(module._parameters)
        for name, p in stand_ins[id(module)].items():
            loaded = real(p)
            if loaded is not None:
                module._parameters[name] = loaded
        running.append([])

    def after(module, _args, _out):
        for owner, name, p in running.pop():
            owner._parameters[name] = p
        module._parameters.update(stand_ins.pop(id(module)))

    module_getattr = torch.nn.Module.__getattr__

    def on_access(module, name):
        value = module_getattr(module, name)
        if running and id(module) in ours and name in module._parameters:
            loaded = real(value)
            if loaded is not None:
                running[-1].append((module, name, value))
                module._parameters[name] = value = loaded
        return value

    for module in model.modules():
        handles.append(module.register_forward_pre_hook(before))
        handles.append(module.register_forward_hook(after))
    torch.nn.Module.__getattr__ = on_access
    try:
        yield model
    finally:
        torch.nn.Module.__getattr__ = module_getattr
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


def dequantizing(model, the_plan: Plan, scheme, min_k: int, spill=None):
    """``transform`` for :func:`streamed_weights`: the PyTorch reference of a ``--weights int4|int8`` graph
    quantized as it streams (no float graph): each weight the quantizers of :mod:`.quantize_stream` pack is
    quantized then dequantized (:func:`.quantize_stream.dequantized`, onnxruntime's own kernel), the rest as read.

    Which weights, by the rule those quantizers follow on the traced graph: a ``Linear`` weight ``[out, in]``
    (the graph's MatMul weight ``[K=in, N=out]``), or another module's 2-D ``weight`` (a MoE router's, multiplied
    by ``F.linear``), with ``in >= min_k``, float32 or float16; the vocabulary tables
    (the input and output embeddings: ``Gather`` and the head's ``Gemm``) where float32 with ``in`` a whole
    number of blocks, always symmetric. A weight on which the rule and the graph disagree differs by the
    quantization error, far above verification's tolerance: the export then fails verification, it does not
    pass wrongly. ``spill``: a :class:`.packed_spill.PackedSpill` keeping each weight's blocks for the writer
    (one quantization per weight)."""
    import torch

    from qeff_kv.export.weights.quantize_stream import dequantized

    tables = {id(m.weight) for m in (model.get_input_embeddings(), model.get_output_embeddings())
              if m is not None and isinstance(getattr(m, "weight", None), torch.Tensor)}
    which: dict[str, bool | None] = {}   # key -> symmetric (None: the scheme's)
    for module in model.modules():
        w = module._parameters.get("weight")
        key = the_plan.key_of(w) if w is not None and w.dim() == 2 else None
        if key is None:
            continue
        k = int(w.shape[1])
        if id(w) in tables:
            if w.dtype == torch.float32 and k >= min_k and k % scheme.block_size == 0:
                which[key] = True
        elif not isinstance(module, torch.nn.Embedding) and k >= min_k and w.dtype in (torch.float32, torch.float16):
            which[key] = None

    def transform(key: str, arr: np.ndarray) -> np.ndarray:
        return dequantized(arr, scheme, which[key], spill, key) if key in which else arr

    transform.keys = which
    return transform


# ------------------------------------------------------------------------------------------- the load stage
#: ``QEFF_KV_EXPORT_STREAM=0`` exports with the whole model loaded, as before streaming (for comparisons).
STREAM_ENV = "QEFF_KV_EXPORT_STREAM"
@dataclass
class Streamed:
    """A skeleton model, its checkpoint and the plan between them (see the module docstring)."""

    model: object
    store: object
    plan: Plan
    record: dict
    spill: object = None   # the packed blocks of a quantizing reference (:meth:`dequantizing`) for the writer

    def weights(self, transform=None):
        """Context: the skeleton runs with its weights streamed module by module (:func:`streamed_weights`)."""
        return streamed_weights(self.model, self.plan, self.store, transform)

    def dequantizing(self, scheme, min_k: int, spill_folder=None):
        """:func:`dequantizing` for this skeleton and plan; with ``spill_folder`` each weight's packed blocks are
        kept there (:attr:`spill`) for the writer."""
        from qeff_kv.export.weights.packed_spill import PackedSpill

        self.spill = None if spill_folder is None else PackedSpill(spill_folder)
        return dequantizing(self.model, self.plan, scheme, min_k, self.spill)

    def recorded(self):
        """Context: :func:`recorded_parameters` for this plan."""
        return recorded_parameters(self.plan)

    def attach(self, ir_model: ir.Model, recorded: dict) -> int:
        """The captured graph's parameters as initializers (lazy where they come from the checkpoint)."""
        return attach_weights(ir_model, lineage(recorded["params"], self.plan), self.store, self.plan.dtype,
                              self.plan.key_dtypes)


def _skeleton_and_store(source, dtype):
    """``(skeleton, store)``: a folder's safetensors (:class:`.checkpoint_store.CheckpointStore`), or a GGUF's
    tensors dequantized one at a time under the model's names (:class:`.gguf_store.GgufStore`)."""
    if source.kind == "gguf":
        from qeff_kv.export.weights import gguf_header
        from qeff_kv.export.weights.gguf_store import GgufStore

        model = skeleton(None, dtype, source.config_object())
        return model, GgufStore(source.path, model, *gguf_header.tensor_index(source.path, error=ExportError))
    from qeff_kv.export.weights.checkpoint_store import CheckpointStore

    store = CheckpointStore(source.path)
    return skeleton(source.path, dtype), store


def _identity(model, raw, store, the_plan: Plan, dtype_name: str, dtype, say) -> tuple[dict, dict]:
    """``(checkpoint record, key -> class of equal tensors)``, reading the checkpoint once, tensor by tensor: a
    folder's files as stored (:func:`.checkpoint.stored_record`: the whole-model path computes the same); a GGUF's
    tensors as the model holds them (dequantized, a few rows at a time: the loaded model's digest, as its whole
    path records it)."""
    from qeff_kv.export import checkpoint as checkpoint_mod
    from qeff_kv.export.publish import ticker

    if hasattr(raw, "stored_size"):
        keys = raw.keys()   # the files' tensors as stored (per expert), whatever the model fuses
        say(f"reading {len(keys)} checkpoint tensors one at a time (identity, as stored)")
        digests: dict[str, str] = {}
        record = checkpoint_mod.stored_record(raw, dtype_name, digests=digests,
                                              step=ticker("identity", sum(map(raw.stored_size, keys)), len(keys)))
        return record, checkpoint_mod.tensor_classes(store, set(the_plan.keys.values()), digests, dtype)
    names = {name: the_plan.key_of(t) for name, t in model.state_dict(keep_vars=True).items()}
    step = ticker("identity", sum(p.numel() * p.element_size() for p in the_plan.params), len(the_plan.params))

    def resolve(name, t):
        if not is_stand_in(t, the_plan):
            return t
        step(t.numel() * t.element_size())
        return store.chunks(names[name], t.dtype)   # a few rows at a time: never a whole 2 GB table

    say(f"reading {len(set(the_plan.keys.values()))} checkpoint tensors one at a time (identity)")
    digests = {}
    record = checkpoint_mod.checkpoint_record(model, dtype_name, resolve=resolve, digests=digests)
    by_digest: dict[str, int] = {}
    classes = {names[name]: by_digest.setdefault(digest, len(by_digest)) for name, digest in digests.items()
               if names.get(name) is not None}
    return record, classes


def open_streamed(source, options, say) -> Streamed | None:
    """The streaming load stage for a safetensors folder or a GGUF file (:mod:`.gguf_store`): the skeleton, the
    plan, one read of the checkpoint (tensor by tensor) for its identity and the classes of equal tensors.
    ``None`` where the model must be loaded whole (the bundled model, ``QEFF_KV_EXPORT_STREAM=0``, or a checkpoint whose tensors are not the model's parameters by name and shape:
    said in one line)."""
    import os

    from qeff_kv.export import transformers_adapter as hf
    from qeff_kv.export.weights.expert_keys import ConversionRefused, converted_store

    if source.kind not in ("folder", "gguf") or os.environ.get(STREAM_ENV, "1") == "0":
        return None
    torch, _transformers = hf.import_transformers()   # the one-line refusal without the export extra
    dtype = {"float32": torch.float32, "float16": torch.float16}[options.dtype]
    say(f"building {source.name} without its weights (they stream from the checkpoint, {options.dtype})")
    try:
        model, raw = _skeleton_and_store(source, dtype)
        store = converted_store(raw, model)   # per-expert tensors as the fused parameters (expert_keys.py)
        the_plan = plan(model, store)
    except CheckpointError:   # files transformers would not read as given: no whole load either
        raise
    except (StreamRefused, ConversionRefused, ExportError) as exc:
        say(f"streaming is not possible ({exc}): loading the whole model")
        return None
    except Exception as exc:   # noqa: BLE001 - a model transformers cannot build from its config alone
        say(f"streaming is not possible ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}): "
            "loading the whole model")
        return None
    record, classes = _identity(model, raw, store, the_plan, options.dtype, dtype, say)
    try:
        tag(model, the_plan, classes)
    except StreamRefused as exc:
        say(f"streaming is not possible ({exc}): loading the whole model")
        return None
    return Streamed(model, store, the_plan, record)
