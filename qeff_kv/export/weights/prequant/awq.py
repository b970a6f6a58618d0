"""AWQ (AutoAWQ's ``version: gemm``) checkpoints: ``<module>.qweight``, ``.qzeros``, ``.scales``.

The GEMM layout, from AutoAWQ's published packing (``WQLinear_GEMM``):

* ``qweight`` int32 ``[K, N/8]``: packed along the **output** features; int32 ``j`` of row ``k`` holds outputs
  ``8j .. 8j+7`` in the interleaved order ``[0, 2, 4, 6, 1, 3, 5, 7]``: nibble ``i`` (bits ``4i..4i+3``) is output
  ``8j + ORDER[i]``;
* ``qzeros`` int32 ``[K/G, N/8]``: the zero points, packed the same way (stored as they are, not minus one);
* ``scales`` ``[K/G, N]`` float16;
* ``W[n, k] = scales[k // G, n] * (q[k, n] - zeros[k // G, n])``. AWQ has no act-order.
"""

from __future__ import annotations

import numpy as np

from qeff_kv.errors import ExportError
from qeff_kv.export.weights.prequant.blocks import QuantizedLinear, check_groups, unpack_int32
from qeff_kv.export.weights.prequant.scheme import PrequantScheme, group_size_of, require_bits

#: AutoAWQ GEMM's interleave: nibble i of each int32 holds element ORDER[i] of its eight
ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
#: the tensor whose presence marks a quantized Linear, and the others it needs
MARK = "qweight"
PARTS = ("qweight", "qzeros", "scales")
#: every tensor of a quantized Linear (none of them is a float weight of the model)
ALL = PARTS


def read(name: str, get, scheme, has=lambda _k: True) -> QuantizedLinear:
    """The Linear ``name`` (``get(key)`` -> numpy array; scales widened to float32)."""
    qweight, qzeros, scales = (get(f"{name}.{p}") for p in PARTS)
    k, n8 = qweight.shape
    if qweight.dtype != np.int32 or qzeros.dtype != np.int32 or scales.shape[1] != n8 * 8 \
            or qzeros.shape != (scales.shape[0], n8):
        raise ExportError(f"{name}: AWQ GEMM tensors of unexpected shapes (qweight {list(qweight.shape)}, qzeros "
                          f"{list(qzeros.shape)}, scales {list(scales.shape)})")
    check_groups(name, k, scales.shape[0], scheme.group_size)
    q = unpack_int32(qweight, axis=1, order=ORDER)          # [K, N]
    z = unpack_int32(qzeros, axis=1, order=ORDER)           # [K/G, N]
    return QuantizedLinear(name, q.T.copy(), z.T.copy(), np.ascontiguousarray(scales.T, dtype=np.float32))


def scheme_of(qc: dict) -> PrequantScheme:
    """The :class:`~qeff_kv.export.weights.prequant.scheme.PrequantScheme` of an AWQ ``quantization_config``."""
    require_bits(qc.get("bits", 4), "AWQ")
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise ExportError(f"an AWQ checkpoint with version {version!r} is not read: only the GEMM packing (version "
                          "'gemm') is known exactly (GEMV and exllama/marlin/ipex layouts are kernel-specific)")
    if qc.get("zero_point", True) is not True:
        raise ExportError("an AWQ checkpoint without zero points (zero_point false) is not read: AWQ GEMM's "
                          "qzeros layout is the one known exactly")
    return PrequantScheme("awq", group_size_of(qc.get("group_size", 128), "AWQ"), symmetric=False, act_order=False,
                          zeros_minus_one=False, layout="gemm")
