"""The graph-passes stage: the raw traced graph made deterministic and final (metadata, exact output shapes,
the IR version onnxruntime loads), then the onnx_ir passes of :mod:`qeff_kv.graph.passes` the target asks for, then the
prefix. Each pass is one file with its invariant; this module only says which run, in which order."""

from __future__ import annotations

import json

import onnx_ir as ir

from qeff_kv import __version__
from qeff_kv.contract import naming
from qeff_kv.graph.passes import (FoldLayoutPairsPass, FuseSkipRMSNormPass, GateVisionEncoderPass, PackGQAQKVPass,
                      PackSharedInputMatMulsPass,
                      RemovePassThroughPass, SetKVPrefixPass)
from qeff_kv.export import options as opt
from qeff_kv.export import targets

#: passes a target may ask for (``TargetInfo.passes``) -> (the pass, the dtypes it applies to)
TARGET_PASSES = {
    "PackGQAQKVPass": (PackGQAQKVPass, ("float32", "float16")),
    "FuseSkipRMSNormPass": (FuseSkipRMSNormPass, ("float32",)),
    "FoldLayoutPairsPass": (FoldLayoutPairsPass, ("float32", "float16")),
    "PackSharedInputMatMulsPass": (PackSharedInputMatMulsPass, ("float32", "float16")),
}


def finalize(model: ir.Model, options: opt.ExportOptions, geometry: dict) -> None:
    """Deterministic metadata, the IR version onnxruntime loads, exact output shapes, then the prefix."""
    model.ir_version = opt.IR_VERSION
    model.producer_name = "qeff-kv"
    model.producer_version = __version__
    model.doc_string = None
    model.graph.name = "qeff_kv_decoder"
    logits = model.graph.outputs[0]
    rows = 1 if options.speculative_tokens is None else naming.LOGITS_TO_KEEP_INPUT
    logits.shape = ir.Shape(["batch_size", rows, geometry["vocab_size"]])
    if options.speculative_tokens is not None:   # decode steps verify up to K drafted tokens (K+1 rows)
        model.metadata_props[naming.SPECULATIVE_META] = str(options.speculative_tokens)
    model.metadata_props["qeff_kv.exporter_version"] = str(opt.EXPORTER_VERSION)
    model.metadata_props["qeff_kv.continuous_batching"] = str(bool(options.continuous_batching)).lower()
    model.metadata_props["qeff_kv.target"] = options.target
    if geometry.get("sliding_window"):
        model.metadata_props[naming.SLIDING_WINDOW_META] = str(geometry["sliding_window"])
        model.metadata_props[naming.SLIDING_CACHE_META] = str(geometry["sliding_cache"])
    if geometry.get("state_spec") is not None:   # what each layer retains (qeff_kv.contract.statespec)
        model.metadata_props[naming.STATE_SPEC_META] = geometry["state_spec"].dumps()
    if geometry.get("mla"):   # MLA's latent cache: the expanded cache's geometry (qeff_kv.tools.buffers)
        model.metadata_props[naming.MLA_META] = json.dumps(geometry["mla"], sort_keys=True)
    if geometry.get("vision"):   # what a runtime needs to feed images, with the bare .onnx too
        model.metadata_props[naming.VISION_META] = json.dumps(geometry["vision"], sort_keys=True)
    RemovePassThroughPass()(model)  # no-op nodes between a KV update and its retained output (in-place rule)
    target = targets.info(options.target)
    for name in target.passes:   # the target's own passes (see qeff_kv.export.targets.REGISTRY)
        if options.dtype in TARGET_PASSES[name][1]:
            TARGET_PASSES[name][0]()(model)
    if options.single_graph and target.gates_vision_encoder:
        # decode steps (image_idx -1 from qeff-kv's runtime) skip the vision encoder; the portable target keeps the
        # peer's plain graph (accelerator compilers may not take an If)
        if GateVisionEncoderPass()(model).modified:
            model.metadata_props["qeff_kv.vision_encoder"] = "gated"   # runs only where image_idx >= 0
    if options.kv_cache_prefix is not None:
        SetKVPrefixPass(options.kv_cache_prefix)(model)
