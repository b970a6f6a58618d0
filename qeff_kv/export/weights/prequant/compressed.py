"""compressed-tensors checkpoints in ``pack-quantized`` format (llm-compressor's W4A16): ``<module>.weight_packed``,
``.weight_scale``, ``.weight_zero_point`` (asymmetric only), ``.weight_shape``, ``.weight_g_idx`` (act-order
``group`` only).

From compressed-tensors' published compressor (``PackedQuantizationCompressor``, ``pack_to_int32``):

* values are signed ``[-8, 7]``, stored as ``value + 8`` in 4 bits;
* ``weight_packed`` int32 ``[N, ceil(K/8)]``: packed along the **input** features, nibble ``i`` of int32 ``j`` =
  feature ``8j + i``; ``weight_shape`` = ``[N, K]`` (the padding dropped);
* ``weight_scale`` ``[N, K/G]`` (``[N, 1]`` for the ``channel`` strategy), in the model's dtype (bfloat16/float16);
* ``weight_zero_point`` int32 ``[ceil(N/8), K/G]``: packed along the **outputs** (``packed_dim=0``), signed
  ``[-8, 7]`` + 8; symmetric checkpoints store none (zero point 0, i.e. 8 unsigned);
* ``W = (q - zero_point) * scale`` per group (``weight_g_idx`` maps features to groups for ``actorder: group``).

Read: one scheme for every quantized Linear (``config_groups`` that differ are refused), weights only (input
activations, KV-cache schemes, other formats and sparsity are refused in one line).
"""

from __future__ import annotations

import numpy as np

from qeff_kv.errors import ExportError
from qeff_kv.export.weights.prequant.blocks import QuantizedLinear, check_groups, unpack_int32
from qeff_kv.export.weights.prequant.scheme import PrequantScheme, group_size_of, require_bits

MARK = "weight_packed"
ALL = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")


def scheme_of(qc: dict):
    """The :class:`~qeff_kv.export.weights.prequant.scheme.PrequantScheme` of a compressed-tensors
    ``quantization_config``."""
    fmt = qc.get("format")
    if fmt != "pack-quantized":
        raise ExportError(f"a compressed-tensors checkpoint in format {fmt!r} is not read: only 'pack-quantized' "
                          "int4 weights map onto MatMulNBits")
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise ExportError(f"a compressed-tensors checkpoint with quantization_status {status!r} is not read "
                          "(its weights are not the packed integers)")
    sparsity = qc.get("sparsity_config")
    if isinstance(sparsity, dict) and sparsity.get("format", "dense") != "dense":
        raise ExportError(f"a compressed-tensors checkpoint with {sparsity.get('format')!r} sparsity is not read")
    if qc.get("kv_cache_scheme"):
        raise ExportError("a compressed-tensors checkpoint with a kv_cache_scheme is not read (a quantized KV "
                          "cache is not the retained-state graph's float cache)")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ExportError("compressed-tensors quantization_config has no config_groups")
    schemes = []
    for gname, g in groups.items():
        if not isinstance(g, dict) or not isinstance(g.get("weights"), dict):
            raise ExportError(f"compressed-tensors config group {gname!r} quantizes no weights")
        if g.get("input_activations") or g.get("output_activations"):
            raise ExportError(f"compressed-tensors config group {gname!r} quantizes activations too: only "
                              "weight-only (W4A16) checkpoints map onto MatMulNBits")
        schemes.append(_weights_scheme(g["weights"]))
    if len(set(schemes)) != 1:
        raise ExportError(f"compressed-tensors config groups with {len(set(schemes))} different weight schemes "
                          "are not read (one int4 scheme for every Linear)")
    _strategy, group, sym, act = schemes[0]
    return PrequantScheme("compressed-tensors", group, symmetric=sym, act_order=act, zeros_minus_one=False,
                          layout="pack-quantized")


def _weights_scheme(w: dict) -> tuple:
    require_bits(w.get("num_bits"), "compressed-tensors")
    if w.get("type", "int") != "int":
        raise ExportError(f"compressed-tensors weights of type {w.get('type')!r} are not read (int only)")
    if w.get("dynamic"):
        raise ExportError("compressed-tensors weights with dynamic quantization are not read")
    strategy = w.get("strategy")
    if strategy == "channel":
        group = -1
    elif strategy == "group":
        group = group_size_of(w.get("group_size"), "compressed-tensors")
    else:
        raise ExportError(f"compressed-tensors weights with strategy {strategy!r} are not read (group or channel)")
    actorder = w.get("actorder")
    if actorder not in (None, "group", "weight", "static", False):
        raise ExportError(f"compressed-tensors actorder {actorder!r} is not read")
    return strategy, group, bool(w.get("symmetric", True)), actorder == "group"


def read(name: str, get, scheme, has=lambda _k: True) -> QuantizedLinear:
    packed, scales = get(f"{name}.weight_packed"), get(f"{name}.weight_scale")
    shape = [int(v) for v in get(f"{name}.weight_shape").reshape(-1)] if has(f"{name}.weight_shape") \
        else [packed.shape[0], packed.shape[1] * 8]
    n, k = shape
    if packed.dtype != np.int32 or packed.shape != (n, -(-k // 8)) or scales.ndim != 2 or scales.shape[0] != n:
        raise ExportError(f"{name}: pack-quantized tensors of unexpected shapes (weight_packed "
                          f"{list(packed.shape)}, weight_scale {list(scales.shape)}, weight_shape {shape})")
    q = unpack_int32(packed, axis=1)[:, :k]
    if scheme.symmetric:
        z = np.full(scales.shape, 8, np.uint8)
    else:
        zp = get(f"{name}.weight_zero_point")
        if zp.dtype != np.int32 or zp.shape != (-(-n // 8), scales.shape[1]):
            raise ExportError(f"{name}: weight_zero_point {list(zp.shape)} is not [{-(-n // 8)}, "
                              f"{scales.shape[1]}] int32 packed along the outputs")
        z = unpack_int32(zp, axis=0)[:n]
    g_idx = get(f"{name}.weight_g_idx").astype(np.int64) if has(f"{name}.weight_g_idx") else None
    if g_idx is None:
        check_groups(name, k, scales.shape[1], scheme.group_size)
    return QuantizedLinear(name, q, z, np.ascontiguousarray(scales, dtype=np.float32), g_idx)
