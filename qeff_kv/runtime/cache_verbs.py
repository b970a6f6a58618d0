"""The session's cache verbs: :class:`~qeff_kv.runtime.session.Session`'s public names for what its memory does
(sequences, rewind, copy, bytes, state files), each one line forwarding to the hybrid ``session.cache``
(:class:`~qeff_kv.runtime.cache.KVCache`, :mod:`qeff_kv.runtime.memory`) or to :mod:`~qeff_kv.runtime.memory.state_file`;
and what is bound, for diagnostics. Kept beside the session so that ``session.py`` holds only what binds and runs
the graph."""

from __future__ import annotations

import os
from pathlib import Path

from qeff_kv.contract import naming
from qeff_kv.runtime.cache import Sequence


class CacheVerbsMixin:
    """Mixed into :class:`~qeff_kv.runtime.session.Session` (which provides ``cache``, ``_io``, ``_out_order`` and
    the attributes :meth:`describe` reports)."""

    def add_sequence(self) -> Sequence:
        """A new empty sequence in a free slot."""
        return self.cache.create()

    def remove_sequence(self, seq: Sequence) -> None:
        self.cache.destroy(seq)

    @property
    def sequences(self) -> list[Sequence]:
        return self.cache.sequences

    # ------------------------------------------------------------------------------------ low level

    def truncate(self, seq: Sequence, n: int) -> None:
        """Rewind ``seq`` to positions ``[0, n)`` in O(1); with ring buffers only as far as they hold the
        window, with recurrent state only to a checkpoint (else a one-line refusal); ``n = 0`` always."""
        self.cache.truncate(seq, n)

    def rewind_points(self, seq: Sequence) -> list[int] | None:
        """The positions a recurrent or hybrid sequence can be rewound (or copied) to: 0, its checkpoints, its
        length; ``None`` for a graph without recurrent state (any position, within the rings' rule)."""
        return self.cache.rewind_points(seq)

    def reusable(self, seq: Sequence, n: int) -> int:
        """The longest prefix of at most ``n`` positions that ``truncate``/``copy`` can return ``seq`` to: ``n``
        without recurrent state (rings may still refuse), else the highest of :meth:`rewind_points` at or below
        ``n`` (prompt reuse: llama.cpp's server restores the newest checkpoint before the point of reuse)."""
        return self.cache.reusable(seq, n)

    def memory(self) -> dict:
        """Bytes the cache holds (buffers, valid positions, recurrent states, checkpoints): see
        :meth:`~qeff_kv.runtime.memory.hybrid.HybridMemory.memory`."""
        return self.cache.memory()

    def copy(self, src: Sequence, dst: Sequence, n: int) -> None:
        """Copy ``src``'s first ``n`` positions into ``dst`` in place (fork a shared prompt); see
        :meth:`~qeff_kv.runtime.memory.hybrid.HybridMemory.copy`."""
        self.cache.copy(src, dst, n)

    def relocate(self, seq: Sequence, slot: int) -> Sequence | None:
        """Move ``seq`` into ``slot`` (exchanging with the sequence there, returned); see
        :meth:`~qeff_kv.runtime.memory.hybrid.HybridMemory.relocate`."""
        return self.cache.relocate(seq, slot)

    # ------------------------------------------------------------------------------------ state
    def export_state(self, seq: Sequence, select: str | None = None, *, checksum: bool = True):
        """The in-memory state of ``seq`` (for hand-off); see :mod:`qeff_kv.runtime.memory.state_file`."""
        from qeff_kv.runtime.memory.state_file import export_state
        return export_state(self, seq, select=select, checksum=checksum)

    def import_state(self, state, seq: Sequence | None = None) -> Sequence:
        from qeff_kv.runtime.memory.state_file import import_state
        return import_state(self, state, seq=seq)

    def save_state(self, seq: Sequence, path: str | os.PathLike, select: str | None = None) -> Path:
        from qeff_kv.runtime.memory.state_file import save_state
        return save_state(self, seq, path, select=select)

    def load_state(self, path: str | os.PathLike, seq: Sequence | None = None) -> Sequence:
        from qeff_kv.runtime.memory.state_file import load_state
        return load_state(self, path, seq=seq)

    # ------------------------------------------------------------------------------------ introspection
    def kv_data_pointers(self) -> dict[str, int]:
        """Address of every KV input buffer currently bound (for tests and diagnostics)."""
        return {n: v.data_ptr() for n, v, _ in self.cache.bindings()}

    def bound_output_pointers(self) -> dict[str, int]:
        """Address of every retained output after the last run."""
        outs = self._io.get_outputs()
        return {n: v.data_ptr() for n, v in zip(self._out_order, outs) if naming.retained_source(n) is not None}

    def describe(self) -> dict:
        return {
            "onnx": str(self.files.onnx_path), "prefix": self.prefix, "num_layers": self.num_layers,
            "ctx_len": self.ctx_len, "prefill_seq_len": self.prefill_seq_len,
            "continuous_batching": self.continuous_batching, "lockstep": self.lockstep,
            "max_sequences": self.max_sequences,
            "inplace": self.inplace, "inplace_issues": self.inplace_issues[:3],
            "invalid_index_patch": self.invalid_index_patch,
            naming.CCL_INPUT: None if self.ccl is None else list(self.ccl.lengths),
            "memory_capacity": self.cache.memory_capacity,
            "sliding_window": self.sliding_window, "ring_capacities": dict(self.rings.capacities),
            "vision_language": None if self.media is None else self.media.kind,
            "recurrent_states": list(self.cache.recurrent.shapes),
            "recurrent_double_buffered": self.cache.recurrent.double_buffer,
            "checkpoint_every": self.cache.recurrent.policy.every if self.cache.recurrent else None,
            "max_checkpoints": self.cache.recurrent.policy.keep if self.cache.recurrent else None,
        }
