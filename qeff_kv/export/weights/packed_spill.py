"""One quantization per weight (issue 51): the packed blocks the streamed reference dequantizes are the blocks the
writer writes.

A streamed ``--weights int4|int8`` export with verification runs the PyTorch reference on each weight quantized
then dequantized (:func:`.stream.dequantizing`), before the graph is traced; the graph's ``MatMulNBits``
initializers are packed later, when the graph is written (:mod:`.quantize_stream`). Both pack with onnxruntime's
``qbits_block_quant`` on the same values in the same column chunks, so the bytes are the same; computing them twice
cost a second pass of the quantizer over every weight.

:class:`PackedSpill` keeps the first computation: the reference's quantizer writes each weight's packed blocks,
scales (and zero points) to one file in the export's staging folder, keyed by checkpoint key and symmetry; the
writer's lazy initializer of that checkpoint tensor (a :class:`CheckpointTensor`) reads the file back instead of
reading and quantizing the float weight, and deletes it. One weight's blocks are in memory at a time (the spill is
on disk: 4.5 GB at 8B int4). A weight the reference did not pack (verification off, a weight it reads as it is)
is packed by the writer as before.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_ir as ir


class CheckpointTensor(ir.LazyTensor):
    """A lazy read of the checkpoint tensor ``key`` with its axes permuted by ``perm`` (None: as stored): what the
    writer looks up in the spill."""

    __slots__ = ("key", "perm")


def checkpoint_tensor(load, dtype: ir.DataType, shape: ir.Shape, name: str, key: str, perm) -> CheckpointTensor:
    t = CheckpointTensor(load, dtype=dtype, shape=shape, name=name)
    t.key, t.perm = key, perm
    return t


def quantize_rows(quantizer, arr: np.ndarray, chunk_bytes: int) -> tuple:
    """``qbits_block_quant`` of the ``[out, in]`` weight ``arr`` read as the graph's ``[K=in, N=out]`` MatMul
    weight: ``(packed [N, K/block, blob], scales [N, K/block], zero points or None)``, rows of ``arr`` (columns of
    the graph's weight) ``chunk_bytes`` at a time: each column's blocks are its own, so the bytes are those of one
    call on the whole weight, without a transposed copy of it."""
    rows = max(1, chunk_bytes // max(1, arr.shape[1] * arr.itemsize))
    parts = [quantizer.qbits_block_quant(np.ascontiguousarray(arr[r0:r0 + rows].T))
             for r0 in range(0, arr.shape[0], rows)]
    if len(parts) == 1:
        return tuple(parts[0])
    return tuple(None if parts[0][j] is None else np.concatenate([p[j] for p in parts]) for j in range(3))


class PackedSpill:
    """The packed blocks of each weight the reference quantized, one file each under ``folder`` (created when the
    first is written), until the writer takes them."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self._files: dict[tuple[str, bool], tuple[Path, list]] = {}

    def blocks(self, key: str, arr: np.ndarray, quantizer, symmetric: bool, chunk_bytes: int) -> tuple:
        """The packed blocks of the checkpoint tensor ``key`` (``arr``, ``[out, in]``) under ``symmetric``: read back
        when packed before (a tied table read twice, a second reference pass), else packed and written down."""
        spilled = self._read((key, symmetric), arr.dtype, keep=True)
        if spilled is not None:
            return spilled
        out = quantize_rows(quantizer, arr, chunk_bytes)
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"{len(self._files)}.bin"
        layout = []
        with open(path, "wb") as fh:
            for part in out:
                layout.append(None if part is None else (part.dtype.str, part.shape))
                if part is not None:
                    np.ascontiguousarray(part).tofile(fh)
        self._files[(key, symmetric)] = (path, layout)
        return out

    def take(self, tensor, symmetric: bool, transposed: bool, dtype: np.dtype) -> tuple | None:
        """The spilled blocks of the writer's weight ``tensor`` (the file deleted), or None where it is not a
        checkpoint tensor read as the reference packed it: ``[K, N]`` (the stored ``[out, in]`` transposed) for a
        MatMul weight, ``[N, K]`` as stored for a vocabulary table (``transposed``), in the same dtype."""
        if len(tensor.shape) != 2:
            return None
        parts = getattr(tensor, "parts", None)   # a packed weight ([K, N1 + N2 ...]: QKV, gate and up)
        if parts is not None and not transposed and tensor.axis == 1:
            if not all(self._spilled(p, symmetric, False, dtype) for p in parts):
                return None
            got = [self._read((p.key, symmetric), np.dtype(dtype), keep=False) for p in parts]
            return tuple(None if got[0][j] is None else np.concatenate([g[j] for g in got]) for j in range(3))
        if not self._spilled(tensor, symmetric, transposed, dtype):
            return None
        return self._read((tensor.key, symmetric), np.dtype(dtype), keep=False)

    def _spilled(self, tensor, symmetric: bool, transposed: bool, dtype) -> bool:
        return isinstance(tensor, CheckpointTensor) and len(tensor.shape) == 2 \
            and tensor.perm == (None if transposed else (1, 0)) and (tensor.key, symmetric) in self._files \
            and np.dtype(self._files[(tensor.key, symmetric)][1][1][0]) == np.dtype(dtype)

    def _read(self, which: tuple[str, bool], dtype: np.dtype, keep: bool) -> tuple | None:
        entry = self._files.get(which)
        if entry is None:
            return None
        path, layout = entry
        if layout[1] is None or np.dtype(layout[1][0]) != dtype:   # scales in another dtype: another weight
            return None
        out = []
        with open(path, "rb") as fh:
            for item in layout:
                if item is None:
                    out.append(None)
                    continue
                code, shape = item
                count = int(np.prod(shape, dtype=np.int64))
                out.append(np.fromfile(fh, dtype=np.dtype(code), count=count).reshape(shape))
        if not keep:
            del self._files[which]
            path.unlink(missing_ok=True)
        return tuple(out)
