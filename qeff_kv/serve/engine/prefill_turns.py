"""The prefill turn of the local engine: which waiting prompts' tokens an engine turn feeds, and how many.

Invariant: a turn feeds at most its budget of prompt tokens (``prefill_chunk``; ``auto``: what costs about
:data:`AUTO_SHARE` of a decode step), oldest prompt first, and cuts a prompt only at a whole number of prefill
lengths unless the budget itself is below one: so every prompt's graph runs are the ones ``generate`` makes, and a
served output does not depend on the load. A prompt with images (``GenerationRequest.images``) is fed whole in one
call, its images bound for all of it (as ``generate`` feeds it). A mixin of :class:`~.scheduler.Scheduler` (its
state and helpers: ``session``, ``prefill_chunk``, ``auto_chunk``, ``_prefilling``, ``_running``, the moving
averages, ``_finish``, ``_fork``, ``_first_token``, ``prefix_cache``).
"""

from __future__ import annotations

import time

import numpy as np

from qeff_kv.runtime.decoding.prompt_rows import log_softmax, prefill_rows
from qeff_kv.serve.engine.engine import PromptLogprobs

#: --prefill-chunk auto: the share of a decode step's time a turn's prefill chunk may take
AUTO_SHARE = 0.9
#: prompt tokens a turn feeds by default (rounded down to whole prefill lengths): vLLM's budget of batched tokens
#: per step, llama.cpp's micro-batch; a slot waiting for its prompt costs a lock-step row, so prompts go in quickly
TURN_TOKENS = 512


class PrefillTurns:
    """The prompt tokens a turn feeds, for :class:`~.scheduler.Scheduler`."""

    def _chunk_size(self) -> int:
        if not (self.auto_chunk and self._running and self._decode_s and self._prefill_tok_s):
            return self.prefill_chunk
        n = int(AUTO_SHARE * self._decode_s / self._prefill_tok_s)
        return max(1, min(self.session.prefill_seq_len, n))

    @staticmethod
    def _average(old: float | None, new: float) -> float:
        return new if old is None else 0.8 * old + 0.2 * new

    def _prefill_turn(self) -> None:
        """Feed one turn's prompt tokens: to the oldest prefilling request, what is left to the next ones."""
        left, fed = self._chunk_size(), 0
        while left > 0 and self._prefilling:
            a = self._prefilling[0]
            # a prompt with images: all of it in one call (its images are bound for the whole prompt)
            n = len(a.todo) if a.req.images is not None else self._share(len(a.todo), left, fed)
            if n == 0:
                return
            self._prefill_one_chunk(a, n)
            left, fed = left - n, fed + n

    def _share(self, todo: int, left: int, fed: int) -> int:
        """Tokens of a prompt with ``todo`` still to prefill that a turn with ``left`` tokens left feeds: all of
        them, or whole prefill lengths (the graph runs ``generate`` makes); a remainder below one prefill length
        only when it is the turn's whole budget (``--prefill-chunk`` below the prefill length, or ``auto``)."""
        if todo <= left:
            return todo
        S = self.session.prefill_seq_len
        return left // S * S if left >= S or fed else left

    def _prefill_one_chunk(self, a, n: int) -> None:
        """Feed the next ``n`` prompt tokens of request ``a`` (the scheduler's ``_Active``); when its prompt is
        done, its choices fork and it selects its first token."""
        images = a.req.images
        chunk = a.todo[:n]
        # recurrent state: the prompt-boundary checkpoints at the prompt's end (and one before), not at every chunk's
        end = a.seq.length + len(a.todo)
        kw = {"checkpoint": (end - 1, end)} if self.session.recurrent else {}
        if images is not None:
            kw["images"] = images
        t0, runs = time.perf_counter(), self.session.timings.prefill_runs
        try:
            logits = (self.session.prefill(a.seq, chunk, **kw) if a.req.prompt_logprobs is None
                      else self._scored_chunk(a, chunk))
        except Exception as exc:   # noqa: BLE001
            self._finish(a, "error", f"prefill failed: {exc}", keep=False)
            return
        self._prefill_tok_s = self._average(self._prefill_tok_s, (time.perf_counter() - t0) / len(chunk))
        del a.todo[:len(chunk)]
        with self._lock:
            self._stats["prefill_chunks"] += self.session.timings.prefill_runs - runs
        if a.todo:
            return
        self._prefilling.remove(a)
        if images is None:
            self.prefix_cache.held(a.seq)
        if a.budget == 0:   # max_tokens 0 (prompt logprobs only): the prompt scored, nothing generated
            self._finish(a, "length")
            return
        if a.followers:
            self._fork(a, logits)
        self._first_token(a, logits)

    def _scored_chunk(self, a, chunk: list[int]):
        """Prefill ``chunk`` keeping every position's logits (:func:`~qeff_kv.runtime.decoding.prompt_rows.prefill_rows`),
        emit its tokens' :class:`~.engine.PromptLogprobs`, and return the logits after its last token."""
        rows = prefill_rows(self.session, a.seq, chunk)
        scoring = rows[:-1] if a.prompt_row is None else np.concatenate([a.prompt_row[None], rows[:-1]])
        a.handle.emit(PromptLogprobs(prompt_entries(scoring, chunk, a.req.prompt_logprobs,
                                                    first=a.prompt_row is None)))
        a.prompt_row = rows[-1]
        return rows[-1]


def prompt_entries(scoring, tokens: list[int], top: int, first: bool) -> tuple:
    """``(token, logprob, top alternatives)`` for each of ``tokens``, scored by the rows ``scoring`` (one per token,
    or one fewer with ``first``: the prompt's first token, which nothing precedes, gets None)."""
    out = [(tokens[0], None, ())] if first else []
    lps = log_softmax(scoring) if len(scoring) else scoring
    for row, tok in zip(lps, tokens[1:] if first else tokens):
        alts = np.argpartition(-row, top - 1)[:top] if top > 0 else []
        alts = sorted(alts, key=lambda t: -row[t])
        out.append((tok, float(row[tok]), tuple((int(t), float(row[t])) for t in alts)))
    return tuple(out)
