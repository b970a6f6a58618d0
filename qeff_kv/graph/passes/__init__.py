"""Graph rewrites as onnx_ir passes, one per module; each module's docstring states its invariant and the pass's
``ensures`` checks it (:class:`~qeff_kv.graph.passes._invariants.InvariantPass`, a violation raising
:class:`~qeff_kv.errors.PassInvariantError`). The exporter runs them as one ``ir.passes.Sequential`` per export
(:func:`qeff_kv.export.graph_passes.pipeline`)."""

from qeff_kv.graph.passes.fold_layout_pairs import FoldLayoutPairsPass
from qeff_kv.graph.passes.fuse_skip_rmsnorm import FuseSkipRMSNormPass
from qeff_kv.graph.passes.gate_vision_encoder import GateVisionEncoderPass
from qeff_kv.graph.passes.dialects.growing_to_static import GrowingToStaticPass
from qeff_kv.graph.passes.ort_invalid_index import OrtInvalidIndexPass
from qeff_kv.graph.passes.pack_gqa_qkv import PackGQAQKVPass
from qeff_kv.graph.passes.pack_shared_input_matmuls import PackSharedInputMatMulsPass
from qeff_kv.graph.passes.remove_passthrough import RemovePassThroughPass
from qeff_kv.graph.passes.dialects.retained_to_static import RetainedToStaticPass
from qeff_kv.graph.passes.set_kv_prefix import SetKVPrefixPass
from qeff_kv.graph.passes.dialects.static_to_retained import StaticToRetainedPass
from qeff_kv.graph.passes.dialects.to_dialect import ToDialectPass

__all__ = ["FoldLayoutPairsPass", "FuseSkipRMSNormPass", "GateVisionEncoderPass", "GrowingToStaticPass",
           "OrtInvalidIndexPass", "PackGQAQKVPass", "PackSharedInputMatMulsPass", "RemovePassThroughPass",
           "RetainedToStaticPass",
           "SetKVPrefixPass", "StaticToRetainedPass", "ToDialectPass"]
