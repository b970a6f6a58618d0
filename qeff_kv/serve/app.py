"""The HTTP app: OpenAI's routes over an :class:`~qeff_kv.serve.engine.Engine`, health, metrics, slots, a chat page.

The app tokenizes (the export's ``tokenizer.json``; chat requests through its chat template), submits token ids
to the engine, and turns the engine's events back into text (:mod:`.text`: incremental detokenizer, stop
strings). It never runs the model: whether the engine is the local scheduler or the disaggregated one makes no
difference here. Every error is answered in OpenAI's shape (:mod:`.openai_io`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
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
from . import discovery, http_errors
from .bodies import DEFAULT_MAX_REQUEST_BYTES, BodyLimit, check_text_fits, encode_text, read_json, text_limit
from .choices import Logprobs, TokenText, choice_samplings, max_tokens_of, sampling_of
from .defaults import SamplingDefaults
from .drain import DrainGate, shutting_down
from .engine import Engine, Finished, GenerationRequest, TokenOut
from .metrics import Metrics
from .openai_io import APIError, Params, bad, parse
from .structured_io import Constraints, parse_structured
from .text import Detokenizer, StopMatcher
from .tool_io import ToolRequest, ToolStream, ToolSupport, calls_json, parse_tools

#: a client that stops reading is noticed within this many seconds even while no token comes
DISCONNECT_POLL_S = 0.5
_FILENAME = re.compile(r"^[A-Za-z0-9._-]{1,200}$")
_SLOT_ID = re.compile(r"[0-9]{1,9}")   # ASCII digits: \d also matches other scripts' digits


@dataclass
class _Prepared:
    """A request checked, rendered and tokenized off the event loop."""

    params: Params
    ids: list[int]
    spec: object = None           # the structured-output grammar (constrained.GrammarSpec), or None
    field: str | None = None      # the field it came from
    parser: object = None         # the tool-call parser, with tools


@dataclass
class TextFacts:
    """What the frontend needs to turn text into token ids and back."""

    tokenizer: object                 # tokenizers.Tokenizer
    chat_template: object | None = None   # qeff_kv.runtime.chat.ChatTemplate, or None: chat requests refused
    eos_token_ids: tuple[int, ...] = ()


def create_app(engine: Engine, *, text: TextFacts, api_key: str | None = None, state_dir: str | Path | None = None,
               registry=None, defaults: SamplingDefaults | None = None, max_n: int = 1,
               allowed_origins: list[str] | None = None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               drain=None) -> FastAPI:
    """The FastAPI app serving ``engine``. ``registry``: a prometheus ``CollectorRegistry`` (default: a new one).
    ``defaults``: the sampling a request leaves out (default: OpenAI's); ``max_n``: the largest ``n`` accepted;
    ``allowed_origins``: browser origins allowed by CORS (None: no CORS headers); ``max_request_bytes``: larger
    request bodies get a 413 before they are read (:mod:`.bodies`); ``drain``: a :class:`~.drain.Drain` (SIGTERM
    answers new requests 503 and lets running ones finish)."""
    app = FastAPI(title="qeff-kv", docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False)
    app.add_middleware(BodyLimit, limit=max_request_bytes, respond=http_errors.send_error)
    if drain is not None:
        app.add_middleware(DrainGate, drain=drain)
    defaults = defaults if defaults is not None else SamplingDefaults()
    token_text = TokenText(text.tokenizer)
    discovery.add_cors(app, allowed_origins)
    metrics = Metrics(engine, registry)
    app.state.engine, app.state.metrics, app.state.text = engine, metrics, text
    #: prompt text longer than this cannot fit the context: refused before it is tokenized (None: no such check)
    app.state.text_limit = text_limit(text.tokenizer, engine.ctx_len)
    created = int(time.time())
    state_dir = Path(state_dir) if state_dir is not None else None
    background: set[asyncio.Task] = set()
    constraints = Constraints(text.tokenizer, text.eos_token_ids)
    tool_support: list[ToolSupport] = []   # made on first use (it renders the template once)

    def _tools() -> ToolSupport:
        if not tool_support:
            tool_support.append(ToolSupport(text.tokenizer, text.chat_template))
        return tool_support[0]

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
        return {"status": "ok", "model": engine.model_name, **engine.stats(),
                "sampling_defaults": defaults.shown(), "max_n": max_n}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/", response_class=HTMLResponse)
    async def page():
        return HTMLResponse(resources.files("qeff_kv.serve").joinpath("static/chat.html").read_text(encoding="utf-8"))

    def _model_card() -> dict:
        return {"id": engine.model_name, "object": "model", "created": created, "owned_by": "qeff-kv",
                "max_model_len": engine.ctx_len, "sampling_defaults": defaults.shown(), "max_n": max_n}

    @app.get("/v1/models")
    async def models(request: Request):
        _auth(request)
        return {"object": "list", "data": [_model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        _auth(request)
        if model_id != engine.model_name:
            raise APIError(f"the model {model_id!r} does not exist; this server serves {engine.model_name!r}",
                           status=404, type="not_found_error", param="model", code="model_not_found")
        return _model_card()

    discovery.add_token_routes(app, engine=engine, text=text, auth=_auth, json_body=read_json)

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
    def _prompt_ids(p: Params, tools: ToolRequest | None = None) -> list[int]:
        tok = text.tokenizer
        if p.messages is not None:
            if text.chat_template is None:
                raise bad("this model has no chat template; use /v1/completions", "messages")
            try:
                messages, listed = _tools().prompt(p.messages, tools)
                rendered = text.chat_template.render(messages, add_generation_prompt=True, tools=listed)
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

    def _prepare(body, chat: bool) -> _Prepared:
        """Check, render and tokenize a request, its structured-output field and tools (in a worker thread: none of
        it runs on the event loop)."""
        p = parse(body, chat=chat, model_name=engine.model_name, ctx_len=engine.ctx_len, max_n=max_n)
        spec, field = parse_structured(body)
        tools = _tool_request(body, chat, spec)
        parser = _tools().parser if tools is not None else None
        if tools is not None and tools.forced:
            spec, field = tools.grammar(parser), "tool_choice"
        return _Prepared(p, _prompt_ids(p, tools), spec, field, parser)

    def _submit(p: Params, ids: list[int], rid: str, param: str, constraint=None) -> list:
        """The request's choices submitted: one handle per choice (``n``)."""
        if len(ids) > engine.ctx_len:
            raise bad(f"the prompt has {len(ids)} tokens; the model's context holds {engine.ctx_len}", param,
                      "context_length_exceeded")
        room = engine.ctx_len - len(ids) + 1
        try:
            first = sampling_of(p, defaults)
        except QeffKvError as exc:
            raise bad(str(exc)) from None
        req = GenerationRequest(
            request_id=rid, prompt=tuple(ids), max_tokens=max_tokens_of(p, defaults, room), sampling=first,
            stop_token_ids=frozenset() if p.ignore_eos else frozenset(text.eos_token_ids), logprobs=p.logprobs,
            constraint=constraint)
        try:
            if p.n == 1:
                return [engine.submit(req)]
            return engine.submit_n(req, choice_samplings(first, p.n))
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
        prep = await asyncio.to_thread(_prepare, await read_json(request), chat)
        p, ids, parser = prep.params, prep.ids, prep.parser
        constraint = await constraints.compile(prep.spec, prep.field) if prep.spec is not None else None
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        handles = _submit(p, ids, rid, "messages" if chat else "prompt", constraint)
        echo = "" if not p.echo else p.prompt_text if p.prompt_text is not None else text.tokenizer.decode(ids)
        runs = [_Run(request, h, p, len(ids), text.tokenizer, metrics, arrival, background,
                     logprobs=Logprobs(token_text, chat, len(echo)) if p.logprobs is not None else None,
                     tools=ToolStream(parser) if parser is not None else None)
                for h in handles]
        if p.stream:
            # the background task also runs when the client left before the stream started: the request is cancelled
            return StreamingResponse(_sse(runs, rid, chat, created_at=int(time.time()), model=engine.model_name,
                                          echo=echo),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"},
                                     background=BackgroundTask(lambda: [r.abandon() for r in runs]))
        contents = await asyncio.gather(*[_collect(r) for r in runs])
        failed = [r for r in runs if r.error is not None]
        if failed:
            raise failed[0].error_object()
        choices = [_choice(i, echo + content, r, chat) for i, (r, content) in enumerate(zip(runs, contents))]
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": engine.model_name, "choices": choices, "usage": _usage(runs)}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _generate(request, chat=True)

    return app


async def _within(awaitable, seconds: float):
    """``await awaitable``, ``asyncio.TimeoutError`` after ``seconds``: ``asyncio.timeout`` where there is one
    (Python 3.11: no task per wait, as ``wait_for`` makes before 3.12)."""
    if _timeout is None:
        return await asyncio.wait_for(awaitable, seconds)
    async with _timeout(seconds):
        return await awaitable


_timeout = getattr(asyncio, "timeout", None)


async def _collect(run: "_Run") -> str:
    return "".join([d async for d in run.deltas()])


def _choice(index: int, content: str, run: "_Run", chat: bool) -> dict:
    logprobs = run.logprobs.all() if run.logprobs is not None else None
    if not chat:
        return {"index": index, "text": content, "logprobs": logprobs, "finish_reason": run.finish_reason}
    message = {"role": "assistant", "content": content}
    if run.tools is not None:   # the calls parsed out of the text (the parser the template's facts chose)
        content, calls = run.tools.parser.parse(content)
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls_json(calls)
            run.finish_reason = "tool_calls"
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": run.finish_reason}


def _tool_request(body: dict, chat: bool, spec) -> ToolRequest | None:
    """The request's tools (chat only; not together with a structured-output field)."""
    if not chat:
        if body.get("tools") not in (None, []) or body.get("tool_choice") is not None:
            raise bad("tools go with /v1/chat/completions", "tools")
        return None
    tools = parse_tools(body)
    if tools is not None and spec is not None:
        raise bad("give either tools or a structured-output field (response_format...), not both; "
                  "or tool_choice \"none\"", "tools")
    return tools


def _usage(runs: list["_Run"]) -> dict:
    """One prompt, every choice's completion tokens."""
    usage = runs[0].usage()
    completion = sum(r.tokens for r in runs)
    return {**usage, "completion_tokens": completion, "total_tokens": usage["prompt_tokens"] + completion}


async def _merged(runs: list["_Run"]):
    """``(choice index, text delta or None at its end)`` from every choice's run, as they come."""
    if len(runs) == 1:   # one choice: its deltas as they are (no task and queue between them and the response)
        async with contextlib.aclosing(runs[0].deltas()) as deltas:
            try:
                async for delta in deltas:
                    yield 0, delta
            except Exception:   # noqa: BLE001 - as with a pump task: a failed run ends its choice, logged
                logging.getLogger(__name__).exception("request %s: its events failed", runs[0].handle.request_id)
        yield 0, None
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, run: "_Run") -> None:
        try:
            async for delta in run.deltas():
                await queue.put((i, delta))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.get_running_loop().create_task(pump(i, r)) for i, r in enumerate(runs)]
    try:
        for _ in range(len(runs)):
            while True:
                i, delta = await queue.get()
                yield i, delta
                if delta is None:
                    break
    finally:
        for t in tasks:
            t.cancel()


async def _sse(runs: list["_Run"], rid: str, chat: bool, *, created_at: int, model: str, echo: str = ""):
    """Server-sent events: one chunk per text delta of a choice, a last chunk per choice with its finish reason,
    optionally a usage chunk, then ``data: [DONE]``."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    # every chunk is this object with one choice: its JSON up to the choices list is encoded once, and per chunk
    # only the choice (the same text json.dumps gives for the whole object)
    head = json.dumps({"id": rid, "object": obj, "created": created_at, "model": model, "choices": []})[:-2]

    def chunk(i: int, content: str | dict | None, finish: str | None, first: bool = False) -> str:
        lp = runs[i].logprobs.take() if runs[i].logprobs is not None else None
        if lp is not None and not (lp.get("content") if chat else lp.get("tokens")):
            lp = None
        if chat:
            delta = content if isinstance(content, dict) else {} if content is None else {"content": content}
            if first:
                delta = {"role": "assistant", **delta}
            choice = {"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}
        else:
            choice = {"index": i, "text": content or "", "logprobs": lp, "finish_reason": finish}
        return "data: " + head + json.dumps(choice) + "]}\n\n"

    for i in range(len(runs)):
        if chat:
            yield chunk(i, "", None, first=True)
        elif echo:
            yield chunk(i, echo, None)
    async for i, delta in _merged(runs):
        tools = runs[i].tools
        if delta is not None:
            if tools is not None:   # text that may open a tool call is held until it is known not to
                delta = tools.feed(delta)
                if not delta:
                    continue
            yield chunk(i, delta, None)
        elif runs[i].error is None:
            if tools is not None:
                for piece in _tool_chunks(i, runs[i], chunk):
                    yield piece
            yield chunk(i, None, runs[i].finish_reason)
    failed = [r for r in runs if r.error is not None]
    if failed:
        yield "data: " + json.dumps(failed[0].error_object().body()) + "\n\n"
    elif runs[0].params.include_usage:
        yield "data: " + json.dumps({"id": rid, "object": obj, "created": created_at, "model": model,
                                     "choices": [], "usage": _usage(runs)}) + "\n\n"
    yield "data: [DONE]\n\n"


def _tool_chunks(i: int, run: "_Run", chunk):
    """The end of a streamed answer with tools: held content, then one ``delta.tool_calls`` chunk per call."""
    tail, calls = run.tools.finish()
    if tail:
        yield chunk(i, tail, None)
    for j, call in enumerate(calls_json(calls)):
        yield chunk(i, {"tool_calls": [{"index": j, **call}]}, None)
    if calls:
        run.finish_reason = "tool_calls"


class _Run:
    """One request's events turned into text deltas (stop strings applied), with timing metrics. With ``tools``
    (a :class:`~.tool_io.ToolStream`), special tokens are kept in the text (tool-call markers may be special)."""

    def __init__(self, request, handle, params: Params, prompt_tokens: int, tokenizer, metrics: Metrics,
                 arrival: float, background: set, logprobs: Logprobs | None = None, tools: ToolStream | None = None):
        self.request, self.handle, self.params = request, handle, params
        self.logprobs = logprobs
        self.tools = tools
        self.prompt_tokens = prompt_tokens
        self.detok = Detokenizer(tokenizer, skip_special_tokens=tools is None)
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
            if not self._queue.empty():   # no timer (nor, before Python 3.12, a task) for an event already here
                return self._queue.get_nowait()
            try:
                return await _within(self._queue.get(), DISCONNECT_POLL_S)
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
                    if self.logprobs is not None:
                        self.logprobs.add(ev)
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
