"""The decode step of the local engine's turn: one step for every running sequence together.

Plainly, one ``Session.decode`` over the running sequences (``batch_index`` rows, or lock step on a graph without
it), each row's token selected by its :meth:`~.active.Active.select`; with a
:class:`~.speculative_step.Speculation` (``--speculative``), one verification step that may give each sequence
several tokens. Every token goes to :meth:`Scheduler.emit_token <.scheduler.Scheduler.emit_token>` (the stop rule)
one at a time, so a stop token or the budget ends a speculative run where plain decoding would have ended.

:class:`DecodeStep` is one object per :class:`~.scheduler.Scheduler`, reaching it through its public face only
(``session``, ``running``, ``speculation``, ``prefix_cache``, ``turns``, ``finish``, ``emit_token``, ``count``).
"""

from __future__ import annotations

import time

#: a running sequence moves down a lock-step row only with at least this many tokens left to make: moving its
#: rows is paid once, the row it leaves is saved at every remaining step
LOWER_MIN_LEFT = 8


class DecodeStep:
    """The decode step for ``sched`` (a :class:`~.scheduler.Scheduler`; see the module docstring)."""

    def __init__(self, sched):
        self.sched = sched

    def step(self) -> None:
        """One decode step for every running sequence."""
        sched = self.sched
        if sched.speculation is not None:
            self._speculative()
            return
        if sched.prefix_cache.low_rows:
            self._lower_top_row()
        batch = list(sched.running)
        out = self._run(batch, lambda: sched.session.decode([(a.seq, a.last) for a in batch]))
        if out is None:
            return
        for a in batch:
            try:
                pick = a.select(out[a.seq])
            except Exception as exc:   # noqa: BLE001
                sched.finish(a, "error", f"sampling failed: {exc}", keep=False)
                continue
            a.seq.pending, a.seq.pending_emitted = pick.token, True
            sched.emit_token(a, pick.token, pick)

    def _run(self, batch: list, step):
        """``step()`` timed and counted as the turn's decode step; on an exception every row of ``batch`` ends with
        an error (the step failed for all of them) and None is returned."""
        sched = self.sched
        t0 = time.perf_counter()
        try:
            out = step()
        except Exception as exc:   # noqa: BLE001 - the step failed for all of them
            for a in batch:
                sched.finish(a, "error", f"decode failed: {exc}", keep=False)
            return None
        sched.turns.note_decode(time.perf_counter() - t0)
        sched.count("decode_steps", 1)
        return out

    def _lower_top_row(self) -> None:
        """Lock step runs every row up to the highest one fed: the running sequence in that row moves down into a
        row no request holds (:meth:`~qeff_kv.runtime.memory.prefix_cache.PrefixCache.lower`: its rows move,
        exchanged with a kept sequence's) when it has at least :data:`LOWER_MIN_LEFT` tokens left to make; at most
        one move a step."""
        top = max(self.sched.running, key=lambda a: a.seq.slot)
        if top.left >= LOWER_MIN_LEFT:
            self.sched.prefix_cache.lower(top.seq)

    def _speculative(self) -> None:
        """The step through the scheduler's speculation: each sequence gets one or more tokens, each emitted as
        its own event through the stop rule (a stop token or the budget ends the run where plain decoding would
        have ended)."""
        from qeff_kv.serve.engine.speculative_step import Row

        sched = self.sched
        batch = list(sched.running)
        rows = [Row(a, a.seq, a.last, a.params, a.left, a.req.stop_token_ids) for a in batch]
        runs = self._run(batch, lambda: sched.speculation.step(rows))
        if runs is None:
            return
        for a, run in zip(batch, runs):
            a.seq.pending, a.seq.pending_emitted = run[-1], True
            for tok in run:
                sched.emit_token(a, tok)
                if a.handle.finished:
                    break
