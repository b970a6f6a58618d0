"""The HTTP app: OpenAI's routes over an :class:`~qeff_kv.serve.engine.Engine`, health, metrics, slots, a chat page.

The app tokenizes (the export's ``tokenizer.json``; chat requests through its chat template), submits token ids
to the engine, and turns the engine's events back into text (:mod:`.text`: incremental detokenizer, stop
strings). It never runs the model: whether the engine is the local scheduler or the disaggregated one makes no
difference here. Every error is answered in OpenAI's shape (:mod:`.openai_io`).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import re
import time
import uuid
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.background import BackgroundTask

from ..errors import QeffKvError, QueueFullError, UnavailableError
from ..runtime.sampling import SamplingParams
from . import http_errors
from .bodies import DEFAULT_MAX_REQUEST_BYTES, BodyLimit, check_text_fits, encode_text, read_json, text_limit
from .drain import DrainGate, shutting_down
from .engine import Engine, Finished, GenerationRequest, TokenOut
from .metrics import Metrics
from .openai_io import APIError, Params, bad, parse
from .text import Detokenizer, StopMatcher

#: a client that stops reading is noticed within this many seconds even while no token comes
DISCONNECT_POLL_S = 0.5
_FILENAME = re.compile(r"^[A-Za-z0-9._-]{1,200}$")
_SLOT_ID = re.compile(r"[0-9]{1,9}")   # ASCII digits: \d also matches other scripts' digits


@dataclass
class TextFacts:
    """What the frontend needs to turn text into token ids and back."""

    tokenizer: object                 # tokenizers.Tokenizer
    chat_template: object | None = None   # qeff_kv.runtime.chat.ChatTemplate, or None: chat requests refused
    eos_token_ids: tuple[int, ...] = ()


def create_app(engine: Engine, *, text: TextFacts, api_key: str | None = None, state_dir: str | Path | None = None,
               registry=None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, drain=None) -> FastAPI:
    """The FastAPI app serving ``engine``. ``registry``: a prometheus ``CollectorRegistry`` (default: a new one);
    ``max_request_bytes``: larger request bodies get a 413 before they are read (:mod:`.bodies`); ``drain``: a
    :class:`~.drain.Drain` (SIGTERM answers new requests 503 and lets running ones finish)."""
    app = FastAPI(title="qeff-kv", docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False)
    app.add_middleware(BodyLimit, limit=max_request_bytes, respond=http_errors.send_error)
    if drain is not None:
        app.add_middleware(DrainGate, drain=drain)
    metrics = Metrics(engine, registry)
    app.state.engine, app.state.metrics, app.state.text = engine, metrics, text
    #: prompt text longer than this cannot fit the context: refused before it is tokenized (None: no such check)
    app.state.text_limit = text_limit(text.tokenizer, engine.ctx_len)
    created = int(time.time())
    state_dir = Path(state_dir) if state_dir is not None else None
    background: set[asyncio.Task] = set()

    # ------------------------------------------------------------------------------------ errors
    http_errors.install(app)

    def _auth(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        given = header[7:].strip() if header[:7].lower() == "bearer " else ""
        if not hmac.compare_digest(given.encode(), api_key.encode()):
            raise APIError("invalid or missing API key (Authorization: Bearer KEY)", status=401,
                           code="invalid_api_key")

    # ------------------------------------------------------------------------------------ plain routes
    @app.get("/health")
    async def health():
        why = engine.health()
        if why is not None:   # a load balancer reads the status; a person reads why
            raise APIError(f"unhealthy: {why}", status=503, type="server_error", code="unhealthy")
        return {"status": "ok", "model": engine.model_name, **engine.stats()}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/", response_class=HTMLResponse)
    async def page():
        return HTMLResponse(resources.files("qeff_kv.serve").joinpath("static/chat.html").read_text(encoding="utf-8"))

    @app.get("/v1/models")
    async def models(request: Request):
        _auth(request)
        return {"object": "list", "data": [{"id": engine.model_name, "object": "model", "created": created,
                                            "owned_by": "qeff-kv", "max_model_len": engine.ctx_len}]}

    # ------------------------------------------------------------------------------------ slots
    @app.get("/slots")
    async def list_slots(request: Request):
        _auth(request)
        return engine.slots()

    @app.post("/slots/{slot_id}")
    async def slot_action(slot_id: str, request: Request, action: str | None = None):
        _auth(request)
        if state_dir is None:
            raise APIError("slot actions need the server to be started with --state-dir", status=501,
                           type="not_supported_error", code="slots_disabled")
        if not _SLOT_ID.fullmatch(slot_id):
            raise bad(f"slot id must be a non-negative integer, got {slot_id!r}", "id_slot")
        if action not in ("save", "restore", "erase"):
            raise bad(f"action must be save, restore or erase, got {action!r}", "action")
        path = None
        if action != "erase":
            body = await read_json(request)
            name = body.get("filename") if isinstance(body, dict) else None
            if not isinstance(name, str) or not _FILENAME.fullmatch(name) or name in (".", "..") \
                    or name.endswith(".tokens.json"):
                raise bad(f"filename must be a plain file name (letters, digits, '.', '_', '-'; no path), got "
                          f"{name!r}", "filename")
            path = state_dir / name
        try:
            return await asyncio.to_thread(engine.slot_action, int(slot_id), action, path)
        except NotImplementedError as exc:
            raise APIError(str(exc), status=501, type="not_supported_error", code="slots_unsupported") from None
        except QeffKvError as exc:
            raise bad(str(exc), "id_slot") from None

    # ------------------------------------------------------------------------------------ generation
    def _prompt_ids(p: Params) -> list[int]:
        tok = text.tokenizer
        if p.messages is not None:
            if text.chat_template is None:
                raise bad("this model has no chat template; use /v1/completions", "messages")
            try:
                rendered = text.chat_template.render(p.messages, add_generation_prompt=True)
            except QeffKvError as exc:   # naming the template by its file name, not the server's folder
                source = str(getattr(text.chat_template, "source", "") or "")
                msg = str(exc).replace(source, Path(source).name) if source else str(exc)
                raise bad(msg, "messages") from None
            check_text_fits(rendered, app.state.text_limit, engine.ctx_len, "messages")
            return encode_text(tok, rendered, add_special_tokens=False)
        if p.prompt_ids is not None:
            return p.prompt_ids
        check_text_fits(p.prompt_text, app.state.text_limit, engine.ctx_len, "prompt")
        return encode_text(tok, p.prompt_text)

    def _prepare(body, chat: bool) -> tuple[Params, list[int]]:
        """Check, render and tokenize a request (in a worker thread: none of it runs on the event loop)."""
        p = parse(body, chat=chat, model_name=engine.model_name, ctx_len=engine.ctx_len)
        return p, _prompt_ids(p)

    def _submit(p: Params, ids: list[int], rid: str, param: str):
        if len(ids) > engine.ctx_len:
            raise bad(f"the prompt has {len(ids)} tokens; the model's context holds {engine.ctx_len}", param,
                      "context_length_exceeded")
        room = engine.ctx_len - len(ids) + 1
        req = GenerationRequest(
            request_id=rid, prompt=tuple(ids), max_tokens=min(p.max_tokens or room, room),
            sampling=SamplingParams(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, seed=p.seed),
            stop_token_ids=frozenset() if p.ignore_eos else frozenset(text.eos_token_ids))
        try:
            return engine.submit(req)
        except QueueFullError as exc:
            metrics.rejected()
            raise APIError(str(exc), status=429, type="rate_limit_error", code="queue_full") from None
        except UnavailableError as exc:
            metrics.rejected()
            raise APIError(str(exc), status=503, type="server_error", code="unavailable") from None
        except QeffKvError as exc:
            metrics.rejected()
            raise bad(str(exc), param) from None

    async def _generate(request: Request, chat: bool):
        arrival = time.monotonic()
        _auth(request)
        p, ids = await asyncio.to_thread(_prepare, await read_json(request), chat)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        handle = _submit(p, ids, rid, "messages" if chat else "prompt")
        run = _Run(request, handle, p, len(ids), text.tokenizer, metrics, arrival, background)
        if p.stream:
            # the background task also runs when the client left before the stream started: the request is cancelled
            return StreamingResponse(_sse(run, rid, chat, created_at=int(time.time()), model=engine.model_name),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"},
                                     background=BackgroundTask(run.abandon))
        pieces = [d async for d in run.deltas()]
        if run.error is not None:
            raise run.error_object()
        content = "".join(pieces)
        choice = ({"index": 0, "message": {"role": "assistant", "content": content}, "logprobs": None,
                   "finish_reason": run.finish_reason} if chat else
                  {"index": 0, "text": content, "logprobs": None, "finish_reason": run.finish_reason})
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": engine.model_name, "choices": [choice], "usage": run.usage()}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _generate(request, chat=True)

    return app


async def _sse(run: "_Run", rid: str, chat: bool, *, created_at: int, model: str):
    """Server-sent events: one chunk per text delta, a last chunk with the finish reason, optionally a usage chunk,
    then ``data: [DONE]``."""
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(content: str | None, finish: str | None, first: bool = False) -> str:
        if chat:
            delta = {} if content is None else {"content": content}
            if first:
                delta = {"role": "assistant", **delta}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": content or "", "logprobs": None, "finish_reason": finish}
        return "data: " + json.dumps({"id": rid, "object": obj, "created": created_at, "model": model,
                                      "choices": [choice]}) + "\n\n"

    first = True
    if chat:
        yield chunk("", None, first=True)
        first = False
    async for delta in run.deltas():
        yield chunk(delta, None, first)
        first = False
    if run.error is not None:
        yield "data: " + json.dumps(run.error_object().body()) + "\n\n"
    else:
        yield chunk(None, run.finish_reason)
        if run.params.include_usage:
            yield "data: " + json.dumps({"id": rid, "object": obj, "created": created_at, "model": model,
                                         "choices": [], "usage": run.usage()}) + "\n\n"
    yield "data: [DONE]\n\n"


class _Run:
    """One request's events turned into text deltas (stop strings applied), with timing metrics."""

    def __init__(self, request, handle, params: Params, prompt_tokens: int, tokenizer, metrics: Metrics,
                 arrival: float, background: set):
        self.request, self.handle, self.params = request, handle, params
        self.prompt_tokens = prompt_tokens
        self.detok = Detokenizer(tokenizer)
        self.stopper = StopMatcher(params.stop)
        self.metrics = metrics
        self.arrival = arrival
        self.finish_reason = "stop"
        self.error: str | None = None
        self.stopped_by_server = False    # the engine ended it without the client asking (shutdown)
        self.tokens = 0
        self.final: Finished | None = None
        self._queue: asyncio.Queue = asyncio.Queue()
        self._stop_hit = False
        task = asyncio.get_running_loop().create_task(self._pump())
        background.add(task)
        task.add_done_callback(background.discard)

    async def _pump(self) -> None:
        fin = None
        async for ev in self.handle:
            self._queue.put_nowait(ev)
            if isinstance(ev, Finished):
                fin = ev
        if fin is not None:   # metrics: what the client saw (a stop string is a "stop", not a cancellation)
            self.metrics.finished(Finished("stop", fin.prompt_tokens, fin.cached_tokens, self.tokens, fin.error)
                                  if self._stop_hit else fin)

    def abandon(self) -> None:
        """The response is over: a request still running has lost its client."""
        if not self.handle.finished:
            self.handle.cancel()

    def error_object(self) -> APIError:
        if self.stopped_by_server:
            return shutting_down()
        return APIError(f"generation failed: {self.error}", status=500, type="server_error")

    def usage(self) -> dict:
        cached = self.final.cached_tokens if self.final is not None else 0
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.tokens,
                "total_tokens": self.prompt_tokens + self.tokens,
                "prompt_tokens_details": {"cached_tokens": cached}}

    async def _next(self):
        while True:
            try:
                return await asyncio.wait_for(self._queue.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await self.request.is_disconnected():
                    self.handle.cancel()
                    return None

    async def deltas(self):
        last = None
        checked = time.monotonic()
        try:
            while True:
                ev = await self._next()
                if ev is None:
                    self.finish_reason = "cancelled"
                    return
                if isinstance(ev, TokenOut):
                    now = time.monotonic()
                    if not self.params.stream and now - checked > DISCONNECT_POLL_S:
                        # a non-streamed request: nothing is sent until the end, so look for a gone client now
                        # and then (a streamed one is watched by the response itself)
                        checked = now
                        if await self.request.is_disconnected():
                            self.handle.cancel()
                            self.finish_reason = "cancelled"
                            return
                    if last is None:
                        self.metrics.ttft.observe(now - self.arrival)
                    else:
                        self.metrics.itl.observe(now - last)
                    last = now
                    self.tokens += 1
                    out = self.stopper.feed(self.detok.add(ev.token))
                    if out:
                        yield out
                    if self.stopper.stopped:
                        self._stop_hit = True
                        self.handle.cancel()
                        self.finish_reason = "stop"
                        await self._drain()
                        return
                    continue
                # Finished
                self.final = ev
                self.tokens = max(self.tokens, ev.completion_tokens)
                tail = self.stopper.feed(self.detok.flush()) + self.stopper.flush()
                if tail:
                    yield tail
                if ev.finish_reason == "error":
                    self.error = ev.error or "unknown error"
                elif ev.finish_reason == "cancelled" and not self.handle.cancelled:
                    # the engine stopped it (closed while draining): an error the client sees, never a normal end
                    self.stopped_by_server = True
                    self.error = "the server is shutting down"
                self.finish_reason = {"length": "length"}.get(ev.finish_reason, "stop")
                return
        finally:
            if not self.handle.finished:
                self.handle.cancel()

    async def _drain(self) -> None:
        """After a stop string: wait (briefly) for the engine's Finished, for the cached-token count."""
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            try:
                ev = await asyncio.wait_for(self._queue.get(), max(0.01, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                return
            if isinstance(ev, Finished):
                self.final = ev
                return
