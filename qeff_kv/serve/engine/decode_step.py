"""The decode step of the local engine's turn: one step for every running sequence together.

Plainly, one ``Session.decode`` over the running sequences (``batch_index`` rows, or lock step on a graph without
it), each row's token selected by its :meth:`~.active.Active.select`; batch-invariant (``--deterministic``), one
solo ``Session.decode`` per sequence (a one-row step: ``batch_index`` of its slot, or its own lock-step row), the
same graph run, with the same inputs, as the sequence alone makes: no other row can change its arithmetic; with a
:class:`~.speculative_step.Speculation` (``--speculative``), one verification step that may give each sequence
several tokens.

:func:`decode` is a function of its inputs (the session, the batch, the speculation) that returns the step's
outcome (:class:`Step`: per row a :class:`~qeff_kv.runtime.decoding.sampling.Pick`, a speculative run of tokens or
a :class:`Failed` selection; or one error for every row) and holds nothing: the
:class:`~.scheduler.Scheduler` applies it, every token through its stop rule one at a time, so a stop token or the
budget ends a speculative run where plain decoding would have ended. :func:`to_lower` says which running sequence
a lock-step graph should move down a row.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

#: a running sequence moves down a lock-step row only with at least this many tokens left to make: moving its
#: rows is paid once, the row it leaves is saved at every remaining step
LOWER_MIN_LEFT = 8


@dataclass(frozen=True)
class Failed:
    """A row whose token could not be selected (``error``: one line)."""

    error: str


@dataclass
class Step:
    """A decode step's outcome: ``rows``, one per request of the batch, in order (a ``Pick``, a speculative run
    ``list[int]`` of at least one token, or :class:`Failed`); ``error``: the step failed for every row (``rows``
    empty); ``seconds``: the step's graph time."""

    rows: list = field(default_factory=list)
    error: str | None = None
    seconds: float = 0.0


def decode(session, batch: list, speculation=None, solo: bool = False) -> Step:
    """One decode step for ``batch`` (:class:`~.active.Active` records, each with its token to feed in ``last``)
    in ``session``, through ``speculation`` when given (see the module docstring). ``solo``: one graph run per
    sequence (``--deterministic``): each row's arithmetic is the run it makes alone, whatever else runs."""
    if speculation is not None:
        return _speculative(speculation, batch)
    t0 = time.perf_counter()
    try:
        if solo:
            out = {a.seq: session.decode([(a.seq, a.last)])[a.seq] for a in batch}
        else:
            out = session.decode([(a.seq, a.last) for a in batch])
    except Exception as exc:   # noqa: BLE001 - the step failed for all of them
        return Step(error=f"decode failed: {exc}")
    step = Step(seconds=time.perf_counter() - t0)
    for a in batch:
        try:
            step.rows.append(a.select(out[a.seq]))
        except Exception as exc:   # noqa: BLE001
            step.rows.append(Failed(f"sampling failed: {exc}"))
    return step


def _speculative(speculation, batch: list) -> Step:
    """The step through ``speculation``: each sequence gets a run of one or more tokens."""
    from qeff_kv.serve.engine.speculative_step import Row

    rows = [Row(a, a.seq, a.last, a.params, a.left, a.req.stop_token_ids) for a in batch]
    t0 = time.perf_counter()
    try:
        runs = speculation.step(rows)
    except Exception as exc:   # noqa: BLE001 - the step failed for all of them
        return Step(error=f"decode failed: {exc}")
    return Step(rows=list(runs), seconds=time.perf_counter() - t0)


def to_lower(running: list):
    """Lock step runs every row up to the highest one fed: the sequence of the running request in that row, to
    move down into a row no request holds
    (:meth:`~qeff_kv.runtime.memory.prefix_cache.PrefixCache.lower`), when it has at least
    :data:`LOWER_MIN_LEFT` tokens left to make; else None (at most one move a step)."""
    top = max(running, key=lambda a: a.seq.slot)
    return top.seq if top.left >= LOWER_MIN_LEFT else None
