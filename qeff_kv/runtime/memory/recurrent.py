"""Recurrent memory: the state of recurrent layers (``conv_state.{i}``, ``recurrent_state.{i}``, contract section 12),
one per sequence, which every token overwrites, and its **checkpoints**.

One implementation of the memory interface (:mod:`.base`), as the positional memory (:mod:`.positional`) is
another; the hybrid (:mod:`.hybrid`) asks both before any verb changes anything. The session's cache holds it as
``cache.recurrent`` (empty, and passing every verb through, for a graph without recurrent layers).

A recurrent buffer is ``[max_sequences, ...]`` (only axis 0 dynamic, no position axis): it holds the state after
the sequence's positions ``[0, length)``, so it cannot be cut by position. What it can return to:

* ``0`` (the state is zeroed: a reset);
* its current length (nothing to do);
* a position where it holds a **checkpoint**: a copy of the recurrent buffers' rows taken when the sequence held
  exactly that many positions. Checkpoints are taken at prompt boundaries (the end of a ``prefill``, and one token
  before it, as llama.cpp's server does: a prompt that repeats a previous one must re-feed its last token) and
  every ``every`` positions (prefill chunks are cut there; a decode step that reaches one takes it), at most
  ``keep`` per sequence (the lowest position is dropped first).

``truncate(seq, n)`` restores the state from the checkpoint at ``n`` (and drops those above ``n``); ``copy(src, dst,
n)`` copies ``src``'s state at ``n`` (live state, checkpoint, or zeros) and its checkpoints at or below ``n``.
Anything else is refused in one line naming the positions the sequence can return to
(:class:`~qeff_kv.errors.RewindError`).

Its part of a state: the recurrent buffers whole, ``[1, ...]`` (never cut by position), each checkpoint as tensors
``checkpoint.{p}.{buffer}``, and the metadata ``recurrent_checkpoints`` (JSON: the positions, ascending).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterable

import numpy as np

from qeff_kv.errors import RewindError, RuntimeInputError, StateFileError
from qeff_kv.contract.layout import KVPair
from qeff_kv.support.limits import positive_int
from qeff_kv.runtime.memory.base import Memory
from qeff_kv.runtime.memory.registry import Settings, holds

#: checkpoint every this many positions, unless the session says otherwise
DEFAULT_EVERY = 256
#: checkpoints kept per sequence, unless the session says otherwise
DEFAULT_KEEP = 8


@dataclass(frozen=True)
class CheckpointPolicy:
    """When checkpoints of the recurrent state are taken: every ``every`` positions (0: never by count) and at the
    end of each prefill (``at_prompts``); at most ``keep`` per sequence (0: none at all)."""

    every: int = DEFAULT_EVERY
    keep: int = DEFAULT_KEEP
    at_prompts: bool = True

    @classmethod
    def of(cls, every: int | None = None, keep: int | None = None) -> "CheckpointPolicy":
        for label, v in (("checkpoint_every", every), ("max_checkpoints", keep)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0):
                raise RuntimeInputError(f"{label} must be a non-negative int, got {v!r}")
        return cls(DEFAULT_EVERY if every is None else int(every), DEFAULT_KEEP if keep is None else int(keep))


def is_recurrent(pair: KVPair, spec) -> bool:
    """Whether ``pair`` is a recurrent layer's buffer (its state kind cannot be sliced by position)."""
    state = spec.recurrent(pair.layer) if spec is not None else None
    return state is not None and pair.stem in state.stems


def split_pairs(layout) -> tuple[list[KVPair], list[KVPair]]:
    """``(positional pairs, recurrent pairs)`` of a graph, in graph order."""
    spec = layout.state_spec
    rec = [p for p in layout.pairs if is_recurrent(p, spec)]
    return [p for p in layout.pairs if p not in rec], rec


def state_shape(pair: KVPair) -> tuple[int, ...]:
    """A recurrent buffer's shape after the batch axis (every dim static), or a one-line refusal."""
    shape = pair.input.shape
    if shape is None or len(shape) < 2 or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape[1:]):
        raise RuntimeInputError(f"recurrent state {pair.input_name!r} has shape {shape}; expected [batch, ...] with "
                                "every axis but the batch static")
    return tuple(int(d) for d in shape[1:])


def buffer_bytes(pairs: Iterable[KVPair], max_sequences: int, double_buffer: bool = False,
                 keep: int = 0) -> int:
    """Bytes of the recurrent buffers for ``max_sequences`` (twice with ``double_buffer``) plus, at most, ``keep``
    checkpoints per sequence; pairs with a symbolic shape count 0 (the allocation refuses them)."""
    per_seq = 0
    for p in pairs:
        try:
            per_seq += int(np.prod(state_shape(p))) * np.dtype(p.input.dtype).itemsize
        except (RuntimeInputError, TypeError):
            continue
    return per_seq * int(max_sequences) * ((2 if double_buffer else 1) + int(keep))


#: state metadata key: the checkpoint positions a state carries (JSON list, ascending)
CHECKPOINTS_META = "recurrent_checkpoints"


def checkpoint_key(position: int, name: str) -> str:
    """The state tensor key of the checkpoint at ``position`` of recurrent buffer ``name``."""
    return f"checkpoint.{int(position)}.{name}"


@holds("recurrent", order=2, role="recurrent")
class RecurrentMemory(Memory):
    """The recurrent buffers of a graph (one row per sequence slot) and each sequence's checkpoints.

    Args:
        pairs: the graph's recurrent buffer pairs (:func:`split_pairs`).
        max_sequences: rows of each buffer.
        double_buffer: a second set of buffers (graphs that are not in-place safe); the sets swap after every run.
        policy: when checkpoints are taken and how many are kept.
    """

    refusal_error = RewindError
    tensor_label = "recurrent tensor"

    def __init__(self, pairs: list[KVPair], *, max_sequences: int, double_buffer: bool = False,
                 policy: CheckpointPolicy | None = None, device=None):
        positive_int("max_sequences", max_sequences)
        self.device = device or self.device
        self.pairs = list(pairs)
        self.policy = policy or CheckpointPolicy()
        self.double_buffer = bool(double_buffer)
        self.shapes, self.dtypes, self.arrays, self.values = {}, {}, {}, {}
        self.spare_arrays, self.spare_values = {}, {}
        for p in self.pairs:
            self._allocate(p.input_name, (int(max_sequences),) + state_shape(p), np.dtype(p.input.dtype))
        #: sequence id -> {position: {buffer: the row's state at that position}}, positions ascending
        self._checkpoints: dict[int, dict[int, dict[str, np.ndarray]]] = {}

    @classmethod
    def build(cls, pairs: list[KVPair], settings: Settings) -> "RecurrentMemory":
        return cls(pairs, max_sequences=settings.max_sequences, double_buffer=settings.recurrent_double_buffer,
                   policy=settings.checkpoints, device=settings.device)

    @classmethod
    def need(cls, pairs: list[KVPair], settings: Settings) -> tuple[int, str]:
        """Bytes of the states of ``pairs`` and of their checkpoints (:func:`buffer_bytes`)."""
        keep = (settings.checkpoints or CheckpointPolicy()).keep
        n = buffer_bytes(pairs, settings.max_sequences, settings.recurrent_double_buffer, keep)
        return n, (f", {len(pairs)} recurrent states with up to {keep} checkpoints each" if pairs else "")

    def __bool__(self) -> bool:
        return bool(self.pairs)

    # ---------------------------------------------------------------------------------- bytes
    @property
    def bytes_per_sequence(self) -> int:
        """Bytes of one sequence's state across every recurrent buffer (also the size of one checkpoint)."""
        return sum(int(np.prod(s[1:])) * self.dtypes[n].itemsize for n, s in self.shapes.items())

    def checkpoint_bytes(self, seq=None) -> int:
        """Bytes held by checkpoints: of ``seq``, or of every sequence."""
        books = [self._checkpoints.get(seq.id, {})] if seq is not None else list(self._checkpoints.values())
        return sum(a.nbytes for book in books for ck in book.values() for a in ck.values())

    def used(self, seqs) -> int:
        """A non-empty sequence's state whole."""
        return self.bytes_per_sequence * sum(1 for s in seqs if s.length)

    def valid_bytes(self, seq) -> int:
        """The state whole, with its checkpoints."""
        return self.bytes_per_sequence + self.checkpoint_bytes(seq) if self else 0

    def report(self, seqs) -> dict:
        """The recurrent states and their checkpoints (``per_sequence``: sequence id -> {``positions``,
        ``bytes``})."""
        per = {s.id: {"positions": self.positions(s), "bytes": self.checkpoint_bytes(s)} for s in seqs}
        return {"recurrent_capacity": self.capacity, "recurrent_per_sequence": self.bytes_per_sequence,
                "checkpoint_bytes": self.bytes_per_sequence if self else 0,
                "checkpoints": sum(len(v["positions"]) for v in per.values()),
                "checkpoints_bytes": self.checkpoint_bytes(),
                "checkpoint_every": self.policy.every if self else None,
                "max_checkpoints": self.policy.keep if self else None, "per_sequence": per}

    # ---------------------------------------------------------------------------------- rows
    def read(self, seq) -> dict[str, np.ndarray]:
        """A copy of ``seq``'s state: buffer name -> ``[1, ...]``."""
        return {n: a[seq.slot:seq.slot + 1].copy() for n, a in self.arrays.items()}

    def write(self, seq, name: str, data: np.ndarray) -> None:
        """``seq``'s row of buffer ``name`` from ``data`` (``[1, ...]``)."""
        self.arrays[name][seq.slot:seq.slot + 1] = data

    def _restore(self, seq, tensors: dict[str, np.ndarray]) -> None:
        for n, a in tensors.items():
            self.write(seq, n, a)

    def clear(self, seq) -> None:
        """Zero ``seq``'s state and forget its checkpoints (a new or reset sequence)."""
        for a in self.arrays.values():
            a[seq.slot] = 0
        self._checkpoints.pop(seq.id, None)

    # ---------------------------------------------------------------------------------- checkpoints
    def positions(self, seq) -> list[int]:
        """Positions where ``seq`` holds a checkpoint, ascending."""
        return sorted(self._checkpoints.get(seq.id, {}))

    def checkpoints(self, seq) -> dict[int, dict[str, np.ndarray]]:
        """``seq``'s checkpoints (position -> buffer -> ``[1, ...]``), ascending; the arrays are the memory's own."""
        book = self._checkpoints.get(seq.id, {})
        return {p: book[p] for p in sorted(book)}

    def snapshot(self, seq, position: int) -> None:
        """Keep ``seq``'s current state as the checkpoint at ``position`` (the sequence holds exactly that many
        positions); beyond ``keep`` checkpoints the lowest position is dropped."""
        if not self.pairs or self.policy.keep <= 0 or position <= 0:
            return
        book = self._checkpoints.setdefault(seq.id, {})
        position = int(position)
        old = book.pop(position, None)
        if old is None and len(book) >= self.policy.keep:
            old = book.pop(min(book))   # the lowest goes; its arrays take the new copy (no fresh pages to fault in)
        if old is None:
            old = {n: np.empty_like(a[seq.slot:seq.slot + 1]) for n, a in self.arrays.items()}
        for n, a in self.arrays.items():
            np.copyto(old[n], a[seq.slot:seq.slot + 1])
        book[position] = old

    def due(self, position: int) -> bool:
        """Whether a run ending at ``position`` takes a checkpoint by count."""
        every = self.policy.every
        return bool(self.pairs) and every > 0 and self.policy.keep > 0 and position > 0 and position % every == 0

    def boundaries(self, start: int, chunks: list[tuple[int, int]], cuts: Iterable[int] = ()) -> list[tuple[int, int]]:
        """``chunks`` (offset, count) from position ``start``, cut so that none crosses a multiple of ``every`` nor
        one of the positions ``cuts`` (a chunk then ends there)."""
        every = self.policy.every
        if not self.pairs or self.policy.keep <= 0:
            return chunks
        cuts = sorted(set(cuts))
        out = []
        for off, cnt in chunks:
            while cnt > 0:
                pos = start + off
                room = every - pos % every if every > 0 else cnt
                room = min([room] + [c - pos for c in cuts if c > pos])
                take = min(cnt, room)
                out.append((off, take))
                off, cnt = off + take, cnt - take
        return out

    def install_checkpoints(self, seq, book: dict[int, dict[str, np.ndarray]]) -> None:
        """Replace ``seq``'s checkpoints with copies of ``book`` (a state file's or another sequence's)."""
        self._checkpoints[seq.id] = {int(p): {n: np.array(a, copy=True) for n, a in ck.items()}
                                     for p, ck in book.items()}

    # ---------------------------------------------------------------------------------- verbs
    def reachable(self, seq) -> list[int] | None:
        """Every position ``seq`` can be rewound to: 0, its checkpoints, its length (``None`` without recurrent
        layers: any)."""
        if not self.pairs:
            return None
        return self._reachable(seq)

    def _reachable(self, seq) -> list[int]:
        return sorted({0, seq.length, *(p for p in self.positions(seq) if p <= seq.length)})

    def _allowed(self, seq, n: int) -> bool:
        return not self.pairs or n in (0, seq.length) or n in self._checkpoints.get(seq.id, {})

    def _points(self, seq) -> str:
        points = [str(p) for p in self._reachable(seq)]
        return points[0] if len(points) == 1 else ", ".join(points[:-1]) + " or " + points[-1]

    def truncate_refusal(self, seq, n: int) -> str | None:
        """Why ``seq`` cannot be rewound to ``n`` (one line naming where it can return to), or ``None``."""
        if self._allowed(seq, n):
            return None
        return (f"cannot rewind sequence {seq.id} to {n} positions: its recurrent state has no checkpoint there; "
                f"it can return to {self._points(seq)}")

    def copy_refusal(self, src, n: int) -> str | None:
        """Why ``src``'s first ``n`` positions cannot be copied (one line naming what can be), or ``None``."""
        if self._allowed(src, n):
            return None
        return (f"cannot copy {n} positions of sequence {src.id}: its recurrent state has no checkpoint there; "
                f"it can be copied at {self._points(src)} positions")

    def truncate(self, seq, n: int) -> None:
        """Apply a rewind :meth:`truncate_refusal` allowed."""
        if not self.pairs or n == seq.length:
            return
        if n == 0:
            self.clear(seq)
            return
        book = self._checkpoints[seq.id]
        self._restore(seq, book[n])
        for p in [p for p in book if p > n]:
            del book[p]

    def copy(self, src, dst, n: int) -> None:
        """Apply a copy :meth:`copy_refusal` allowed: ``dst``'s state becomes ``src``'s at ``n``, with ``src``'s
        checkpoints at or below ``n``."""
        if not self.pairs:
            return
        if n == 0:
            self.clear(dst)
            return
        book = self._checkpoints.get(src.id, {})
        if n == src.length:
            for a in self.arrays.values():
                a[dst.slot] = a[src.slot]
        else:
            self._restore(dst, book[n])
        self.install_checkpoints(dst, {p: ck for p, ck in book.items() if p <= n})

    def destroy(self, seq) -> None:
        self._checkpoints.pop(seq.id, None)

    # ---------------------------------------------------------------------------------- states
    def state_write(self, seq, select=None):
        """``seq``'s state whole (never cut by position) and its checkpoints (:func:`checkpoint_key`), and the
        metadata naming the checkpoint positions."""
        if not self:
            return {}, {}
        tensors = {n: a for n, a in self.read(seq).items() if select is None or n in select}
        book = self.checkpoints(seq)
        for p, ck in book.items():
            tensors.update({checkpoint_key(p, n): a.copy() for n, a in ck.items() if select is None or n in select})
        return tensors, {CHECKPOINTS_META: "[" + ",".join(str(p) for p in book) + "]"}

    def state_check(self, meta, n, where) -> list[int]:
        """The checkpoint positions a state carries, checked against this memory and the valid length ``n``;
        ``[]`` for a graph without recurrent state."""
        raw = meta.get(CHECKPOINTS_META)
        if not self:
            if raw is not None:
                raise StateFileError(f"{where}: carries recurrent-state checkpoints; this graph keeps no recurrent "
                                     "state")
            return []
        if raw is None:
            return []
        try:
            positions = json.loads(raw)
        except (ValueError, RecursionError):
            positions = None
        if (not isinstance(positions, list)
                or not all(isinstance(p, int) and not isinstance(p, bool) for p in positions)
                or positions != sorted(set(positions)) or any(p <= 0 or p > n for p in positions)):
            raise StateFileError(f"{where}: malformed state metadata ({CHECKPOINTS_META}: expected ascending "
                                 f"positions in 1..{n})")
        return positions

    def state_expected(self, part: list[int]) -> dict:
        """The live state and each checkpoint -> (shape, dtype)."""
        out = {}
        for name, shape in self.shapes.items():
            want = ((1,) + tuple(shape[1:]), self.dtypes[name])
            out[name] = want
            for p in part:
                out[checkpoint_key(p, name)] = want
        return out

    def state_read(self, seq, tensors, part: list[int]) -> dict[str, np.ndarray]:
        """Install the state's checkpoints; its live state is the rows to write."""
        if not self:
            return {}
        self.install_checkpoints(seq, {p: {n: tensors[checkpoint_key(p, n)] for n in self.shapes} for p in part})
        return {n: tensors[n] for n in self.shapes}

    def slicing_specs(self) -> dict[str, list]:
        """Never sliced: ``batch_index``, then 0 for every axis."""
        return {name: ["batch_index"] + [0] * (len(shape) - 1) for name, shape in self.shapes.items()}
