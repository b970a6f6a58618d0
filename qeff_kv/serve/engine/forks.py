"""OpenAI's ``n`` in the local engine: several choices of one prompt, the prompt prefilled once.

:meth:`ChoiceForks.submit_n` queues the choices as one waiting entry (the first choice's handle; the others in
``_groups``), admitted when ``n`` sequence slots are free or held by kept sequences. The first choice is started
as any request; the others are *parked* on it (``_Active.followers``) with empty sequences of their own. When its
prompt is prefilled, :meth:`ChoiceForks._fork` copies the prompt's positions into each parked choice's sequence
(``Session.copy``) and each selects its first token from the same logits with its own sampling, then decodes on
as a sequence of its own. A session that cannot copy makes the parked choice prefill the prompt itself (the same
logits, so the same tokens: the copy is refused, ``QeffKvError``). A mixin of :class:`~.scheduler.Scheduler` (its state and helpers).
"""

from __future__ import annotations

import dataclasses

from qeff_kv.errors import QeffKvError, QueueFullError, RuntimeInputError, UnavailableError
from qeff_kv.runtime.decoding.prompt_rows import unsupported
from qeff_kv.serve.engine.engine import Finished, GenerationRequest, RequestHandle, check_request


class ChoiceForks:
    """``submit_n`` and the forking of parked choices, for :class:`~.scheduler.Scheduler`."""

    def submit_n(self, req: GenerationRequest, samplings: list) -> list[RequestHandle]:
        """``n`` choices of one prompt: the prompt is prefilled once (the first choice's), then copied into the
        other choices' slots (``Session.copy``) and each choice samples on with its own parameters; where the
        session cannot copy, each choice prefills the prompt itself (the same logits)."""
        if not 1 <= len(samplings) <= self.max_sequences:
            raise RuntimeInputError(f"n must be in [1, {self.max_sequences}] (the sequences this server runs at "
                                    f"once), got {len(samplings)}")
        return self._queue(req, samplings)

    def _members(self, handle: RequestHandle) -> int:
        """Sequences the waiting request of ``handle`` needs (n choices: n)."""
        return 1 + len(self._groups.get(id(handle), ()))

    def _parked(self) -> list:
        return [f for a in self._prefilling for f in a.followers if not f.handle.finished]

    def _release_followers(self, a, reason: str, error: str | None) -> None:
        """``a`` ends before its prompt was forked: its parked choices end the same way on an error or at
        shutdown, else (``a`` was cancelled alone) each prefills the prompt itself."""
        followers, a.followers = a.followers, []
        for f in followers:
            if f.handle.finished:
                continue
            if reason == "error" or self._closed or f.handle.cancelled:
                self._finish(f, reason if not f.handle.cancelled else "cancelled", error, keep=False)
            else:
                f.todo = list(f.req.prompt)
                self._prefilling.append(f)

    def _fork(self, a, logits) -> None:
        """``a``'s prompt is prefilled: copy it into each parked choice's sequence, which then selects its first
        token from the same ``logits`` (a choice the session cannot copy into prefills the prompt itself)."""
        followers, a.followers = a.followers, []
        for f in followers:
            if f.handle.finished:
                continue
            if f.handle.cancelled:
                self._finish(f, "cancelled", keep=False)
                continue
            try:
                if not self.prefix_cache.copies:
                    raise RuntimeInputError("this session cannot copy sequences")
                self.session.copy(a.seq, f.seq, a.seq.length)
            except QeffKvError:   # a memory that cannot copy refuses: the choice prefills the prompt itself
                f.todo = list(f.req.prompt)
                self._prefilling.append(f)
                continue
            self.prefix_cache.held(f.seq)
            f.cached = len(f.req.prompt)
            self._first_token(f, logits)

    def _queue(self, req: GenerationRequest, samplings: list) -> list[RequestHandle]:
        """Admit ``req`` once per sampling (``n`` choices): each choice its own request id, sampling and grammar
        state (a copy of the request's, taken before any token)."""
        reqs = [req] if len(samplings) == 1 else [
            dataclasses.replace(req, request_id=f"{req.request_id}-{i}", sampling=sp,
                                constraint=req.constraint if req.constraint is None or i == 0 else req.constraint.fork())
            for i, sp in enumerate(samplings)]
        for r in reqs:
            check_request(r, ctx_len=self.ctx_len, vocab_size=self.session.vocab_size,
                          constraint_refused=None if self.speculation is None else
                          "structured output and forced tool calls are not supported with --speculative")
            if self.speculation is not None and (r.sampling.adjusts or r.logprobs is not None):
                raise RuntimeInputError("logprobs, logit_bias and penalties are not supported with --speculative")
            if r.prompt_logprobs is not None:
                why = "prompt logprobs go with one choice (n = 1)" if len(reqs) > 1 else unsupported(self.session)
                if why is not None:
                    raise RuntimeInputError(why)
        handles = [RequestHandle(r.request_id, on_cancel=lambda h: self._wake.set()) for r in reqs]
        with self._lock:
            if self._closed:
                raise UnavailableError("the engine is closed")
            # the queue holds max_queue requests beyond those a free slot is about to take
            if len(self._waiting) >= self.max_queue + max(0, self.max_sequences - self._admitted):
                raise QueueFullError(f"the queue is full ({self.max_queue} requests waiting); retry later")
            self._waiting.append((handles[0], reqs[0]))
            if len(reqs) > 1:
                self._groups[id(handles[0])] = list(zip(handles[1:], reqs[1:]))
            self._stats["queue_depth"] = len(self._waiting)
        self._wake.set()
        return handles

    def _fail_admitted(self, a, members: list, error: str) -> None:
        """An admitted request that could not start: what was started (``a`` and its parked choices) finishes
        through :meth:`_finish`, the rest is told here; every member leaves the admitted count once."""
        started = set()
        if a is not None:
            started = {id(a.handle)} | {id(f.handle) for f in a.followers}
            self._finish(a, "error", error, keep=False)
        rest = [(h, r) for h, r in members if id(h) not in started]
        with self._lock:
            self._admitted -= len(rest)
        for h, r in rest:
            h.emit(Finished("error", len(r.prompt), 0, 0, error))
