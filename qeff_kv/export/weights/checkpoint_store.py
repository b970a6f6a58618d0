"""The checkpoint's tensors, one at a time: a folder's safetensors files (sharded with
``model.safetensors.index.json`` or not).

Each tensor is read with one positioned read of its bytes (the safetensors layout: an 8-byte little-endian header
length, a JSON header naming each tensor's dtype, shape and byte range, then the data), not through a memory map:
mapped pages of a 16 GB checkpoint would stay in the exporter's resident set as they are touched, while a read
buffer is freed with its tensor.

:class:`CheckpointStore` answers a tensor's shape and dtype from the file headers, and hands out one tensor at a
time converted to the export dtype (:meth:`CheckpointStore.array`): a bf16 checkpoint is never copied whole, in
float32 or otherwise. Every array handed out is counted while it is alive (:attr:`CheckpointStore.live`,
:attr:`CheckpointStore.max_live`): the streaming exporter's bound on the tensors it holds at once is measured, not
assumed (tests/export/test_export_stream.py).

No torch at import time (torch reads bf16, which numpy cannot).
"""

from __future__ import annotations

import json
import os
import weakref
from pathlib import Path

import numpy as np

from qeff_kv.errors import CheckpointError, ExportError
from qeff_kv.support import safetensors_header

INDEX_FILE = "model.safetensors.index.json"
#: the index files of a folder whose entries are checked (the .bin one is never read: pickled weights are not loaded)
INDEX_FILES = (INDEX_FILE, "pytorch_model.bin.index.json")
#: :meth:`CheckpointStore.chunks` reads about this many bytes at a time
CHUNK_BYTES = 64 << 20


#: safetensors dtype names -> torch dtype attribute names (the dtypes this store converts)
_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64", "I64": "int64", "I32": "int32",
           "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


def read_header(path: Path) -> tuple[int, dict]:
    """``(offset of the data, {name: {"dtype", "shape", "data_offsets"}})`` of a safetensors file, validated as
    safetensors validates it before any tensor is read (:mod:`qeff_kv.support.safetensors_header`);
    :class:`CheckpointError` otherwise."""
    start, header, _size = safetensors_header.read_header(path, CheckpointError)
    return start, header


def index_map(folder: Path, name: str = INDEX_FILE) -> dict[str, str] | None:
    """The ``weight_map`` of the index ``name`` in ``folder`` (``None`` without one), every entry a plain file
    name of the folder (no separator, no ``..``, not absolute): :class:`CheckpointError` otherwise."""
    index = Path(folder) / name
    if not os.path.lexists(index):
        return None
    if safetensors_header.regular(index, "index", CheckpointError).st_size > safetensors_header.MAX_HEADER:
        raise CheckpointError(f"{index}: index larger than {safetensors_header.MAX_HEADER} bytes")
    try:
        weight_map = json.loads(index.read_bytes().decode("utf-8"))["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{index}: unreadable index ({type(exc).__name__}: {exc})") from None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index}: unreadable index (weight_map is not an object)")
    suffix = name.removesuffix(".index.json").rpartition(".")[2]
    for tensor, file in weight_map.items():
        if not isinstance(file, str) or not _plain_name(file) or not file.endswith(f".{suffix}"):
            raise CheckpointError(f"{index}: entry {tensor!r} names {file!r}, which is not a plain .{suffix} file "
                                  f"name inside the folder (a path, '..' or an absolute name is refused)")
    return weight_map


def _plain_name(file: str) -> bool:
    return file not in ("", ".", "..") and not any(c in file for c in "/\\\0") and not os.path.isabs(file) \
        and Path(file).name == file


def tensor_files(folder: Path) -> dict[str, tuple[Path, int, dict]]:
    """The one rule of which file holds each tensor of a safetensors folder, ``{name: (file, data offset, header
    entry)}`` (every reader uses it: streamed, pre-quantized, the budget): transformers' own. With
    ``model.safetensors.index.json`` only the files it names are read (a stray file beside them never is) and
    its ``weight_map`` must match their headers; a tensor held by two of them is refused (transformers would take
    the copy of the last file by name, whatever the ``weight_map`` says). Without one, every ``*.safetensors``
    file, and a tensor in two of them is refused in one line naming both. Every header is validated first."""
    folder = Path(folder)
    index_map(folder, INDEX_FILES[1])   # never read, but a hostile one is refused all the same
    weight_map = index_map(folder)
    names = sorted(set(weight_map.values())) if weight_map is not None else \
        sorted(p.name for p in folder.glob("*.safetensors"))
    where: dict[str, tuple[Path, int, dict]] = {}
    for file in names:
        path = folder / file
        start, header = read_header(path)
        for key in sorted(header):
            if key in where:
                raise CheckpointError(f"{folder}: tensor {key!r} is in both {where[key][0].name!r} and {file!r}"
                                      f"{' (both named by the index)' if weight_map is not None else ''}: "
                                      f"remove the stale file")
            where[key] = (path, start, header[key])
    for key, file in (weight_map or {}).items():
        if key not in where or where[key][0].name != file:
            raise CheckpointError(f"{folder / INDEX_FILE}: places tensor {key!r} in {file!r}, which does not "
                                  f"hold it")
    return where


class CheckpointStore:
    """The tensors of the safetensors files of ``folder``, by checkpoint key."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self._where = tensor_files(self.folder)
        for key, (path, _start, info) in self._where.items():
            if info["dtype"] not in _DTYPES:
                raise ExportError(f"{path}: tensor {key} has dtype {info['dtype']!r}, which is not read")
        self.live = 0
        self.max_live = 0
        self.reads = 0

    def keys(self) -> set[str]:
        return set(self._where)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(int(d) for d in self._where[key][2]["shape"])

    def stored_size(self, key: str) -> int:
        """The tensor's bytes as stored."""
        begin, end = (int(x) for x in self._where[key][2]["data_offsets"])
        return end - begin

    def stored_dtype(self, key: str) -> str:
        """The tensor's dtype as the file stores it (the safetensors name: ``BF16``, ``F32``...)."""
        return self._where[key][2]["dtype"]

    def stored_bytes(self, key: str, chunk_bytes: int | None = None):
        """The tensor's bytes exactly as stored, about ``chunk_bytes`` at a time, read one chunk after the other
        (nothing converted; counted as one read, alive while iterated): what the checkpoint identity hashes."""
        path, start, info = self._where[key]
        begin, end = (int(x) for x in info["data_offsets"])
        step = max(1, CHUNK_BYTES if chunk_bytes is None else chunk_bytes)
        self.reads += 1
        self.live += 1
        self.max_live = max(self.max_live, self.live)
        try:
            with open(path, "rb") as fh:
                fh.seek(start + begin)
                for at in range(begin, end, step):
                    buf = fh.read(min(step, end - at))
                    if len(buf) != min(step, end - at):
                        raise ExportError(f"{path}: truncated (tensor {key} lies past the end of the file)")
                    yield buf
        finally:
            self.live -= 1

    def torch_tensor(self, key: str, dtype):
        """The tensor ``key`` as a torch tensor of ``dtype`` (uncounted: :meth:`array` is the counted door)."""
        import torch

        path, start, info = self._where[key]
        begin, end = (int(x) for x in info["data_offsets"])
        buf = bytearray(end - begin)
        with open(path, "rb") as fh:
            fh.seek(start + begin)
            if fh.readinto(buf) != len(buf):
                raise ExportError(f"{path}: truncated (tensor {key} lies past the end of the file)")
        t = torch.frombuffer(buf, dtype=getattr(torch, _DTYPES[info["dtype"]])) if buf else \
            torch.empty(0, dtype=getattr(torch, _DTYPES[info["dtype"]]))
        return t.reshape(self.shape(key)).to(dtype)

    def array(self, key: str, dtype) -> np.ndarray:
        """The tensor ``key`` converted to the torch ``dtype``, as a contiguous numpy array (counted while alive)."""
        self.reads += 1
        return self.hold(np.ascontiguousarray(self.torch_tensor(key, dtype).numpy()))

    def hold(self, arr: np.ndarray) -> np.ndarray:
        """``arr`` counted in :attr:`live` while it is alive (an array assembled from this store's tensors)."""
        self.live += 1
        self.max_live = max(self.max_live, self.live)
        weakref.finalize(arr, self._release)
        return arr

    def chunks(self, key: str, dtype, chunk_bytes: int | None = None):
        """The tensor ``key`` converted to the torch ``dtype``, as contiguous numpy arrays of whole rows (the last
        axis), each about ``chunk_bytes``, read from the file one after the other: in order, their bytes are the
        bytes of :meth:`array`, without the whole tensor in memory (counted as one read, alive while iterated)."""
        import torch

        path, start, info = self._where[key]
        begin, end = (int(x) for x in info["data_offsets"])
        src = getattr(torch, _DTYPES[info["dtype"]])
        shape = self.shape(key)
        row = shape[-1] if len(shape) > 1 else max(1, (end - begin) // src.itemsize)
        chunk_bytes = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
        rows = max(1, chunk_bytes // max(1, row * max(src.itemsize, dtype.itemsize)))
        step = rows * row * src.itemsize
        self.reads += 1
        self.live += 1
        self.max_live = max(self.max_live, self.live)
        try:
            with open(path, "rb") as fh:
                for at in range(begin, end, step):
                    buf = bytearray(min(step, end - at))
                    fh.seek(start + at)
                    if fh.readinto(buf) != len(buf):
                        raise ExportError(f"{path}: truncated (tensor {key} lies past the end of the file)")
                    yield np.ascontiguousarray(torch.frombuffer(buf, dtype=src).to(dtype).numpy())
        finally:
            self.live -= 1

    def _release(self) -> None:
        self.live -= 1
