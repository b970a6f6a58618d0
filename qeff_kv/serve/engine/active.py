"""A request the local engine admitted and has not finished: its sequence, the prompt tokens still to prefill, its
token budget (decided once, here, by :func:`~qeff_kv.runtime.decoding.stopping.token_budget`), what it generated
and its sampling state (:meth:`Active.select`: its token selection). The :class:`~.scheduler.Scheduler` applies
what happens to these records; its collaborators (:class:`~.prefill_turns.PrefillTurns`,
:class:`~.forks.ChoiceGroups`, :func:`~.decode_step.decode`) read them and return outcomes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from qeff_kv.runtime.memory.hybrid import Sequence
from qeff_kv.runtime.decoding.sampling import Pick, TokenPicker
from qeff_kv.runtime.decoding.stopping import context_room, token_budget
from qeff_kv.serve.engine.engine import GenerationRequest, RequestHandle


@dataclass(eq=False)
class Active:
    handle: RequestHandle
    req: GenerationRequest
    seq: Sequence
    todo: list[int]                     # prompt tokens still to prefill
    budget: int                         # tokens it may generate
    params: object                      # resolved SamplingParams
    cached: int = 0
    generated: int = 0
    last: int | None = None             # the last sampled token, fed by the next decode step
    admitted_at: float = field(default_factory=time.monotonic)
    picker: TokenPicker | None = None   # the row's logits pipeline and token history (runtime/sampling.py)
    prompt_row: object = None           # prompt logprobs (no reuse): the logits after the last token prefilled

    @property
    def left(self) -> int:
        """Tokens left in its budget."""
        return self.budget - self.generated

    def select(self, logits) -> Pick:
        """The per-row sampling step: the logits pipeline (bias, penalties, its grammar's allowed-token mask when it
        has one (computed for constrained rows only), logprobs, temperature / top-k / top-p / min-p, select) on its
        row, for the cache position the token will occupy; the token enters the row's history and advances its
        grammar."""
        c = self.req.constraint
        allowed = None if c is None else c.allowed(logits.shape[-1])
        pick = self.picker.pick(logits, self.seq.length, top_logprobs=self.req.logprobs, allowed=allowed)
        if c is not None:
            c.advance(pick.token)
        self.picker.accept(pick.token)
        return pick


def admitted(handle: RequestHandle, req: GenerationRequest, seq: Sequence, *, ctx_len: int, vocab_size: int | None,
             todo: list[int] | None = None, cached: int = 0) -> Active:
    """The record of ``req`` admitted into ``seq``, its budget decided: a prompt fills ``len(req.prompt)``
    positions before its first new token; a handed-off state (``req.state``, already in ``seq``) fills
    ``seq.length`` and has its pending token to show whatever it asked (at least one token)."""
    params = req.sampling.resolved()
    handed = req.state is not None
    fed = seq.length if handed else len(req.prompt)
    budget = token_budget(req.max_tokens, context_room(ctx_len, fed), least=1 if handed else 0)
    return Active(handle, req, seq, list(todo or []), budget, params, cached=cached,
                  picker=TokenPicker(params, req.prompt, vocab_size))
