"""Graph rewrites as onnx_ir passes, one per module; each module's docstring states its invariant."""

from qeff_kv.graph.passes.fold_layout_pairs import FoldLayoutPairsPass
from qeff_kv.graph.passes.fuse_skip_rmsnorm import FuseSkipRMSNormPass
from qeff_kv.graph.passes.gate_vision_encoder import GateVisionEncoderPass
from qeff_kv.graph.passes.ort_invalid_index import OrtInvalidIndexPass
from qeff_kv.graph.passes.pack_gqa_qkv import PackGQAQKVPass
from qeff_kv.graph.passes.pack_shared_input_matmuls import PackSharedInputMatMulsPass
from qeff_kv.graph.passes.remove_passthrough import RemovePassThroughPass
from qeff_kv.graph.passes.set_kv_prefix import SetKVPrefixPass

__all__ = ["FoldLayoutPairsPass", "FuseSkipRMSNormPass", "GateVisionEncoderPass", "OrtInvalidIndexPass", "PackGQAQKVPass",
           "PackSharedInputMatMulsPass", "RemovePassThroughPass",
           "SetKVPrefixPass"]
