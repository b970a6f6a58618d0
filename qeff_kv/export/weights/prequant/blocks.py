"""One Linear's int4 weight as a checkpoint holds it, unpacked, and the same numbers as ``MatMulNBits`` blocks.

Every layout read here (AWQ GEMM, GPTQ, compressed-tensors ``pack-quantized``) dequantizes the same way once its
integers are unpacked: ``W[n, k] = scale[n, g(k)] * (q[n, k] - zero[n, g(k)])`` with ``q`` and ``zero`` integers in
``[0, 15]`` (compressed-tensors' signed ``[-8, 7]`` shifted by 8 on both sides, which leaves ``q - zero`` as it is)
and ``g(k)`` the group of input feature ``k``: ``k // group_size``, or ``g_idx[k]`` for act-order checkpoints.

**Exact in float32.** ``q - zero`` is an integer of at most 4 bits and the checkpoint's scales are float16 or
bfloat16 (11 or 8 significant bits), so the product has at most 15 significant bits: float32 holds it exactly,
which is what :meth:`QuantizedLinear.dequantize` computes (the formats' own CUDA kernels compute it in float16,
rounding it once more: the exact value is the checkpoint's number, the float16 one a kernel's rounding of it).

**MatMulNBits** (4 bits) dequantizes ``(q - zero_point) * scale`` per block of ``block`` values along K: packed
``B [N, K/block, block/2]`` uint8 (element ``2i`` in the low nibble of byte ``i``), ``scales [N * K/block]`` and
zero points packed two per byte ``[N, ceil((K/block)/2)]`` (block ``2j`` in the low nibble), default 8 when
omitted. A group of ``G`` values is ``G/block`` blocks with the group's scale and zero point, so the blocks
reproduce every weight bit for bit (:meth:`QuantizedLinear.matmulnbits_rows`).

**Act-order** (``g_idx`` not ``k // group_size``): onnxruntime 1.32's schema marks MatMulNBits' ``g_idx`` input
deprecated, so it is not used. Instead K is permuted so that each group's features are contiguous
(:attr:`QuantizedLinear.order`): the node reads the activation's columns in that order (a ``Gather`` on the last
axis) and the weight's rows in the same order: ``sum_k x[k] W[n, k]`` over the same terms, exact weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from qeff_kv.errors import ExportError
from qeff_kv.export.weights.prequant.scheme import block_for_group


@dataclass
class QuantizedLinear:
    """``q [N, K]`` and ``zeros [N, G]`` uint8 in ``[0, 15]``, ``scales [N, G]`` float32 (the checkpoint's own,
    widened exactly), ``g_idx [K]`` (``None``: contiguous groups of ``K / G``)."""

    name: str
    q: np.ndarray
    zeros: np.ndarray
    scales: np.ndarray
    g_idx: np.ndarray | None = None

    def __post_init__(self):
        n, k = self.q.shape
        if self.zeros.shape != self.scales.shape or self.scales.shape[0] != n or k % self.scales.shape[1]:
            raise ExportError(f"{self.name}: scales {list(self.scales.shape)} and zero points "
                              f"{list(self.zeros.shape)} do not describe groups of a [{n}, {k}] weight")
        if self.q.max(initial=0) > 15 or self.zeros.max(initial=0) > 15:
            raise ExportError(f"{self.name}: 4-bit values or zero points outside [0, 15]")
        if self.g_idx is not None:
            g = np.asarray(self.g_idx, dtype=np.int64)
            if g.shape != (k,) or g.min(initial=0) < 0 or g.max(initial=0) >= self.scales.shape[1]:
                raise ExportError(f"{self.name}: g_idx does not map {k} input features onto "
                                  f"{self.scales.shape[1]} groups")
            self.g_idx = None if np.array_equal(g, np.arange(k) // self.group_size) else g

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape

    @property
    def group_size(self) -> int:
        return self.q.shape[1] // self.scales.shape[1]

    @property
    def groups(self) -> np.ndarray:
        """The group of each input feature."""
        return np.arange(self.q.shape[1]) // self.group_size if self.g_idx is None else self.g_idx

    def dequantize(self) -> np.ndarray:
        """``W [N, K]`` float32: ``scale * (q - zero)``, exact (see the module's docstring)."""
        g = self.groups
        return self.scales[:, g] * (self.q.astype(np.float32) - self.zeros[:, g].astype(np.float32))

    @cached_property
    def order(self) -> np.ndarray | None:
        """The permutation of K that makes act-order groups contiguous (``None``: they already are). Refused when
        a group does not hold exactly ``K / G`` features (no permutation makes it a run of whole blocks)."""
        if self.g_idx is None:
            return None
        perm = np.argsort(self.g_idx, kind="stable")
        if not np.array_equal(self.g_idx[perm], np.arange(self.q.shape[1]) // self.group_size):
            raise ExportError(f"{self.name}: its g_idx groups are not {self.group_size} features each; act-order "
                              "cannot be made contiguous blocks")
        return perm

    @property
    def block(self) -> int:
        """MatMulNBits' block: tiles a group (``group_size`` <= K; one group per row is K itself)."""
        return block_for_group(self.group_size)

    def matmulnbits_rows(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rows ``rows`` of the weight as MatMulNBits data in :attr:`order`: ``(packed [n, K/block, block/2]
        uint8, scales [n, K/block] float32, zero points [n, K/block] uint8 unpacked)``."""
        block = self.block
        k = self.q.shape[1]
        perm = self.order
        q = self.q[rows] if perm is None else self.q[rows][:, perm]
        g = self.groups if perm is None else self.groups[perm]
        first = g[::block]                                  # each block's group (a block lies inside one group)
        q = q.reshape(len(rows), k // block, block)
        packed = (q[:, :, 0::2] | (q[:, :, 1::2] << 4)).astype(np.uint8)
        return packed, self.scales[rows][:, first], self.zeros[rows][:, first]


def check_groups(name: str, k: int, groups: int, group_size: int) -> None:
    """Refuse scales whose group count is not the config's ``group_size`` over ``k`` features (-1: one group)."""
    expected = 1 if group_size == -1 else k // group_size
    if group_size != -1 and k % group_size or groups != expected:
        raise ExportError(f"{name}: {groups} groups for {k} input features, but the config's group_size is "
                          f"{group_size}")


def pack_zero_points(zp: np.ndarray) -> np.ndarray:
    """``[N, blocks]`` uint8 in ``[0, 15]`` -> MatMulNBits' packed ``[N, ceil(blocks / 2)]`` (block ``2j`` in the
    low nibble, an odd count's last high nibble 0)."""
    n, b = zp.shape
    if b % 2:
        zp = np.concatenate([zp, np.zeros((n, 1), np.uint8)], axis=1)
    return (zp[:, 0::2] | (zp[:, 1::2] << 4)).astype(np.uint8)


def unpack_int32(packed: np.ndarray, axis: int, order=None) -> np.ndarray:
    """Eight 4-bit values per int32 along ``axis`` (0 or 1), nibble ``i`` (bits ``4i..4i+3``) holding element
    ``8j + order[i]`` of packed index ``j`` (``order``: identity unless given, e.g. AWQ's interleave)."""
    u = np.ascontiguousarray(packed).view(np.uint32)
    nib = [((u >> np.uint32(4 * i)) & np.uint32(0xF)).astype(np.uint8) for i in range(8)]
    slots = list(range(8)) if order is None else [list(order).index(j) for j in range(8)]
    stacked = np.stack([nib[s] for s in slots], axis=axis + 1)   # element 8j + t is nibble slots[t]
    shape = list(packed.shape)
    shape[axis] *= 8
    return stacked.reshape(shape)
