"""The KV cache manager: one fixed buffer per KV pair, sequences as slots of its batch axis.

In the spirit of llama.cpp's memory API: a sequence is created in a free slot, has a valid ``length``
(its tokens occupy cache positions ``[0, length)``), can be truncated (rewound) in O(1) — only the valid
length moves, no data is copied or cleared — reset to empty, or destroyed (its slot becomes free).

Nothing beyond a sequence's valid length is ever read: the graph masks every position past the one it is
computing, so stale data left by a truncate or by a destroyed sequence is harmless and is overwritten as the
new tokens arrive.

Buffers are allocated once, each at its own capacity (``max_sequences`` x ``ctx_len`` positions; a
sliding-window ring buffer ``max_sequences`` x ``C`` slots, see :mod:`qeff_kv.runtime.ring`; a static axis as
the graph fixes it), as numpy arrays wrapped by ``OrtValue`` objects that share their memory; the session binds
them to the graph. A graph that is not in-place safe gets a second set (``spare``), and the two sets swap after
every run.

With ring buffers, a truncate is exact only while the ring still holds the window of the new last position;
otherwise it is refused in one line (:func:`qeff_kv.runtime.ring.rewind_refusal`). Each sequence records
``written`` (1 + the highest position written since its last reset) for that rule.

A recurrent or hybrid graph's state that cannot be sliced by position (``conv_state``/``recurrent_state``) is the
cache's second memory, ``cache.recurrent`` (:class:`~qeff_kv.runtime.recurrent.RecurrentMemory`, with its
checkpoints). Every verb applies to both (llama.cpp's hybrid memory): each kind is asked for its refusal first,
and only when neither refuses is anything changed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import numpy as np
import onnxruntime as ort

from ..errors import RewindError, RuntimeInputError
from ..layout import KVPair
from ..limits import positive_int, require_memory
from . import positions as pos_mod
from . import recurrent as rec_mod
from .ring import RingSpec, copy_refusal, copy_slots, lowest_held, rewind_refusal


@dataclass(eq=False)
class Sequence:
    """One sequence in the cache.

    Attributes:
        id: stable identifier (never reused within a cache).
        slot: index on the KV batch axis (``batch_index`` of a continuous-batching graph).
        length: valid cache positions ``[0, length)``.
        tokens: the token ids at those positions.
        pending: the last sampled token, not yet in the cache (it is fed at position ``length`` next), or
            ``None``.
        pending_emitted: whether ``pending`` has already been returned to the caller (a prefill-only run
            samples the first token but leaves it to whoever continues).
        written: 1 + the highest position written since the last reset (``>= length``; ring bookkeeping).
        floor: the lowest position this sequence's buffers hold, 0 unless a ring state was loaded into
            full-length buffers (a rewind then stops where the window would need a lower position).
        rope_marks: multimodal RoPE: the images it holds and the RoPE offset of the text after each
            (:mod:`qeff_kv.runtime.positions`).
    """

    id: int
    slot: int
    length: int = 0
    tokens: list[int] = field(default_factory=list)
    pending: int | None = None
    pending_emitted: bool = False
    alive: bool = True
    written: int = 0
    floor: int = 0
    rope_marks: list[pos_mod.RopeMark] = field(default_factory=list)

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return f"Sequence(id={self.id}, slot={self.slot}, length={self.length}, pending={self.pending})"


class KVCache:
    """Fixed-capacity KV buffers plus the slot bookkeeping of the sequences stored in them.

    Args:
        pairs: the graph's KV pairs (from :class:`qeff_kv.layout.KVLayout`), in graph input order.
        max_sequences: size of the KV batch axis.
        ctx_len: capacity in positions of every sequence (of each full-length buffer).
        double_buffer: allocate a second set of buffers (graphs that are not in-place safe).
        rings: the sliding-window ring buffers and their capacities (:func:`qeff_kv.runtime.ring.resolve`).
        recurrent: the recurrent layers' buffer pairs (:func:`qeff_kv.runtime.recurrent.split_pairs`): the second
            memory, ``cache.recurrent``.
        checkpoints: when the recurrent state is checkpointed (:class:`~qeff_kv.runtime.recurrent.CheckpointPolicy`).
    """

    def __init__(self, pairs: list[KVPair], *, max_sequences: int, ctx_len: int, double_buffer: bool = False,
                 rings: RingSpec | None = None, recurrent: list[KVPair] | None = None,
                 checkpoints: rec_mod.CheckpointPolicy | None = None, recurrent_double_buffer: bool | None = None):
        positive_int("max_sequences", max_sequences)
        rec_double = double_buffer if recurrent_double_buffer is None else bool(recurrent_double_buffer)
        positive_int("ctx_len", ctx_len)
        self.rings = rings if rings is not None else RingSpec()
        policy = checkpoints or rec_mod.CheckpointPolicy()
        self.require_memory(pairs, max_sequences=max_sequences, ctx_len=ctx_len, double_buffer=double_buffer,
                            rings=self.rings, recurrent=recurrent, keep=policy.keep, recurrent_double_buffer=rec_double)
        #: the recurrent part (empty for a graph without recurrent layers: every verb then passes through)
        self.recurrent = rec_mod.RecurrentMemory(list(recurrent or []), max_sequences=max_sequences,
                                                 double_buffer=rec_double, policy=policy)
        self.pairs = list(pairs)
        self.max_sequences = int(max_sequences)
        self.ctx_len = int(ctx_len)
        #: slots of axis 2 per buffer (KV input name -> ctx_len, a ring's C, or a static axis)
        self.capacities: dict[str, int] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, np.dtype] = {}
        self.arrays: dict[str, np.ndarray] = {}
        self.values: dict[str, ort.OrtValue] = {}
        self.spare_arrays: dict[str, np.ndarray] = {}
        self.spare_values: dict[str, ort.OrtValue] = {}
        for p in self.pairs:
            shape = p.input.shape
            if shape is None or len(shape) != 4:
                raise RuntimeInputError(
                    f"KV input {p.input_name!r} has shape {shape}; expected [batch, heads, ctx_len, head_dim]")
            heads, head_dim = shape[1], shape[3]
            if not isinstance(heads, int) or not isinstance(head_dim, int):
                raise RuntimeInputError(
                    f"KV input {p.input_name!r} has symbolic heads or head_dim ({shape}); cannot allocate it")
            self.capacities[p.input_name] = self.capacity_of(p, self.ctx_len, self.rings)
            full = (self.max_sequences, heads, self.capacities[p.input_name], head_dim)
            dtype = np.dtype(p.input.dtype)
            self.shapes[p.input_name] = full
            self.dtypes[p.input_name] = dtype
            self.arrays[p.input_name] = np.zeros(full, dtype=dtype)
            self.values[p.input_name] = ort.OrtValue.ortvalue_from_numpy(self.arrays[p.input_name])
            if double_buffer:
                self.spare_arrays[p.input_name] = np.zeros(full, dtype=dtype)
                self.spare_values[p.input_name] = ort.OrtValue.ortvalue_from_numpy(self.spare_arrays[p.input_name])
        self.double_buffer = double_buffer
        self._seqs: dict[int, Sequence] = {}
        self._next_id = 0

    @staticmethod
    def capacity_of(pair: KVPair, ctx_len: int, rings: RingSpec | None = None) -> int:
        """Slots of ``pair``'s buffer: a ring's capacity, a static axis 2 as it is, else ``ctx_len``."""
        if rings is not None and pair.input_name in rings.capacities:
            return rings.capacities[pair.input_name]
        axis = pair.axis2
        return axis if isinstance(axis, int) and not isinstance(axis, bool) else int(ctx_len)

    @classmethod
    def buffer_bytes(cls, pairs: list[KVPair], *, max_sequences: int, ctx_len: int, double_buffer: bool = False,
                     rings: RingSpec | None = None) -> int:
        """Bytes the buffers of ``pairs`` take, each at its own capacity, for ``max_sequences`` (twice with
        ``double_buffer``); pairs with a symbolic or malformed shape count 0 (the allocation refuses them)."""
        total = 0
        for p in pairs:
            shape = p.input.shape
            if shape is None or len(shape) != 4 or not isinstance(shape[1], int) or not isinstance(shape[3], int):
                continue
            try:
                itemsize = np.dtype(p.input.dtype).itemsize
            except TypeError:
                continue
            slots = cls.capacity_of(p, ctx_len, rings)
            total += int(shape[1]) * int(shape[3]) * itemsize * slots * int(max_sequences) * (2 if double_buffer else 1)
        return total

    @classmethod
    def require_memory(cls, pairs: list[KVPair], *, max_sequences: int, ctx_len: int,
                       double_buffer: bool = False, rings: RingSpec | None = None,
                       recurrent: list[KVPair] | None = None, keep: int = 0,
                       recurrent_double_buffer: bool | None = None) -> int:
        """Refuse (:class:`~qeff_kv.errors.MemoryLimitError`, one line with the size) KV buffers that do not fit
        in the memory available now (recurrent buffers and their ``keep`` checkpoints per sequence included);
        return their size in bytes."""
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

    # ---------------------------------------------------------------------------------- buffers
    def swap(self) -> None:
        """After a run with separate output buffers: the outputs become the current cache."""
        if self.double_buffer:
            self.arrays, self.spare_arrays = self.spare_arrays, self.arrays
            self.values, self.spare_values = self.spare_values, self.values
        self.recurrent.swap()   # its own setting: a replaced recurrent state is double-buffered alone

    def bindings(self) -> list[tuple[str, ort.OrtValue, ort.OrtValue | None]]:
        """``(KV input name, current value, spare value or None)`` of every buffer of both memories."""
        out = []
        for mem in (self, self.recurrent):
            out += [(n, v, mem.spare_values.get(n)) for n, v in mem.values.items()]
        return out

    def _slot_bytes(self, name: str) -> int:
        _, h, _, d = self.shapes[name]
        return h * d * self.dtypes[name].itemsize

    @property
    def bytes_per_position(self) -> int:
        """Bytes one position of one sequence occupies across every KV buffer (a ring slot counted once: the
        cost of a position while the sequence is shorter than its rings)."""
        return sum(self._slot_bytes(n) for n in self.shapes)

    @property
    def bytes_per_sequence(self) -> int:
        """Bytes of one sequence's slot across every KV buffer, each at its own capacity (a recurrent state
        whole)."""
        return sum(self._slot_bytes(n) * self.capacities[n] for n in self.shapes) + self.recurrent.bytes_per_sequence

    @property
    def memory_capacity(self) -> int:
        """Bytes of the KV buffers (one set: ``max_sequences`` sequences, each buffer at its own capacity; the
        recurrent states included, their checkpoints not: :meth:`memory`)."""
        return sum(a.nbytes for a in self.arrays.values()) + self.recurrent.memory_capacity

    @property
    def memory_used(self) -> int:
        """Bytes holding valid positions of live sequences (a ring holds at most its capacity of them; a
        non-empty sequence's recurrent state whole)."""
        return sum(self._slot_bytes(n) * min(s.length, self.capacities[n])
                   for s in self._seqs.values() for n in self.shapes) + \
            self.recurrent.bytes_per_sequence * sum(1 for s in self._seqs.values() if s.length)

    def memory(self) -> dict:
        """What the cache holds, in bytes: the buffers (``capacity``), the valid positions and states of live
        sequences (``used``), the recurrent states (``recurrent_per_sequence``), and the checkpoints of the
        recurrent state (``checkpoints``: count and bytes in all, ``checkpoint_bytes``: one checkpoint,
        ``per_sequence``: sequence id -> {``positions``, ``bytes``})."""
        rec = self.recurrent
        per = {s.id: {"positions": rec.positions(s), "bytes": rec.checkpoint_bytes(s)} for s in self.sequences}
        return {"capacity": self.memory_capacity, "used": self.memory_used,
                "positional_capacity": sum(a.nbytes for a in self.arrays.values()),
                "recurrent_capacity": rec.memory_capacity, "recurrent_per_sequence": rec.bytes_per_sequence,
                "checkpoint_bytes": rec.bytes_per_sequence if rec else 0,
                "checkpoints": sum(len(v["positions"]) for v in per.values()),
                "checkpoints_bytes": rec.checkpoint_bytes(),
                "checkpoint_every": rec.policy.every if rec else None,
                "max_checkpoints": rec.policy.keep if rec else None, "per_sequence": per}

    def read(self, seq: Sequence, name: str, length: int | None = None) -> np.ndarray:
        """A copy of ``seq``'s slice ``[1, heads, length, head_dim]`` of buffer ``name`` (its first ``length``
        slots: ring order for a ring buffer)."""
        n = seq.length if length is None else length
        # always a copy: a slice that spans the whole buffer (one slot, a full ring) is already contiguous, and
        # ascontiguousarray would hand out a view that the next run overwrites
        return np.array(self.arrays[name][seq.slot:seq.slot + 1, :, :n, :], order="C", copy=True)

    def write(self, seq: Sequence, name: str, data: np.ndarray) -> None:
        """Copy ``data`` (``[1, heads, n, head_dim]``) into slots ``[0, n)`` of ``seq``'s slot."""
        n = data.shape[2]
        self.arrays[name][seq.slot:seq.slot + 1, :, :n, :] = data

    @staticmethod
    def wrote(seq: Sequence, end: int) -> None:
        """Record that a run wrote ``seq``'s positions up to ``end`` (exclusive)."""
        seq.written = max(seq.written, int(end))

    # ---------------------------------------------------------------------------------- sequences
    @property
    def num_sequences(self) -> int:
        return len(self._seqs)

    @property
    def sequences(self) -> list[Sequence]:
        return sorted(self._seqs.values(), key=lambda s: s.id)

    def free_slots(self) -> list[int]:
        used = {s.slot for s in self._seqs.values()}
        return [i for i in range(self.max_sequences) if i not in used]

    def create(self, slot: int | None = None) -> Sequence:
        """A new empty sequence in a free slot (the lowest one unless ``slot`` is given)."""
        free = self.free_slots()
        if not free:
            raise RuntimeInputError(
                f"all {self.max_sequences} sequence slots are in use; destroy a sequence first")
        if slot is None:
            slot = free[0]
        elif slot not in free:
            raise RuntimeInputError(f"slot {slot} is not free (free: {free})")
        seq = Sequence(self._next_id, slot)
        self._next_id += 1
        self._seqs[seq.id] = seq
        self.recurrent.clear(seq)   # a freed slot keeps its last state: a new sequence starts from zeros
        return seq

    def get(self, seq: Sequence | int) -> Sequence:
        if isinstance(seq, bool) or not isinstance(seq, (Sequence, int, np.integer)):
            raise RuntimeInputError(f"expected a Sequence (or its id), got {type(seq).__name__}")
        sid = seq.id if isinstance(seq, Sequence) else int(seq)
        found = self._seqs.get(sid)
        if found is None or (isinstance(seq, Sequence) and found is not seq):
            raise RuntimeInputError(f"sequence {sid} does not exist (destroyed or from another session)")
        return found

    def destroy(self, seq: Sequence | int) -> None:
        s = self.get(seq)
        s.alive = False
        del self._seqs[s.id]
        self.recurrent.destroy(s)

    def reset(self, seq: Sequence | int) -> None:
        """Empty the sequence (length 0) but keep its slot."""
        self.truncate(seq, 0)

    def length(self, seq: Sequence | int) -> int:
        return self.get(seq).length

    def truncate(self, seq: Sequence | int, n: int) -> None:
        """Keep positions ``[0, n)``; O(1): only the valid length moves. Drops a pending token unless
        ``n`` equals the current length. With ring buffers a rewind the rings cannot serve exactly is refused
        (one line, nothing changed), and with a recurrent state a rewind to a position without a checkpoint
        (:class:`~qeff_kv.errors.RewindError`, naming where it can return to); ``n == 0`` (a reset) always
        works."""
        s = self.get(seq)
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise RuntimeInputError(f"truncate length must be a non-negative int, got {n!r}")
        if n > s.length:
            raise RuntimeInputError(f"cannot truncate sequence {s.id} of length {s.length} to {n}")
        if 0 < n < s.length:
            why = rewind_refusal(s, int(n), self.rings) or pos_mod.rewind_refusal(s.rope_marks, int(n))
            if why is not None:
                raise RuntimeInputError(why)
            why = self.recurrent.truncate_refusal(s, int(n))
            if why is not None:
                raise RewindError(why)
        # both memories agreed: apply to both
        self.recurrent.truncate(s, int(n))
        s.rope_marks = pos_mod.rewind(s.rope_marks, int(n))
        if n == 0:
            s.written = s.floor = 0
        if n != s.length:
            s.pending = None
            s.pending_emitted = False
        s.length = int(n)
        del s.tokens[n:]

    def copy(self, src: Sequence | int, dst: Sequence | int, n: int) -> None:
        """Copy the first ``n`` positions of ``src`` into ``dst`` in place (llama.cpp's ``seq_cp``: fork a shared
        prompt): every buffer's slots holding positions ``[0, n)`` of ``src``'s slot written into ``dst``'s;
        ``dst`` then holds ``n`` positions (its own are dropped) and no pending token. With ring buffers only
        while ``src``'s rings hold the window of position ``n`` (the rule of :meth:`truncate`), else a one-line
        refusal naming what can be copied; nothing changes on a refusal."""
        s, d = self.get(src), self.get(dst)
        if s is d:
            raise RuntimeInputError(f"cannot copy sequence {s.id} into itself; give another sequence")
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise RuntimeInputError(f"copy length must be a non-negative int, got {n!r}")
        n = int(n)
        if n > s.length:
            raise RuntimeInputError(f"cannot copy {n} positions of sequence {s.id}: it holds {s.length}")
        if 0 < n:
            why = copy_refusal(s, n, self.rings) or pos_mod.rewind_refusal(s.rope_marks, n)
            if why is not None:
                raise RuntimeInputError(why)
            why = self.recurrent.copy_refusal(s, n)
            if why is not None:
                raise RewindError(why)
        self.recurrent.copy(s, d, n)
        lowest = lowest_held(s, self.rings) if n else 0
        for name, arr in self.arrays.items():
            slots = copy_slots(self.rings.capacities.get(name), n, lowest)
            arr[d.slot, :, slots, :] = arr[s.slot, :, slots, :]
        d.length = n
        d.tokens = list(s.tokens[:n])
        d.written = n
        d.floor = lowest if n else 0
        d.rope_marks = pos_mod.rewind(s.rope_marks, n)
        d.pending = None
        d.pending_emitted = False

    def check_room(self, seqs: Iterable[Sequence], extra: int = 1) -> None:
        for s in seqs:
            if s.length + extra > self.ctx_len:
                raise RuntimeInputError(
                    f"sequence {s.id} holds {s.length} positions; {extra} more exceed the capacity "
                    f"ctx_len={self.ctx_len}")
