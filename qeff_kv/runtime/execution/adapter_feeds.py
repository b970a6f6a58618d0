"""The LoRA adapters a session holds and how its graph is fed them (docs/lora.md): :class:`AdapterFeeds`.

A graph exported with adapters (:mod:`qeff_kv.contract.lora`) takes, per adapted module, a stack of adapter slots and,
per row, the slot and scale of that row's adapter. The session's adapters are read once each
(:func:`qeff_kv.tools.adapters.read_adapter`, fitted to the graph) and stacked once per change of the set: slot 0
the zero adapter, then each loaded adapter in load order, every rank padded to the graph's largest (exact: the
padding is zeros). The stacks are bound once and stay bound; a step writes only its rows' slots and scales
(:meth:`AdapterFeeds.fill`), so rows of one step each take their own adapter, base rows slot 0 with scale 0.
"""

from __future__ import annotations

import hashlib
import os
from typing import Iterable

import numpy as np

from qeff_kv.contract import naming
from qeff_kv.contract.lora import LoraGeometry
from qeff_kv.errors import AdapterError


class AdapterFeeds:
    """The adapters of one session over a graph whose adapter inputs are ``geometry``, on ``device``
    (:mod:`.device`: its ``buffer(shape, dtype)`` gives an array and its bound value)."""

    def __init__(self, geometry: LoraGeometry, device, base_name: str | None = None):
        self.geometry = geometry
        self.device = device
        #: the graph's base model (a manifest's source name): an adapter naming another base is refused
        self.base_name = base_name
        #: name -> the adapter read (:class:`qeff_kv.tools.adapters.Adapter`), in slot order (slot = index + 1)
        self.adapters: dict = {}
        #: the stacks bound now (input name -> value), rebuilt when the set changes
        self.values: dict | None = None
        #: how many times the stacks were built (once per change of the set, not per step)
        self.builds = 0
        self._bound = False
        self._identities: dict[str, str] = {}

    # ------------------------------------------------------------------------------------ the set
    def load(self, name: str, source) -> object:
        """Read the PEFT folder ``source`` (or take an adapter already read) as ``name``, fitted to the graph; the
        stacks are rebuilt before the next run. Loading a name again with the same folder is a no-op; with another
        folder, refused (unload it first)."""
        from qeff_kv.tools import adapters as adapters_mod

        if not isinstance(name, str) or not name:
            raise AdapterError(f"an adapter name must be a non-empty string, got {name!r}")
        held = self.adapters.get(name)
        if isinstance(source, (str, os.PathLike)):
            if held is not None and os.path.realpath(held.path) == os.path.realpath(source):
                return held
            adapter = adapters_mod.read_adapter(source, name=name)
        else:
            adapter = source
        if held is not None:
            raise AdapterError(f"adapter {name!r} is already loaded from {held.path}; unload it first")
        adapters_mod.fit(adapter, self.geometry, base_name=self.base_name)
        self.adapters[name] = adapter
        self.values = None
        return adapter

    def unload(self, name: str) -> None:
        """Forget adapter ``name`` (the caller has checked that no sequence uses it); the slots after it move down."""
        self.require(name)
        del self.adapters[name]
        self._identities.pop(name, None)
        self.values = None

    def require(self, name: str):
        """The adapter ``name``, or a one-line refusal listing those loaded."""
        adapter = self.adapters.get(name)
        if adapter is None:
            held = ", ".join(self.adapters) or "none"
            raise AdapterError(f"adapter {name!r} is not loaded (loaded: {held})")
        return adapter

    def slot(self, name: str | None) -> int:
        """The stack slot of adapter ``name`` (0: no adapter, the base)."""
        if name is None:
            return 0
        self.require(name)
        return 1 + list(self.adapters).index(name)

    def nbytes(self) -> int:
        """Bytes of the stacks (every loaded adapter at the graph's rank, and the zero slot): bound now, or bound
        at the next run."""
        g = self.geometry
        rank = g.max_rank or max([a.rank for a in self.adapters.values()] + [1])
        per_slot = sum(m.in_features + m.out_features for m in g.modules) * rank
        return (1 + len(self.adapters)) * per_slot * np.dtype(g.dtype).itemsize

    def identity(self, name: str) -> str:
        """SHA-256 of adapter ``name``'s weights as the graph takes them (every module's A and scaled B): what a
        state computed with it records, so that it continues only under the same weights."""
        if name not in self._identities:
            h = hashlib.sha256()
            for (layer, module), (a, b) in sorted(self.require(name).weights.items()):
                h.update(f"|{layer}|{module}|{list(a.shape)}|{list(b.shape)}|".encode())
                h.update(np.ascontiguousarray(a, np.float32).tobytes())
                h.update(np.ascontiguousarray(b, np.float32).tobytes())
            self._identities[name] = h.hexdigest()
        return self._identities[name]

    # ------------------------------------------------------------------------------------ a run
    def bind(self, io) -> None:
        """Bind the stacks (rebuilt first when the set changed); a no-op while nothing changed."""
        if self.values is None:
            self.values = self._stacks()
            self._bound = False
        if not self._bound:
            for input_name, value in self.values.items():
                io.bind_ortvalue_input(input_name, value)
            self._bound = True

    def _stacks(self) -> dict:
        from qeff_kv.tools import adapters as adapters_mod

        arrays = adapters_mod.stack(list(self.adapters.values()), self.geometry)
        self.builds += 1
        values = {}
        for input_name, array in arrays.items():
            buf, value = self.device.buffer(array.shape, array.dtype)
            buf[...] = array
            values[input_name] = value
        return values

    def small_shapes(self, rows: int) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """The per-row inputs of a ``rows``-row step: ``lora_ids`` and ``lora_scales``."""
        return {naming.LORA_IDS_INPUT: ((rows,), np.dtype(np.int64)),
                naming.LORA_SCALES_INPUT: ((rows,), np.dtype(self.geometry.dtype))}

    def fill(self, arrays: dict[str, np.ndarray], rows: Iterable[tuple[int, object]]) -> None:
        """Write the step's per-row adapter inputs: every row the base (slot 0, scale 0), then each ``(row,
        sequence)`` of ``rows`` its sequence's adapter and scale."""
        ids, scales = arrays[naming.LORA_IDS_INPUT], arrays[naming.LORA_SCALES_INPUT]
        ids.fill(0)
        scales.fill(0)
        for row, seq in rows:
            name = getattr(seq, "adapter", None)
            if name is not None:
                ids[row] = self.slot(name)
                scales[row] = seq.lora_scale
