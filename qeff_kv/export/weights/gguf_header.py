"""A cheap structural check of a GGUF file before any library reads it (no torch, no gguf package).

transformers' GGUF reader trusts the file: a file truncated or corrupted past its magic surfaces as
``struct.error`` or an out-of-range numpy view deep inside it. :func:`check` walks the header the way the GGUF
specification lays it out (versions 2 and 3) and refuses, in one line, a file whose header, metadata or tensor
table runs past its end, whose counts cannot fit in it, or whose tensors' data (offset and size from their type
and dims) does not lie inside it. It reads the header only (a few MiB for a large vocabulary), never the weights.
"""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path

from qeff_kv.errors import QeffKvError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
#: metadata value types: fixed sizes (8: string and 9: array are read apart)
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
#: ggml tensor types: (elements per block, bytes per block), from the GGUF specification
GGML_BLOCKS = {0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 9: (32, 36),
               10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210), 15: (256, 292),
               16: (256, 66), 17: (256, 74), 18: (256, 98), 19: (256, 50), 20: (32, 18), 21: (256, 110),
               22: (256, 82), 23: (256, 136), 24: (1, 1), 25: (1, 2), 26: (1, 4), 27: (1, 8), 28: (1, 8),
               29: (256, 56), 30: (1, 2), 34: (256, 54), 35: (256, 66)}
MAX_DIMS = 8


class _Corrupt(Exception):
    pass


class _Reader:
    def __init__(self, buf, size: int):
        self.buf, self.size, self.pos = buf, size, 0

    def take(self, n: int, what: str) -> int:
        if n < 0 or self.pos + n > self.size:
            raise _Corrupt(f"{what} at byte {self.pos} runs past the end")
        start = self.pos
        self.pos += n
        return start

    def u32(self, what: str) -> int:
        return struct.unpack_from("<I", self.buf, self.take(4, what))[0]

    def u64(self, what: str) -> int:
        return struct.unpack_from("<Q", self.buf, self.take(8, what))[0]

    def string(self, what: str) -> bytes:
        n = self.u64(f"{what} length")
        start = self.take(n, what)
        return bytes(self.buf[start:start + n])

    def value(self, vtype: int, what: str, depth: int = 0):
        if vtype in _SCALAR_SIZES:
            start = self.take(_SCALAR_SIZES[vtype], what)
            if vtype == 4:
                return struct.unpack_from("<I", self.buf, start)[0]
            return None
        if vtype == _STRING:
            self.string(what)
            return None
        if vtype == _ARRAY and depth == 0:
            etype = self.u32(f"{what} element type")
            count = self.u64(f"{what} length")
            if etype in _SCALAR_SIZES:
                self.take(count * _SCALAR_SIZES[etype], what)
            elif etype == _STRING:
                if count * 8 > self.size - self.pos:
                    raise _Corrupt(f"{what}: {count} strings cannot fit in the file")
                for _ in range(count):
                    self.string(what)
            else:
                raise _Corrupt(f"{what}: unknown array element type {etype}")
            return None
        raise _Corrupt(f"{what}: unknown value type {vtype}")


def check(path: str | os.PathLike, *, error: type[QeffKvError]) -> None:
    """Refuse (``error``, one line) a GGUF file whose structure is not whole; return quietly otherwise."""
    tensor_table(path, error=error)


def tensor_table(path: str | os.PathLike, *, error: type[QeffKvError]) -> list[tuple[str, list[int], int]]:
    """``(name, dims, ggml type)`` of every tensor of a GGUF file whose structure is whole (:func:`check`'s
    refusals otherwise); the header only, no tensor data is read."""
    return [(name, dims, ttype) for name, dims, ttype, _offset in _guarded_walk(path, error)[2]]


def _guarded_walk(path, error):
    """:func:`_walk` over the file ``path``, its refusals as ``error`` (one line)."""
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size < 24:
                raise error(f"{path}: truncated GGUF file ({size} bytes; the header alone takes 24)")
            with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _walk(buf, size)
    except _Corrupt as exc:
        raise error(f"{path}: truncated or corrupt GGUF file ({exc}; the file has {size} bytes)") from None
    except OSError as exc:
        raise error(f"{path}: unreadable ({exc.strerror or exc})") from None


def tensor_index(path: str | os.PathLike, *, error: type[QeffKvError]) -> tuple[str, list[tuple]]:
    """``(general.architecture, [(name, numpy shape, ggml type id, absolute data offset), ...])`` of a GGUF file whose
    structure is whole (:func:`check`'s refusals otherwise); the tensor data is not read."""
    arch, data_start, tensors = _guarded_walk(path, error)
    return arch, [(name, tuple(int(d) for d in reversed(dims)), ttype, data_start + offset)
                  for name, dims, ttype, offset in tensors]


def _walk(buf, size: int) -> tuple[str, int, list[tuple]]:
    """``(general.architecture, start of the tensor data, [(name, dims, type, offset), ...])``; refuses
    (:class:`_Corrupt`) a file whose structure is not whole."""
    r = _Reader(buf, size)
    if bytes(buf[r.take(4, "magic"):4]) != MAGIC:
        raise _Corrupt("no GGUF magic")
    version = r.u32("version")
    if version not in VERSIONS:
        raise _Corrupt(f"GGUF version {version}; versions {VERSIONS[0]} and {VERSIONS[1]} are read")
    n_tensors = r.u64("tensor count")
    n_kv = r.u64("metadata count")
    # every metadata entry takes at least 8 + 4 + 1 bytes, every tensor info at least 8 + 4 + 4 + 8
    if n_kv * 13 > size or n_tensors * 24 > size:
        raise _Corrupt(f"{n_kv} metadata entries and {n_tensors} tensors cannot fit in the file")
    alignment, arch = DEFAULT_ALIGNMENT, ""
    for i in range(n_kv):
        key = r.string(f"metadata key {i}")
        vtype = r.u32(f"metadata {key[:64]!r} type")
        if key == b"general.architecture" and vtype == _STRING:
            arch = r.string("general.architecture").decode("utf-8", "replace")
            continue
        v = r.value(vtype, f"metadata {key[:64].decode('utf-8', 'replace')!r}")
        if key == b"general.alignment":
            if not isinstance(v, int) or v == 0 or v & (v - 1):
                raise _Corrupt(f"general.alignment {v!r} is not a power of two")
            alignment = v
    tensors = []
    for i in range(n_tensors):
        name = r.string(f"tensor {i} name").decode("utf-8", "replace")
        n_dims = r.u32(f"tensor {name!r} dimension count")
        if not 1 <= n_dims <= MAX_DIMS:
            raise _Corrupt(f"tensor {name!r} has {n_dims} dimensions")
        dims = [r.u64(f"tensor {name!r} dims") for _ in range(n_dims)]
        ttype = r.u32(f"tensor {name!r} type")
        offset = r.u64(f"tensor {name!r} offset")
        tensors.append((name, dims, ttype, offset))
    data_start = -(-r.pos // alignment) * alignment
    for name, dims, ttype, offset in tensors:
        if offset % alignment:
            raise _Corrupt(f"tensor {name!r} offset {offset} is not aligned to {alignment}")
        count = 1
        for d in dims:
            count *= d
        block = GGML_BLOCKS.get(ttype)
        nbytes = 0 if block is None else -(-count // block[0]) * block[1]
        end = data_start + offset + nbytes
        if end > size or (block is None and data_start + offset >= size):
            raise _Corrupt(f"tensor {name!r} data (bytes {data_start + offset}..{end}) lies past the end")
    return arch, data_start, tensors
