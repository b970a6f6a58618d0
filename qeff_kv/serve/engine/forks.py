"""OpenAI's ``n`` in the local engine: several choices of one prompt, the prompt prefilled once.

:meth:`Scheduler.submit_n <.scheduler.Scheduler.submit_n>` queues the choices as one waiting group (the first
choice's handle and request, the others with it: :class:`~.inbox.Inbox`), admitted when ``n`` sequence slots are
free or held by kept sequences. The first choice is started as any request; the others are *parked* on it
(:meth:`ChoiceGroups.park`) with empty sequences of their own. When its prompt is prefilled,
:meth:`ChoiceGroups.fork` copies the prompt's positions into each parked choice's sequence (``Session.copy``) and
the scheduler has each select its first token from the same logits with its own sampling, then decode on as a
sequence of its own. A session that cannot copy makes the parked choice prefill the prompt itself (the same logits,
so the same tokens: the copy is refused, ``QeffKvError``).

:class:`ChoiceGroups` is one object per :class:`~.scheduler.Scheduler` and holds no scheduler: it holds the parked
choices, and its methods return what the scheduler applies (:class:`Forks`: which choices end, which were copied
and select their first token, which prefill the prompt themselves). It is the engine thread's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from qeff_kv.errors import QeffKvError, RuntimeInputError
from qeff_kv.serve.engine.active import Active
from qeff_kv.serve.engine.engine import GenerationRequest


def choice_requests(req: GenerationRequest, samplings: list) -> list[GenerationRequest]:
    """``req`` once per sampling (``n`` choices): each choice its own request id, sampling and grammar state (a
    copy of the request's, taken before any token)."""
    if len(samplings) == 1:
        return [req]
    return [dataclasses.replace(req, request_id=f"{req.request_id}-{i}", sampling=sp,
                                constraint=req.constraint if req.constraint is None or i == 0 else req.constraint.fork())
            for i, sp in enumerate(samplings)]


@dataclass
class Forks:
    """What became of the choices parked on a first choice: ``ends`` (choice, finish reason, error) finish without
    their sequence kept; ``copied`` hold the prompt and select their first token from its logits; ``refeed``
    prefill the prompt themselves (their ``todo`` set)."""

    ends: list[tuple[Active, str, str | None]] = field(default_factory=list)
    copied: list[Active] = field(default_factory=list)
    refeed: list[Active] = field(default_factory=list)


class ChoiceGroups:
    """The parked choices of ``n``-choice requests (see the module docstring)."""

    def __init__(self):
        #: the choices parked on a first choice whose prompt is being prefilled, by that first choice
        self.parked: dict[Active, list[Active]] = {}

    def park(self, a: Active, f: Active) -> None:
        """``f`` (another choice of ``a``'s prompt, in an empty sequence of its own) waits until ``a``'s prompt is
        done."""
        self.parked.setdefault(a, []).append(f)

    def parked_on(self, a: Active) -> list[Active]:
        """The choices parked on ``a`` (finished ones included)."""
        return list(self.parked.get(a, ()))

    def all_parked(self, prefilling: list[Active]) -> list[Active]:
        """Every choice not finished that is parked on one of ``prefilling`` (the prompts being prefilled)."""
        return [f for a in prefilling for f in self.parked.get(a, ()) if not f.handle.finished]

    def leader_ended(self, a: Active, reason: str, error: str | None, closed: bool) -> Forks:
        """``a`` ends (``reason``, ``error``) before its prompt was forked: its parked choices end the same way on an
        error or when the engine is ``closed``, else (``a`` was cancelled alone) each prefills the prompt itself."""
        out = Forks()
        for f in self.parked.pop(a, []):
            if f.handle.finished:
                continue
            if reason == "error" or closed or f.handle.cancelled:
                out.ends.append((f, reason if not f.handle.cancelled else "cancelled", error))
            else:
                f.todo = list(f.req.prompt)
                out.refeed.append(f)
        return out

    def fork(self, a: Active, session, can_copy: bool) -> Forks:
        """``a``'s prompt is prefilled: copy it into each parked choice's sequence in ``session`` (``can_copy``:
        the session copies sequences); a choice the session cannot copy into prefills the prompt itself."""
        out = Forks()
        for f in self.parked.pop(a, []):
            if f.handle.finished:
                continue
            if f.handle.cancelled:
                out.ends.append((f, "cancelled", None))
                continue
            try:
                if not can_copy:
                    raise RuntimeInputError("this session cannot copy sequences")
                session.copy(a.seq, f.seq, a.seq.length)
            except QeffKvError:   # a memory that cannot copy refuses: the choice prefills the prompt itself
                f.todo = list(f.req.prompt)
                out.refeed.append(f)
                continue
            f.cached = len(f.req.prompt)
            out.copied.append(f)
        return out
