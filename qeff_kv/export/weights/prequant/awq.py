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

