"""Pre-quantized int4 checkpoints (AWQ GEMM, GPTQ, compressed-tensors ``pack-quantized``): what the checkpoint is,
read from ``config.json``'s ``quantization_config`` before anything is loaded (no torch, no onnxruntime).

:func:`detect` answers ``None`` for a float checkpoint, a :class:`PrequantScheme` for one the exporter reads, and
raises a one-line :class:`~qeff_kv.errors.ExportError` for any other quantized checkpoint (another method, another
bit width, a kernel-specific layout, activation quantization). :meth:`PrequantScheme.resolve_flags` then turns the
export's ``--weights``/``--block-size``/``--target``/``--dtype`` into what the checkpoint itself says (int4
``MatMulNBits`` blocks of its own group size) or refuses them in one line.

The rooms, bottom to top (docs/architecture.md): :mod:`.scheme` (:class:`PrequantScheme` and the checks every
layout's config shares), :mod:`.blocks` (one Linear's int4 weight unpacked, its exact float dequantization and its
``MatMulNBits`` repacking), one reader per layout, each reading its own config too (:mod:`.awq`, :mod:`.gptq`,
:mod:`.compressed`), :mod:`.detection` (:func:`detect`: the reader by ``quant_method``), :mod:`.folder` (the
safetensors folder: every quantized Linear, the dequantized float model for the PyTorch reference) and :mod:`.graph`
(the float graph's MatMuls replaced by ``MatMulNBits`` built from the checkpoint's own blocks). This face
re-exports :func:`detect` and :mod:`.scheme`'s names.
"""

from qeff_kv.export.weights.prequant.detection import detect
from qeff_kv.export.weights.prequant.scheme import (FORMATS, MAX_BLOCK, PrequantScheme, block_for_group, group_size_of,
                                                    require_bits)

__all__ = ["FORMATS", "MAX_BLOCK", "PrequantScheme", "block_for_group", "detect", "group_size_of", "require_bits"]
