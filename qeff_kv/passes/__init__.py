"""Graph rewrites as onnx_ir passes, one per module; each module's docstring states its invariant."""

from .ort_invalid_index import OrtInvalidIndexPass
from .pack_gqa_qkv import PackGQAQKVPass
from .set_kv_prefix import SetKVPrefixPass

__all__ = ["OrtInvalidIndexPass", "PackGQAQKVPass", "SetKVPrefixPass"]
