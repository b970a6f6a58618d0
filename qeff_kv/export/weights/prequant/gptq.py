"""GPTQ checkpoints (AutoGPTQ / GPTQModel, ``checkpoint_format`` ``gptq`` (v1) or ``gptq_v2``): ``<module>.qweight``,
``.qzeros``, ``.scales``, ``.g_idx``.

From the published packing (AutoGPTQ's ``QuantLinear.pack``):

* ``qweight`` int32 ``[K/8, N]``: packed along the **input** features, nibble ``i`` of int32 ``j`` = feature
  ``8j + i``;
* ``qzeros`` int32 ``[G, N/8]``: packed along the outputs, nibble ``i`` = output ``8j + i``. **v1 stores each zero
  point minus one** (``zeros -= 1`` before packing; its kernels add the one back), so a symmetric checkpoint's
  zero point 8 is stored as 7; ``gptq_v2`` stores the zero point itself. A v1 zero point of 0 was stored as -1 and
  reads back as 16, which no 4-bit zero point holds: refused in one line;
* ``scales`` ``[G, N]`` float16; ``g_idx`` int32 ``[K]``: the group of each input feature (``k // group_size``
  without act-order, a scatter with ``desc_act``);
* ``W[n, k] = scales[g_idx[k], n] * (q[k, n] - zeros[g_idx[k], n])``.
"""

from __future__ import annotations

import numpy as np

from qeff_kv.errors import ExportError
from qeff_kv.export.weights.prequant.blocks import QuantizedLinear, check_groups, unpack_int32
from qeff_kv.export.weights.prequant.scheme import PrequantScheme, group_size_of, require_bits

MARK = "qweight"
PARTS = ("qweight", "qzeros", "scales")
ALL = PARTS + ("g_idx",)


def read(name: str, get, scheme, has=lambda _k: True) -> QuantizedLinear:
    qweight, qzeros, scales = (get(f"{name}.{p}") for p in PARTS)
    k8, n = qweight.shape
    k = k8 * 8
    if qweight.dtype != np.int32 or qzeros.dtype != np.int32 or scales.shape[1] != n \
            or qzeros.shape != (scales.shape[0], (n + 7) // 8):
        raise ExportError(f"{name}: GPTQ tensors of unexpected shapes (qweight {list(qweight.shape)}, qzeros "
                          f"{list(qzeros.shape)}, scales {list(scales.shape)})")
    q = unpack_int32(qweight, axis=0)                                   # [K, N]
    z = unpack_int32(qzeros, axis=1)[:, :n].astype(np.int16)            # [G, N]
    if scheme.zeros_minus_one:
        z = z + 1
        if (z > 15).any():
            raise ExportError(f"{name}: a GPTQ v1 zero point of 0 was stored as -1 (it reads back as 16, which "
                              "no 4-bit zero point holds); re-save the checkpoint in gptq_v2 format")
    g_idx = get(f"{name}.g_idx").astype(np.int64) if has(f"{name}.g_idx") else None
    if g_idx is None and scheme.act_order:
        raise ExportError(f"{name}: desc_act is set but the checkpoint holds no g_idx")
    if g_idx is None:
        check_groups(name, k, scales.shape[0], scheme.group_size)
    elif scheme.group_size != -1 and scales.shape[0] != -(-k // scheme.group_size):
        raise ExportError(f"{name}: {scales.shape[0]} groups for {k} input features, but the config's group_size "
                          f"is {scheme.group_size}")
    return QuantizedLinear(name, q.T.copy(), z.astype(np.uint8).T.copy(),
                           np.ascontiguousarray(scales.T, dtype=np.float32), g_idx)


def scheme_of(qc: dict) -> PrequantScheme:
    """The :class:`~qeff_kv.export.weights.prequant.scheme.PrequantScheme` of a GPTQ ``quantization_config``."""
    require_bits(qc.get("bits", 4), "GPTQ")
    fmt = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ExportError(f"a GPTQ checkpoint in format {fmt!r} is not read: only the gptq (v1) and gptq_v2 "
                          "layouts are known exactly (marlin, bitblas and exllama layouts are kernel-specific)")
    sym = qc.get("sym", True)
    if not isinstance(sym, bool):
        raise ExportError(f"quantization_config: 'sym' must be true or false, got {sym!r}")
    return PrequantScheme("gptq", group_size_of(qc.get("group_size", 128), "GPTQ"), symmetric=sym,
                          act_order=bool(qc.get("desc_act", False)), zeros_minus_one=fmt == "gptq", layout=fmt)
