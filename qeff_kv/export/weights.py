"""The checkpoint's tensors, one at a time: a folder's safetensors files (sharded with
``model.safetensors.index.json`` or not), memory-mapped by safetensors' ``safe_open``.

:class:`CheckpointStore` answers a tensor's shape and dtype from the file headers, and hands out one tensor at a
time converted to the export dtype (:meth:`CheckpointStore.array`): a bf16 checkpoint is never copied whole, in
float32 or otherwise. Every array handed out is counted while it is alive (:attr:`CheckpointStore.live`,
:attr:`CheckpointStore.max_live`): the streaming exporter's bound on the tensors it holds at once is measured, not
assumed (tests/test_export_stream.py).

No torch at import time (safetensors' ``pt`` framework reads bf16, which numpy cannot).
"""

from __future__ import annotations

import json
import weakref
from pathlib import Path

import numpy as np

from ..errors import ExportError

INDEX_FILE = "model.safetensors.index.json"


class CheckpointStore:
    """The tensors of the safetensors files of ``folder``, by checkpoint key."""

    def __init__(self, folder: Path):
        from safetensors import safe_open

        self.folder = Path(folder)
        self._open = safe_open
        self._where: dict[str, Path] = {}
        self._handles: dict[Path, object] = {}
        index = self.folder / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise ExportError(f"{index}: unreadable safetensors index ({exc})") from None
            for key, fname in weight_map.items():
                self._where[key] = self.folder / fname
        else:
            for path in sorted(self.folder.glob("*.safetensors")):
                for key in self._handle(path).keys():
                    self._where.setdefault(key, path)
        self.live = 0
        self.max_live = 0
        self.reads = 0

    def _handle(self, path: Path):
        if path not in self._handles:
            try:
                self._handles[path] = self._open(str(path), framework="pt")
            except Exception as exc:   # a truncated or corrupt file
                raise ExportError(f"{path}: unreadable safetensors file ({type(exc).__name__}: {exc})") from None
        return self._handles[path]

    def keys(self) -> set[str]:
        return set(self._where)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(int(d) for d in self._handle(self._where[key]).get_slice(key).get_shape())

    def torch_tensor(self, key: str, dtype):
        """The tensor ``key`` as a torch tensor of ``dtype`` (uncounted: :meth:`array` is the counted door)."""
        return self._handle(self._where[key]).get_tensor(key).to(dtype)

    def array(self, key: str, dtype) -> np.ndarray:
        """The tensor ``key`` converted to the torch ``dtype``, as a contiguous numpy array (counted while alive)."""
        arr = np.ascontiguousarray(self.torch_tensor(key, dtype).numpy())
        self.reads += 1
        self.live += 1
        self.max_live = max(self.max_live, self.live)
        weakref.finalize(arr, self._release)
        return arr

    def _release(self) -> None:
        self.live -= 1
