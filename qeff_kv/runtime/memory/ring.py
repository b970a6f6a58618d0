"""Sliding-window ring buffers in the runtime (contract section 7; ``docs/runtime.md``, sliding-window models).

A KV buffer whose axis 2 is named ``sliding_window`` is a *ring* of ``C`` slots: position ``p`` of a sequence
lives in slot ``p % C``. The model's window ``W`` (a query at ``p`` sees keys ``p - W + 1 .. p``) is at most
``C``; our exports use ``C == W``.

Where ``C`` and ``W`` come from: the value bound to the symbolic ``sliding_window`` axis is ``C``; ``W`` is the
graph's metadata ``qeff_kv.sliding_window``, else the manifest's ``sliding_window``, else the caller's
(``Session(..., sliding_window=N)``, ``--sliding-window N``). A ring with a static axis has that many slots;
without any window given its ``W`` is taken equal to ``C`` (peer graphs). With neither: a one-line refusal.

Per sequence, ``written`` is 1 + the highest position written since the last reset; the ring of capacity
``C`` then holds positions ``max(0, written - C) .. written - 1``. This module holds the graph's ring facts (which
buffers are rings, ``W``, ``C``, how prefill chunks are cut); the rule a rewind or a copy follows and a ring's part
of a state file are the positional memory's (:mod:`qeff_kv.runtime.memory.positional`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from qeff_kv.contract import naming, statespec
from qeff_kv.errors import RuntimeInputError
from qeff_kv.contract.layout import KVLayout, parse_sliding_window
from qeff_kv.support.limits import positive_int


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
