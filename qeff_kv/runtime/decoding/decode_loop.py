"""Generation over a :class:`~qeff_kv.runtime.session.Session`: requests planned and checked before anything runs,
then prefilled one by one and decoded together, token by token (:meth:`GenerationLoop.stream`).

:class:`GenerationLoop` is the session's ``generation`` collaborator: ``Session.stream``, ``generate`` and
``warm_up`` call it. It builds on the session's public low level: ``prefill``, ``decode``, ``cache``, ``ctx_len``,
``max_sequences``, ``prefill_seq_len``, ``eos_token_ids``, ``vocab_size``, ``timings``, ``graph`` (its
:class:`~qeff_kv.runtime.graph_description.GraphDescription`) and ``media`` (a vision-language graph's image inputs).
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, Sequence as Seq

import numpy as np

from qeff_kv.support import validate
from qeff_kv.errors import RuntimeInputError
from qeff_kv.runtime.arguments import check_tokens
from qeff_kv.runtime.multimodal import media as media_mod
from qeff_kv.runtime.memory.hybrid import Sequence
from qeff_kv.runtime.results import Generation, TokenEvent
from qeff_kv.runtime.decoding.sampling import GREEDY, SamplingParams, TokenPicker
from qeff_kv.runtime.decoding.stopping import (DEFAULT_MAX_TOKENS, asked_tokens, check_asked, check_stop,
                                                context_room, token_budget)


class GenerationLoop:
    """``stream``, ``generate`` and ``warm_up`` of ``session`` (a :class:`~qeff_kv.runtime.session.Session`)."""

    def __init__(self, session):
        self.session = session

    def _tokens(self, tokens: Iterable[int]) -> list[int]:
        """Token ids checked against the session's vocabulary (:func:`.arguments.check_tokens`)."""
        return check_tokens(tokens, self.session.vocab_size)

    @staticmethod
    def _fed(seq: Sequence, prompt_len: int) -> int:
        """Positions ``seq`` holds once everything before its first new token is fed (:func:`.stopping.context_room`):
        its cache, ``prompt_len`` more tokens, and a pending token already shown to the caller (fed first)."""
        shown = prompt_len == 0 and seq.pending is not None and seq.pending_emitted
        return seq.length + prompt_len + (1 if shown else 0)

    def stream(self, prompts: Seq[Seq[int] | Sequence | tuple[Sequence, Seq[int]]], *,
               max_tokens: int = DEFAULT_MAX_TOKENS, sampling: SamplingParams | None = None,
               stop_tokens: Iterable[int] | None = None, on_capacity: str = "error",
               results: list[Generation] | None = None, max_new_tokens: int | None = None) -> Iterator[TokenEvent]:
        """Generate for several requests together, yielding each token as it is produced.

        A request is a list of prompt token ids (a new sequence), a :class:`~qeff_kv.runtime.multimodal.media.Prompt` (token
        ids with their images), an existing :class:`Sequence` (continue it from its pending token, e.g. after
        :func:`load_state`), or ``(sequence, more_tokens or Prompt)``. Every check
        (capacity, slots, token ids) runs when ``stream`` is called, before anything runs; the returned iterator
        does the work. ``on_capacity="stop"`` shortens a request that would exceed the capacity instead of
        refusing it (``finish_reason == "capacity"``). ``max_new_tokens``: the deprecated name of ``max_tokens``.
        """
        max_tokens = asked_tokens(max_tokens, max_new_tokens)
        prompts = self._check_stream_args(prompts, max_tokens, sampling, on_capacity)
        params = (sampling or GREEDY).resolved()
        stops = set(self._tokens(stop_tokens if stop_tokens is not None else self.session.eos_token_ids))
        # ---- plan and validate everything first
        plan, images = self._plan_requests(prompts)
        self._check_slots(plan)
        budgets = self._budgets(plan, max_tokens, on_capacity)
        for (s, toks), imgs in zip(plan, images):
            if self.session.media is not None:
                self.session.media.check(toks, imgs, self.session.prefill_seq_len)
            elif imgs is not None:
                raise RuntimeInputError("images were given but the graph is a text decoder")
        return self._iterate(plan, budgets, params, stops, max_tokens,
                             results if results is not None else [], images)

    @staticmethod
    def _check_stream_args(prompts, max_tokens, sampling, on_capacity) -> list:
        """``prompts`` as a list, once every argument of :meth:`stream` is known to be of its kind."""
        if on_capacity not in ("error", "stop"):
            raise RuntimeInputError(f"on_capacity must be 'error' or 'stop', got {on_capacity!r}")
        check_asked(max_tokens)
        if sampling is not None and not isinstance(sampling, SamplingParams):
            raise RuntimeInputError(
                f"sampling must be a SamplingParams (e.g. SamplingParams(temperature=0.7)) or None, got {sampling!r}")
        if isinstance(prompts, np.ndarray):
            prompts = [prompts] if prompts.ndim == 1 else list(prompts)
        if isinstance(prompts, (str, bytes, dict)) or not isinstance(prompts, Iterable):
            raise RuntimeInputError(f"prompts must be a list of requests (lists of token ids or sequences), got "
                                    f"{type(prompts).__name__}")
        return list(prompts)

    def _plan_requests(self, prompts: list) -> tuple[list[tuple[Sequence | None, list[int]]],
                                                    list[media_mod.Images | None]]:
        """Each request as ``(its sequence or None for a new one, the tokens to prefill)``, and its images."""
        plan: list[tuple[Sequence | None, list[int]]] = []
        images: list[media_mod.Images | None] = []
        for req in prompts:
            req, more_images = self._unwrap(req)
            images.append(more_images)
            if isinstance(req, Sequence):
                plan.append((self.session.cache.get(req), []))
            elif isinstance(req, tuple) and len(req) == 2 and isinstance(req[0], Sequence):
                s = self.session.cache.get(req[0])
                more = self._tokens(req[1])
                # A pending token the caller has seen is part of the text: it goes in first. One never
                # shown (a prefill-only run) is replaced by the caller's tokens.
                if more and s.pending is not None and s.pending_emitted:
                    more = [s.pending] + more
                    if images[-1] is not None:
                        images[-1] = images[-1].after_text(1)
                plan.append((s, more))
            else:
                toks = self._tokens(req)
                if not toks:
                    raise RuntimeInputError("a prompt is empty; give at least one token")
                plan.append((None, toks))
        return plan, images

    def _check_slots(self, plan: list[tuple[Sequence | None, list[int]]]) -> None:
        """Refuse more new sequences than free slots, and a sequence given twice."""
        new_count = sum(1 for s, _ in plan if s is None)
        if new_count > len(self.session.cache.free_slots()):
            raise RuntimeInputError(
                f"{new_count} new sequences requested but only {len(self.session.cache.free_slots())} of "
                f"{self.session.max_sequences} slots are free" + self.session.graph.batching.slots_hint)
        ids = [s.id for s, _ in plan if s is not None]
        if len(set(ids)) != len(ids):
            raise RuntimeInputError("a sequence appears twice in one request")

    def _budgets(self, plan: list[tuple[Sequence | None, list[int]]], max_tokens: int, on_capacity: str
                 ) -> list[int]:
        """New tokens each request may make (:func:`.stopping.token_budget` within :func:`.stopping.context_room`):
        ``max_tokens``, or with ``on_capacity="stop"`` what the capacity leaves (a request that does not fit is
        refused in one line either way)."""
        budgets, ctx_len = [], self.session.ctx_len
        for i, (s, toks) in enumerate(plan):
            probe = s if s is not None else Sequence(-1, -1)
            if s is not None and not toks and s.pending is None:
                raise RuntimeInputError(
                    f"sequence {s.id} has no pending token to continue from; give it more tokens")
            held, fed = probe.length + len(toks), self._fed(probe, len(toks))
            budget = token_budget(max_tokens, context_room(ctx_len, fed))
            if on_capacity == "error" and (budget < max_tokens or held > ctx_len):
                need = held if max_tokens == 0 else fed + max_tokens - 1
                raise RuntimeInputError(
                    f"request {i}: {probe.length} cached + {len(toks)} prompt + {max_tokens} new tokens "
                    f"need {need} positions; the capacity is ctx_len={ctx_len}")
            if budget == 0 and held > ctx_len:
                raise RuntimeInputError(
                    f"request {i}: {probe.length} cached + {len(toks)} prompt tokens exceed the capacity "
                    f"ctx_len={ctx_len}")
            budgets.append(budget)
        return budgets

    @staticmethod
    def _unwrap(req):
        """``(request with a Prompt's token ids, its images)``."""
        if isinstance(req, media_mod.Prompt):
            return list(req.tokens), req.images
        if isinstance(req, tuple) and len(req) == 2 and isinstance(req[1], media_mod.Prompt):
            return (req[0], list(req[1].tokens)), req[1].images
        return req, None

    def _iterate(self, plan, budgets, params, stops, max_tokens, gens: list[Generation],
                 images) -> Iterator[TokenEvent]:
        gens.clear()
        for (s, toks), budget in zip(plan, budgets):
            gens.append(Generation(s if s is not None else self.session.cache.create(), [], len(toks)))
        # one picker per request: the token history its penalties read (prompt = what the sequence holds + toks)
        pickers = [TokenPicker(params, list(g.sequence.tokens) + list(toks)) for g, (_, toks) in zip(gens, plan)]
        active: list[int] = []
        for i, ((_, toks), gen) in enumerate(zip(plan, gens)):
            seq = gen.sequence
            if toks:
                logits = self.session.prefill(seq, toks, images[i])
                seq.pending = pickers[i].pick(logits, seq.length).token
                pickers[i].accept(seq.pending)
                seq.pending_emitted = False
            if max_tokens == 0:
                gen.finish_reason = "prefill"
                continue
            if budgets[i] == 0:   # max_tokens > 0: the capacity left no room
                gen.finish_reason = check_stop(None, 0, 0, stops, asked=max_tokens)
                continue
            if not seq.pending_emitted:
                tok = seq.pending
                seq.pending_emitted = True
                gen.tokens.append(tok)
                yield TokenEvent(i, tok, seq)
                if self._finished(gen, budgets[i], stops, max_tokens):
                    continue
            active.append(i)
        while active:
            step = [(gens[i].sequence, gens[i].sequence.pending) for i in active]
            out = self.session.decode(step)
            still = []
            for i in active:
                seq = gens[i].sequence
                tok = pickers[i].pick(out[seq], seq.length).token
                pickers[i].accept(tok)
                seq.pending = tok
                seq.pending_emitted = True
                gens[i].tokens.append(tok)
                self.session.timings.decode_tokens += 1
                yield TokenEvent(i, tok, seq)
                if not self._finished(gens[i], budgets[i], stops, max_tokens):
                    still.append(i)
            active = still

    @staticmethod
    def _finished(gen: Generation, budget: int, stops: set[int], asked: int) -> bool:
        """The stop rule (:func:`~qeff_kv.runtime.decoding.stopping.check_stop`) after ``gen``'s last token."""
        gen.finish_reason = check_stop(gen.tokens[-1], len(gen.tokens), budget, stops, asked=asked)
        return gen.finish_reason is not None

    def generate(self, prompts, *, max_tokens: int = DEFAULT_MAX_TOKENS, sampling: SamplingParams | None = None,
                 stop_tokens: Iterable[int] | None = None, on_capacity: str = "error",
                 callback: Callable[[TokenEvent], None] | None = None,
                 max_new_tokens: int | None = None) -> list[Generation]:
        """Run :meth:`stream` to the end; one :class:`Generation` per request, in order.

        ``prompts`` may also be a single list of token ids (one request). ``max_new_tokens``: the deprecated name of
        ``max_tokens``.
        """
        max_tokens = asked_tokens(max_tokens, max_new_tokens)
        validate.callable_or_none("callback", callback)
        if isinstance(prompts, np.ndarray):
            if prompts.ndim not in (1, 2):
                raise RuntimeInputError(f"prompts as an array must be 1-D (one prompt) or 2-D (one per row), got "
                                        f"shape {prompts.shape}")
            prompts = [prompts.tolist()] if prompts.ndim == 1 else prompts.tolist()
        if isinstance(prompts, (list, tuple)) and prompts and all(
                isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompts):
            prompts = [list(prompts)]
        results: list[Generation] = []
        for ev in self.stream(prompts, max_tokens=max_tokens, sampling=sampling,
                              stop_tokens=stop_tokens, on_capacity=on_capacity, results=results):
            if callback is not None:
                callback(ev)
        return results

    def warm_up(self) -> None:
        """Run once each step shape a served load starts with, so that the first requests do not pay
        onnxruntime's first-run costs (its memory arena grows at the first step of a larger shape: 0.36-0.77 s for
        the first 8-row step of SmolLM2-135M int4, 4 ms once warm): a prefill of one prefill length, and a
        decode step over every slot, in sequences made for it and removed after. Only on a session holding no
        sequence (every slot it writes is free, and a new sequence starts empty); the timings start again."""
        if self.session.cache.sequences:
            raise RuntimeInputError("warm_up runs on a session without sequences; remove them first")
        seqs = [self.session.add_sequence() for _ in range(self.session.max_sequences)]
        try:
            width = min(self.session.prefill_seq_len, self.session.ctx_len - 1)
            self.session.prefill(seqs[0], [0] * width)
            for seq in seqs[1:]:
                self.session.prefill(seq, [0])
            self.session.decode([(seq, 0) for seq in seqs])
        finally:
            for seq in seqs:
                self.session.remove_sequence(seq)
        self.session.timings = type(self.session.timings)()
