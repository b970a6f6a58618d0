"""Graph rewrites as onnx_ir passes, one per module; each module's docstring states its invariant."""

from .fold_layout_pairs import FoldLayoutPairsPass
from .fuse_skip_rmsnorm import FuseSkipRMSNormPass
from .gate_vision_encoder import GateVisionEncoderPass
from .ort_invalid_index import OrtInvalidIndexPass
from .pack_gqa_qkv import PackGQAQKVPass
from .pack_shared_input_matmuls import PackSharedInputMatMulsPass
from .remove_passthrough import RemovePassThroughPass
from .set_kv_prefix import SetKVPrefixPass

__all__ = ["FoldLayoutPairsPass", "FuseSkipRMSNormPass", "GateVisionEncoderPass", "OrtInvalidIndexPass", "PackGQAQKVPass",
           "PackSharedInputMatMulsPass", "RemovePassThroughPass",
           "SetKVPrefixPass"]
