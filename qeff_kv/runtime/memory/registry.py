"""Which memory of the runtime holds each kind of retained state the state spec names (``full``, ``ring``,
``latent``, ``recurrent``: :data:`qeff_kv.contract.statespec.KINDS`), and how the session's memories are built.

A memory class registers the kinds it holds with :func:`holds` (a class decorator, in its own module) and builds
itself from its pairs and the session's :class:`Settings` (``build``); a memory without buffers (the RoPE marks of
images) registers no kind and is always built. :func:`build` makes one memory per registered class, in the order
the hybrid asks them (``order``: the first memory's refusal is the one raised); before anything is allocated,
:func:`require_memory` asks each class for its bytes (``need``). A new kind is then one module here (its class with
``@holds("kind", order=..., role=...)``, ``build`` and ``need``; the package imports every module of its folder)
plus its builder in the conformance suite (``tests/runtime/test_memory_conformance.py``), which checks that every kind of
the state spec has a memory; ``tests/runtime/test_memory_new_kind.py`` shows a toy kind added that way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from qeff_kv.contract.layout import KVPair
from qeff_kv.errors import RuntimeInputError
from qeff_kv.support.limits import require_memory as require_bytes
from qeff_kv.runtime.memory.base import Memory

#: state kind -> the memory class that holds it
MEMORY_OF: dict[str, type[Memory]] = {}
#: every registered memory class -> its place in the hybrid's order
ORDER: dict[type[Memory], int] = {}


def holds(*kinds: str, order: int, role: str = "") -> Callable[[type[Memory]], type[Memory]]:
    """Register a memory class as the holder of ``kinds`` (none: a memory without buffers), ``order``-th in the
    hybrid; ``role``: the hybrid's attribute that names its memory of this class (``cache.recurrent``), if any."""
    def register(cls: type[Memory]) -> type[Memory]:
        if role and any(c.role == role and c is not cls for c in ORDER):
            raise ValueError(f"memory role {role!r} is already taken")
        for kind in kinds:
            if MEMORY_OF.get(kind, cls) is not cls:
                raise ValueError(f"state kind {kind!r} is already held by {MEMORY_OF[kind].__name__}")
            MEMORY_OF[kind] = cls
        ORDER[cls] = order
        cls.kinds = tuple(kinds)
        cls.role = role
        return cls
    return register


def memory_of(kind: str) -> type[Memory]:
    """The memory class that holds state kind ``kind``; a one-line refusal for a kind no memory holds."""
    if kind not in MEMORY_OF:
        raise RuntimeInputError(f"no memory of the runtime holds state kind {kind!r} (held: {', '.join(MEMORY_OF)})")
    return MEMORY_OF[kind]


@dataclass(frozen=True)
class Settings:
    """What the session's memories are built with (each memory reads its own)."""

    max_sequences: int
    ctx_len: int
    double_buffer: bool = False
    #: the sliding-window rings (:class:`~qeff_kv.runtime.memory.ring.RingSpec`)
    rings: Any = None
    #: the recurrent checkpoints (:class:`~qeff_kv.runtime.memory.recurrent.CheckpointPolicy`)
    checkpoints: Any = None
    #: the recurrent states' own double buffering
    recurrent_double_buffer: bool = False
    #: where the buffers live (:mod:`qeff_kv.runtime.execution.device`; ``None``: the CPU)
    device: Any = None


def _by_class(pairs_by_kind: dict[str, list[KVPair]]) -> dict[type[Memory], list[KVPair]]:
    """Every registered class, in the hybrid's order, with the pairs of the kinds it holds (graph order)."""
    pairs: dict[type[Memory], list[KVPair]] = {cls: [] for cls in sorted(ORDER, key=ORDER.get)}
    for kind, some in pairs_by_kind.items():
        pairs[memory_of(kind)] += list(some)
    return pairs


def require_memory(pairs_by_kind: dict[str, list[KVPair]], settings: Settings) -> int:
    """Refuse (:class:`~qeff_kv.errors.MemoryLimitError`, one line with the size) memories that do not fit in the
    memory available now, each class reporting its own bytes and words (:meth:`~.base.Memory.need`); return their
    size in bytes."""
    needs = [cls.need(some, settings) for cls, some in _by_class(pairs_by_kind).items()]
    n = sum(b for b, _ in needs)
    words = "".join(w for _, w in needs)
    require_bytes(n, f"the KV buffers ({words}{', two sets' if settings.double_buffer else ''})")
    return n


def build(pairs_by_kind: dict[str, list[KVPair]], settings: Settings) -> dict[type[Memory], Memory]:
    """One memory per registered class, in the hybrid's order, each built from the pairs of the kinds it holds
    (``pairs_by_kind``: state kind -> pairs, graph order; a class with none gets an empty list)."""
    return {cls: cls.build(some, settings) for cls, some in _by_class(pairs_by_kind).items()}
