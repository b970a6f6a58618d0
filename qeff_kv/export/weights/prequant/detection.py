"""Which pre-quantized scheme a checkpoint is, from ``config.json``'s ``quantization_config`` (no torch): each
layout's reader reads its own config (``scheme_of``); this room picks the reader by ``quant_method``."""

from __future__ import annotations

from qeff_kv.errors import ExportError
from qeff_kv.export.weights.prequant import awq, compressed, gptq
from qeff_kv.export.weights.prequant.scheme import FORMATS, PrequantScheme


def detect(config: dict) -> PrequantScheme | None:
    """The checkpoint's int4 scheme from ``config.json`` (``None``: not a quantized checkpoint)."""
    qc = config.get("quantization_config")
    if qc is None and isinstance(config.get("text_config"), dict):
        qc = config["text_config"].get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ExportError(f"quantization_config must be an object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    if method == "awq":
        return awq.scheme_of(qc)
    if method == "gptq":
        return gptq.scheme_of(qc)
    if method == "compressed-tensors":
        return compressed.scheme_of(qc)
    raise ExportError(f"quantization_config quant_method {method!r} is not read (the exporter reads int4 "
                      f"{', '.join(FORMATS)} checkpoints)")
