"""Sliding-window ring buffers in the runtime (contract section 7; ``docs/runtime.md``, sliding-window models).

A KV buffer whose axis 2 is named ``sliding_window`` is a *ring* of ``C`` slots: position ``p`` of a sequence
lives in slot ``p % C``. The model's window ``W`` (a query at ``p`` sees keys ``p - W + 1 .. p``) is at most
``C``; our exports use ``C == W``.

Where ``C`` and ``W`` come from: the value bound to the symbolic ``sliding_window`` axis is ``C``; ``W`` is the
graph's metadata ``qeff_kv.sliding_window``, else the manifest's ``sliding_window``, else the caller's
(``Session(..., sliding_window=N)``, ``--sliding-window N``). A ring with a static axis has that many slots;
without any window given its ``W`` is taken equal to ``C`` (peer graphs). With neither: a one-line refusal.

Per sequence, ``written`` is 1 + the highest position written since the last reset; the ring of capacity
``C`` then holds positions ``max(0, written - C) .. written - 1``. Rewinding to ``n`` is exact iff the next
query (at ``n``) still finds every key of its window: ``written - C <= max(0, n - W + 1)``. A sequence loaded
from a ring state into full-length buffers (the fused target) holds its positions from ``floor`` on only; the
same rule applies with ``floor`` as the lowest position held.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

import numpy as np

from .. import naming, statespec
from ..errors import RuntimeInputError, StateFileError
from ..layout import KVLayout, parse_sliding_window
from ..limits import MAX_DIM, positive_int


@dataclass(frozen=True)
class RingSpec:
    """The session's sliding-window facts: ``window`` (``W``, ``None`` for a model without one) and the ring
    buffers' capacities (KV input name -> ``C``; empty when no buffer is a ring, e.g. the fused target)."""

    window: int | None = None
    capacities: dict[str, int] = field(default_factory=dict)

    @property
    def capacity(self) -> int | None:
        """The smallest ring capacity (the chunk limit and the rewind bound), ``None`` without rings."""
        return min(self.capacities.values()) if self.capacities else None

    def __bool__(self) -> bool:
        return bool(self.capacities)


def recorded_window(layout: KVLayout, manifest: dict | None) -> int | None:
    """``W`` as the graph metadata or the manifest records it (they must agree), else ``None``."""
    raw = layout.sliding_window_meta
    meta = layout.sliding_window
    if raw is not None and meta is None:
        raise RuntimeInputError(f"graph metadata {naming.SLIDING_WINDOW_META}={raw!r} is not a positive integer")
    man_raw = (manifest or {}).get("sliding_window")
    man = parse_sliding_window(man_raw) if man_raw is not None else None
    if man_raw is not None and man is None:
        raise RuntimeInputError(f"manifest sliding_window {man_raw!r} is not a positive integer")
    if meta is not None and man is not None and meta != man:
        raise RuntimeInputError(f"graph metadata records sliding window {meta}, its manifest {man}")
    return meta if meta is not None else man


def resolve(layout: KVLayout, manifest: dict | None, given: int | None) -> RingSpec:
    """The :class:`RingSpec` of a graph; refuses (one line) a ring graph whose window nobody gives, a
    window contradicting the recorded one, a ring smaller than the window."""
    if given is not None:
        positive_int("sliding_window", given)
    recorded = recorded_window(layout, manifest)
    if given is not None and recorded is not None and given != recorded:
        raise RuntimeInputError(f"the graph records sliding window {recorded}; {given} was requested")
    window = recorded if recorded is not None else given
    kinds = {state.layer: state.kind for state in layout.state_spec.layers   # what each layer's KV retains
             if state.kind != "recurrent"}
    rings = [p for p in layout.pairs if kinds.get(p.layer) == "ring" and not p.recurrent]
    if not rings:
        if given is not None and recorded is None:
            raise RuntimeInputError(f"sliding window {given} was given, but the graph has no sliding-window KV "
                                    f"buffers (axis {naming.SLIDING_DIM!r}) and records no window")
        return RingSpec(window, {})
    static = {p.input_name: p.axis2 for p in rings if isinstance(p.axis2, int) and not isinstance(p.axis2, bool)}
    if window is None:
        if not static:
            raise RuntimeInputError(f"graph has sliding-window KV buffers (axis {naming.SLIDING_DIM!r}); give "
                                    "--sliding-window N")
        window = min(static.values())  # a peer graph's W is taken equal to C
    caps = {p.input_name: static.get(p.input_name, window) for p in rings}
    for name, cap in caps.items():
        if cap < window:
            raise RuntimeInputError(f"ring buffer {name!r} holds {cap} slots, fewer than the sliding window {window}")
    return RingSpec(window, caps)


def cap_chunk(spec: RingSpec, fixed_seq_len: int | None, prefill_seq_len: int) -> int:
    """The prefill chunk length: at most the smallest ring capacity (a chunk must not write a slot twice);
    a graph whose fixed ``seq_len`` exceeds it is refused."""
    cap = spec.capacity
    if cap is None:
        return prefill_seq_len
    if fixed_seq_len is not None and fixed_seq_len > cap:
        raise RuntimeInputError(f"the graph fixes seq_len={fixed_seq_len}, more than its smallest sliding-window "
                                f"ring ({cap} slots); a chunk must hold at most {cap} tokens")
    return min(prefill_seq_len, cap)


def within_ring(plan: list[tuple[int, int]], start: int, capacity: int) -> list[tuple[int, int]]:
    """``plan`` (``(offset, count)`` chunks feeding positions from ``start``) cut so that no chunk of more than one
    token writes past slot ``capacity - 1``: the first chunks fill the ring up to its end, every later token goes
    alone. Another exporter's ring graph (the peer's GPT-OSS) writes a chunk into its ring before attending, so a
    chunk that wraps overwrites keys its own earlier rows still need: it is exact only fed so (measured on the
    peer's graph: a chunk past the window gives other logits there)."""
    out = []
    for off, cnt in plan:
        pos, end = start + off, start + off + cnt
        while pos < end:
            step = min(end, capacity) - pos if pos < capacity and min(end, capacity) - pos > 1 else 1
            out.append((pos - start, step))
            pos += step
    return out


def held(written: int, capacity: int) -> tuple[int, int]:
    """``[lo, hi)``: the positions a ring of ``capacity`` slots holds after positions ``[0, written)``."""
    return statespec.KINDS["ring"].held(written, capacity)


def lowest_held(seq, spec: RingSpec) -> int:
    """The lowest position every buffer of ``seq`` still holds (0 when nothing was overwritten or dropped)."""
    cap = spec.capacity
    return max(seq.floor, held(seq.written, cap)[0] if cap is not None else 0)


def rewind_refusal(seq, n: int, spec: RingSpec) -> str | None:
    """Why ``seq`` cannot be rewound to ``n`` positions (``0 < n < length``), or ``None`` if it can, exactly."""
    lo, window = lowest_held(seq, spec), spec.window
    if lo == 0 or window is None or lo <= max(0, n - window + 1):
        return None
    hi = max(seq.written, seq.length)
    least = lo + window - 1
    tail = (f"it can be rewound to {least} or more, or reset to 0" if least < seq.length
            else "it can only be reset to 0")
    return (f"cannot rewind sequence {seq.id} to {n} positions: its sliding-window layers (window {window}) hold "
            f"positions {lo}..{hi - 1} only; {tail}")


def copy_refusal(seq, n: int, spec: RingSpec) -> str | None:
    """Why the first ``n`` positions of ``seq`` cannot be copied into another sequence (``0 < n <= length``),
    or ``None``: the copy needs what a rewind to ``n`` needs (:func:`rewind_refusal`), the window of position
    ``n``."""
    lo, window = lowest_held(seq, spec), spec.window
    if lo == 0 or window is None or lo <= max(0, n - window + 1):
        return None
    hi = max(seq.written, seq.length)
    least = min(lo + window - 1, seq.length)
    return (f"cannot copy the first {n} positions of sequence {seq.id}: its sliding-window layers (window "
            f"{window}) hold positions {lo}..{hi - 1} only; copy {least} or more positions (up to {seq.length}), "
            "or prefill the tokens into the new sequence")


def copy_slots(capacity: int | None, n: int, lowest: int) -> np.ndarray | slice:
    """The slots of one buffer that hold positions ``[lowest, n)`` after positions ``[0, n)``: ``slice(0, n)``
    for a full-length buffer (slot = position), else slots ``p % C`` for ``p`` in ``[max(lowest, n - C), n)``."""
    if capacity is None:
        return slice(0, n)
    return np.arange(max(lowest, n - capacity, 0), n) % capacity


# ============================================================================================ state files
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


@dataclass(frozen=True)
class StateRings:
    """A state's ring bookkeeping as read from its metadata (files without it: full-length, written = n)."""

    written: int
    capacities: dict[str, int]
    window: int | None
    floor: int = 0


def meta_int(text) -> int:
    """An integer of a state file's metadata: ASCII digits (``int()`` also reads ``'١٤'``, ``'1_4'``, ``' 14'``);
    ``ValueError`` otherwise."""
    if not isinstance(text, str) or not re.fullmatch(r"-?[0-9]+", text):
        raise ValueError(f"{text!r} is not an integer")
    return int(text)


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
