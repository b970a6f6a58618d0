"""Graph rewrites as onnx_ir passes, one per module; each module's docstring states its invariant."""

from .fuse_skip_rmsnorm import FuseSkipRMSNormPass
from .gate_vision_encoder import GateVisionEncoderPass
from .ort_invalid_index import OrtInvalidIndexPass
from .pack_gqa_qkv import PackGQAQKVPass
from .remove_passthrough import RemovePassThroughPass
from .set_kv_prefix import SetKVPrefixPass

__all__ = ["FuseSkipRMSNormPass", "GateVisionEncoderPass", "OrtInvalidIndexPass", "PackGQAQKVPass", "RemovePassThroughPass",
           "SetKVPrefixPass"]
