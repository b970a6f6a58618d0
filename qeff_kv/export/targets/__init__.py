"""Export targets: one module per target, one interface (:class:`~qeff_kv.export.targets.base.Target`).

A target says how attention reads the cache (every slot / the valid length / onnxruntime's GroupQueryAttention),
which cache object the trace uses, what the attention mask is, and how RoPE is traced. Options
(continuous batching, CCL, sliding rings) are inputs a target composes with, not branches elsewhere.

Adding a target: a module here with a :class:`Target` subclass named ``TARGET``, and one entry in
:data:`REGISTRY` (its module and what options validation, the family facts and the graph passes need to know
before torch is imported: :class:`TargetInfo`, whose ``passes`` are the classes of :mod:`qeff_kv.graph.passes`
the target runs; :func:`qeff_kv.export.graph_passes.pipeline` makes them one ``ir.passes.Sequential``).
Importing this package does not import torch; :func:`get` imports the module asked for.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

import onnx_ir as ir

from qeff_kv.graph.passes import FoldLayoutPairsPass, FuseSkipRMSNormPass, PackGQAQKVPass, PackSharedInputMatMulsPass


@dataclass(frozen=True)
class TargetInfo:
    """What is known of a target without torch."""

    #: the module of this package that defines the target as ``TARGET``
    module: str
    #: options the target cannot honour (``continuous_batching``, ``ccl``, ``ring``, ``mla_latent``) -> the one-line
    #: refusal
    refuses: dict[str, str] = field(default_factory=dict)
    #: sliding layers can keep ring buffers (the cache is written with ScatterND); else full-length buffers,
    #: the window applied by the attention op
    ring_buffers: bool = True
    #: attention runs as onnxruntime's GroupQueryAttention: the model's attention must be expressible by it
    #: (``ModelFacts.fused_refusal``)
    group_query_attention: bool = False
    #: the target's own graph passes after tracing, in order (classes of :mod:`qeff_kv.graph.passes`, each run
    #: where the export's dtype is one of its ``dtypes``; see :func:`qeff_kv.export.graph_passes.pipeline`)
    passes: tuple[type[ir.passes.PassBase], ...] = ()
    #: a single vision-language graph skips its vision encoder on decode steps (an ``If`` on ``image_idx``)
    gates_vision_encoder: bool = False


#: target name -> :class:`TargetInfo`
REGISTRY: dict[str, TargetInfo] = {
    "portable": TargetInfo("portable"),
    "onnxruntime": TargetInfo("onnxruntime", gates_vision_encoder=True),
    "onnxruntime-fused": TargetInfo(
        "fused", ring_buffers=False, group_query_attention=True, gates_vision_encoder=True,
        passes=(PackGQAQKVPass, FuseSkipRMSNormPass, FoldLayoutPairsPass, PackSharedInputMatMulsPass),
        refuses={
            "continuous_batching": "--target onnxruntime-fused does not support --continuous-batching "
                                   "(GroupQueryAttention has no batch_index); use --target onnxruntime",
            "ccl": "--target onnxruntime-fused does not support --ccl (GroupQueryAttention already reads exactly "
                   "the filled slots); use --target portable or onnxruntime",
            "ring": "--target onnxruntime-fused keeps full-length buffers on sliding layers (GroupQueryAttention "
                    "appends in order and windows attention itself); use --sliding-cache full, or --target "
                    "portable or onnxruntime for ring buffers",
            "mla_latent": "--target onnxruntime-fused does not support --mla-cache latent (GroupQueryAttention "
                          "cannot attend over a compressed cache); use --target portable or onnxruntime",
        }),
}
NAMES: tuple[str, ...] = tuple(REGISTRY)


def info(name: str) -> TargetInfo:
    return REGISTRY[name]


def get(name: str):
    """The :class:`~qeff_kv.export.targets.base.Target` subclass of target ``name`` (imports torch)."""
    return importlib.import_module(f"{__name__}.{REGISTRY[name].module}").TARGET
