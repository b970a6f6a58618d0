"""Which memory of the runtime holds each kind of retained state the state spec names (``full``, ``ring``,
``latent``, ``recurrent``: :data:`qeff_kv.contract.statespec.KINDS`), and how the session's memories are built.

A memory class registers the kinds it holds with :func:`holds` (a class decorator, in its own module) and builds
itself from its pairs and the session's :class:`Settings` (``build``); a memory without buffers (the RoPE marks of
images) registers no kind and is always built. :func:`build` makes one memory per registered class, in the order
the hybrid asks them (``order``: the first memory's refusal is the one raised). A new kind is then one module here
(its class with ``@holds("kind", order=...)`` and ``build``, imported by the package) plus its builder in the
conformance suite (``tests/runtime/test_memory_conformance.py``), which checks that every kind of the state spec has a
memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from qeff_kv.contract.layout import KVPair
from qeff_kv.errors import RuntimeInputError
from qeff_kv.runtime.memory.base import Memory

#: state kind -> the memory class that holds it
MEMORY_OF: dict[str, type[Memory]] = {}
#: every registered memory class -> its place in the hybrid's order
ORDER: dict[type[Memory], int] = {}


def holds(*kinds: str, order: int) -> Callable[[type[Memory]], type[Memory]]:
    """Register a memory class as the holder of ``kinds`` (none: a memory without buffers), ``order``-th in the
    hybrid."""
    def register(cls: type[Memory]) -> type[Memory]:
        for kind in kinds:
            if MEMORY_OF.get(kind, cls) is not cls:
                raise ValueError(f"state kind {kind!r} is already held by {MEMORY_OF[kind].__name__}")
            MEMORY_OF[kind] = cls
        ORDER[cls] = order
        cls.kinds = tuple(kinds)
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


def build(pairs_by_kind: dict[str, list[KVPair]], settings: Settings) -> dict[type[Memory], Memory]:
    """One memory per registered class, in the hybrid's order, each built from the pairs of the kinds it holds
    (``pairs_by_kind``: state kind -> pairs, graph order; a class with none gets an empty list)."""
    pairs: dict[type[Memory], list[KVPair]] = {cls: [] for cls in sorted(ORDER, key=ORDER.get)}
    for kind, some in pairs_by_kind.items():
        pairs[memory_of(kind)] += list(some)
    return {cls: cls.build(some, settings) for cls, some in pairs.items()}
