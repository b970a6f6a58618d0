"""What the HTTP frontend talks to: an :class:`Engine` takes token-level requests and streams tokens back.

The frontend (:mod:`qeff_kv.serve.http.app`) tokenizes, applies the chat template, detokenizes and matches stop
strings; an engine sees token ids only. Two engines implement this interface: the local
:class:`qeff_kv.serve.engine.scheduler.Scheduler` (one engine thread owning a :class:`~qeff_kv.runtime.Session`) and
the Ray-based disaggregated engine (:mod:`qeff_kv.serve.cluster.disagg`). The frontend must not care which one runs.

Events of a request, in order: zero or more :class:`TokenOut`, then exactly one :class:`Finished`. A stop
token (``stop_token_ids``) ends the request with ``finish_reason == "stop"``; it is counted in
``completion_tokens`` but not emitted as a :class:`TokenOut` (it has no text).

Engine threads hand events over with :meth:`RequestHandle.emit`, which is thread-safe: a consumer iterates
either from an asyncio loop (``async for ev in handle``; the events cross threads with
``loop.call_soon_threadsafe``) or from a plain thread (:meth:`RequestHandle.iter_sync`).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Union

from qeff_kv.errors import QeffKvError, QueueFullError, RuntimeInputError  # noqa: F401  (re-exported for engines)
from qeff_kv.runtime.decoding.sampling import MAX_TOP_LOGPROBS, SamplingParams
from qeff_kv.runtime.decoding.stopping import context_room

if TYPE_CHECKING:  # pragma: no cover
    from qeff_kv.runtime.memory.state_file import KVState

FINISH_REASONS = ("stop", "length", "cancelled", "error")


@dataclass(frozen=True)
class GenerationRequest:
    """One request as an engine sees it (token ids; the frontend did the text).

    ``max_tokens``: at most this many generated tokens (>= 1, or 0 with ``prompt_logprobs``: the prompt scored
    only; None: as many as the context leaves); an engine may end earlier at its capacity, with
    ``finish_reason == "length"`` (the budget: :func:`~qeff_kv.runtime.decoding.stopping.token_budget`). ``state``: disaggregated serving: a sequence already prefilled by a prefill
    worker, admitted by ``session.import_state`` (its pending token is the first generated token), not by
    prefill; ``prompt`` then still holds the prompt's ids (for accounting).
    """

    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int | None
    sampling: SamplingParams
    stop_token_ids: frozenset[int]
    state: "KVState | None" = None
    #: None: no logprobs; else each TokenOut carries the token's logprob and this many alternatives
    logprobs: int | None = None
    #: a grammar's state (serve/constrained.py TokenConstraint): the tokens are drawn within its mask
    constraint: object | None = None
    #: vLLM's P/D protocol (serve/pd.py): ``do_remote_decode`` asks the engine's KV connector to hold the prefilled
    #: sequence when the request ends; ``do_remote_prefill`` comes with ``state`` (the loaded hand-off)
    kv_transfer_params: dict | None = None
    #: a vision-language prompt's images (runtime.media.Images, made by the frontend): the prompt is prefilled in
    #: one call with them bound, reuses no cached prefix and is not kept for reuse (its KV depends on the images)
    images: object | None = None
    #: None: no prompt logprobs; else a :class:`PromptLogprobs` event (every prompt token's logprob and this many
    #: alternatives) comes before the first token; needs a graph that returns every position's logits
    #: (:mod:`qeff_kv.runtime.decoding.prompt_rows`)
    prompt_logprobs: int | None = None
    #: the LoRA adapter the request runs with and its scale (:mod:`.lora`; None: the base model): its sequence is
    #: that adapter's, and reuses only prompts of that adapter at that scale
    lora: tuple[str, float] | None = None
    #: an embedding input (``/v1/embeddings``): the prompt is prefilled as any prompt (queued, in the turns'
    #: chunks) and its last token's final hidden state comes back as one :class:`Embedding` event; nothing is
    #: generated (``max_tokens`` 0), the request ends ``"stop"``
    embed: bool = False


@dataclass(frozen=True)
class Embedding:
    """An embedding request's vector: the last prompt token's final hidden state, L2-normalised, ``[hidden]``
    float32 (:func:`qeff_kv.runtime.embeddings.pooled`)."""

    vector: object


@dataclass(frozen=True)
class PromptLogprobs:
    """Logprobs of prompt tokens (one event per prefill chunk, in order): ``entries`` ``((token, logprob or None,
    ((token, logprob), ...)), ...)``; the prompt's first token has None (nothing precedes it). Raw model logprobs
    (``log_softmax`` of the logits; no penalties, bias or temperature)."""

    entries: tuple


@dataclass(frozen=True)
class TokenOut:
    """One generated token; with ``logprobs`` asked for, its logprob and the ``top`` alternatives (``((token id,
    logprob), ...)``), read from the logits it was selected from (:mod:`qeff_kv.runtime.decoding.sampling`)."""

    token: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Finished:
    """The last event of a request."""

    finish_reason: str          # "stop" | "length" | "cancelled" | "error"
    prompt_tokens: int
    cached_tokens: int          # prompt tokens taken from a kept sequence instead of being prefilled
    completion_tokens: int
    error: str | None = None
    #: a producer's answer in vLLM's P/D protocol: what names the state its KV connector holds
    kv_transfer_params: dict | None = None


Event = Union[TokenOut, Finished, PromptLogprobs, Embedding]


class RequestHandle:
    """A submitted request: its events, and :meth:`cancel`.

    Thread-safe. The engine calls :meth:`emit`; exactly one consumer reads the events, either with
    ``async for`` (from any asyncio loop) or with :meth:`iter_sync`. Events emitted before the consumer starts
    are kept and delivered first.
    """

    def __init__(self, request_id: str, on_cancel=None):
        self.request_id = request_id
        self.submitted_at = time.monotonic()
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._backlog: collections.deque[Event] = collections.deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._aqueue: asyncio.Queue | None = None
        self._cancelled = False
        self._finished = False
        self._on_cancel = on_cancel

    # ---- engine side
    @property
    def cancelled(self) -> bool:
        return self._cancelled

    @property
    def finished(self) -> bool:
        return self._finished

    def emit(self, event: Event) -> None:
        """Hand one event to the consumer (any thread). Events after the :class:`Finished` are dropped."""
        with self._lock:
            if self._finished:
                return
            if isinstance(event, Finished):
                self._finished = True
            if self._aqueue is not None:
                try:
                    self._loop.call_soon_threadsafe(self._aqueue.put_nowait, event)
                except RuntimeError:   # the consumer's loop is closed: nobody is listening any more
                    pass
            else:
                self._backlog.append(event)
                self._cond.notify_all()

    # ---- consumer side
    def cancel(self) -> None:
        """Ask the engine to stop this request and free its sequence (at its next turn). Thread-safe; idempotent."""
        if self._cancelled:
            return
        self._cancelled = True
        if self._on_cancel is not None:
            self._on_cancel(self)

    def __aiter__(self):
        return self._aiter()

    async def _aiter(self):
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._aqueue is not None:
                raise RuntimeError("a request's events have one consumer")
            self._loop = loop
            self._aqueue = asyncio.Queue()
            while self._backlog:
                self._aqueue.put_nowait(self._backlog.popleft())
        while True:
            ev = await self._aqueue.get()
            yield ev
            if isinstance(ev, Finished):
                return

    def iter_sync(self, timeout: float | None = None) -> Iterator[Event]:
        """The events, for a plain thread. ``timeout``: seconds to wait for each event (``TimeoutError``)."""
        while True:
            with self._cond:
                if not self._backlog:
                    if not self._cond.wait_for(lambda: bool(self._backlog), timeout):
                        raise TimeoutError(f"request {self.request_id}: no event within {timeout} s")
                ev = self._backlog.popleft()
            yield ev
            if isinstance(ev, Finished):
                return


def check_request(req, *, ctx_len: int, vocab_size: int | None, state_allowed: bool = True,
                  constraint_refused: str | None = None) -> None:
    """What every engine refuses at :meth:`Engine.submit`, before anything is queued (one line each): not a
    :class:`GenerationRequest`, ``max_tokens`` below 1, and for a prompt (no handed-off ``state``) an empty one,
    one longer than the context, or a token id outside the vocabulary; a ``constraint`` where the engine says why
    it cannot apply one (``constraint_refused``)."""
    if not isinstance(req, GenerationRequest):
        raise RuntimeInputError(f"submit takes a GenerationRequest, got {type(req).__name__}")
    least = 0 if req.prompt_logprobs is not None or req.embed else 1
    if req.max_tokens is not None and (isinstance(req.max_tokens, bool) or not isinstance(req.max_tokens, int)
                                       or req.max_tokens < least):
        raise RuntimeInputError(f"max_tokens must be an int >= {least} or None, got {req.max_tokens!r}")
    if req.logprobs is not None and (isinstance(req.logprobs, bool) or not isinstance(req.logprobs, int)
                                     or not 0 <= req.logprobs <= MAX_TOP_LOGPROBS):
        raise RuntimeInputError(f"logprobs must be an int in [0, {MAX_TOP_LOGPROBS}] or None, got {req.logprobs!r}")
    outside = [t for t, _ in req.sampling.logit_bias if vocab_size is not None and t >= vocab_size]
    if outside:
        raise RuntimeInputError(f"logit_bias: token id {outside[0]} is outside the vocabulary [0, {vocab_size})")
    if req.constraint is not None and constraint_refused:
        raise RuntimeInputError(constraint_refused)
    if req.state is not None:
        if not state_allowed:
            raise RuntimeInputError("the disaggregated engine prefills every request itself; give no state")
        return
    if not req.prompt:
        raise RuntimeInputError("the prompt is empty")
    if context_room(ctx_len, len(req.prompt)) < 1:   # not even its first new token fits
        raise RuntimeInputError(f"the prompt has {len(req.prompt)} tokens; the context holds {ctx_len}")
    bad = [t for t in req.prompt if isinstance(t, bool) or not isinstance(t, int) or t < 0
           or (vocab_size is not None and t >= vocab_size)]
    if bad:
        raise RuntimeInputError(f"token id {bad[0]!r} is outside the vocabulary [0, {vocab_size})")


class Engine(ABC):
    """Token-level generation for the HTTP frontend.

    Attributes: ``model_name`` (what ``/v1/models`` lists), ``ctx_len`` (positions a sequence may hold),
    ``max_sequences`` (sequences generated at once).
    """

    model_name: str
    ctx_len: int
    max_sequences: int
    #: the LoRA adapters served (:class:`~.lora.AdapterTable`), or None: a graph without adapter inputs
    adapters = None

    @abstractmethod
    def submit(self, req: GenerationRequest) -> RequestHandle:
        """Queue ``req``. Raises :class:`~qeff_kv.errors.QueueFullError` when the queue is full and
        :class:`~qeff_kv.errors.RuntimeInputError` for a request that cannot run (a prompt longer than the
        context, bad token ids, ``max_tokens < 1``)."""

    def submit_n(self, req: GenerationRequest, samplings: list[SamplingParams]) -> list[RequestHandle]:
        """``len(samplings)`` choices of one prompt (OpenAI's ``n``): one handle each, the i-th sampled with
        ``samplings[i]``, each giving the tokens ``req`` with that sampling gives alone. This default submits
        them one by one (each prompt prefilled); an engine that can fork a prefilled prompt overrides it. All or
        none are queued."""
        handles: list[RequestHandle] = []
        try:
            for i, sp in enumerate(samplings):
                handles.append(self.submit(dataclasses.replace(req, request_id=f"{req.request_id}-{i}", sampling=sp)))
        except Exception:
            for h in handles:
                h.cancel()
            raise
        return handles

    @abstractmethod
    def stats(self) -> dict:
        """At least ``queue_depth``, ``sequences_active``, ``kv_bytes_used``, ``prompt_tokens_reused``."""

    @abstractmethod
    def close(self) -> None:
        """Stop: every request not finished ends with ``finish_reason == "cancelled"``."""

    def health(self) -> str | None:
        """None when the engine can run requests, else why not (one line; ``/health`` answers 503 with it). Never
        blocks."""
        return None

    # ---- optional: LoRA adapters loaded and unloaded at run time (an engine without them answers 501)
    def update_adapter(self, verb: str, name: str, adapter=None):
        """``verb`` ``"load"`` (``adapter``: a PEFT folder read by :func:`.lora.read`; returns its
        :class:`~.lora.ServedAdapter`) or ``"unload"`` adapter ``name``, as a control action of the engine's thread
        between two turns (:func:`.lora.load`, :func:`.lora.unload`: refused while a request uses it). An engine
        without control actions (``run_on_engine``) loads adapters at start only: NotImplementedError."""
        run = getattr(self, "run_on_engine", None)
        if run is None:
            raise NotImplementedError(f"this engine ({type(self).__name__}) loads adapters at start only "
                                      "(--lora-modules)")
        return run(("lora", verb, name, adapter)).result(timeout=120)

    # ---- optional: slot state files (POST /slots/{id}); an engine without them answers 501
    def slot_action(self, slot: int, action: str, path=None) -> dict:
        """``action`` ``save`` | ``restore`` | ``erase`` on sequence slot ``slot`` (``path``: the state file)."""
        raise NotImplementedError(f"this engine ({type(self).__name__}) has no slot actions")

    def slots(self) -> list[dict]:
        """``[{"id", "state", "n_tokens"}]`` per sequence slot (empty where the engine has no such notion; an engine
        whose sequences are not in one slot table raises NotImplementedError: ``GET /slots`` answers 501)."""
        return []
