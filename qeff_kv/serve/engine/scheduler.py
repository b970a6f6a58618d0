"""The local engine: one thread owns the :class:`~qeff_kv.runtime.Session` and runs every request.

Each turn of the engine thread:

1. applies cancellations (a waiting request leaves the queue; a running one stops and its sequence is kept as
   a cached sequence, its slot free for the next request) and slot actions (``/slots``);
2. admits waiting requests in FIFO order while a slot is free or held by a cached sequence (evicted least
   recently used first), starting each from the longest common prefix of a kept sequence (prompt reuse);
3. feeds up to one turn's prompt tokens (``prefill_chunk``: by default :data:`TURN_TOKENS` rounded down to
   whole prefill lengths, vLLM's token budget of a step) to the oldest request still prefilling, and what is
   left of them to the next ones (a turn can finish several short prompts, so their rows decode from the next
   step on); a prompt cut by the budget is cut at a whole number of prefill lengths, so its graph runs are the
   ones ``generate`` makes;
4. runs **one** decode step for every running sequence together (``batch_index`` rows, or lock step on a graph
   without it: the session does both); with a :class:`~.speculation.Speculation` (``--speculative``), that step
   verifies each sequence's drafts and may give each several tokens, emitted one event each.

Token selection is one call per row, :meth:`.active.Active.select`: the row's
:class:`~qeff_kv.runtime.decoding.sampling.TokenPicker` (``logit_bias``, penalties, logprobs, temperature / top-k / top-p /
min-p, the seeded draw) on that row's logits, for the position the token will occupy; a row with nothing to adjust
and no logprobs takes the plain fast path. OpenAI's ``n`` prefills a prompt once and forks it
(:mod:`.forks`).

Collaborators, each an object with its own state and a reference to the scheduler it serves (through the
scheduler's public face): :attr:`Scheduler.turns` (:class:`~.prefill_turns.PrefillTurns`: the requests still
prefilling and what a turn feeds), :attr:`Scheduler.choices` (:class:`~.forks.ChoiceGroups`: ``n``'s waiting
groups and parked choices) and :attr:`Scheduler.decode` (:class:`~.decode_step.DecodeStep`). A request's record is an :class:`~.active.Active`, its budget decided once when it is
admitted; every token goes through one stop rule (:func:`~qeff_kv.runtime.decoding.stopping.check_stop`,
:meth:`Scheduler.emit_token`).

So running streams keep flowing while a long prompt is prefilled: between two of their tokens the engine
spends at most one turn's prompt tokens (``--prefill-chunk N`` lowers it; ``auto`` sizes it to about one
decode step). HTTP handlers never call onnxruntime: they submit and read events.

Prompt reuse (decided by the :class:`~qeff_kv.runtime.memory.prefix_cache.PrefixCache`; the scheduler only asks): a
finished (or cancelled) sequence is not destroyed; it stays in its slot, with its tokens, until the slot is needed
(LRU). A new prompt sharing a prefix with a kept sequence starts from it: the kept sequence is
truncated to the common prefix and continued in its slot, or, when the session has ``copy`` and a slot is free,
the prefix is copied into the free slot so that the longer kept sequence stays (also from a *running*
sequence's prompt). At most ``len(prompt) - 1`` tokens are reused: the last prompt token is always fed (its
logits give the first token). Ring-buffer graphs reuse only where ``truncate`` allows it (else the prompt is
prefilled from scratch). A recurrent or hybrid graph reuses the longest common prefix that ends where the kept
sequence can return to (a checkpoint of its recurrent state, or its whole length: ``Session.reusable``); with none,
the prompt is prefilled from scratch (llama.cpp's server rule). A prompt fed in several chunks takes its
prompt-boundary checkpoints at its end and one token before (the point a repeated prompt returns to), not at each
chunk's.
"""

from __future__ import annotations

import collections
import threading
import time
import traceback
from concurrent.futures import Future
from pathlib import Path

from qeff_kv.errors import QueueFullError, RuntimeInputError, UnavailableError
from qeff_kv.runtime.memory.hybrid import Sequence
from qeff_kv.runtime.decoding.prompt_rows import unsupported
from qeff_kv.runtime.decoding.sampling import Pick
from qeff_kv.runtime.decoding.stopping import LENGTH, STOP, check_stop
from qeff_kv.runtime.memory.prefix_cache import PrefixCache
from qeff_kv.serve.engine.active import Active, admitted
from qeff_kv.serve.engine.decode_step import DecodeStep
from qeff_kv.serve.engine.engine import (Engine, Finished, GenerationRequest, RequestHandle, TokenOut,
                                         check_request)
from qeff_kv.serve.engine.forks import ChoiceGroups, choice_requests
from qeff_kv.serve.engine.prefill_turns import TURN_TOKENS, PrefillTurns  # noqa: F401  (TURN_TOKENS: documented here)


class Scheduler(Engine):
    """Continuous batching over one :class:`~qeff_kv.runtime.Session` (see the module docstring).

    Args:
        session: the session; the scheduler's thread is its only user from now on.
        max_queue: requests waiting for a slot beyond which :meth:`submit` raises ``QueueFullError``.
        reuse_prompts: keep finished sequences for prompt reuse.
        model_name: what ``/v1/models`` lists (default: the export folder's name).
        prefill_chunk: prompt tokens fed per engine turn (default: :data:`TURN_TOKENS` in whole prefill lengths), or
            ``"auto"`` (:class:`~.prefill_turns.PrefillTurns`).
        speculation: a :class:`~.speculation.Speculation` over ``session`` (speculative decoding), or None.
        kv_events: a :class:`~.kv_events.KVEventPublisher` told what the sequences hold (``--kv-events``), or
            None; the scheduler closes it.
    """

    def __init__(self, session, *, max_queue: int = 64, reuse_prompts: bool = True, model_name: str | None = None,
                 prefill_chunk: int | str | None = None, speculation=None, kv_events=None,
                 connector=None):
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 0:
            raise RuntimeInputError(f"max_queue must be a non-negative int, got {max_queue!r}")
        self.session = session
        #: the requests still prefilling and what each turn feeds
        self.turns = PrefillTurns(self, prefill_chunk)
        if speculation is not None and speculation.session is not session:
            raise RuntimeInputError("the speculation drives another session than the scheduler's")
        self.speculation = speculation
        #: a KV connector (serve/kv_connector.py, ``--kv-role``): holds the sequences of do_remote_decode requests
        self.connector = connector
        self.model_name = model_name or session.files.folder.name
        self.ctx_len = session.ctx_len
        self.max_sequences = session.max_sequences
        self.max_queue = max_queue
        self.reuse_prompts = reuse_prompts
        #: the kept sequences and the prompt-reuse decision (the engine thread is its only user)
        self.prefix_cache = PrefixCache(session, reuse=reuse_prompts, listener=kv_events)
        self.kv_events = kv_events
        #: n's waiting groups and parked choices
        self.choices = ChoiceGroups(self)
        #: the requests decoding (the engine thread's), and the decode step that runs them
        self.running: list[Active] = []
        self.decode = DecodeStep(self)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._waiting: collections.deque[tuple[RequestHandle, GenerationRequest]] = collections.deque()
        self._control: collections.deque[tuple[Future, object]] = collections.deque()
        self._admitted = 0   # sequences of requests taken from the queue and not yet finished (under _lock)
        self._closed = False
        self._published = 0.0
        self._stats = {"queue_depth": 0, "sequences_active": 0, "sequences_cached": 0, "kv_bytes_used": 0,
                       "prompt_tokens_reused": 0, "decode_steps": 0, "prefill_chunks": 0,
                       "kv_bytes_capacity": session.cache.memory_capacity, "max_sequences": self.max_sequences}
        self._slots: list[dict] = [{"id": i, "state": "free", "n_tokens": 0} for i in range(self.max_sequences)]
        self._thread = threading.Thread(target=self._loop, name="qeff-kv-engine", daemon=True)
        self._thread.start()

    @property
    def prefill_chunk(self) -> int:
        """Prompt tokens fed per engine turn (the most, with ``"auto"``)."""
        return self.turns.chunk

    @property
    def closed(self) -> bool:
        return self._closed

    # ------------------------------------------------------------------------------------ Engine API
    def submit(self, req: GenerationRequest) -> RequestHandle:
        return self._queue(req, [req.sampling])[0]

    def submit_n(self, req: GenerationRequest, samplings: list) -> list[RequestHandle]:
        """``n`` choices of one prompt: the prompt is prefilled once (the first choice's), then copied into the
        other choices' slots (``Session.copy``) and each choice samples on with its own parameters; where the
        session cannot copy, each choice prefills the prompt itself (the same logits)."""
        if not 1 <= len(samplings) <= self.max_sequences:
            raise RuntimeInputError(f"n must be in [1, {self.max_sequences}] (the sequences this server runs at "
                                    f"once), got {len(samplings)}")
        return self._queue(req, samplings)

    def stats(self) -> dict:
        with self._lock:
            out = dict(self._stats)
        if self.speculation is not None:
            out.update(self.speculation.stats())
        if self.kv_events is not None:
            out.update(self.kv_events.stats())
        if self.connector is not None:
            out.update(self.connector.stats())
        return out

    def count(self, stat: str, n: int) -> None:
        """Add ``n`` to the counter ``stat`` of :meth:`stats`."""
        with self._lock:
            self._stats[stat] += n

    def health(self) -> str | None:
        if self._closed:
            return "the engine is closed"
        if not self._thread.is_alive():
            return "the engine thread has stopped"
        return None

    def slots(self) -> list[dict]:
        with self._lock:
            return [dict(s) for s in self._slots]

    def busy_slots(self) -> set[int]:
        """Slots a request runs in (prefilling, decoding, or parked until its prompt is forked); engine thread."""
        return {a.seq.slot for a in self._busy()}

    def slot_action(self, slot: int, action: str, path=None) -> dict:
        """Run a slot action on the engine thread and wait for it (see :meth:`_slot_action`)."""
        fut = self.run_on_engine(("slot", slot, action, path))
        return fut.result(timeout=120)

    def run_on_engine(self, what) -> Future:
        fut: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeInputError("the engine is closed")
            self._control.append((fut, what))
        self._wake.set()
        return fut

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._wake.set()
        self._thread.join(timeout=30)
        if self.kv_events is not None:
            self.kv_events.close()
        if self.connector is not None:
            self.connector.close()

    # ------------------------------------------------------------------------------------ submission
    def _queue(self, req: GenerationRequest, samplings: list) -> list[RequestHandle]:
        """Admit ``req`` once per sampling (``n`` choices, :func:`~.forks.choice_requests`)."""
        reqs = choice_requests(req, samplings)
        for r in reqs:
            self._check(r, len(reqs))
        handles = [RequestHandle(r.request_id, on_cancel=lambda h: self._wake.set()) for r in reqs]
        with self._lock:
            if self._closed:
                raise UnavailableError("the engine is closed")
            # the queue holds max_queue requests beyond those a free slot is about to take
            if len(self._waiting) >= self.max_queue + max(0, self.max_sequences - self._admitted):
                raise QueueFullError(f"the queue is full ({self.max_queue} requests waiting); retry later")
            self._waiting.append((handles[0], reqs[0]))
            self.choices.wait(handles[0], list(zip(handles[1:], reqs[1:])))
            self._stats["queue_depth"] = len(self._waiting)
        self._wake.set()
        return handles

    def _check(self, r: GenerationRequest, n: int) -> None:
        """What this engine refuses of one of ``n`` choices, before anything is queued."""
        check_request(r, ctx_len=self.ctx_len, vocab_size=self.session.vocab_size,
                      constraint_refused=None if self.speculation is None else
                      "structured output and forced tool calls are not supported with --speculative")
        if self.speculation is not None and (r.sampling.adjusts or r.logprobs is not None):
            raise RuntimeInputError("logprobs, logit_bias and penalties are not supported with --speculative")
        if r.prompt_logprobs is not None:
            why = "prompt logprobs go with one choice (n = 1)" if n > 1 else unsupported(self.session)
            if why is not None:
                raise RuntimeInputError(why)

    # ------------------------------------------------------------------------------------ engine thread
    def _loop(self) -> None:
        while True:
            with self._lock:
                closed = self._closed
            if closed:
                self._shutdown()
                return
            try:
                self._turn()
            except Exception as exc:   # noqa: BLE001 - the engine thread must survive anything
                self._fail_all(f"engine error: {type(exc).__name__}: {exc}")
                traceback.print_exc()
            self._publish()
            if not (self.turns.queue or self.running or self._admissible() or self._control):
                self._wake.wait(timeout=0.5)
                self._wake.clear()

    def _turn(self) -> None:
        self._apply_cancellations()
        self._apply_control()
        self._admit()
        if self.turns.queue:
            self.turns.turn()
        if self.running:
            self.decode.step()

    def _busy(self) -> list[Active]:
        """Every request holding a slot: prefilling, decoding, parked."""
        return self.turns.queue + self.running + self.choices.all_parked()

    def _admissible(self) -> bool:
        with self._lock:
            return bool(self._waiting) and self._slot_available(self.choices.members(self._waiting[0][0]))

    def _slot_available(self, need: int = 1) -> bool:
        return self.prefix_cache.available() >= need

    def _publish(self) -> None:
        now = time.monotonic()
        if now - self._published < 0.02 and (self.turns.queue or self.running):
            return   # while busy, at most 50 times a second (the slot table walks every sequence)
        self._published = now
        cache = self.session.cache
        slots = [{"id": i, "state": "free", "n_tokens": 0} for i in range(self.max_sequences)]
        for a in self._busy():
            slots[a.seq.slot] = {"id": a.seq.slot, "state": "busy", "n_tokens": a.seq.length}
        for s in self.prefix_cache.kept:
            slots[s.slot] = {"id": s.slot, "state": "cached", "n_tokens": s.length}
        with self._lock:
            self._stats.update(queue_depth=len(self._waiting),
                               sequences_active=len(self.turns.queue) + len(self.running),
                               sequences_cached=len(self.prefix_cache), kv_bytes_used=cache.memory_used)
            self._slots = slots

    # ---- finishing
    def finish(self, a: Active, reason: str, error: str | None = None, keep: bool = True) -> None:
        """End request ``a`` (``reason``: a finish reason); its sequence is kept for prompt reuse when ``keep``."""
        self.turns.drop(a)
        if a in self.running:
            self.running.remove(a)
        if self.speculation is not None:
            self.speculation.release(a)
        self.choices.leader_ended(a, reason, error)
        held = self._hold_for_remote_decode(a, reason)   # before the sequence is kept or freed
        self.prefix_cache.release(a.seq, keep and a.req.images is None)   # an image prompt's KV: not reused
        with self._lock:
            self._admitted -= 1
        a.handle.emit(Finished(reason, len(a.req.prompt), a.cached, a.generated, error, held))

    def _hold_for_remote_decode(self, a: Active, reason: str) -> dict | None:
        """vLLM's ``request_finished``: a do_remote_decode request capped at its one token (its prompt prefilled,
        the token sampled and pending) has its sequence held by the KV connector; the params naming it."""
        params = a.req.kv_transfer_params
        if self.connector is None or not params or not params.get("do_remote_decode") or reason != LENGTH \
                or a.generated != 1 or not a.seq.alive or a.seq.length != len(a.req.prompt):
            return None
        try:
            return self.connector.request_finished(self.session, a.seq, a.req.request_id)
        except Exception:   # noqa: BLE001 - the answer goes out without kv_transfer_params: the consumer prefills
            traceback.print_exc()
            return None

    def _fail_all(self, message: str) -> None:
        for a in list(self.turns.queue) + list(self.running):
            self.finish(a, "error", message, keep=False)

    def _shutdown(self) -> None:
        for a in list(self.turns.queue) + list(self.running):
            self.finish(a, "cancelled", keep=False)
        with self._lock:
            waiting, self._waiting = list(self._waiting), collections.deque()
            control, self._control = list(self._control), collections.deque()
            groups = [[(h, req)] + self.choices.take(h) for h, req in waiting]
        for members in groups:
            for gh, greq in members:
                gh.emit(Finished("cancelled", len(greq.prompt), 0, 0))
        for fut, _ in control:
            fut.set_exception(RuntimeInputError("the engine is closed"))
        if self.speculation is not None:
            self.speculation.close()

    def _apply_cancellations(self) -> None:
        for a in [a for a in self._busy() if a.handle.cancelled]:
            if not a.handle.finished:
                self.finish(a, "cancelled")
        with self._lock:
            gone = [(h, r) for h, r in self._waiting if h.cancelled]
            if gone:
                self._waiting = collections.deque((h, r) for h, r in self._waiting if not h.cancelled)
            # cancelling the first choice of a waiting n-choice request cancels all its choices
            gone = [m for h, r in gone for m in [(h, r)] + self.choices.take(h)]
        for h, r in gone:
            h.emit(Finished("cancelled", len(r.prompt), 0, 0))

    def _apply_control(self) -> None:
        while True:
            with self._lock:
                if not self._control:
                    return
                fut, what = self._control.popleft()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                if what[0] == "slot":
                    fut.set_result(self._slot_action(*what[1:]))
                elif what[0] == "call":   # a function of the scheduler, run between two turns (tests, diagnostics)
                    fut.set_result(what[1](self))
                else:
                    raise RuntimeInputError(f"unknown engine action {what[0]!r}")
            except Exception as exc:   # noqa: BLE001 - handed to the caller
                fut.set_exception(exc)

    # ---- admission and prompt reuse
    def _reuse(self, prompt: tuple[int, ...]) -> tuple[Sequence, int]:
        """A sequence to continue for ``prompt`` and how many of its positions are reused (running sequences'
        prompts are sources too)."""
        return self.prefix_cache.acquire(prompt, [a.seq for a in self.running if a.req.images is None])

    def _admit(self) -> None:
        while True:
            with self._lock:
                if not self._waiting or not self._slot_available(self.choices.members(self._waiting[0][0])):
                    return
                handle, req = self._waiting.popleft()
                others = self.choices.take(handle)
                self._admitted += 1 + len(others)
            if handle.cancelled:
                with self._lock:
                    self._admitted -= 1 + len(others)
                for h, r in [(handle, req)] + others:
                    h.emit(Finished("cancelled", len(r.prompt), 0, 0))
                continue
            a = None
            try:
                a = self._start(handle, req)
                self.choices.park(a, others)
            except Exception as exc:   # noqa: BLE001 - this request fails, the others go on
                self._fail_admitted(a, [(handle, req)] + others, f"{type(exc).__name__}: {exc}")

    def _fail_admitted(self, a: Active | None, members: list, error: str) -> None:
        """An admitted request that could not start: what was started (``a`` and its parked choices) finishes
        through :meth:`finish`, the rest is told here; every member leaves the admitted count once."""
        started = set()
        if a is not None:
            started = {id(a.handle)} | {id(f.handle) for f in self.choices.parked_on(a)}
            self.finish(a, "error", error, keep=False)
        rest = [(h, r) for h, r in members if id(h) not in started]
        with self._lock:
            self._admitted -= len(rest)
        for h, r in rest:
            h.emit(Finished("error", len(r.prompt), 0, 0, error))

    def _start(self, handle: RequestHandle, req: GenerationRequest) -> Active:
        vocab = self.session.vocab_size
        if req.state is not None:
            self.prefix_cache.make_room()
            seq = self.session.import_state(req.state)
            # a P/D consumer reports the prompt it loaded as cached (the in-process decode replica reports its own)
            a = admitted(handle, req, seq, ctx_len=self.ctx_len, vocab_size=vocab,
                         cached=seq.length if req.kv_transfer_params else 0)
            if seq.pending is None:
                self.prefix_cache.remove(seq)
                raise RuntimeInputError("the handed-off state has no pending token")
            self.prefix_cache.held(seq)
            a.picker.accept(seq.pending)
            self.emit_token(a, seq.pending)
            return a
        fresh = req.images is not None or req.prompt_logprobs is not None   # neither reuses a cached prefix
        seq, cached = (self.prefix_cache.fresh(), 0) if fresh else self._reuse(req.prompt)
        a = admitted(handle, req, seq, ctx_len=self.ctx_len, vocab_size=vocab, todo=list(req.prompt[cached:]),
                     cached=cached)
        with self._lock:
            self._stats["prompt_tokens_reused"] += cached
        self.turns.enqueue(a)
        return a

    # ---- decode (the prefill turn is :class:`~.prefill_turns.PrefillTurns`)
    def prompt_done(self, a: Active, logits) -> None:
        """``a``'s prompt is prefilled (``logits``: after its last token): it ends if its budget is 0 (the prompt
        scored only), else its parked choices fork and it selects its first token."""
        if check_stop(None, a.generated, a.budget, ()) is not None:
            self.finish(a, LENGTH)
            return
        self.choices.fork(a, logits)
        self.first_token(a, logits)

    def first_token(self, a: Active, logits) -> None:
        """``a`` selects its first token from ``logits`` (after its prompt)."""
        try:
            pick = a.select(logits)
        except Exception as exc:   # noqa: BLE001
            self.finish(a, "error", f"sampling failed: {exc}", keep=False)
            return
        a.seq.pending, a.seq.pending_emitted = pick.token, True
        self.emit_token(a, pick.token, pick)

    def emit_token(self, a: Active, tok: int, pick: Pick | None = None) -> None:
        """Account one generated token and apply the stop rule: finish the request (a stop token is counted, not
        emitted) or (re)enter it into the running set."""
        a.generated += 1
        a.last = tok
        why = check_stop(tok, a.generated, a.budget, a.req.stop_token_ids)
        if why == STOP:
            self.finish(a, STOP)
            return
        a.handle.emit(TokenOut(tok) if pick is None or pick.logprob is None else
                      TokenOut(tok, pick.logprob, pick.top))
        if why is not None:
            self.finish(a, why)
            return
        if a not in self.running:
            self.running.append(a)

    # ---- slots
    def _slot_action(self, slot: int, action: str, path) -> dict:
        from qeff_kv.serve.engine import slots as slots_mod

        return slots_mod.run(self, slot, action, Path(path) if path is not None else None)
