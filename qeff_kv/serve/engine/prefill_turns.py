"""The prefill turn of the local engine: which waiting prompts' tokens an engine turn feeds, and how many.

Invariant: a turn feeds at most its budget of prompt tokens (``prefill_chunk``; ``auto``: what costs about
:data:`AUTO_SHARE` of a decode step), oldest prompt first, and cuts a prompt only at a whole number of prefill
lengths unless the budget itself is below one: so every prompt's graph runs are the ones ``generate`` makes, and a
served output does not depend on the load. A prompt with images (``GenerationRequest.images``) is fed whole in one
call, its images bound for all of it (as ``generate`` feeds it). A prompt scored position by position (prompt
logprobs on a graph that returns its last row only: one graph run per token) counts a prefill length of the budget
per position while sequences are decoding, so a turn makes no more graph runs than a plain one and running
streams keep their pace.

:class:`PrefillTurns` is one object per :class:`~.scheduler.Scheduler` and holds no scheduler: it holds the session
it feeds, the requests still prefilling (:attr:`~PrefillTurns.queue`, oldest first), the turn's size and the moving
averages ``auto`` reads. :meth:`PrefillTurns.feeds` feeds a turn chunk by chunk and yields what each chunk did (:class:`Turn`:
the prompts completed with their logits, the requests whose prefill failed, the prompt logprobs to emit, the graph
runs); the scheduler applies each outcome as it comes, before the next chunk is fed (a prompt's first token is not
held back by the rest of the turn).

An embedding input (``GenerationRequest.embed``) is fed as a prompt, in the same chunks; its last chunk is fed
with the graph's ``hidden_states`` output bound (:func:`qeff_kv.runtime.embeddings.pooled`), and ``done`` carries
its vector in place of logits.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from qeff_kv.errors import RuntimeInputError
from qeff_kv.runtime import embeddings
from qeff_kv.runtime.decoding.prompt_rows import chunked, log_softmax, prefill_rows
from qeff_kv.serve.engine.engine import PromptLogprobs

#: --prefill-chunk auto: the share of a decode step's time a turn's prefill chunk may take
AUTO_SHARE = 0.9
#: prompt tokens a turn feeds by default (rounded down to whole prefill lengths): vLLM's budget of batched tokens
#: per step, llama.cpp's micro-batch; a slot waiting for its prompt costs a lock-step row, so prompts go in quickly
TURN_TOKENS = 512


@dataclass
class Turn:
    """What one prefill turn did: ``done`` (request, logits after its last prompt token; an embedding request's
    vector), the prompts completed, in order; ``failed`` (request, error), the requests whose prefill failed (both have left the queue); ``scored``
    (request, :class:`~.engine.PromptLogprobs`), the prompt logprobs of the chunks fed, in order; ``runs``: the
    graph runs of the chunks fed."""

    done: list = field(default_factory=list)
    failed: list = field(default_factory=list)
    scored: list = field(default_factory=list)
    runs: int = 0


class PrefillTurns:
    """The prompt tokens each turn feeds into ``session`` (see the module docstring). ``prefill_chunk``: prompt tokens per turn (None: :data:`TURN_TOKENS` in whole prefill lengths), or
    ``"auto"``: while sequences are running, as many tokens as cost :data:`AUTO_SHARE` of a decode step
    (measured), so a running stream's step at most about doubles; the full prefill length when nothing runs."""

    def __init__(self, session, prefill_chunk: int | str | None = None, whole: bool = False):
        if prefill_chunk is not None and prefill_chunk != "auto" and (
                isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk < 1):
            raise RuntimeInputError(f"prefill_chunk must be a positive int or 'auto', got {prefill_chunk!r}")
        self.session = session
        self.auto = prefill_chunk == "auto"
        S = session.prefill_seq_len
        #: prompt tokens fed per turn (the most, with ``auto``)
        self.chunk = (S if self.auto else max(S, TURN_TOKENS // S * S) if prefill_chunk is None
                      else prefill_chunk)
        if whole:   # batch-invariant serving: every prompt is fed in whole prefill lengths (never auto)
            self.auto, self.chunk = False, max(S, self.chunk // S * S)
        #: requests whose prompt is still being fed, oldest first
        self.queue: list = []
        self.decode_s: float | None = None       # moving averages: one decode step, one prefill token
        self.prefill_tok_s: float | None = None

    def enqueue(self, a) -> None:
        """``a`` (an :class:`~.active.Active` with ``todo`` to feed) prefills after the requests already here."""
        self.queue.append(a)

    def drop(self, a) -> None:
        """``a`` ends: it leaves the queue, if it is in it."""
        if a in self.queue:
            self.queue.remove(a)

    def note_decode(self, seconds: float) -> None:
        """A decode step took ``seconds`` (what ``auto`` sizes a turn by)."""
        self.decode_s = _average(self.decode_s, seconds)

    def chunk_size(self, running: bool) -> int:
        """Prompt tokens the next turn feeds (``running``: sequences are decoding)."""
        if not (self.auto and running and self.decode_s and self.prefill_tok_s):
            return self.chunk
        n = int(AUTO_SHARE * self.decode_s / self.prefill_tok_s)
        return max(1, min(self.session.prefill_seq_len, n))

    def feeds(self, running: bool) -> Iterator[Turn]:
        """Feed one turn's prompt tokens, chunk by chunk: to the oldest prefilling request, what is left to the next
        ones (``running``: sequences are decoding, what ``auto`` sizes the turn by). Each chunk's outcome (a
        :class:`Turn` of that chunk alone) is yielded before the next chunk is fed, so the scheduler applies a
        completed prompt (its first token) at once, not after the rest of the turn; the queue is read again after
        each yield, so a request the scheduler enqueues meanwhile is fed in this turn while its budget lasts."""
        left, fed = self.chunk_size(running), 0
        while left > 0 and self.queue:
            a = self.queue[0]
            # a prompt with images: all of it in one call (its images are bound for the whole prompt)
            n, cost = self._size(a, left, fed, running)
            if n == 0:
                return
            out = Turn()
            self._feed(a, n, out)
            left, fed = left - n * cost, fed + n
            yield out

    def turn(self, running: bool) -> Turn:
        """The whole of one turn (:meth:`feeds`) at once: every chunk's outcome in one :class:`Turn`."""
        out = Turn()
        for part in self.feeds(running):
            out.done += part.done
            out.failed += part.failed
            out.scored += part.scored
            out.runs += part.runs
        return out

    def _size(self, a, left: int, fed: int, running: bool) -> tuple[int, int]:
        """``(tokens, budget per token)`` of request ``a`` this chunk feeds: a prompt with images all at once (its
        images are bound for the whole prompt); one scored position by position while sequences decode, a prefill
        length of the budget per position (one graph run each, as a plain chunk is one), at least one per turn;
        else :meth:`_share`."""
        if a.req.images is not None:
            return len(a.todo), 1
        if running and self.single(a):
            S = self.session.prefill_seq_len
            return min(len(a.todo), left // S if left >= S or fed else 1), S
        return self._share(len(a.todo), left, fed), 1

    def single(self, a) -> bool:
        """Whether ``a`` is prefilled one position per graph run (prompt logprobs on a last-row graph)."""
        return a.req.prompt_logprobs is not None and not chunked(self.session)

    def _share(self, todo: int, left: int, fed: int) -> int:
        """Tokens of a prompt with ``todo`` still to prefill that a turn with ``left`` tokens left feeds: all of
        them, or whole prefill lengths (the graph runs ``generate`` makes); a remainder below one prefill length
        only when it is the turn's whole budget (``--prefill-chunk`` below the prefill length, or ``auto``)."""
        if todo <= left:
            return todo
        S = self.session.prefill_seq_len
        return left // S * S if left >= S or fed else left

    def _feed(self, a, n: int, out: Turn) -> None:
        """Feed the next ``n`` prompt tokens of request ``a``; when its prompt is done it leaves the queue into
        ``out.done`` (the scheduler takes it on: its choices fork and it selects its first token), when the feed
        fails into ``out.failed``."""
        session = self.session
        images = a.req.images
        chunk = a.todo[:n]
        # recurrent state: the prompt-boundary checkpoints at the prompt's end (and one before), not at every chunk's
        end = a.seq.length + len(a.todo)
        kw = {"checkpoint": (end - 1, end)} if session.recurrent else {}
        if images is not None:
            kw["images"] = images
        t0, runs = time.perf_counter(), session.timings.prefill_runs
        try:
            if a.req.prompt_logprobs is not None:
                logits = self._scored_chunk(a, chunk, out, kw)
            elif a.req.embed and n == len(a.todo):   # an embedding's last chunk: its vector instead of logits
                logits = embeddings.pooled(session, a.seq, chunk, **kw)
            else:
                logits = session.prefill(a.seq, chunk, **kw)
        except Exception as exc:   # noqa: BLE001
            self.queue.remove(a)
            out.failed.append((a, f"prefill failed: {exc}"))
            return
        if not self.single(a):   # ``auto`` sizes turns by chunked prefill's cost per token
            self.prefill_tok_s = _average(self.prefill_tok_s, (time.perf_counter() - t0) / len(chunk))
        del a.todo[:len(chunk)]
        out.runs += session.timings.prefill_runs - runs
        if a.todo:
            return
        self.queue.remove(a)
        out.done.append((a, logits))

    def _scored_chunk(self, a, chunk: list[int], out: Turn, kw: dict):
        """Prefill ``chunk`` keeping every position's logits (:func:`~qeff_kv.runtime.decoding.prompt_rows.prefill_rows`),
        add its tokens' :class:`~.engine.PromptLogprobs` to ``out.scored``, and return the logits after its last
        token."""
        rows = prefill_rows(self.session, a.seq, chunk, checkpoint=kw.get("checkpoint", True))
        scoring = rows[:-1] if a.prompt_row is None else np.concatenate([a.prompt_row[None], rows[:-1]])
        out.scored.append((a, PromptLogprobs(prompt_entries(scoring, chunk, a.req.prompt_logprobs,
                                                            first=a.prompt_row is None))))
        a.prompt_row = rows[-1]
        return rows[-1]


def _average(old: float | None, new: float) -> float:
    return new if old is None else 0.8 * old + 0.2 * new


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
