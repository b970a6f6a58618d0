"""Positional memory: the KV buffers whose axis 2 holds positions (the state spec's ``full``, ``ring``, ``latent``
and ``indexed`` kinds: DeepSeek sparse attention's ``index_key`` is one more full-length buffer), one row per sequence
slot, and the ring rules.

Every buffer is ``[max_sequences, heads, capacity, head_dim]``: ``ctx_len`` positions (a ``full`` buffer, and MLA's
``latent`` pair ``compressed_kv``/``k_pe``: position ``p`` in slot ``p``), a sliding-window ring's ``C`` slots
(position ``p`` in slot ``p % C``, see :mod:`qeff_kv.runtime.memory.ring`), or a static axis as the graph fixes it.
A sequence's positions ``[0, length)`` are valid; a truncate moves only the length (no data is copied or cleared:
the graph masks every position past the one it computes, so stale data is never read).

**The ring rule** (one rule for truncate and copy): a sequence whose rings overwrote positions holds
``[lo, written)`` only (``lo``: :meth:`PositionalMemory.lowest_held`); it can continue exactly from ``n`` only while
the next query, at ``n``, still finds every key of its window: ``lo <= max(0, n - W + 1)``. The sequence records
``written`` (1 + the highest position written since its last reset) and ``floor`` (the lowest position it holds
when a ring state was loaded into full-length buffers).

Its part of a state: each buffer's valid positions ``[1, heads, n, head_dim]``, a ring's ``min(C, written)`` slots in
ring order, and the metadata ``ring_written``, ``capacities``, ``sliding_window`` (and ``ring_floor``). A full-length
state loads into rings (position ``p`` to slot ``p % C``), a ring state into full-length buffers of the same window
(by position, from the lowest position held).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from qeff_kv.errors import RuntimeInputError, StateFileError
from qeff_kv.contract.layout import KVPair
from qeff_kv.support.limits import MAX_DIM, positive_int
from qeff_kv.runtime.memory.ring import RingSpec, held
from qeff_kv.runtime.memory.base import Memory, meta_int
from qeff_kv.runtime.memory.registry import Settings, holds

#: the peer's dims of a KV slice: the sequence's row, every head, positions from ctx_start, every head_dim
SLICE_DIMS = ("batch_index", 0, "ctx_start", 0)
#: the same of a static cache's packed ``[batch, capacity, heads*head_dim]`` buffer (positions on axis 1)
PACKED_SLICE_DIMS = ("batch_index", "ctx_start", 0)


def capacity_of(pair: KVPair, ctx_len: int, rings: RingSpec | None = None) -> int:
    """Slots of ``pair``'s buffer: a ring's capacity, a static axis 2 as it is, else ``ctx_len``."""
    if rings is not None and pair.input_name in rings.capacities:
        return rings.capacities[pair.input_name]
    axis = pair.axis2
    return axis if isinstance(axis, int) and not isinstance(axis, bool) else int(ctx_len)


def buffer_bytes(pairs: list[KVPair], *, max_sequences: int, ctx_len: int, double_buffer: bool = False,
                 rings: RingSpec | None = None) -> int:
    """Bytes the buffers of ``pairs`` take, each at its own capacity, for ``max_sequences`` (twice with
    ``double_buffer``); pairs with a symbolic or malformed shape count 0 (the allocation refuses them)."""
    total = 0
    for p in pairs:
        shape = p.view_shape(p.input.shape)
        if shape is None or len(shape) != 4 or not isinstance(shape[1], int) or not isinstance(shape[3], int):
            continue
        try:
            itemsize = np.dtype(p.input.dtype).itemsize
        except TypeError:
            continue
        slots = capacity_of(p, ctx_len, rings)
        total += int(shape[1]) * int(shape[3]) * itemsize * slots * int(max_sequences) * (2 if double_buffer else 1)
    return total


def copy_slots(capacity: int | None, n: int, lowest: int) -> np.ndarray | slice:
    """The slots of one buffer that hold positions ``[lowest, n)`` after positions ``[0, n)``: ``slice(0, n)``
    for a full-length buffer (slot = position), else slots ``p % C`` for ``p`` in ``[max(lowest, n - C), n)``."""
    if capacity is None:
        return slice(0, n)
    return np.arange(max(lowest, n - capacity, 0), n) % capacity


@holds("full", "ring", "latent", "indexed", order=0, role="positional")
class PositionalMemory(Memory):
    """The buffers of ``pairs`` (graph order), each at its own capacity, and the ring rules.

    Args:
        pairs: the positional KV pairs (:func:`qeff_kv.runtime.memory.recurrent.split_pairs`).
        max_sequences: rows of each buffer.
        ctx_len: capacity of a full-length buffer.
        double_buffer: a second set of buffers (a graph that is not in-place safe); the sets swap after every run.
        rings: the sliding-window facts (:func:`qeff_kv.runtime.memory.ring.resolve`).
    """

    def __init__(self, pairs: list[KVPair], *, max_sequences: int, ctx_len: int, double_buffer: bool = False,
                 rings: RingSpec | None = None, device=None):
        positive_int("max_sequences", max_sequences)
        positive_int("ctx_len", ctx_len)
        self.device = device or self.device
        self.pairs = list(pairs)
        self.rings = rings if rings is not None else RingSpec()
        self.double_buffer = bool(double_buffer)
        #: slots of axis 2 per buffer (KV input name -> ctx_len, a ring's C, or a static axis)
        self.capacities: dict[str, int] = {}
        self.shapes, self.dtypes, self.arrays, self.values = {}, {}, {}, {}
        self.spare_arrays, self.spare_values = {}, {}
        #: buffers the graph sees packed (a static cache's ``[batch, capacity, heads*head_dim]``): kept here as
        #: ``[batch, 1, capacity, heads*head_dim]`` (positions on axis 2), bound as the rank-3 view of that memory
        self.packed = {p.input_name for p in self.pairs if p.packed}
        for p in self.pairs:
            shape = p.view_shape(p.input.shape)
            if shape is None or len(shape) != 4:
                raise RuntimeInputError(
                    f"KV input {p.input_name!r} has shape {shape}; expected [batch, heads, ctx_len, head_dim]")
            heads, head_dim = shape[1], shape[3]
            if not isinstance(heads, int) or not isinstance(head_dim, int):
                raise RuntimeInputError(
                    f"KV input {p.input_name!r} has symbolic heads or head_dim ({shape}); cannot allocate it")
            self.capacities[p.input_name] = capacity_of(p, ctx_len, self.rings)
            self._allocate(p.input_name, (int(max_sequences), heads, self.capacities[p.input_name], head_dim),
                           np.dtype(p.input.dtype))

    def _allocate(self, name: str, shape: tuple[int, ...], dtype: np.dtype) -> None:
        """The buffer (and spare) of ``shape``; a packed one bound as its rank-3 view (the same memory)."""
        super()._allocate(name, shape, dtype)
        if name in self.packed:
            self.values[name] = self.device.wrap(self.graph_view(name, self.arrays[name]))
            if self.double_buffer:
                self.spare_values[name] = self.device.wrap(self.graph_view(name, self.spare_arrays[name]))

    def graph_view(self, name: str, view: np.ndarray) -> np.ndarray:
        """``view`` (rows of buffer ``name``) in the graph's shape: a packed buffer's ``[rows, capacity, h*d]``
        (a reshape of contiguous rows: the same memory), any other as it is."""
        if name not in self.packed:
            return view
        out = view.reshape(view.shape[0], view.shape[2], view.shape[3])
        if not np.shares_memory(out, view):  # pragma: no cover - rows of a C-ordered array reshape as a view
            raise RuntimeInputError(f"KV buffer {name!r} cannot be shown packed without a copy")
        return out

    @classmethod
    def build(cls, pairs: list[KVPair], settings: Settings) -> "PositionalMemory":
        return cls(pairs, max_sequences=settings.max_sequences, ctx_len=settings.ctx_len,
                   double_buffer=settings.double_buffer, rings=settings.rings, device=settings.device)

    @classmethod
    def need(cls, pairs: list[KVPair], settings: Settings) -> tuple[int, str]:
        """Bytes of the buffers of ``pairs`` (:func:`buffer_bytes`), and how many."""
        n = buffer_bytes(pairs, max_sequences=settings.max_sequences, ctx_len=settings.ctx_len,
                         double_buffer=settings.double_buffer, rings=settings.rings)
        ring = f", sliding-window rings of {settings.rings.capacity}" if settings.rings else ""
        return n, f"{len(pairs)} buffers x {settings.max_sequences} sequences x ctx_len {settings.ctx_len}{ring}"

    # ------------------------------------------------------------------------------------ rows
    def read(self, seq, name: str, length: int | None = None) -> np.ndarray:
        """A copy of ``seq``'s slice ``[1, heads, length, head_dim]`` of buffer ``name`` (its first ``length``
        slots: ring order for a ring buffer)."""
        n = seq.length if length is None else length
        # always a copy: a slice that spans the whole buffer (one slot, a full ring) is already contiguous, and
        # ascontiguousarray would hand out a view that the next run overwrites
        return np.array(self.arrays[name][seq.slot:seq.slot + 1, :, :n, :], order="C", copy=True)

    def write(self, seq, name: str, data: np.ndarray) -> None:
        """Copy ``data`` (``[1, heads, n, head_dim]``) into slots ``[0, n)`` of ``seq``'s row."""
        n = data.shape[2]
        self.arrays[name][seq.slot:seq.slot + 1, :, :n, :] = data

    @staticmethod
    def wrote(seq, end: int) -> None:
        """Record that a run wrote ``seq``'s positions up to ``end`` (exclusive)."""
        seq.written = max(seq.written, int(end))

    def clear(self, seq) -> None:
        seq.written = seq.floor = 0

    def row_part(self, name: str, seq, other) -> tuple:
        """The positions written by either sequence (a ring's whole capacity at most): a relocation moves no more."""
        end = max(seq.written, seq.length, 0 if other is None else max(other.written, other.length))
        return (slice(None), slice(0, min(end, self.shapes[name][2])))

    # ------------------------------------------------------------------------------------ the ring rule
    def lowest_held(self, seq) -> int:
        """The lowest position every buffer of ``seq`` still holds (0 when nothing was overwritten or dropped)."""
        cap = self.rings.capacity
        return max(seq.floor, held(seq.written, cap)[0] if cap is not None else 0)

    def _missing_window(self, seq, n: int) -> tuple[int, int, int] | None:
        """``(lo, hi, window)`` when ``seq``'s rings lack a position the next step from ``n`` attends to (they hold
        ``lo..hi - 1`` only), else ``None``: the one rule of truncate and copy."""
        lo, window = self.lowest_held(seq), self.rings.window
        if n == 0 or lo == 0 or window is None or lo <= max(0, n - window + 1):
            return None
        return lo, max(seq.written, seq.length), window

    def truncate_refusal(self, seq, n: int) -> str | None:
        gap = self._missing_window(seq, n) if n < seq.length else None
        if gap is None:
            return None
        lo, hi, window = gap
        least = lo + window - 1
        tail = (f"it can be rewound to {least} or more, or reset to 0" if least < seq.length
                else "it can only be reset to 0")
        return (f"cannot rewind sequence {seq.id} to {n} positions: its sliding-window layers (window {window}) hold "
                f"positions {lo}..{hi - 1} only; {tail}")

    def copy_refusal(self, src, n: int) -> str | None:
        gap = self._missing_window(src, n)
        if gap is None:
            return None
        lo, hi, window = gap
        least = min(lo + window - 1, src.length)
        return (f"cannot copy the first {n} positions of sequence {src.id}: its sliding-window layers (window "
                f"{window}) hold positions {lo}..{hi - 1} only; copy {least} or more positions (up to {src.length}), "
                "or prefill the tokens into the new sequence")

    # ------------------------------------------------------------------------------------ verbs
    def truncate(self, seq, n: int) -> None:
        if n == 0:
            self.clear(seq)

    def copy(self, src, dst, n: int) -> None:
        lowest = self.lowest_held(src) if n else 0
        for name, arr in self.arrays.items():
            slots = copy_slots(self.rings.capacities.get(name), n, lowest)
            arr[dst.slot, :, slots, :] = arr[src.slot, :, slots, :]
        dst.written = n
        dst.floor = lowest if n else 0

    # ------------------------------------------------------------------------------------ bytes
    def slot_bytes(self, name: str) -> int:
        """Bytes of one slot (one position) of one sequence in buffer ``name``."""
        _, h, _, d = self.shapes[name]
        return h * d * self.dtypes[name].itemsize

    @property
    def bytes_per_position(self) -> int:
        """Bytes one position of one sequence occupies across every buffer (a ring slot counted once: the cost of
        a position while the sequence is shorter than its rings)."""
        return sum(self.slot_bytes(n) for n in self.shapes)

    @property
    def bytes_per_sequence(self) -> int:
        return sum(self.slot_bytes(n) * self.capacities[n] for n in self.shapes)

    def used(self, seqs) -> int:
        """Bytes holding valid positions of ``seqs`` (a ring holds at most its capacity of them)."""
        return sum(self.slot_bytes(n) * min(s.length, self.capacities[n]) for s in seqs for n in self.shapes)

    def saved_slots(self, name: str, seq) -> int:
        """Slots of buffer ``name`` a state of ``seq`` holds: ``min(C, written)`` for a ring, else ``length``."""
        return saved_slots(self.rings, name, seq.length, seq.written)

    def valid_bytes(self, seq) -> int:
        """``n`` positions of each full-length buffer, ``min(C, written)`` slots of a ring."""
        return sum(self.slot_bytes(name) * self.saved_slots(name, seq) for name in self.shapes)

    def report(self, seqs) -> dict:
        return {"positional_capacity": self.capacity}

    def slicing_specs(self) -> dict[str, list]:
        return {name: list(PACKED_SLICE_DIMS if name in self.packed else SLICE_DIMS) for name in self.shapes}

    # ------------------------------------------------------------------------------------ states
    def state_write(self, seq, select=None):
        tensors = {n: self.read(seq, n, self.saved_slots(n, seq)) for n in self.shapes
                   if select is None or n in select}
        return tensors, state_metadata(self.rings, seq)

    def state_check(self, meta, n, where) -> "PositionalPart":
        theirs = read_state_rings(meta, n, where)
        return PositionalPart(n, theirs, check_state(self.rings, theirs, n, where))

    def state_expected(self, part: "PositionalPart") -> dict:
        spec = RingSpec(part.rings.window, part.rings.capacities)
        return {name: ((1, full[1], saved_slots(spec, name, part.n, part.rings.written), full[3]), self.dtypes[name])
                for name, full in self.shapes.items()}

    def state_read(self, seq, tensors, part: "PositionalPart") -> dict[str, np.ndarray]:
        rows, theirs, n = {}, part.rings, part.n
        for name in self.shapes:
            arr, cap = tensors[name], self.rings.capacities.get(name)
            if part.mode == "to_ring" and cap:
                arr = to_ring(arr, cap)
            elif part.mode == "to_full" and name in theirs.capacities:
                arr = to_full(arr, theirs.capacities[name], n, theirs.written)
            rows[name] = arr
        seq.written = theirs.written if part.mode == "same" else n
        seq.floor = floor_after(part.mode, theirs)
        return rows


# ============================================================================================ its part of a state
@dataclass(frozen=True)
class StateRings:
    """A state's ring bookkeeping as read from its metadata (files without it: full-length, written = n)."""

    written: int
    capacities: dict[str, int]
    window: int | None
    floor: int = 0


@dataclass(frozen=True)
class PositionalPart:
    """A checked state's positional part: its valid length, ring bookkeeping and how its buffers go in (``mode``:
    :func:`check_state`)."""

    n: int
    rings: StateRings
    mode: str


def state_metadata(spec: RingSpec, seq) -> dict[str, str]:
    """The ring bookkeeping a state carries: ``ring_written``, ``capacities`` (JSON), ``sliding_window``, and
    ``ring_floor`` when the sequence holds its positions from ``floor > 0`` on only."""
    meta = {"ring_written": str(seq.written),
            "capacities": json.dumps(spec.capacities, sort_keys=True),
            "sliding_window": "" if spec.window is None else str(spec.window)}
    if seq.floor:
        meta["ring_floor"] = str(seq.floor)
    return meta


def saved_slots(spec: RingSpec, name: str, length: int, written: int) -> int:
    """Slots of buffer ``name`` a state holds: ``min(C, written)`` for a ring (ring order), else ``length``."""
    cap = spec.capacities.get(name)
    return length if cap is None else min(cap, written)


def read_state_rings(meta: dict[str, str], n: int, where: str) -> StateRings:
    try:
        written = meta_int(meta.get("ring_written", str(n)))
        caps = json.loads(meta.get("capacities", "{}"))
        w_raw = meta.get("sliding_window", "")
        window = meta_int(w_raw) if w_raw != "" else None
        floor = meta_int(meta.get("ring_floor", "0"))
    except (ValueError, TypeError, RecursionError):
        raise StateFileError(f"{where}: malformed state metadata (ring_written, capacities, sliding_window)") from None
    if (not isinstance(caps, dict) or not all(isinstance(c, int) and not isinstance(c, bool) and c > 0
                                              for c in caps.values())
            or written < n or (window is not None and window < 1) or (caps and window is None)
            or not 0 <= floor <= n or (floor and window is None)):
        raise StateFileError(f"{where}: malformed state metadata (ring_written, capacities, sliding_window)")
    # A valid checksum proves the bytes, not that the bookkeeping is consistent: the ring must still hold every
    # position the next step attends to (the rule a rewind follows), and nothing is written beyond any capacity.
    if written > MAX_DIM:
        raise StateFileError(f"{where}: inconsistent state metadata: ring_written {written} is beyond any capacity")
    if caps and window is not None:
        cap = min(caps.values())
        lo, need = max(floor, held(written, cap)[0]), max(0, n - window + 1)
        if lo > need:
            raise StateFileError(
                f"{where}: inconsistent state metadata: ring_written {written} with valid length {n}: its ring buffers "
                f"({cap} slots) hold positions {lo}..{written - 1}, the next step needs {need}..{n - 1}")
    return StateRings(written, {str(k): v for k, v in caps.items()}, window, floor)


def check_state(spec: RingSpec, theirs: StateRings, n: int, where: str) -> str:
    """How a state's buffers go into this session's: ``"same"`` (slot for slot), ``"to_ring"`` (a full-length
    state into ring buffers, by position) or ``"to_full"`` (a ring state into the full-length buffers of a
    session with the same window, by position). Refuses (:class:`StateFileError`, one line) another window,
    other capacities, and a conversion that lacks a position the window needs."""
    if theirs.window is not None and spec.window is not None and theirs.window != spec.window:
        raise StateFileError(f"{where}: state was saved from a graph with sliding window {theirs.window}; this "
                             f"session's is {spec.window}")
    if theirs.floor and spec.window is None:
        raise StateFileError(f"{where}: state holds positions {theirs.floor}..{n - 1} only (from a sliding-window "
                             "ring); this session records no sliding window")
    if theirs.capacities == spec.capacities:
        return "same"
    if not theirs.capacities:
        return "to_ring"  # a full-length state holds every position from its floor on: the ring is filled exactly
    if not spec.capacities:
        if spec.window is None:
            raise StateFileError(f"{where}: state holds sliding-window ring buffers ({_caps(theirs.capacities)}); "
                                 "this session's buffers are full-length and it records no sliding window")
        lo = max(theirs.floor, held(theirs.written, min(theirs.capacities.values()))[0])
        if lo > max(0, n - spec.window + 1):
            raise StateFileError(f"{where}: state's sliding-window ring buffers hold positions {lo}.."
                                 f"{theirs.written - 1} only; this session's full-length buffers need positions "
                                 f"{max(0, n - spec.window + 1)}..{n - 1}")
        return "to_full"
    raise StateFileError(f"{where}: state was saved from a graph with ring capacities {_caps(theirs.capacities)}; "
                         f"this session's are {_caps(spec.capacities)}")


def _caps(caps: dict[str, int]) -> str:
    values = sorted(set(caps.values()))
    slots = "/".join(str(v) for v in values)
    return f"{len(caps)} buffers of {slots} slots"


def floor_after(mode: str, theirs: StateRings) -> int:
    """The loaded sequence's ``floor``: a ring state in full-length buffers holds its positions from the ring's
    lowest on only."""
    if mode != "to_full":
        return theirs.floor
    return max(theirs.floor, held(theirs.written, min(theirs.capacities.values()))[0])


def to_full(ring: np.ndarray, capacity: int, n: int, written: int) -> np.ndarray:
    """A ring state's ``[1, heads, min(C, written), head_dim]`` by position ``[1, heads, n, head_dim]``: the
    positions the ring holds below ``n`` at their own slots, zeros below them (never read: see ``floor``)."""
    out = np.zeros(ring.shape[:2] + (n,) + ring.shape[3:], dtype=ring.dtype)
    pos = np.arange(held(written, capacity)[0], n)
    out[:, :, pos, :] = ring[:, :, pos % capacity, :]
    return out


def to_ring(linear: np.ndarray, capacity: int) -> np.ndarray:
    """A full-length state's ``[1, heads, n, head_dim]`` as the ring of ``capacity`` slots after positions
    ``[0, n)``: positions ``max(0, n - C) .. n - 1`` at slots ``p % C``, ``min(C, n)`` slots."""
    n = linear.shape[2]
    out = np.zeros(linear.shape[:2] + (min(capacity, n),) + linear.shape[3:], dtype=linear.dtype)
    lo, _ = held(n, capacity)
    pos = np.arange(lo, n)
    out[:, :, pos % capacity, :] = linear[:, :, lo:n, :]
    return out
