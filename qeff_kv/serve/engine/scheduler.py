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

Token selection is one call per row, :meth:`Scheduler._select`: the row's
:class:`~qeff_kv.runtime.decoding.sampling.TokenPicker` (``logit_bias``, penalties, logprobs, temperature / top-k / top-p /
min-p, the seeded draw) on that row's logits, for the position the token will occupy; a row with nothing to adjust
and no logprobs takes the plain fast path. OpenAI's ``n`` prefills a prompt once and forks it
(:mod:`.forks`).

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
from dataclasses import dataclass, field
from pathlib import Path

from qeff_kv.errors import RuntimeInputError
from qeff_kv.runtime.cache import Sequence
from qeff_kv.runtime.memory.prefix_cache import PrefixCache
from qeff_kv.runtime.decoding.sampling import Pick, TokenPicker
from qeff_kv.serve.engine.forks import ChoiceForks
from qeff_kv.serve.engine.prefill_turns import TURN_TOKENS, PrefillTurns
from qeff_kv.serve.engine.engine import Engine, Finished, GenerationRequest, RequestHandle, TokenOut


#: a running sequence moves down a lock-step row only with at least this many tokens left to make: moving its
#: rows is paid once, the row it leaves is saved at every remaining step
LOWER_MIN_LEFT = 8


@dataclass(eq=False)
class _Active:
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
    #: other choices of the same prompt (OpenAI's n), parked until this one's prompt is prefilled, then forked
    followers: list["_Active"] = field(default_factory=list)
    prompt_row: object = None           # prompt logprobs (no reuse): the logits after the last token prefilled


class Scheduler(PrefillTurns, ChoiceForks, Engine):
    """Continuous batching over one :class:`~qeff_kv.runtime.Session` (see the module docstring).

    Args:
        session: the session; the scheduler's thread is its only user from now on.
        max_queue: requests waiting for a slot beyond which :meth:`submit` raises ``QueueFullError``.
        reuse_prompts: keep finished sequences for prompt reuse.
        model_name: what ``/v1/models`` lists (default: the export folder's name).
        prefill_chunk: prompt tokens fed per engine turn (default: :data:`TURN_TOKENS` in whole prefill lengths), or
            ``"auto"``.
        speculation: a :class:`~.speculation.Speculation` over ``session`` (speculative decoding), or None.
        kv_events: a :class:`~.kv_events.KVEventPublisher` told what the sequences hold (``--kv-events``), or
            None; the scheduler closes it.
    """

    def __init__(self, session, *, max_queue: int = 64, reuse_prompts: bool = True, model_name: str | None = None,
                 prefill_chunk: int | str | None = None, speculation=None, kv_events=None,
                 connector=None):
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 0:
            raise RuntimeInputError(f"max_queue must be a non-negative int, got {max_queue!r}")
        if prefill_chunk is not None and prefill_chunk != "auto" and (
                isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk < 1):
            raise RuntimeInputError(f"prefill_chunk must be a positive int or 'auto', got {prefill_chunk!r}")
        #: prompt tokens fed per engine turn (between two decode steps): TURN_TOKENS in whole prefill lengths by
        #: default; smaller keeps running streams smoother while long prompts arrive, at some throughput. "auto":
        #: while sequences are running, as many tokens as cost AUTO_SHARE of a decode step (measured), so a running
        #: stream's step at most about doubles; the full prefill length when nothing runs
        self.auto_chunk = prefill_chunk == "auto"
        S = session.prefill_seq_len
        self.prefill_chunk = (S if self.auto_chunk else max(S, TURN_TOKENS // S * S) if prefill_chunk is None
                              else prefill_chunk)
        self._decode_s: float | None = None       # moving averages: one decode step, one prefill token
        self._prefill_tok_s: float | None = None
        self.session = session
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
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._waiting: collections.deque[tuple[RequestHandle, GenerationRequest]] = collections.deque()
        self._control: collections.deque[tuple[Future, object]] = collections.deque()
        self._prefilling: list[_Active] = []
        self._running: list[_Active] = []
        #: a waiting request's other choices (n > 1), by id() of the first choice's handle
        self._groups: dict[int, list[tuple[RequestHandle, GenerationRequest]]] = {}
        self._admitted = 0   # sequences of requests taken from the queue and not yet finished (under _lock)
        self._closed = False
        self._published = 0.0
        self._stats = {"queue_depth": 0, "sequences_active": 0, "sequences_cached": 0, "kv_bytes_used": 0,
                       "prompt_tokens_reused": 0, "decode_steps": 0, "prefill_chunks": 0,
                       "kv_bytes_capacity": session.cache.memory_capacity, "max_sequences": self.max_sequences}
        self._slots: list[dict] = [{"id": i, "state": "free", "n_tokens": 0} for i in range(self.max_sequences)]
        self._thread = threading.Thread(target=self._loop, name="qeff-kv-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------------ Engine API
    def submit(self, req: GenerationRequest) -> RequestHandle:
        return self._queue(req, [req.sampling])[0]

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
        return {a.seq.slot for a in self._prefilling + self._running + self._parked()}

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
            if not (self._prefilling or self._running or self._admissible() or self._control):
                self._wake.wait(timeout=0.5)
                self._wake.clear()

    def _turn(self) -> None:
        self._apply_cancellations()
        self._apply_control()
        self._admit()
        if self._prefilling:
            self._prefill_turn()
        if self._running:
            self._decode_step()

    def _admissible(self) -> bool:
        with self._lock:
            return bool(self._waiting) and self._slot_available(self._members(self._waiting[0][0]))

    def _slot_available(self, need: int = 1) -> bool:
        return self.prefix_cache.available() >= need

    def _publish(self) -> None:
        now = time.monotonic()
        if now - self._published < 0.02 and (self._prefilling or self._running):
            return   # while busy, at most 50 times a second (the slot table walks every sequence)
        self._published = now
        cache = self.session.cache
        slots = [{"id": i, "state": "free", "n_tokens": 0} for i in range(self.max_sequences)]
        for a in self._prefilling + self._running + self._parked():
            slots[a.seq.slot] = {"id": a.seq.slot, "state": "busy", "n_tokens": a.seq.length}
        for s in self.prefix_cache.kept:
            slots[s.slot] = {"id": s.slot, "state": "cached", "n_tokens": s.length}
        with self._lock:
            self._stats.update(queue_depth=len(self._waiting),
                               sequences_active=len(self._prefilling) + len(self._running),
                               sequences_cached=len(self.prefix_cache), kv_bytes_used=cache.memory_used)
            self._slots = slots

    # ---- finishing
    def _finish(self, a: _Active, reason: str, error: str | None = None, keep: bool = True) -> None:
        for group in (self._prefilling, self._running):
            if a in group:
                group.remove(a)
        if self.speculation is not None:
            self.speculation.release(a)
        if a.followers:
            self._release_followers(a, reason, error)
        held = self._hold_for_remote_decode(a, reason)   # before the sequence is kept or freed
        self.prefix_cache.release(a.seq, keep and a.req.images is None)   # an image prompt's KV: not reused
        with self._lock:
            self._admitted -= 1
        a.handle.emit(Finished(reason, len(a.req.prompt), a.cached, a.generated, error, held))

    def _hold_for_remote_decode(self, a: _Active, reason: str) -> dict | None:
        """vLLM's ``request_finished``: a do_remote_decode request capped at its one token (its prompt prefilled,
        the token sampled and pending) has its sequence held by the KV connector; the params naming it."""
        params = a.req.kv_transfer_params
        if self.connector is None or not params or not params.get("do_remote_decode") or reason != "length" \
                or a.generated != 1 or not a.seq.alive or a.seq.length != len(a.req.prompt):
            return None
        try:
            return self.connector.request_finished(self.session, a.seq, a.req.request_id)
        except Exception:   # noqa: BLE001 - the answer goes out without kv_transfer_params: the consumer prefills
            traceback.print_exc()
            return None

    def _fail_all(self, message: str) -> None:
        for a in list(self._prefilling) + list(self._running):
            self._finish(a, "error", message, keep=False)

    def _shutdown(self) -> None:
        for a in list(self._prefilling) + list(self._running):
            self._finish(a, "cancelled", keep=False)
        with self._lock:
            waiting, self._waiting = list(self._waiting), collections.deque()
            control, self._control = list(self._control), collections.deque()
        for h, req in waiting:
            for gh, greq in [(h, req)] + self._groups.pop(id(h), []):
                gh.emit(Finished("cancelled", len(greq.prompt), 0, 0))
        for fut, _ in control:
            fut.set_exception(RuntimeInputError("the engine is closed"))
        if self.speculation is not None:
            self.speculation.close()

    def _apply_cancellations(self) -> None:
        for a in [a for a in self._prefilling + self._running + self._parked() if a.handle.cancelled]:
            if not a.handle.finished:
                self._finish(a, "cancelled")
        with self._lock:
            gone = [(h, r) for h, r in self._waiting if h.cancelled]
            if gone:
                self._waiting = collections.deque((h, r) for h, r in self._waiting if not h.cancelled)
            # cancelling the first choice of a waiting n-choice request cancels all its choices
            gone = [m for h, r in gone for m in [(h, r)] + self._groups.pop(id(h), [])]
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
    def _take_slot(self) -> Sequence:
        """A new empty sequence: in a free slot, else in the slot of the least recently used kept sequence."""
        return self.prefix_cache.fresh()

    def _reuse(self, prompt: tuple[int, ...]) -> tuple[Sequence, int]:
        """A sequence to continue for ``prompt`` and how many of its positions are reused (running sequences'
        prompts are sources too)."""
        return self.prefix_cache.acquire(prompt, [a.seq for a in self._running if a.req.images is None])

    def _admit(self) -> None:
        while True:
            with self._lock:
                if not self._waiting or not self._slot_available(self._members(self._waiting[0][0])):
                    return
                handle, req = self._waiting.popleft()
                followers = self._groups.pop(id(handle), [])
                self._admitted += 1 + len(followers)
            if handle.cancelled:
                with self._lock:
                    self._admitted -= 1 + len(followers)
                for h, r in [(handle, req)] + followers:
                    h.emit(Finished("cancelled", len(r.prompt), 0, 0))
                continue
            a = None
            try:
                a = self._start(handle, req)
                for h, r in followers:
                    a.followers.append(self._parked_choice(h, r))
            except Exception as exc:   # noqa: BLE001 - this request fails, the others go on
                self._fail_admitted(a, [(handle, req)] + followers, f"{type(exc).__name__}: {exc}")

    def _parked_choice(self, handle: RequestHandle, req: GenerationRequest) -> _Active:
        """Another choice of a prompt being prefilled: its own (empty) sequence, forked when the prompt is done."""
        budget = min(req.max_tokens, self.ctx_len - len(req.prompt) + 1)
        params = req.sampling.resolved()
        return _Active(handle, req, self._take_slot(), [], budget, params,
                       picker=TokenPicker(params, req.prompt, self.session.vocab_size))

    def _start(self, handle: RequestHandle, req: GenerationRequest) -> _Active:
        params = req.sampling.resolved()
        picker = TokenPicker(params, req.prompt, self.session.vocab_size)
        if req.state is not None:
            self.prefix_cache.make_room()
            seq = self.session.import_state(req.state)
            budget = max(1, min(req.max_tokens, self.ctx_len - seq.length + 1))
            # a P/D consumer reports the prompt it loaded as cached (the in-process decode replica reports its own)
            a = _Active(handle, req, seq, [], budget, params, picker=picker,
                        cached=seq.length if req.kv_transfer_params else 0)
            if seq.pending is None:
                self.prefix_cache.remove(seq)
                raise RuntimeInputError("the handed-off state has no pending token")
            self.prefix_cache.held(seq)
            picker.accept(seq.pending)
            self._emit_token(a, seq.pending)
            return a
        fresh = req.images is not None or req.prompt_logprobs is not None   # neither reuses a cached prefix
        seq, cached = (self._take_slot(), 0) if fresh else self._reuse(req.prompt)
        budget = min(req.max_tokens, self.ctx_len - len(req.prompt) + 1)
        a = _Active(handle, req, seq, list(req.prompt[cached:]), budget, params, cached=cached, picker=picker)
        with self._lock:
            self._stats["prompt_tokens_reused"] += cached
        self._prefilling.append(a)
        return a

    # ---- decode (the prefill turn is :class:`~.prefill_turns.PrefillTurns`)
    def _first_token(self, a: _Active, logits) -> None:
        try:
            pick = self._select(a, logits)
        except Exception as exc:   # noqa: BLE001
            self._finish(a, "error", f"sampling failed: {exc}", keep=False)
            return
        a.seq.pending, a.seq.pending_emitted = pick.token, True
        self._emit_token(a, pick.token, pick)

    def _select(self, a: _Active, logits) -> Pick:
        """The per-row sampling step: ``a``'s logits pipeline (bias, penalties, its grammar's allowed-token mask
        when it has one (computed for constrained rows only), logprobs, temperature / top-k / top-p / min-p,
        select) on its row, for the cache position the token will occupy; the token enters the row's history and
        advances its grammar."""
        c = a.req.constraint
        allowed = None if c is None else c.allowed(logits.shape[-1])
        pick = a.picker.pick(logits, a.seq.length, top_logprobs=a.req.logprobs, allowed=allowed)
        if c is not None:
            c.advance(pick.token)
        a.picker.accept(pick.token)
        return pick

    def _emit_token(self, a: _Active, tok: int, pick: Pick | None = None) -> None:
        """Account one generated token; finish the request or (re)enter it into the running set."""
        a.generated += 1
        a.last = tok
        if tok in a.req.stop_token_ids:
            self._finish(a, "stop")
            return
        a.handle.emit(TokenOut(tok) if pick is None or pick.logprob is None else
                      TokenOut(tok, pick.logprob, pick.top))
        if a.generated >= a.budget:
            self._finish(a, "length")
            return
        if a not in self._running:
            self._running.append(a)

    def _decode_step(self) -> None:
        if self.speculation is not None:
            self._speculative_step()
            return
        if self.prefix_cache.low_rows:
            self._lower_top_row()
        batch = list(self._running)
        t0 = time.perf_counter()
        try:
            out = self.session.decode([(a.seq, a.last) for a in batch])
        except Exception as exc:   # noqa: BLE001 - the step failed for all of them
            for a in batch:
                self._finish(a, "error", f"decode failed: {exc}", keep=False)
            return
        self._decode_s = self._average(self._decode_s, time.perf_counter() - t0)
        with self._lock:
            self._stats["decode_steps"] += 1
        for a in batch:
            try:
                pick = self._select(a, out[a.seq])
            except Exception as exc:   # noqa: BLE001
                self._finish(a, "error", f"sampling failed: {exc}", keep=False)
                continue
            a.seq.pending, a.seq.pending_emitted = pick.token, True
            self._emit_token(a, pick.token, pick)

    def _lower_top_row(self) -> None:
        """Lock step runs every row up to the highest one fed: the running sequence in that row moves down into a
        row no request holds (:meth:`~qeff_kv.runtime.memory.prefix_cache.PrefixCache.lower`: its rows move, exchanged
        with a kept sequence's) when it has at least :data:`LOWER_MIN_LEFT` tokens left to make; at most one move a step."""
        top = max(self._running, key=lambda a: a.seq.slot)
        if top.budget - top.generated >= LOWER_MIN_LEFT:
            self.prefix_cache.lower(top.seq)

    def _speculative_step(self) -> None:
        """The decode step through :attr:`speculation`: each sequence gets one or more tokens, each emitted as
        its own event (a stop token or the budget ends the run where plain decoding would have ended)."""
        from qeff_kv.serve.engine.speculative_step import Row

        batch = list(self._running)
        rows = [Row(a, a.seq, a.last, a.params, a.budget - a.generated, a.req.stop_token_ids) for a in batch]
        t0 = time.perf_counter()
        try:
            runs = self.speculation.step(rows)
        except Exception as exc:   # noqa: BLE001 - the step failed for all of them
            for a in batch:
                self._finish(a, "error", f"decode failed: {exc}", keep=False)
            return
        self._decode_s = self._average(self._decode_s, time.perf_counter() - t0)
        with self._lock:
            self._stats["decode_steps"] += 1
        for a, run in zip(batch, runs):
            a.seq.pending, a.seq.pending_emitted = run[-1], True
            for tok in run:
                self._emit_token(a, tok)
                if a.handle.finished:
                    break

    # ---- slots
    def _slot_action(self, slot: int, action: str, path) -> dict:
        from qeff_kv.serve.engine import slots as slots_mod

        return slots_mod.run(self, slot, action, Path(path) if path is not None else None)
