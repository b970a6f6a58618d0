"""The graph-passes stage: the raw traced graph made deterministic and final (metadata, exact output shapes,
the IR version onnxruntime loads), then one ``ir.passes.Sequential`` of onnx_ir passes (:func:`pipeline`): the
passes every export runs, the target's own (``TargetInfo.passes``), the vision-encoder gate, the prefix. Each pass
is one file of :mod:`qeff_kv.graph.passes` with its invariant, checked by its ``ensures``; this module only says
which run, in which order."""

from __future__ import annotations

import json

import onnx_ir as ir

from qeff_kv import __version__
from qeff_kv.contract import naming
from qeff_kv.errors import QeffKvError
from qeff_kv.export import options as opt
from qeff_kv.export import targets
from qeff_kv.graph.passes import GateVisionEncoderPass, RemovePassThroughPass, SetKVPrefixPass


class Pipeline(ir.passes.Sequential):
    """``ir.passes.Sequential`` that lets a pass's typed refusal (:class:`~qeff_kv.errors.QeffKvError`: a prefix
    the graph cannot take, a broken invariant) out as it is, where onnx_ir wraps every error in a ``PassError``."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        try:
            return super().call(model)
        except ir.passes.PassError as exc:
            cause = exc.__cause__
            while cause is not None and not isinstance(cause, QeffKvError):
                cause = cause.__cause__
            if cause is None:
                raise
            raise cause from None


def pipeline(options: opt.ExportOptions) -> Pipeline:
    """The passes an export with ``options`` runs on its decoder graph, in order: no-op nodes between a KV update
    and its retained output removed (the in-place rule), the target's passes that apply to the dtype, the gate of a
    single vision-language graph's encoder where the target gates it, the KV-cache prefix when one is asked for."""
    target = targets.info(options.target)
    passes: list[ir.passes.PassBase] = [RemovePassThroughPass()]
    passes += [cls() for cls in target.passes if options.dtype in cls.dtypes]
    if options.single_graph and target.gates_vision_encoder:
        # decode steps (image_idx -1 from qeff-kv's runtime) skip the vision encoder; the portable target keeps the
        # peer's plain graph (accelerator compilers may not take an If)
        passes.append(GateVisionEncoderPass())
    if options.kv_cache_prefix is not None:
        passes.append(SetKVPrefixPass(options.kv_cache_prefix))
    return Pipeline(*passes)


def finalize(model: ir.Model, options: opt.ExportOptions, geometry: dict) -> None:
    """Deterministic metadata, the IR version onnxruntime loads, exact output shapes, then the passes."""
    model.ir_version = opt.IR_VERSION
    model.producer_name = "qeff-kv"
    model.producer_version = __version__
    model.doc_string = None
    model.graph.name = "qeff_kv_decoder"
    logits = model.graph.outputs[0]
    rows = 1 if options.speculative_tokens is None else naming.LOGITS_TO_KEEP_INPUT
    logits.shape = ir.Shape(["batch_size", rows, geometry["vocab_size"]])
    _metadata(model, options, geometry)
    if options.quantized_kv:
        name_kv_scales(model)
    passes = pipeline(options)
    passes(model)
    if any(isinstance(p, GateVisionEncoderPass) and p.gated for p in passes.passes):
        model.metadata_props[naming.VISION_ENCODER_META] = naming.VISION_ENCODER_GATED   # runs where image_idx >= 0


def _metadata(model: ir.Model, options: opt.ExportOptions, geometry: dict) -> None:
    """The graph metadata the runtime and the tools read back (keys: :mod:`qeff_kv.contract.naming`)."""
    meta = model.metadata_props
    if options.speculative_tokens is not None:   # decode steps verify up to K drafted tokens (K+1 rows)
        meta[naming.SPECULATIVE_META] = str(options.speculative_tokens)
    meta[naming.EXPORTER_VERSION_META] = str(opt.EXPORTER_VERSION)
    meta[naming.CONTINUOUS_BATCHING_META] = str(bool(options.continuous_batching)).lower()
    meta[naming.TARGET_META] = options.target
    if geometry.get("sliding_window"):
        meta[naming.SLIDING_WINDOW_META] = str(geometry["sliding_window"])
        meta[naming.SLIDING_CACHE_META] = str(geometry["sliding_cache"])
    if geometry.get("state_spec") is not None:   # what each layer retains (qeff_kv.contract.statespec)
        meta[naming.STATE_SPEC_META] = geometry["state_spec"].dumps()
    if geometry.get("mla"):   # MLA's latent cache: the expanded cache's geometry (qeff_kv.tools.buffers)
        meta[naming.MLA_META] = json.dumps(geometry["mla"], sort_keys=True)
    if geometry.get("lora"):   # the adapters' largest rank and modules, and those the export was proved with
        meta[naming.LORA_META] = json.dumps(geometry["lora"], sort_keys=True)
    if geometry.get("vision"):   # what a runtime needs to feed images, with the bare .onnx too
        meta[naming.VISION_META] = json.dumps(geometry["vision"], sort_keys=True)


def name_kv_scales(model: ir.Model) -> None:
    """``--kv-cache-dtype int8``: the static scales take the contract's names (:func:`~qeff_kv.contract.naming.
    kv_scale_name`) of the buffer they scale, as initializers: GroupQueryAttention's inputs 12 and 13 (fused target);
    on the ScatterND targets the ``Div`` that quantizes a buffer's update (``Cast(Clip(Round(Div(x, scale))))``)
    and every equal constant (the ``Mul`` that dequantizes what attention reads)."""
    found = []   # (value read as the scale, its tensor, the name)
    for node in model.graph:
        if node.op_type == "GroupQueryAttention" and len(node.inputs) >= 14:
            for index, buffer in zip((12, 13), node.inputs[3:5]):
                found.append((node, index, buffer))
        elif node.op_type == "ScatterND":
            div = _quantizing_div(node.inputs[2])
            if div is not None:
                found.append((div, 1, node.inputs[0]))
    named: dict[str, ir.Value] = {}
    for node, index, buffer in found:
        scale = node.inputs[index]
        kv = naming.parse_kv_name(buffer.name) if buffer is not None and buffer.name else None
        tensor = _constant(scale)
        if kv is None or tensor is None:
            raise QeffKvError(f"{node.op_type} node {node.name} reads no retained buffer or no static scale")
        name = naming.kv_scale_name(kv.stem, kv.layer)
        if name not in named:
            named[name] = ir.Value(name=name, shape=ir.Shape(tensor.shape), type=ir.TensorType(tensor.dtype),
                                   const_value=tensor)
            model.graph.register_initializer(named[name])
        node.replace_input_with(index, named[name])
        _drop_if_unused(model, scale)
    _share_equal_constants(model, list(named.values()))


def _quantizing_div(value):
    """The ``Div`` of ``Cast(Clip(Round(Div(x, scale))))`` (through any ``Cast``) that produced ``value``, or None."""
    node = value.producer() if value is not None else None
    for op in ("Cast", "Clip", "Round", "Div"):
        while node is not None and node.op_type == "Cast" and op != "Cast":
            node = node.inputs[0].producer()
        if node is None or node.op_type != op:
            return None
        if op == "Div":
            return node
        node = node.inputs[0].producer()
    return None


def _constant(value):
    """The tensor of an initializer or a ``Constant`` node's output, else None."""
    if value is None:
        return None
    if value.is_initializer():
        return value.const_value
    producer = value.producer()
    if producer is not None and producer.op_type == "Constant" and "value" in producer.attributes:
        return producer.attributes["value"].as_tensor()
    return None


def _drop_if_unused(model: ir.Model, value) -> None:
    if value.uses():
        return
    producer = value.producer()
    if producer is not None:
        model.graph.remove(producer, safe=True)
    elif value.is_initializer():
        model.graph.initializers.pop(value.name)


def _share_equal_constants(model: ir.Model, scales: list) -> None:
    """Constants equal to a named scale (the dequantizing ``Mul``'s copy) read the named initializer instead."""
    by_bytes = {(tuple(v.const_value.shape), v.const_value.numpy().tobytes()): v for v in scales}
    for node in list(model.graph):
        if node.op_type != "Constant" or "value" not in node.attributes:
            continue
        tensor = node.attributes["value"].as_tensor()
        target = by_bytes.get((tuple(tensor.shape), tensor.numpy().tobytes()))
        if target is None or tensor.dtype != target.const_value.dtype:
            continue
        out = node.outputs[0]
        for user, index in list(out.uses()):
            user.replace_input_with(index, target)
        _drop_if_unused(model, out)
