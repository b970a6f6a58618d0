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
   ones ``generate`` makes; what the turn returns is applied after it (a choice sent back to prefill its prompt
   itself joins the queue for the next turn);
4. runs **one** decode step for every running sequence together (``batch_index`` rows, or lock step on a graph
   without it: the session does both); with a :class:`~.speculation.Speculation` (``--speculative``), that step
   verifies each sequence's drafts and may give each several tokens, emitted one event each.

Token selection is one call per row, :meth:`.active.Active.select`: the row's
:class:`~qeff_kv.runtime.decoding.sampling.TokenPicker` (``logit_bias``, penalties, logprobs, temperature / top-k / top-p /
min-p, the seeded draw) on that row's logits, for the position the token will occupy; a row with nothing to adjust
and no logprobs takes the plain fast path. OpenAI's ``n`` prefills a prompt once and forks it
(:mod:`.forks`).

Plan, then apply (vLLM v1's way): the collaborators hold no scheduler; each is a function or an object of its own
state whose methods take their inputs and return outcomes, and the scheduler alone applies them (emit, stop,
finish, enqueue), so a request's lifecycle reads in this file: :attr:`Scheduler.inbox` (:class:`~.inbox.Inbox`: the
waiting groups, control actions, counters and slot table shared with the submitting threads),
:attr:`Scheduler.turns` (:class:`~.prefill_turns.PrefillTurns`: the requests still prefilling; a turn yields each
chunk's outcome, the prompts it completed, applied before the next chunk is fed), :attr:`Scheduler.choices` (:class:`~.forks.ChoiceGroups`: ``n``'s parked choices; their fork
returns :class:`~.forks.Forks`) and :func:`~.decode_step.decode` (per row a token, a run or an error). A request's
record is an :class:`~.active.Active`, its budget decided once when it is admitted; every token goes through one
stop rule (:func:`~qeff_kv.runtime.decoding.stopping.check_stop`, in :meth:`Scheduler._emit`).

An embedding input (``GenerationRequest.embed``, ``/v1/embeddings``) is a request like a prompt: queued, admitted
as slots free, prefilled in the same turns' chunks between decode steps; its last chunk gives its vector (an
:class:`~.engine.Embedding` event) and it ends ``"stop"``. Unlike a prompt it starts from an empty sequence (no
reused prefix: the vector is the same bit for bit whatever the cache holds) and its sequence is freed, not kept:
it generates nothing that a prompt continues, and a batch of documents kept would evict, least recently used
first, the kept prompts that chats do reuse.

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

LoRA adapters (:mod:`.lora`): a request of an adapter (``GenerationRequest.lora``) runs in a sequence of that
adapter and reuses only prompts of that adapter at that scale; rows of different adapters decode in one step. An
adapter is loaded or unloaded as a control action between two turns.
"""

from __future__ import annotations

import threading
import traceback
from pathlib import Path

from qeff_kv.errors import RuntimeInputError
from qeff_kv.runtime.decoding.sampling import Pick
from qeff_kv.runtime.decoding.stopping import LENGTH, STOP, check_stop
from qeff_kv.runtime.memory.prefix_cache import PrefixCache
from qeff_kv.serve.engine.active import Active, admitted
from qeff_kv.serve.engine.decode_step import Failed, decode, to_lower
from qeff_kv.serve.engine.engine import (Embedding, Engine, Finished, GenerationRequest, RequestHandle, TokenOut,
                                         check_request)
from qeff_kv.serve.engine.forks import ChoiceGroups, choice_requests
from qeff_kv.serve.engine import lora as lora_mod
from qeff_kv.serve.engine.inbox import Inbox, free_slots
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
        deterministic: batch-invariant (``--deterministic``): solo decode steps, exact prompt reuse, whole prefill
            lengths (:mod:`~.decode_step`), so a request's tokens equal the same request alone.
    """

    def __init__(self, session, *, max_queue: int = 64, reuse_prompts: bool = True, model_name: str | None = None,
                 prefill_chunk: int | str | None = None, speculation=None, kv_events=None,
                 connector=None, adapters=None, deterministic: bool = False):
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 0:
            raise RuntimeInputError(f"max_queue must be a non-negative int, got {max_queue!r}")
        self.session = session
        #: the requests still prefilling and what each turn feeds
        self.turns = PrefillTurns(session, prefill_chunk, whole=deterministic)
        self.deterministic = deterministic
        #: prompt tokens fed per engine turn (the most, with ``"auto"``)
        self.prefill_chunk: int = self.turns.chunk
        if speculation is not None and speculation.session is not session:
            raise RuntimeInputError("the speculation drives another session than the scheduler's")
        self.speculation = speculation
        #: a KV connector (serve/kv_connector.py, ``--kv-role``): holds the sequences of do_remote_decode requests
        self.connector = connector
        self.model_name = model_name or session.files.folder.name
        self.ctx_len = session.ctx_len
        self.kv_cache_dtype = session.layout.kv_dtype   # /v1/models tells a router (int8: --kv-cache-dtype int8)
        self.max_sequences = session.max_sequences
        self.max_queue = max_queue
        self.reuse_prompts = reuse_prompts
        #: the kept sequences and the prompt-reuse decision (the engine thread is its only user)
        self.prefix_cache = PrefixCache(session, reuse=reuse_prompts, listener=kv_events,
                                        align=session.prefill_seq_len if deterministic else None)
        self.kv_events = kv_events
        #: the waiting groups, control actions, counters and slot table (shared with the submitting threads)
        self.inbox = Inbox(self.max_sequences, session.cache.memory_capacity)
        #: n's parked choices
        self.choices = ChoiceGroups()
        #: the LoRA adapters served (:class:`~.lora.AdapterTable`), or None
        self.adapters = adapters
        #: the requests decoding (the engine thread's)
        self.running: list[Active] = []
        self._thread = threading.Thread(target=self._loop, name="qeff-kv-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------------ Engine API
    def submit(self, req: GenerationRequest) -> RequestHandle:
        return self.submit_n(req, [req.sampling])[0]

    def submit_n(self, req: GenerationRequest, samplings: list) -> list[RequestHandle]:
        """``n`` choices of one prompt: the prompt is prefilled once (the first choice's), then copied into the
        other choices' slots (``Session.copy``) and each choice samples on with its own parameters; where the
        session cannot copy, each choice prefills the prompt itself (the same logits). Queued as one group
        (:func:`~.forks.choice_requests`)."""
        if not 1 <= len(samplings) <= self.max_sequences:
            raise RuntimeInputError(f"n must be in [1, {self.max_sequences}] (the sequences this server runs at "
                                    f"once), got {len(samplings)}")
        reqs = choice_requests(req, samplings)
        for r in reqs:
            _check(self, r, len(reqs))
        wake = self.inbox.wake
        handles = [RequestHandle(r.request_id, on_cancel=lambda h: wake.set()) for r in reqs]
        self.inbox.put(handles, reqs, self.max_queue)
        return handles

    def submit_batch(self, reqs: list[GenerationRequest]) -> list[RequestHandle]:
        """Several requests of one client request (``/v1/embeddings``' list of inputs), each queued as a request of
        its own (a sequence each, admitted as slots free), one after another in the queue; counted as one request
        against ``max_queue`` (a batch longer than the queue still runs); all or none are queued."""
        for r in reqs:
            _check(self, r, 1)
        wake = self.inbox.wake
        handles = [RequestHandle(r.request_id, on_cancel=lambda h: wake.set()) for r in reqs]
        self.inbox.put_each(handles, reqs, self.max_queue)
        return handles

    def stats(self) -> dict:
        out = self.inbox.stats()
        for extra in (self.speculation, self.kv_events, self.connector, self.adapters):
            if extra is not None:
                out.update(extra.stats())
        return out

    def health(self) -> str | None:
        if self.inbox.closed:
            return "the engine is closed"
        if not self._thread.is_alive():
            return "the engine thread has stopped"
        return None

    def slots(self) -> list[dict]:
        return self.inbox.slots()

    def busy_slots(self) -> set[int]:
        """Slots a request runs in (prefilling, decoding, or parked until its prompt is forked); engine thread."""
        return {a.seq.slot for a in _busy(self)}

    def slot_action(self, slot: int, action: str, path=None) -> dict:
        """Run a slot action (:func:`~.slots.run`) on the engine thread and wait for it."""
        return self.run_on_engine(("slot", slot, action, path)).result(timeout=120)

    def run_on_engine(self, what):
        """Queue ``what`` for the engine thread, between two turns: ``("slot", slot, action, path)``, ``("lora",
        "load" | "unload", name, adapter)`` (:meth:`~.engine.Engine.update_adapter`) or ``("call", fn)``
        (``fn(scheduler)``: tests, diagnostics); a ``Future`` of its result."""
        return self.inbox.run(what)

    def close(self) -> None:
        if not self.inbox.close():
            return
        self._thread.join(timeout=30)
        if self.kv_events is not None:
            self.kv_events.close()
        if self.connector is not None:
            self.connector.close()

    # ------------------------------------------------------------------------------------ engine thread
    def _loop(self) -> None:
        inbox = self.inbox
        while True:
            if inbox.closed:
                for a in list(self.turns.queue) + list(self.running):
                    self._finish(a, "cancelled", keep=False)
                _shutdown(self)
                return
            try:
                self._turn()
            except Exception as exc:   # noqa: BLE001 - the engine thread must survive anything
                for a in list(self.turns.queue) + list(self.running):
                    self._finish(a, "error", f"engine error: {type(exc).__name__}: {exc}", keep=False)
                traceback.print_exc()
            if inbox.due(bool(self.turns.queue or self.running)):
                inbox.publish(_table(self), sequences_active=len(self.turns.queue) + len(self.running),
                              sequences_cached=len(self.prefix_cache), kv_bytes_used=self.session.cache.memory_used)
            if not (self.turns.queue or self.running or inbox.admissible(self.prefix_cache.available())
                    or inbox.control):
                inbox.wake.wait(timeout=0.5)
                inbox.wake.clear()

    def _turn(self) -> None:
        """One turn: cancellations and control actions, admission, one prefill turn, one decode step, each
        collaborator's outcome applied here."""
        for a in [a for a in _busy(self) if a.handle.cancelled]:
            if not a.handle.finished:
                self._finish(a, "cancelled")
        for h, r in self.inbox.cancelled():
            h.emit(Finished("cancelled", len(r.prompt), 0, 0))
        self.inbox.apply_control(lambda what: _control(self, what))
        self._admit()
        if self.turns.queue:
            for fed in self.turns.feeds(bool(self.running)):   # each chunk's outcome applied before the next
                self.inbox.count("prefill_chunks", fed.runs)
                for a, event in fed.scored:
                    a.handle.emit(event)
                for a, error in fed.failed:
                    self._finish(a, "error", error, keep=False)
                for a, logits in fed.done:
                    if a.req.embed:   # its vector; its sequence freed (the module docstring says why)
                        a.handle.emit(Embedding(logits))
                        self._finish(a, STOP)
                        continue
                    if a.req.images is None:   # a scored prompt ran position by position: not reused exactly
                        self.prefix_cache.held(a.seq, a.req.prompt_logprobs is None)
                    self._prompt_done(a, logits)
        if self.running:
            self._decode()

    # ---- admission and prompt reuse
    def _admit(self) -> None:
        """Admit waiting groups in FIFO order while their sequences fit; a group that cannot start fails alone."""
        while True:
            group = self.inbox.next_group(self.prefix_cache.available())
            if group is None:
                return
            handle, req, others = group
            members = [(handle, req)] + others
            if handle.cancelled:
                self.inbox.left(len(members))
                for h, r in members:
                    h.emit(Finished("cancelled", len(r.prompt), 0, 0))
                continue
            a = None
            try:
                a = self._start(handle, req)
                for h, r in others:   # the other choices, parked in empty sequences until a's prompt is done
                    self.choices.park(a, admitted(h, r, self.prefix_cache.fresh(r.lora), ctx_len=self.ctx_len,
                                                  vocab_size=self.session.vocab_size))
            except Exception as exc:   # noqa: BLE001 - this request fails, the others go on
                # what was started (a and its parked choices) finishes through _finish, the rest is told here;
                # every member leaves the admitted count once
                error, started = f"{type(exc).__name__}: {exc}", set()
                if a is not None:
                    started = {id(a.handle)} | {id(f.handle) for f in self.choices.parked_on(a)}
                    self._finish(a, "error", error, keep=False)
                rest = [(h, r) for h, r in members if id(h) not in started]
                self.inbox.left(len(rest))
                for h, r in rest:
                    h.emit(Finished("error", len(r.prompt), 0, 0, error))

    def _start(self, handle: RequestHandle, req: GenerationRequest) -> Active:
        vocab = self.session.vocab_size
        if req.state is not None:
            self.prefix_cache.make_room()
            seq = self.session.import_state(req.state)
            try:   # the hand-off runs with the request's adapter (P/D: the producer ran it with the same)
                lora_mod.adopt(self.session, seq, req.lora)
            except Exception:
                self.prefix_cache.remove(seq)
                raise
            # a P/D consumer reports the prompt it loaded as cached (the in-process decode replica reports its own)
            a = admitted(handle, req, seq, ctx_len=self.ctx_len, vocab_size=vocab,
                         cached=seq.length if req.kv_transfer_params else 0)
            if seq.pending is None:
                self.prefix_cache.remove(seq)
                raise RuntimeInputError("the handed-off state has no pending token")
            self.prefix_cache.held(seq, exact=False)
            a.picker.accept(seq.pending)
            self._emit(a, seq.pending)
            return a
        if req.images is not None or req.prompt_logprobs is not None or req.embed:   # none reuses a cached prefix
            seq, cached = self.prefix_cache.fresh(req.lora), 0
        else:   # a kept sequence to continue and how many of its positions are reused (running prompts too)
            seq, cached = self.prefix_cache.acquire(req.prompt, [a.seq for a in self.running if a.req.images is None],
                                                    req.lora)
        a = admitted(handle, req, seq, ctx_len=self.ctx_len, vocab_size=vocab, todo=list(req.prompt[cached:]),
                     cached=cached)
        self.inbox.count("prompt_tokens_reused", cached)
        self.turns.enqueue(a)
        return a

    # ---- tokens
    def _prompt_done(self, a: Active, logits) -> None:
        """``a``'s prompt is prefilled (``logits``: after its last token): it ends if its budget is 0 (the prompt
        scored only), else its parked choices fork (each copied one selects its first token from ``logits``) and
        it selects its first token."""
        if check_stop(None, a.generated, a.budget, ()) is not None:
            self._finish(a, LENGTH)
            return
        forks = self.choices.fork(a, self.session, self.prefix_cache.copies)
        for f, reason, error in forks.ends:
            self._finish(f, reason, error, keep=False)
        for f in forks.refeed:
            self.turns.enqueue(f)
        for f in forks.copied:
            self.prefix_cache.held(f.seq)
            self._take(f, _select(f, logits))
        self._take(a, _select(a, logits))

    def _decode(self) -> None:
        """One decode step for every running request (:func:`~.decode_step.decode`), applied row by row."""
        if self.speculation is None and self.prefix_cache.low_rows and not self.deterministic:
            seq = to_lower(self.running)
            if seq is not None:
                self.prefix_cache.lower(seq)
        batch = list(self.running)
        step = decode(self.session, batch, self.speculation, solo=self.deterministic)
        if step.error is not None:
            for a in batch:
                self._finish(a, "error", step.error, keep=False)
            return
        self.turns.note_decode(step.seconds)
        self.inbox.count("decode_steps", 1)
        if self.adapters is not None:   # rows of different adapters in this one step
            self.adapters.note_step([a.req.lora for a in batch])
        for a, out in zip(batch, step.rows):
            if not isinstance(out, list):
                self._take(a, out)
                continue
            a.seq.pending, a.seq.pending_emitted = out[-1], True   # a speculative run: one event per token
            for tok in out:
                self._emit(a, tok)
                if a.handle.finished:
                    break

    def _take(self, a: Active, out: Pick | Failed) -> None:
        """``a``'s selected token becomes its pending token and is emitted; a failed selection ends ``a``."""
        if isinstance(out, Failed):
            self._finish(a, "error", out.error, keep=False)
            return
        a.seq.pending, a.seq.pending_emitted = out.token, True
        self._emit(a, out.token, out)

    def _emit(self, a: Active, tok: int, pick: Pick | None = None) -> None:
        """Account one generated token and apply the stop rule: finish the request (a stop token is counted, not
        emitted) or (re)enter it into the running set."""
        a.generated += 1
        a.last = tok
        why = check_stop(tok, a.generated, a.budget, a.req.stop_token_ids)
        if why == STOP:
            self._finish(a, STOP)
            return
        a.handle.emit(TokenOut(tok) if pick is None or pick.logprob is None else
                      TokenOut(tok, pick.logprob, pick.top))
        if why is not None:
            self._finish(a, why)
            return
        if a not in self.running:
            self.running.append(a)

    # ---- finishing
    def _finish(self, a: Active, reason: str, error: str | None = None, keep: bool = True) -> None:
        """End request ``a`` (``reason``: a finish reason); its sequence is kept for prompt reuse when ``keep``. Its
        parked choices end with it or prefill the prompt themselves (:meth:`~.forks.ChoiceGroups.leader_ended`)."""
        self.turns.drop(a)
        if a in self.running:
            self.running.remove(a)
        if self.speculation is not None:
            self.speculation.release(a)
        forks = self.choices.leader_ended(a, reason, error, self.inbox.closed)
        for f, why, err in forks.ends:
            self._finish(f, why, err, keep=False)
        for f in forks.refeed:
            self.turns.enqueue(f)
        held = _hold_for_remote_decode(self.connector, self.session, a, reason)   # before it is kept or freed
        # an image prompt's KV is not reused, an embedding's not kept (the module docstring)
        self.prefix_cache.release(a.seq, keep and a.req.images is None and not a.req.embed)
        self.inbox.left(1)
        a.handle.emit(Finished(reason, len(a.req.prompt), a.cached, a.generated, error, held))


def _shutdown(sched: Scheduler) -> None:
    """The engine is closed (its admitted requests ended): every waiting request ends ``cancelled``, every control
    action is refused."""
    waiting, control = sched.inbox.drain()
    for h, r in waiting:
        h.emit(Finished("cancelled", len(r.prompt), 0, 0))
    for fut in control:
        fut.set_exception(RuntimeInputError("the engine is closed"))
    if sched.speculation is not None:
        sched.speculation.close()


def _select(a: Active, logits) -> Pick | Failed:
    """``a``'s token from ``logits`` (:meth:`~.active.Active.select`), or why it could not be selected."""
    try:
        return a.select(logits)
    except Exception as exc:   # noqa: BLE001
        return Failed(f"sampling failed: {exc}")


def _busy(sched: Scheduler) -> list[Active]:
    """Every request holding a slot: prefilling, decoding, parked."""
    return sched.turns.queue + sched.running + sched.choices.all_parked(sched.turns.queue)


def _table(sched: Scheduler) -> list[dict]:
    """The slot table: each slot free, busy (a request holds it) or cached (a kept sequence)."""
    slots = free_slots(sched.max_sequences)
    for a in _busy(sched):
        slots[a.seq.slot] = {"id": a.seq.slot, "state": "busy", "n_tokens": a.seq.length}
    for s in sched.prefix_cache.kept:
        slots[s.slot] = {"id": s.slot, "state": "cached", "n_tokens": s.length}
    return slots


def _check(sched: Scheduler, r: GenerationRequest, n: int) -> None:
    """What ``sched`` refuses of one of ``n`` choices, before anything is queued."""
    check_request(r, ctx_len=sched.ctx_len, vocab_size=sched.session.vocab_size,
                  constraint_refused=None if sched.speculation is None else
                  "structured output and forced tool calls are not supported with --speculative")
    if sched.speculation is not None and (r.sampling.adjusts or r.logprobs is not None):
        raise RuntimeInputError("logprobs, logit_bias and penalties are not supported with --speculative")
    if r.prompt_logprobs is not None:
        if n > 1:
            raise RuntimeInputError("prompt logprobs go with one choice (n = 1)")
        if r.images is not None:   # its image rows are fed in one call: no row per position
            raise RuntimeInputError("prompt logprobs are not computed for a prompt with images")
    if r.lora is not None:
        sched.session.lora.get(r.lora[0])   # a one-line AdapterError when it is not loaded


def _control(sched: Scheduler, what):
    """A control action on the engine thread (:meth:`Scheduler.run_on_engine`)."""
    if what[0] == "slot":
        from qeff_kv.serve.engine import slots as slots_mod

        slot, action, path = what[1:]
        return slots_mod.run(sched.session, sched.prefix_cache, sched.busy_slots(), slot, action,
                             Path(path) if path is not None else None)
    if what[0] == "lora":   # an adapter loaded or unloaded between two turns
        verb, name, adapter = what[1:]
        if verb == "load":
            return lora_mod.load(sched.session, sched.adapters, name, adapter)
        requests = [a.req for a in _busy(sched)] + sched.inbox.waiting_requests()
        return lora_mod.unload(sched.session, sched.adapters, sched.prefix_cache, requests, name)
    if what[0] == "call":   # a function of the scheduler, run between two turns (tests, diagnostics)
        return what[1](sched)
    raise RuntimeInputError(f"unknown engine action {what[0]!r}")


def _hold_for_remote_decode(connector, session, a: Active, reason: str) -> dict | None:
    """vLLM's ``request_finished``: a do_remote_decode request capped at its one token (its prompt prefilled, the
    token sampled and pending) has its sequence held by the KV ``connector``; the params naming it."""
    params = a.req.kv_transfer_params
    if connector is None or not params or not params.get("do_remote_decode") or reason != LENGTH \
            or a.generated != 1 or not a.seq.alive or a.seq.length != len(a.req.prompt):
        return None
    try:
        return connector.request_finished(session, a.seq, a.req.request_id)
    except Exception:   # noqa: BLE001 - the answer goes out without kv_transfer_params: the consumer prefills
        traceback.print_exc()
        return None
