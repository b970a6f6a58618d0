"""Graph rewrites as onnx_ir passes, one per module; each module's docstring states its invariant."""

from .set_kv_prefix import SetKVPrefixPass

__all__ = ["SetKVPrefixPass"]
