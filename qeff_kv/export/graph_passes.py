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
    if options.kv_cache_dtype == "int8":
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
    """``--kv-cache-dtype int8``: each GroupQueryAttention's static scales (inputs 12 and 13) take the contract's
    names (:func:`~qeff_kv.contract.naming.kv_scale_name`) of the layer whose buffers the node reads."""
    for node in model.graph:
        if node.op_type != "GroupQueryAttention" or len(node.inputs) < 14:
            continue
        for index, buffer in zip((12, 13), node.inputs[3:5]):
            scale = node.inputs[index]
            kv = naming.parse_kv_name(buffer.name) if buffer is not None else None
            producer = scale.producer() if scale is not None else None
            tensor = scale.const_value if scale is not None and scale.is_initializer() else \
                producer.attributes["value"].as_tensor() if producer is not None and producer.op_type == "Constant" \
                else None
            if kv is None or tensor is None:
                raise QeffKvError(f"GroupQueryAttention node {node.name} reads no retained buffer or no static scale")
            named = ir.Value(name=naming.kv_scale_name(kv.stem, kv.layer), shape=ir.Shape(tensor.shape),
                             type=ir.TensorType(tensor.dtype), const_value=tensor)
            model.graph.register_initializer(named)
            node.replace_input_with(index, named)
            if producer is not None and not scale.uses():
                model.graph.remove(producer, safe=True)
            elif scale.is_initializer() and not scale.uses():
                model.graph.initializers.pop(scale.name)
