"""A safetensors file's header, validated as safetensors validates it before any tensor is read: the one reader of
the layout for every safetensors file qeff-kv opens (a checkpoint's shards, a LoRA adapter's weights).

The layout: an 8-byte little-endian header length, a JSON object naming each tensor's dtype, shape and
``data_offsets`` (``[begin, end)`` relative to the data section), an optional ``__metadata__`` map of strings, then
the data. Invariant of :func:`read_header`: what it returns is a regular file's header whose length fits the file,
a JSON object with no key twice, every entry of a known dtype with a shape of non-negative integers and a byte range
of exactly dtype size x prod(shape) bytes, the ranges in order, neither overlapping nor leaving a gap, covering
exactly the data section; anything else is refused with one line naming the file (and the tensor), raised as the
caller's error type. A device, a FIFO or a folder is never opened for reading (``stat`` before, ``fstat`` after).
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Callable

#: the longest header safetensors itself reads (also the longest index file a folder's reader takes)
MAX_HEADER = 100_000_000
#: every safetensors dtype -> bytes per element
DTYPE_SIZES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
               "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}

#: what the caller raises: a typed error class of :mod:`qeff_kv.errors` (or any callable of one message)
Refusal = Callable[[str], Exception]


def regular(path: Path, what: str, error: Refusal) -> os.stat_result:
    """``path``'s status, following links (a Hugging Face cache's files link to its blobs): refused unless it is
    a regular file (a device such as /dev/zero, a FIFO, a folder)."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise error(f"{path}: {what} cannot be read ({exc.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{path}: {what} is not a regular file (a device, a pipe or a folder is never read)")
    return st


def _unique_keys(pairs: list) -> dict:
    keys = [k for k, _v in pairs]
    if len(keys) != len(set(keys)):
        raise ValueError(f"key {next(k for k in keys if keys.count(k) > 1)!r} appears twice")
    return dict(pairs)


def read_header(path: Path, error: Refusal) -> tuple[int, dict, int]:
    """``(offset of the data, {name: {"dtype", "shape", "data_offsets"}}, file size)`` of a safetensors file,
    validated (the module's invariant); ``error(message)`` raised otherwise."""
    path = Path(path)
    size = regular(path, "safetensors file", error).st_size
    try:
        with open(path, "rb") as fh:
            if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                raise error(f"{path}: safetensors file is not a regular file")
            head = fh.read(8)
            length = int.from_bytes(head, "little")
            if len(head) < 8 or length < 2 or length > MAX_HEADER or 8 + length > size:
                raise error(f"{path}: not a safetensors file (header length {length} does not fit a file "
                            f"of {size} bytes)")
            text = fh.read(length)
    except OSError as exc:
        raise error(f"{path}: unreadable safetensors file ({exc.strerror})") from None
    try:
        header = json.loads(text.decode("utf-8"), object_pairs_hook=_unique_keys)
    except ValueError as exc:   # not UTF-8, not JSON, a key twice
        raise error(f"{path}: not a safetensors file (its header is not JSON: {exc})") from None
    if not isinstance(header, dict):
        raise error(f"{path}: not a safetensors file (its header is not a JSON object)")
    meta = header.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise error(f"{path}: safetensors __metadata__ must map strings to strings")
    check_layout(path, header, size - 8 - length, error)
    return 8 + length, header, size


def _entry(path: Path, name: str, info, error: Refusal) -> tuple[int, int]:
    """``(begin, end)`` of one header entry, checked: dtype known, shape of non-negative integers, data_offsets
    two integers in order spanning dtype size x prod(shape) bytes."""
    where = f"{path}: tensor {name!r}"
    if not isinstance(info, dict):
        raise error(f"{where}: its header entry is not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in DTYPE_SIZES:
        raise error(f"{where}: dtype {dtype!r} is not a safetensors dtype")

    def ints(v):
        return isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v)

    if not ints(shape):
        raise error(f"{where}: shape {shape!r} is not a list of non-negative integers")
    if not ints(offsets) or len(offsets) != 2 or offsets[0] > offsets[1]:
        raise error(f"{where}: data_offsets {offsets!r} are not [begin, end] with begin <= end")
    count = DTYPE_SIZES[dtype]
    for d in shape:
        count *= d
    if offsets[1] - offsets[0] != count:
        raise error(f"{where}: holds {offsets[1] - offsets[0]} bytes, but {dtype} x {shape} is {count}")
    return offsets[0], offsets[1]


def check_layout(path: Path, header: dict, data_bytes: int, error: Refusal) -> None:
    """The entries' byte ranges, in order, neither overlap nor leave a gap and cover exactly the ``data_bytes``
    after the header (safetensors refuses any other layout)."""
    spans = sorted((*_entry(path, name, info, error), name) for name, info in header.items())
    at, before = 0, None
    for begin, end, name in spans:
        if begin != at:
            how = f"overlaps tensor {before!r}" if begin < at else f"leaves {begin - at} bytes unused before it"
            raise error(f"{path}: tensor {name!r} starts at byte {begin} and {how} (a corrupt header)")
        at, before = end, name
    if at != data_bytes:
        raise error(f"{path}: the tensors cover {at} bytes but the data section holds {data_bytes} "
                    f"({'truncated' if at > data_bytes else 'bytes no tensor names'}: a corrupt file)")
