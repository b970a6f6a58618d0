"""OpenAI's ``n`` in the local engine: several choices of one prompt, the prompt prefilled once.

:meth:`Scheduler.submit_n <.scheduler.Scheduler.submit_n>` queues the choices as one waiting entry (the first
choice's handle; the others in :attr:`ChoiceGroups.waiting`), admitted when ``n`` sequence slots are free or held by
kept sequences. The first choice is started as any request; the others are *parked* on it
(:meth:`ChoiceGroups.park`) with empty sequences of their own. When its prompt is prefilled,
:meth:`ChoiceGroups.fork` copies the prompt's positions into each parked choice's sequence (``Session.copy``) and
each selects its first token from the same logits with its own sampling, then decodes on as a sequence of its own.
A session that cannot copy makes the parked choice prefill the prompt itself (the same logits, so the same tokens:
the copy is refused, ``QeffKvError``).

:class:`ChoiceGroups` is one object per :class:`~.scheduler.Scheduler`: it holds the waiting groups and the
parked choices, and reaches the scheduler it serves through its public face only (``session``, ``ctx_len``,
``prefix_cache``, ``turns``, ``closed``, ``finish``, ``first_token``). Its :attr:`~ChoiceGroups.waiting` is read
and written under the scheduler's lock (the submitting threads and the engine thread share it); the rest is the
engine thread's.
"""

from __future__ import annotations

import dataclasses

from qeff_kv.errors import QeffKvError, RuntimeInputError
from qeff_kv.serve.engine.active import Active, admitted
from qeff_kv.serve.engine.engine import GenerationRequest, RequestHandle


def choice_requests(req: GenerationRequest, samplings: list) -> list[GenerationRequest]:
    """``req`` once per sampling (``n`` choices): each choice its own request id, sampling and grammar state (a
    copy of the request's, taken before any token)."""
    if len(samplings) == 1:
        return [req]
    return [dataclasses.replace(req, request_id=f"{req.request_id}-{i}", sampling=sp,
                                constraint=req.constraint if req.constraint is None or i == 0 else req.constraint.fork())
            for i, sp in enumerate(samplings)]


class ChoiceGroups:
    """The choices of ``n``-choice requests, for ``sched`` (a :class:`~.scheduler.Scheduler`; see the module
    docstring)."""

    def __init__(self, sched):
        self.sched = sched
        #: a waiting request's other choices, by id() of the first choice's handle (under the scheduler's lock)
        self.waiting: dict[int, list[tuple[RequestHandle, GenerationRequest]]] = {}
        #: the choices parked on a first choice whose prompt is being prefilled, by that first choice
        self.parked: dict[Active, list[Active]] = {}

    # ---- waiting (under the scheduler's lock)
    def wait(self, first: RequestHandle, others: list[tuple[RequestHandle, GenerationRequest]]) -> None:
        """``others`` wait with the first choice's ``first`` handle."""
        if others:
            self.waiting[id(first)] = list(others)

    def members(self, handle: RequestHandle) -> int:
        """Sequences the waiting request of ``handle`` needs (n choices: n)."""
        return 1 + len(self.waiting.get(id(handle), ()))

    def take(self, handle: RequestHandle) -> list[tuple[RequestHandle, GenerationRequest]]:
        """The other choices waiting with ``handle`` (they leave the waiting groups)."""
        return self.waiting.pop(id(handle), [])

    # ---- parked (the engine thread)
    def park(self, a: Active, others: list[tuple[RequestHandle, GenerationRequest]]) -> None:
        """The other choices of ``a``'s prompt, each in an empty sequence of its own until ``a``'s prompt is done."""
        sched = self.sched
        for h, r in others:
            f = admitted(h, r, sched.prefix_cache.fresh(), ctx_len=sched.ctx_len, vocab_size=sched.session.vocab_size)
            self.parked.setdefault(a, []).append(f)

    def parked_on(self, a: Active) -> list[Active]:
        """The choices parked on ``a`` (finished ones included)."""
        return list(self.parked.get(a, ()))

    def all_parked(self) -> list[Active]:
        """Every choice not finished that is parked on a prompt being prefilled."""
        return [f for a in self.sched.turns.queue for f in self.parked.get(a, ()) if not f.handle.finished]

    def leader_ended(self, a: Active, reason: str, error: str | None) -> None:
        """``a`` ends before its prompt was forked: its parked choices end the same way on an error or at
        shutdown, else (``a`` was cancelled alone) each prefills the prompt itself."""
        for f in self.parked.pop(a, []):
            if f.handle.finished:
                continue
            if reason == "error" or self.sched.closed or f.handle.cancelled:
                self.sched.finish(f, reason if not f.handle.cancelled else "cancelled", error, keep=False)
            else:
                f.todo = list(f.req.prompt)
                self.sched.turns.enqueue(f)

    def fork(self, a: Active, logits) -> None:
        """``a``'s prompt is prefilled: copy it into each parked choice's sequence, which then selects its first
        token from the same ``logits`` (a choice the session cannot copy into prefills the prompt itself)."""
        sched = self.sched
        for f in self.parked.pop(a, []):
            if f.handle.finished:
                continue
            if f.handle.cancelled:
                sched.finish(f, "cancelled", keep=False)
                continue
            try:
                if not sched.prefix_cache.copies:
                    raise RuntimeInputError("this session cannot copy sequences")
                sched.session.copy(a.seq, f.seq, a.seq.length)
            except QeffKvError:   # a memory that cannot copy refuses: the choice prefills the prompt itself
                f.todo = list(f.req.prompt)
                sched.turns.enqueue(f)
                continue
            sched.prefix_cache.held(f.seq)
            f.cached = len(f.req.prompt)
            sched.first_token(f, logits)
