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
import stat
import weakref
from pathlib import Path

import numpy as np

from qeff_kv.errors import CheckpointError, ExportError

INDEX_FILE = "model.safetensors.index.json"
#: the index files of a folder whose entries are checked (the .bin one is never read: pickled weights are not loaded)
INDEX_FILES = (INDEX_FILE, "pytorch_model.bin.index.json")
#: :meth:`CheckpointStore.chunks` reads about this many bytes at a time
CHUNK_BYTES = 64 << 20
#: the longest safetensors header safetensors itself reads (and the longest index file read)
MAX_HEADER = 100_000_000


#: safetensors dtype names -> torch dtype attribute names (the dtypes this store converts)
_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64", "I64": "int64", "I32": "int32",
           "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}
#: every safetensors dtype -> bytes per element (a header is validated whatever dtype its tensors have)
DTYPE_SIZES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
               "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def _regular(path: Path, what: str) -> os.stat_result:
    """``path``'s status, following links (a Hugging Face cache's shards link to its blobs): refused unless it is
    a regular file (a device such as /dev/zero, a FIFO, a folder)."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise CheckpointError(f"{path}: {what} cannot be read ({exc.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{path}: {what} is not a regular file (a device, a pipe or a folder is never read)")
    return st


def _unique_keys(pairs: list) -> dict:
    keys = [k for k, _v in pairs]
    if len(keys) != len(set(keys)):
        raise ValueError(f"key {next(k for k in keys if keys.count(k) > 1)!r} appears twice")
    return dict(pairs)


def read_header(path: Path) -> tuple[int, dict]:
    """``(offset of the data, {name: {"dtype", "shape", "data_offsets"}})`` of a safetensors file, validated as
    safetensors validates it before any tensor is read (:func:`check_layout`); :class:`CheckpointError` otherwise."""
    path = Path(path)
    size = _regular(path, "safetensors file").st_size
    try:
        with open(path, "rb") as fh:
            if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                raise CheckpointError(f"{path}: safetensors file is not a regular file")
            head = fh.read(8)
            length = int.from_bytes(head, "little")
            if len(head) < 8 or length < 2 or length > MAX_HEADER or 8 + length > size:
                raise CheckpointError(f"{path}: not a safetensors file (header length {length} does not fit a file "
                                      f"of {size} bytes)")
            text = fh.read(length)
    except OSError as exc:
        raise CheckpointError(f"{path}: unreadable safetensors file ({exc.strerror})") from None
    try:
        header = json.loads(text.decode("utf-8"), object_pairs_hook=_unique_keys)
    except ValueError as exc:   # not UTF-8, not JSON, a key twice
        raise CheckpointError(f"{path}: not a safetensors file (its header is not JSON: {exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: not a safetensors file (its header is not a JSON object)")
    meta = header.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise CheckpointError(f"{path}: safetensors __metadata__ must map strings to strings")
    check_layout(path, header, size - 8 - length)
    return 8 + length, header


def _entry(path: Path, name: str, info) -> tuple[int, int]:
    """``(begin, end)`` of one header entry, checked: dtype known, shape of non-negative integers, data_offsets
    two integers in order spanning dtype size x prod(shape) bytes."""
    where = f"{path}: tensor {name!r}"
    if not isinstance(info, dict):
        raise CheckpointError(f"{where}: its header entry is not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in DTYPE_SIZES:
        raise CheckpointError(f"{where}: dtype {dtype!r} is not a safetensors dtype")

    def ints(v):
        return isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v)

    if not ints(shape):
        raise CheckpointError(f"{where}: shape {shape!r} is not a list of non-negative integers")
    if not ints(offsets) or len(offsets) != 2 or offsets[0] > offsets[1]:
        raise CheckpointError(f"{where}: data_offsets {offsets!r} are not [begin, end] with begin <= end")
    count = DTYPE_SIZES[dtype]
    for d in shape:
        count *= d
    if offsets[1] - offsets[0] != count:
        raise CheckpointError(f"{where}: holds {offsets[1] - offsets[0]} bytes, but {dtype} x {shape} is {count}")
    return offsets[0], offsets[1]


def check_layout(path: Path, header: dict, data_bytes: int) -> None:
    """The entries' byte ranges, in order, neither overlap nor leave a gap and cover exactly the ``data_bytes``
    after the header (safetensors refuses any other layout)."""
    spans = sorted((*_entry(path, name, info), name) for name, info in header.items())
    at, before = 0, None
    for begin, end, name in spans:
        if begin != at:
            how = f"overlaps tensor {before!r}" if begin < at else f"leaves {begin - at} bytes unused before it"
            raise CheckpointError(f"{path}: tensor {name!r} starts at byte {begin} and {how} (a corrupt header)")
        at, before = end, name
    if at != data_bytes:
        raise CheckpointError(f"{path}: the tensors cover {at} bytes but the data section holds {data_bytes} "
                              f"({'truncated' if at > data_bytes else 'bytes no tensor names'}: a corrupt file)")


def index_map(folder: Path, name: str = INDEX_FILE) -> dict[str, str] | None:
    """The ``weight_map`` of the index ``name`` in ``folder`` (``None`` without one), every entry a plain file
    name of the folder (no separator, no ``..``, not absolute): :class:`CheckpointError` otherwise."""
    index = Path(folder) / name
    if not os.path.lexists(index):
        return None
    if _regular(index, "index").st_size > MAX_HEADER:
        raise CheckpointError(f"{index}: index larger than {MAX_HEADER} bytes")
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
