"""A GGUF file's tensors, one at a time, under the Hugging Face parameter names and shapes of the model
transformers builds from it: the :class:`~.checkpoint_store.CheckpointStore` interface (``keys``, ``shape``,
``array``, ``chunks``, the ``live``/``max_live``/``reads`` counters) for the streaming exporter (:mod:`.stream`).

What transformers' GGUF loader (the legacy, dequantizing one that every architecture outside its own
``integrations.gguf`` list goes through) does to each tensor, done here per tensor:

1. the bytes of the tensor dequantized with the ``gguf`` package's own ``dequantize`` (float32);
2. the architecture's *tensor processor* (``transformers.modeling_gguf_pytorch_utils.TENSOR_PROCESSORS``:
   llama.cpp's Q/K row permutation undone for Llama-style models, Gemma's norms ``w - 1``...) applied to it;
3. renamed by ``get_gguf_hf_weights_map`` (gguf's own tensor-name tables, asked with the model's parameter names);
4. converted to the export dtype with torch (``.to(dtype)``).

Transformers' public helpers are called for steps 2 and 3, so the facts are not re-typed here. A processor is
probed once per tensor on a stand-in (``np.broadcast_to``: no memory) for the shape it gives, and on the row
numbers ``0..R-1`` for whether it only reorders rows (llama.cpp's Q/K permutation, or nothing): such a tensor is
read a few rows at a time (each row's blocks dequantize on their own), so a 2 GB vocabulary table is never in
memory as float32 at once. Any other tensor (a norm's ``w - 1``, a transposed GPT-2 matrix) is read whole and
given to the processor itself. A parameter made of several GGUF tensors (MoE experts merged by the loader) is
not a key here: :func:`.stream.plan` then refuses, and the model loads whole.

Bytes are read with positioned reads, not through the file's memory map (mapped pages would stay in the resident
set as they are touched; :mod:`.checkpoint_store` says the same of safetensors).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from qeff_kv.errors import ExportError

#: :meth:`GgufStore.chunks` dequantizes about this many bytes (float32) at a time
CHUNK_BYTES = 64 << 20


@dataclass
class _Entry:
    """One model parameter: the GGUF tensor it comes from and how."""

    gguf_name: str
    qtype: object              # gguf.GGMLQuantizationType
    offset: int                # absolute byte offset of the tensor's data in the file
    file_shape: tuple          # the tensor's element shape as numpy reads it (rows..., ne0)
    row_bytes: int             # bytes of one row (the last axis) in the file
    shape: tuple               # the parameter's shape (after the processor)
    rows: np.ndarray | None    # 2-D tensors the processor only reorders: output row i is file row rows[i]
    hf_name: str | None        # the processor stores this tensor under its own name (GPT-2's head)


class GgufStore:
    """The tensors of the GGUF file ``path`` keyed by the parameter names of ``model`` (the skeleton built from
    the file's config). ``arch`` and ``table``: the file's ``general.architecture`` and its tensor table
    ``[(name, numpy shape, ggml type id, absolute data offset), ...]`` (:func:`.gguf_header.tensor_index`)."""

    def __init__(self, path: Path, model, arch: str, table: list[tuple]):
        from qeff_kv.export import transformers_adapter as hf

        try:
            import gguf
        except ImportError as exc:
            raise ExportError(f"{Path(path).name}: the GGUF store needs the gguf package ({exc})") from None
        self.path = Path(path)
        self._gguf = gguf
        helpers = hf.gguf_tensor_helpers(arch)
        if helpers is None:
            raise ExportError(f"{self.path.name}: transformers converts {arch!r} GGUF weights with its own "
                              "conversion ops, which this store does not reproduce")
        processor_for, weights_map, gguf_config = helpers
        self._processor = processor_for(gguf_config(self.path))   # the config from the metadata, as the loader's
        names = weights_map(model, self._processor)
        self._entries: dict[str, _Entry] = {}
        merged: set[str] = set()
        for t in table:
            entry = self._entry(*t, names)
            if entry is None:
                continue
            key, e = entry
            if key in self._entries:
                merged.add(key)
            self._entries[key] = e
        for key in merged:   # several GGUF tensors make this parameter (the loader merges them)
            del self._entries[key]
        self.live = 0
        self.max_live = 0
        self.reads = 0

    def _process(self, weights: np.ndarray, name: str):
        """The architecture's processor on one tensor: ``(weights, name or None, what it stored aside)``."""
        aside: dict = {"tensors": {}}
        out = self._processor.process(weights=weights, name=name, tensor_key_mapping=None, parsed_parameters=aside)
        return out.weights, out.name, aside["tensors"]

    def _entry(self, gguf_name: str, file_shape: tuple, type_id: int, offset: int,
               names: dict) -> tuple[str, _Entry] | None:
        """``(parameter name, entry)`` of one tensor of the file's table, or None when the model takes no such
        tensor."""
        qtype = self._gguf.GGMLQuantizationType(type_id)
        block, type_size = self._gguf.GGML_QUANT_SIZES[qtype]
        row_bytes = file_shape[-1] // block * type_size
        weights, name, aside = self._process(np.broadcast_to(np.float32(0), file_shape), gguf_name)
        hf_name = None
        if name is None:
            if len(aside) != 1:
                return None
            (hf_name, tensor), = aside.items()
            key, shape = hf_name, tuple(tensor.shape)
        elif name in names:
            key, shape = names[name], tuple(weights.shape)
        else:
            return None
        rows = None
        if hf_name is None and len(file_shape) == 2 and shape == file_shape:
            index = np.broadcast_to(np.arange(file_shape[0], dtype=np.float64)[:, None], file_shape)
            moved = self._process(index, gguf_name)[0]
            first = np.asarray(moved[:, 0])
            if moved.shape == file_shape and np.array_equal(first, np.asarray(moved[:, -1])) \
                    and np.array_equal(np.sort(first), np.arange(file_shape[0])):
                rows = first.astype(np.int64)
        return key, _Entry(gguf_name, qtype, offset, file_shape, row_bytes, shape, rows, hf_name)

    # ------------------------------------------------------------------------------- the CheckpointStore interface
    def keys(self) -> set[str]:
        return set(self._entries)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(int(d) for d in self._entries[key].shape)

    def gguf_name(self, key: str) -> str:
        """The GGUF tensor behind the parameter ``key``."""
        return self._entries[key].gguf_name

    def _read(self, e: _Entry, first: int, count: int) -> np.ndarray:
        """File rows ``first .. first + count`` of ``e`` (all its axes but the last flattened), as the file's
        bytes ``(count, row_bytes)``."""
        buf = bytearray(count * e.row_bytes)
        with open(self.path, "rb") as fh:
            fh.seek(e.offset + first * e.row_bytes)
            if fh.readinto(buf) != len(buf):
                raise ExportError(f"{self.path}: truncated (tensor {e.gguf_name} lies past the end of the file)")
        return np.frombuffer(buf, dtype=np.uint8).reshape(count, e.row_bytes)

    def _dequantized(self, raw: np.ndarray, e: _Entry) -> np.ndarray:
        return self._gguf.dequantize(raw, e.qtype)

    @staticmethod
    def _to(arr: np.ndarray, dtype) -> np.ndarray:
        import torch

        return np.ascontiguousarray(torch.from_numpy(np.ascontiguousarray(arr)).to(dtype).numpy())

    def _whole(self, e: _Entry, dtype) -> np.ndarray:
        """The whole tensor through the processor, as transformers' loader computes it."""
        rows = int(np.prod(e.file_shape[:-1], dtype=np.int64))
        raw = self._read(e, 0, rows).reshape(e.file_shape[:-1] + (e.row_bytes,))
        weights, _name, aside = self._process(self._dequantized(raw, e), e.gguf_name)
        if e.hf_name is not None:
            return self._to(aside[e.hf_name].numpy(), dtype)
        return self._to(weights, dtype)

    def _pieces(self, e: _Entry, dtype, chunk_bytes: int):
        """The rows of a row-reordered tensor (``e.rows``) a chunk at a time, dequantized and converted."""
        cols = e.file_shape[-1]
        step = max(1, chunk_bytes // max(1, cols * 4))
        for at in range(0, len(e.rows), step):
            src = e.rows[at:at + step]
            lo, hi = int(src.min()), int(src.max()) + 1
            raw = self._read(e, lo, hi - lo)[src - lo]
            yield self._to(self._dequantized(raw, e), dtype)

    def _count(self) -> None:
        self.reads += 1
        self.live += 1
        self.max_live = max(self.max_live, self.live)

    def _release(self) -> None:
        self.live -= 1

    def array(self, key: str, dtype) -> np.ndarray:
        """The parameter ``key`` converted to the torch ``dtype``, as a contiguous numpy array (counted while
        alive); a row-reordered tensor is filled a chunk of rows at a time (no float32 copy of the whole)."""
        e = self._entries[key]
        if e.rows is None:
            arr = self._whole(e, dtype)
        else:
            arr, at = None, 0
            for piece in self._pieces(e, dtype, CHUNK_BYTES):
                if arr is None:
                    arr = np.empty(e.shape, dtype=piece.dtype)
                arr[at:at + len(piece)] = piece
                at += len(piece)
        self._count()
        weakref.finalize(arr, self._release)
        return arr

    def chunks(self, key: str, dtype, chunk_bytes: int | None = None):
        """The parameter ``key`` converted to the torch ``dtype``, as contiguous arrays of whole rows whose bytes,
        in order, are those of :meth:`array` (counted as one read, alive while iterated)."""
        e = self._entries[key]
        self._count()
        try:
            if e.rows is None:
                yield self._whole(e, dtype)
            else:
                yield from self._pieces(e, dtype, CHUNK_BYTES if chunk_bytes is None else chunk_bytes)
        finally:
            self.live -= 1
