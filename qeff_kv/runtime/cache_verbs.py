"""The session's cache verbs: :class:`CacheVerbs` (``session.cache_verbs``), what
:class:`~qeff_kv.runtime.session.Session`'s public names for its memory do (sequences, rewind, copy, bytes, state
files), each forwarding to the hybrid ``session.cache`` (:class:`~qeff_kv.runtime.cache.KVCache`,
:mod:`qeff_kv.runtime.memory`) or to :mod:`~qeff_kv.runtime.memory.state_file`; the session's description for
diagnostics; and the one fact the state files compute from the graph file, once per session (the weights' fiber
fingerprint). Kept beside the session so that ``session.py`` holds only what opens the graph and feeds it."""

from __future__ import annotations

import os
from pathlib import Path

from qeff_kv.contract import naming
from qeff_kv.runtime.cache import Sequence


class CacheVerbs:
    """The cache verbs of ``session`` (its ``cache``, ``files`` and the attributes :meth:`describe` reports); the
    session's methods of the same names call these."""

    def __init__(self, session):
        self.session = session
        self._fibers: str | None = None

    def add_sequence(self) -> Sequence:
        """A new empty sequence in a free slot."""
        return self.session.cache.create()

    def remove_sequence(self, seq: Sequence) -> None:
        self.session.cache.destroy(seq)

    @property
    def sequences(self) -> list[Sequence]:
        return self.session.cache.sequences

    # ------------------------------------------------------------------------------------ low level
    def truncate(self, seq: Sequence, n: int) -> None:
        """Rewind ``seq`` to positions ``[0, n)`` in O(1); with ring buffers only as far as they hold the
        window, with recurrent state only to a checkpoint (else a one-line refusal); ``n = 0`` always."""
        self.session.cache.truncate(seq, n)

    def rewind_points(self, seq: Sequence) -> list[int] | None:
        """The positions a recurrent or hybrid sequence can be rewound (or copied) to: 0, its checkpoints, its
        length; ``None`` for a graph without recurrent state (any position, within the rings' rule)."""
        return self.session.cache.rewind_points(seq)

    def reusable(self, seq: Sequence, n: int) -> int:
        """The longest prefix of at most ``n`` positions that ``truncate``/``copy`` can return ``seq`` to: ``n``
        without recurrent state (rings may still refuse), else the highest of :meth:`rewind_points` at or below
        ``n`` (prompt reuse: llama.cpp's server restores the newest checkpoint before the point of reuse)."""
        return self.session.cache.reusable(seq, n)

    def memory(self) -> dict:
        """Bytes the cache holds (buffers, valid positions, recurrent states, checkpoints): see
        :meth:`~qeff_kv.runtime.memory.hybrid.HybridMemory.memory`."""
        return self.session.cache.memory()

    def copy(self, src: Sequence, dst: Sequence, n: int) -> None:
        """Copy ``src``'s first ``n`` positions into ``dst`` in place (fork a shared prompt); see
        :meth:`~qeff_kv.runtime.memory.hybrid.HybridMemory.copy`."""
        self.session.cache.copy(src, dst, n)

    def relocate(self, seq: Sequence, slot: int) -> Sequence | None:
        """Move ``seq`` into ``slot`` (exchanging with the sequence there, returned); see
        :meth:`~qeff_kv.runtime.memory.hybrid.HybridMemory.relocate`."""
        return self.session.cache.relocate(seq, slot)

    # ------------------------------------------------------------------------------------ state
    def export_state(self, seq: Sequence, select: str | None = None, *, checksum: bool = True):
        """The in-memory state of ``seq`` (for hand-off); see :mod:`qeff_kv.runtime.memory.state_file`."""
        from qeff_kv.runtime.memory.state_file import export_state
        return export_state(self.session, seq, select=select, checksum=checksum)

    def import_state(self, state, seq: Sequence | None = None) -> Sequence:
        from qeff_kv.runtime.memory.state_file import import_state
        return import_state(self.session, state, seq=seq)

    def save_state(self, seq: Sequence, path: str | os.PathLike, select: str | None = None) -> Path:
        from qeff_kv.runtime.memory.state_file import save_state
        return save_state(self.session, seq, path, select=select)

    def load_state(self, path: str | os.PathLike, seq: Sequence | None = None) -> Sequence:
        from qeff_kv.runtime.memory.state_file import load_state
        return load_state(self.session, path, seq=seq)

    def weights_fibers(self) -> str:
        """The fiber fingerprint of the session's weights (:mod:`qeff_kv.runtime.weight_fibers`: the same for every
        exporter's layout of one checkpoint; a state file's last model check), computed once from its graph file."""
        if self._fibers is None:
            from qeff_kv.graph import graphio
            from qeff_kv.runtime.weight_fibers import fingerprint

            self._fibers = fingerprint(graphio.load(self.session.files.onnx_path))
        return self._fibers

    # ------------------------------------------------------------------------------------ introspection
    def describe(self) -> dict:
        """What the session runs: the graph, its sizes, how it is bound, its memories (for diagnostics)."""
        s = self.session
        rec = s.cache.recurrent
        return {
            "onnx": str(s.files.onnx_path), "prefix": s.prefix, "num_layers": s.num_layers,
            "ctx_len": s.ctx_len, "prefill_seq_len": s.prefill_seq_len,
            "continuous_batching": s.continuous_batching, "lockstep": s.lockstep,
            "max_sequences": s.max_sequences,
            "inplace": s.inplace, "inplace_issues": s.inplace_issues[:3],
            "invalid_index_patch": s.invalid_index_patch,
            naming.CCL_INPUT: None if s.ccl is None else list(s.ccl.lengths),
            "memory_capacity": s.cache.memory_capacity,
            "sliding_window": s.sliding_window, "ring_capacities": dict(s.rings.capacities),
            "vision_language": None if s.media is None else s.media.kind,
            "recurrent_states": list(rec.shapes),
            "recurrent_double_buffered": rec.double_buffer,
            "checkpoint_every": rec.policy.every if rec else None,
            "max_checkpoints": rec.policy.keep if rec else None,
        }
