"""The hybrid: the sequence table and a list of memories (:mod:`.base`), every verb applied to all of them.

In the spirit of llama.cpp's memory API: a sequence is created in a free slot (the row of every memory's buffers),
has a valid ``length`` (its tokens occupy positions ``[0, length)``), can be truncated (rewound), copied into
another sequence (fork a shared prompt), reset to empty, or destroyed (its slot becomes free).

**Ask every memory, then apply to all.** A truncate or copy first asks each memory, in order, for its refusal
(:meth:`~.base.Memory.truncate_refusal`, :meth:`~.base.Memory.copy_refusal`); the first refusal is raised (as that
memory's :attr:`~.base.Memory.refusal_error`, one line naming where the sequence can return to) and nothing has
changed in any memory. Only when none refuses is the verb applied to every memory, then to the sequence's own
record (length, tokens, pending token). llama.cpp's hybrid lets one memory succeed where the other fails; this one
does not.

The hybrid knows no file format: a state file (:mod:`qeff_kv.runtime.memory.state_file`) or a hand-off
(:mod:`qeff_kv.serve.cluster.transfer`) asks it for every memory's part (:meth:`HybridMemory.state_write`,
:meth:`~HybridMemory.state_check`, :meth:`~HybridMemory.state_read`, :meth:`~HybridMemory.valid_bytes`,
:meth:`~HybridMemory.slicing_specs`), and it asks each memory in turn.

**The session's cache** (``session.cache``) is a hybrid built only from the registry (:meth:`HybridMemory.open`:
one memory per registered class, each at its own capacity, after :func:`.registry.require_memory` asked each class
for its bytes); each memory with a role is the hybrid's attribute of that name: ``cache.positional``
(:mod:`.positional`: the KV buffers with a position axis, ``cache.positional.arrays`` ...), ``cache.marks``
(:mod:`.rope_marks`), ``cache.recurrent`` (:mod:`.recurrent`, empty for a graph without recurrent layers). A graph
that is not in-place safe gets a second set of buffers (``spare``), and the two sets swap after every run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import numpy as np
import onnxruntime as ort

from qeff_kv.errors import AdapterError, RuntimeInputError
from qeff_kv.support.limits import positive_int
from qeff_kv.contract.layout import KVPair
from qeff_kv.runtime.memory import registry
from qeff_kv.runtime.memory.base import Memory
from qeff_kv.runtime.memory.rope_marks import RopeMark


@dataclass(eq=False)
class Sequence:
    """One sequence of the table.

    Attributes:
        id: stable identifier (never reused within a cache).
        slot: index on the buffers' batch axis (``batch_index`` of a continuous-batching graph).
        length: valid cache positions ``[0, length)``.
        tokens: the token ids at those positions.
        pending: the last sampled token, not yet in the cache (it is fed at position ``length`` next), or
            ``None``.
        pending_emitted: whether ``pending`` has already been returned to the caller (a prefill-only run
            samples the first token but leaves it to whoever continues).
        written: 1 + the highest position written since the last reset (``>= length``; the positional memory's
            ring bookkeeping).
        floor: the lowest position this sequence's buffers hold, 0 unless a ring state was loaded into
            full-length buffers (a rewind then stops where the window would need a lower position).
        rope_marks: multimodal RoPE: the images it holds and the RoPE offset of the text after each
            (:mod:`.rope_marks`).
        adapter: the LoRA adapter its rows run with (a name the session holds), ``None``: the base model;
            ``lora_scale`` multiplies the adapter's delta (docs/lora.md).
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
    rope_marks: list[RopeMark] = field(default_factory=list)
    adapter: str | None = None
    lora_scale: float = 1.0

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return f"Sequence(id={self.id}, slot={self.slot}, length={self.length}, pending={self.pending})"


def describe_adapter(name: str | None, scale: float = 1.0) -> str:
    """``adapter 'a' (scale 0.5)`` or ``the base model``: what a sequence runs with, for messages."""
    if name is None:
        return "the base model"
    return f"adapter {name!r}" + ("" if scale == 1.0 else f" (scale {scale:g})")


def take_adapter(dst: Sequence, name: str | None, scale: float, what: str) -> None:
    """``dst`` receives positions computed with adapter ``name`` at ``scale`` (a copy, a restored state): it runs
    with them from now on. Refused in one line when ``dst`` holds positions computed with another adapter (an
    empty sequence takes the adapter of what it receives)."""
    if dst.length and (dst.adapter, dst.lora_scale) != (name, scale):
        raise AdapterError(f"sequence {dst.id} holds {dst.length} positions computed with "
                           f"{describe_adapter(dst.adapter, dst.lora_scale)}; {what} was computed with "
                           f"{describe_adapter(name, scale)}: give an empty sequence or one of the same adapter")


def _length_arg(n, verb: str) -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise RuntimeInputError(f"{verb} length must be a non-negative int, got {n!r}")
    return int(n)


class HybridMemory:
    """``max_sequences`` slots, each a row of every memory in ``memories``, and the table of live sequences.

    ``ctx_len``: the positions a sequence may hold (:meth:`check_room`). Each memory with a
    :attr:`~.base.Memory.role` is the attribute of that name."""

    def __init__(self, memories: list[Memory], *, max_sequences: int, ctx_len: int):
        positive_int("max_sequences", max_sequences)
        positive_int("ctx_len", ctx_len)
        self.memories = list(memories)
        for m in self.memories:
            if m.role:
                setattr(self, m.role, m)
        self.max_sequences = int(max_sequences)
        self.ctx_len = int(ctx_len)
        #: KV input name -> the memory whose buffer it is
        self._owner = {name: m for m in self.memories for name in m.names}
        self._seqs: dict[int, Sequence] = {}
        self._next_id = 0

    @classmethod
    def open(cls, pairs_by_kind: dict[str, list[KVPair]], settings: registry.Settings) -> "HybridMemory":
        """The session's cache: refuse what does not fit (:func:`.registry.require_memory`), then one memory per
        registered class (:func:`.registry.build`: ``pairs_by_kind``, state kind -> pairs, graph order), in the
        hybrid's order."""
        positive_int("max_sequences", settings.max_sequences)
        positive_int("ctx_len", settings.ctx_len)
        registry.require_memory(pairs_by_kind, settings)
        memories = registry.build(pairs_by_kind, settings)
        return cls(list(memories.values()), max_sequences=settings.max_sequences, ctx_len=settings.ctx_len)

    # ---------------------------------------------------------------------------------- buffers
    def swap(self) -> None:
        """After a run with separate output buffers: each memory's outputs become its current buffers (each memory
        by its own setting: a replaced recurrent state is double-buffered alone)."""
        for m in self.memories:
            m.swap()

    def bindings(self) -> list[tuple[str, ort.OrtValue, ort.OrtValue | None]]:
        """``(KV input name, current value, spare value or None)`` of every buffer of every memory."""
        return [b for m in self.memories for b in m.bindings()]

    def write(self, seq: Sequence, name: str, data: np.ndarray) -> None:
        """Write ``data`` into ``seq``'s row of buffer ``name`` (whichever memory holds it)."""
        self._owner[name].write(seq, name, data)

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
        for m in self.memories:   # a freed slot keeps its last data: a new sequence starts empty
            m.create(seq)
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
        for m in self.memories:
            m.destroy(s)

    def reset(self, seq: Sequence | int) -> None:
        """Empty the sequence (length 0) but keep its slot."""
        self.truncate(seq, 0)

    def length(self, seq: Sequence | int) -> int:
        return self.get(seq).length

    def check_room(self, seqs: Iterable[Sequence], extra: int = 1) -> None:
        for s in seqs:
            if s.length + extra > self.ctx_len:
                raise RuntimeInputError(
                    f"sequence {s.id} holds {s.length} positions; {extra} more exceed the capacity "
                    f"ctx_len={self.ctx_len}")

    # ---------------------------------------------------------------------------------- verbs
    def _refuse(self, ask) -> None:
        """Raise the first memory's refusal (``ask(memory)``), asking them in order; nothing changes."""
        for m in self.memories:
            why = ask(m)
            if why is not None:
                raise m.refusal_error(why)

    def truncate(self, seq: Sequence | int, n: int) -> None:
        """Keep positions ``[0, n)``; O(1) for the positional memory (only the valid length moves). Drops a pending
        token unless ``n`` equals the current length. A rewind some memory cannot serve exactly (a ring that
        overwrote the window, an image that would be cut, a recurrent state without a checkpoint at ``n``) is
        refused in one line and changes nothing; ``n == 0`` (a reset) always works. The sequence keeps its LoRA
        adapter."""
        s = self.get(seq)
        n = _length_arg(n, "truncate")
        if n > s.length:
            raise RuntimeInputError(f"cannot truncate sequence {s.id} of length {s.length} to {n}")
        if 0 < n < s.length:
            self._refuse(lambda m: m.truncate_refusal(s, n))
        for m in self.memories:   # every memory agreed: apply to all
            m.truncate(s, n)
        if n != s.length:
            s.pending = None
            s.pending_emitted = False
        s.length = n
        del s.tokens[n:]

    def copy(self, src: Sequence | int, dst: Sequence | int, n: int) -> None:
        """Copy the first ``n`` positions of ``src`` into ``dst`` in place (llama.cpp's ``seq_cp``: fork a shared
        prompt); ``dst`` then holds ``n`` positions (its own are dropped) and no pending token, and runs with
        ``src``'s LoRA adapter (refused when ``dst`` holds positions of another: :func:`take_adapter`). A copy some
        memory cannot serve is refused in one line naming what can be copied; nothing changes on a refusal."""
        s, d = self.get(src), self.get(dst)
        if s is d:
            raise RuntimeInputError(f"cannot copy sequence {s.id} into itself; give another sequence")
        n = _length_arg(n, "copy")
        if n > s.length:
            raise RuntimeInputError(f"cannot copy {n} positions of sequence {s.id}: it holds {s.length}")
        take_adapter(d, s.adapter, s.lora_scale, f"sequence {s.id}")   # refused before anything changes
        if 0 < n:
            self._refuse(lambda m: m.copy_refusal(s, n))
        for m in self.memories:
            m.copy(s, d, n)
        d.adapter, d.lora_scale = s.adapter, s.lora_scale
        d.length = n
        d.tokens = list(s.tokens[:n])
        d.pending = None
        d.pending_emitted = False

    def relocate(self, seq: Sequence | int, slot: int) -> Sequence | None:
        """Move ``seq`` into ``slot``, its identity, positions, tokens, pending token and adapter unchanged: into a
        free slot its rows move; with the sequence holding ``slot`` it exchanges rows and slots (that sequence is
        returned). Lock step runs every row up to the highest one fed, so sequences in use are kept in the lowest
        rows this way. A memory that cannot move its rows refuses in one line; nothing changes on a refusal."""
        s = self.get(seq)
        if isinstance(slot, bool) or not isinstance(slot, (int, np.integer)) or not 0 <= slot < self.max_sequences:
            raise RuntimeInputError(f"slot must be an int in [0, {self.max_sequences}), got {slot!r}")
        slot = int(slot)
        if slot == s.slot:
            return None
        other = next((o for o in self._seqs.values() if o.slot == slot), None)
        self._refuse(lambda m: m.relocate_refusal())
        for m in self.memories:
            m.move_rows(s, slot, other)
        if other is not None:
            other.slot = s.slot
        s.slot = slot
        return other

    def rewind_points(self, seq: Sequence | int) -> list[int] | None:
        """The positions every memory lets ``seq`` be rewound (or copied) to, when some memory restricts them (a
        recurrent state: 0, its checkpoints, its length); ``None`` when none does (any position, within the
        refusals)."""
        s = self.get(seq)
        lists = [points for m in self.memories if (points := m.reachable(s)) is not None]
        if not lists:
            return None
        return sorted(set(lists[0]).intersection(*lists[1:]))

    def reusable(self, seq: Sequence | int, n: int) -> int:
        """The longest prefix of at most ``n`` positions that :meth:`truncate`/:meth:`copy` can return ``seq`` to:
        ``n`` when no memory restricts the positions (rings may still refuse), else the highest of
        :meth:`rewind_points` at or below ``n``."""
        points = self.rewind_points(seq)
        return int(n) if points is None else max(p for p in points if p <= n)

    # ---------------------------------------------------------------------------------- bytes
    @property
    def bytes_per_position(self) -> int:
        """Bytes one position of one sequence occupies across every buffer (a ring slot counted once)."""
        return sum(m.bytes_per_position for m in self.memories)

    @property
    def bytes_per_sequence(self) -> int:
        """Bytes of one sequence's row across every buffer, each at its own capacity (a recurrent state whole)."""
        return sum(m.bytes_per_sequence for m in self.memories)

    @property
    def memory_capacity(self) -> int:
        """Bytes of the buffers (one set; a recurrent state's checkpoints not included: :meth:`memory`)."""
        return sum(m.capacity for m in self.memories)

    @property
    def memory_used(self) -> int:
        """Bytes holding valid data of live sequences."""
        return sum(m.used(self._seqs.values()) for m in self.memories)

    def memory(self) -> dict:
        """What the memories hold, in bytes: ``capacity``, ``used``, and each memory's own entries
        (:meth:`~.base.Memory.report`)."""
        out = {"capacity": self.memory_capacity, "used": self.memory_used}
        for m in self.memories:
            out.update(m.report(self.sequences))
        return out

    def valid_bytes(self, seq: Sequence) -> int:
        """Bytes of ``seq``'s state across every memory: what a hand-off of ``seq`` moves."""
        return sum(m.valid_bytes(seq) for m in self.memories)

    # ---------------------------------------------------------------------------------- states
    def state_write(self, seq: Sequence, select=None) -> tuple[dict[str, np.ndarray], dict[str, str]]:
        """Every memory's part of ``seq``'s state: tensors (memory by memory, each in graph order) and metadata."""
        tensors, meta = {}, {}
        for m in self.memories:
            t, md = m.state_write(seq, select)
            tensors.update(t)
            meta.update(md)
        return tensors, meta

    def state_check(self, meta: dict[str, str], n: int, where: str) -> list:
        """Each memory's metadata checked (the first refusal raises); returns their parts, in memory order."""
        return [m.state_check(meta, n, where) for m in self.memories]

    def state_expected(self, parts: list) -> dict:
        """Every tensor the state must hold -> (shape, dtype)."""
        return {k: v for m, part in zip(self.memories, parts) for k, v in m.state_expected(part).items()}

    def state_check_tensors(self, tensors: dict, declared: dict, parts: list, where: str) -> None:
        for m, part in zip(self.memories, parts):
            m.state_check_tensors(tensors, declared, part, where)

    def state_read(self, seq: Sequence, tensors: dict, parts: list) -> None:
        """Each memory takes ``seq``'s bookkeeping from its checked part; every row it returns is written with
        :meth:`write`."""
        for m, part in zip(self.memories, parts):
            for name, data in m.state_read(seq, tensors, part).items():
                self.write(seq, name, data)

    def slicing_specs(self) -> dict[str, list]:
        """KV input name -> how a hand-off cuts it (:meth:`~.base.Memory.slicing_specs`)."""
        return {k: v for m in self.memories for k, v in m.slicing_specs().items()}
