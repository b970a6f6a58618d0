"""The session's cache: the hybrid (:class:`~qeff_kv.runtime.memory.hybrid.HybridMemory`) of its positional KV
buffers, the RoPE marks of its images and its recurrent states, allocated once.

Buffers are allocated once, each at its own capacity (``max_sequences`` x ``ctx_len`` positions; a sliding-window
ring buffer ``max_sequences`` x ``C`` slots, see :mod:`qeff_kv.runtime.memory.ring`; a static axis as the graph fixes it;
a recurrent state ``[max_sequences, ...]``), on the session's device (:mod:`qeff_kv.runtime.execution.device`: on the CPU,
numpy arrays wrapped by ``OrtValue`` objects that share their memory);
the session binds them to the graph. A graph that is not in-place safe gets a second set (``spare``), and the two
sets swap after every run. Before anything is allocated, :meth:`KVCache.require_memory` refuses buffers that do not
fit in the memory available.

The memories are ``cache.positional`` (:mod:`~qeff_kv.runtime.memory.positional`), ``cache.marks``
(:mod:`~qeff_kv.runtime.memory.rope_marks`) and ``cache.recurrent``
(:mod:`~qeff_kv.runtime.memory.recurrent`, with its checkpoints; empty for a graph without recurrent layers); the
verbs, the sequence table and the bytes are the hybrid's. ``arrays``, ``values``, ``shapes``, ``capacities`` ... name
the positional memory's buffers.
"""

from __future__ import annotations

import numpy as np

from qeff_kv.contract.layout import KVPair
from qeff_kv.support.limits import positive_int, require_memory
from qeff_kv.runtime.memory import recurrent as rec_mod
from qeff_kv.runtime.memory import registry
from qeff_kv.runtime.memory.hybrid import HybridMemory, Sequence
from qeff_kv.runtime.memory.positional import PositionalMemory, buffer_bytes, capacity_of
from qeff_kv.runtime.memory.rope_marks import RopeMarks
from qeff_kv.runtime.memory.ring import RingSpec

__all__ = ["KVCache", "Sequence"]


class KVCache(HybridMemory):
    """Fixed-capacity buffers of every memory of a graph plus the slot bookkeeping of the sequences stored in them.

    Args:
        pairs: the graph's positional KV pairs (from :class:`qeff_kv.contract.layout.KVLayout`), in graph input order.
        max_sequences: size of the batch axis.
        ctx_len: capacity in positions of every sequence (of each full-length buffer).
        double_buffer: allocate a second set of buffers (graphs that are not in-place safe).
        rings: the sliding-window ring buffers and their capacities (:func:`qeff_kv.runtime.memory.ring.resolve`).
        recurrent: the recurrent layers' buffer pairs (:func:`qeff_kv.runtime.memory.recurrent.split_pairs`).
        checkpoints: when the recurrent state is checkpointed (:class:`~qeff_kv.runtime.memory.recurrent.CheckpointPolicy`).
        recurrent_double_buffer: the recurrent states' own setting (default: ``double_buffer``).
        device: where the buffers live (:mod:`qeff_kv.runtime.execution.device`; default the CPU).
    """

    def __init__(self, pairs: list[KVPair], *, max_sequences: int, ctx_len: int, double_buffer: bool = False,
                 rings: RingSpec | None = None, recurrent: list[KVPair] | None = None,
                 checkpoints: rec_mod.CheckpointPolicy | None = None, recurrent_double_buffer: bool | None = None,
                 device=None):
        positive_int("max_sequences", max_sequences)
        rec_double = double_buffer if recurrent_double_buffer is None else bool(recurrent_double_buffer)
        positive_int("ctx_len", ctx_len)
        rings = rings if rings is not None else RingSpec()
        policy = checkpoints or rec_mod.CheckpointPolicy()
        self.require_memory(pairs, max_sequences=max_sequences, ctx_len=ctx_len, double_buffer=double_buffer,
                            rings=rings, recurrent=recurrent, keep=policy.keep, recurrent_double_buffer=rec_double)
        settings = registry.Settings(max_sequences, ctx_len, double_buffer, rings, policy, rec_double, device)
        # the memory of each kind (registry.MEMORY_OF), in the hybrid's order; the positional pairs are of the
        # kinds full, ring and latent (one memory)
        memories = registry.build({"full": list(pairs), "recurrent": list(recurrent or [])}, settings)
        #: the KV buffers with a position axis (full, ring, latent)
        self.positional = memories[PositionalMemory]
        #: the multimodal RoPE marks of the images each sequence holds
        self.marks = memories[RopeMarks]
        #: the recurrent part (empty for a graph without recurrent layers: every verb then passes through)
        self.recurrent = memories[rec_mod.RecurrentMemory]
        super().__init__(list(memories.values()), max_sequences=max_sequences, ctx_len=ctx_len)

    # ------------------------------------------------------------------ the positional memory's buffers, by name
    pairs = property(lambda self: self.positional.pairs)
    rings = property(lambda self: self.positional.rings)
    capacities = property(lambda self: self.positional.capacities)
    shapes = property(lambda self: self.positional.shapes)
    dtypes = property(lambda self: self.positional.dtypes)
    arrays = property(lambda self: self.positional.arrays)
    values = property(lambda self: self.positional.values)
    spare_arrays = property(lambda self: self.positional.spare_arrays)
    spare_values = property(lambda self: self.positional.spare_values)
    double_buffer = property(lambda self: self.positional.double_buffer)

    def read(self, seq: Sequence, name: str, length: int | None = None) -> np.ndarray:
        """A copy of ``seq``'s slice ``[1, heads, length, head_dim]`` of positional buffer ``name``."""
        return self.positional.read(seq, name, length)

    wrote = staticmethod(PositionalMemory.wrote)

    # ------------------------------------------------------------------ sizes before allocating
    capacity_of = staticmethod(capacity_of)

    @classmethod
    def buffer_bytes(cls, pairs: list[KVPair], *, max_sequences: int, ctx_len: int, double_buffer: bool = False,
                     rings: RingSpec | None = None) -> int:
        """Bytes the positional buffers of ``pairs`` take (:func:`~qeff_kv.runtime.memory.positional.buffer_bytes`)."""
        return buffer_bytes(pairs, max_sequences=max_sequences, ctx_len=ctx_len, double_buffer=double_buffer,
                            rings=rings)

    @classmethod
    def require_memory(cls, pairs: list[KVPair], *, max_sequences: int, ctx_len: int,
                       double_buffer: bool = False, rings: RingSpec | None = None,
                       recurrent: list[KVPair] | None = None, keep: int = 0,
                       recurrent_double_buffer: bool | None = None) -> int:
        """Refuse (:class:`~qeff_kv.errors.MemoryLimitError`, one line with the size) buffers that do not fit in the
        memory available now (recurrent buffers and their ``keep`` checkpoints per sequence included); return their
        size in bytes."""
        n = cls.buffer_bytes(pairs, max_sequences=max_sequences, ctx_len=ctx_len, double_buffer=double_buffer,
                             rings=rings)
        rec = list(recurrent or [])
        n += rec_mod.buffer_bytes(rec, max_sequences, double_buffer if recurrent_double_buffer is None
                                  else recurrent_double_buffer, keep)
        ring = f", sliding-window rings of {rings.capacity}" if rings else ""
        states = f", {len(rec)} recurrent states with up to {keep} checkpoints each" if rec else ""
        require_memory(n, f"the KV buffers ({len(list(pairs))} buffers x {max_sequences} sequences x ctx_len "
                          f"{ctx_len}{ring}{states}{', two sets' if double_buffer else ''})")
        return n
