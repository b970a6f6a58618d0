"""Export targets: one module per target, one interface (:class:`~qeff_kv.export.targets.base.Target`).

A target says how attention reads the cache (every slot / the valid length / onnxruntime's GroupQueryAttention),
which ``past_key_values`` object the trace uses, what the attention mask is, and how RoPE is traced. Options
(continuous batching, CCL, sliding rings) are inputs a target composes with, not branches elsewhere.

Adding a target: a module here with a :class:`Target` subclass named ``TARGET``, and one line in
:data:`REGISTRY`. Importing this package does not import torch (the registry names modules; :func:`get`
imports the one asked for).
"""

from __future__ import annotations

import importlib

#: target name -> the module (in this package) that defines it as ``TARGET``
REGISTRY: dict[str, str] = {
    "portable": "portable",
    "onnxruntime": "onnxruntime",
    "onnxruntime-fused": "fused",
}
NAMES: tuple[str, ...] = tuple(REGISTRY)


def get(name: str):
    """The :class:`~qeff_kv.export.targets.base.Target` subclass of target ``name`` (imports torch)."""
    return importlib.import_module(f"{__name__}.{REGISTRY[name]}").TARGET
