"""The HTTP app: OpenAI's routes over an :class:`~qeff_kv.serve.engine.engine.Engine`, health, metrics, slots, a chat page.

The app tokenizes (the export's ``tokenizer.json``; chat requests through its chat template), submits token ids
to the engine, and answers with what :mod:`.responses` makes of the engine's events (text deltas, choices, server-sent
events). It never runs the model: whether the engine is the local scheduler or the disaggregated one makes no
difference here. Every error is answered in OpenAI's shape (:mod:`~qeff_kv.serve.wire.openai_io`).
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

from qeff_kv.errors import QeffKvError
from qeff_kv.serve.http import discovery, embeddings_api, http_errors, openai_responses
from qeff_kv.serve.http.bodies import DEFAULT_MAX_REQUEST_BYTES, BodyLimit, check_text_fits, encode_text, read_json, text_limit
from qeff_kv.serve.http.choices import Logprobs, TokenText, choice_samplings, max_tokens_of, sampling_of
from qeff_kv.serve.engine.defaults import SamplingDefaults
from qeff_kv.serve.http.discovery import check_chat_size
from qeff_kv.serve.http.drain import DrainGate
from qeff_kv.serve.engine.engine import Engine, GenerationRequest
from qeff_kv.serve.http.images import has_images, image_request
from qeff_kv.serve.http.metrics import Metrics
from qeff_kv.serve.wire.openai_io import APIError, ModelNames, Params, bad, parse
from qeff_kv.serve.cluster.pd import KVAsk, answer_field, prepare as prepare_kv
from qeff_kv.serve.http.prefill import Turn, parse_turn, render as render_chat
from qeff_kv.serve.http.responses import Run, choice, collect, sse, usage
from qeff_kv.serve.structured.structured_io import Constraints, parse_structured
from qeff_kv.serve.structured.tool_io import ToolRequest, ToolStream, ToolSupport, parse_tools

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
    tool_names: tuple = ()        # the names of the request's tools (calls to others are text)
    kv: KVAsk | None = None       # vLLM's P/D protocol (serve/pd.py): a producer's ask, a consumer's loaded state
    images: object = None         # a vision-language prompt's images (serve/images.py), or None
    lora: tuple | None = None     # the LoRA adapter and scale it runs with (serve/engine/lora.py), or None: the base


@dataclass
class TextFacts:
    """What the frontend needs to turn text into token ids and back."""

    tokenizer: object                 # tokenizers.Tokenizer
    chat_template: object | None = None   # qeff_kv.runtime.text.chat.ChatTemplate, or None: chat requests refused
    eos_token_ids: tuple[int, ...] = ()


def create_app(engine: Engine, *, text: TextFacts, api_key: str | None = None, state_dir: str | Path | None = None,
               registry=None, defaults: SamplingDefaults | None = None, max_n: int = 1,
               allowed_origins: list[str] | None = None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               drain=None, media_path: str | None = None, max_image_pixels: int | None = None,
               model_aliases=(), accept_any_model_name: bool = False) -> FastAPI:
    """The FastAPI app serving ``engine``. ``registry``: a prometheus ``CollectorRegistry`` (default: a new one).
    ``defaults``: the sampling a request leaves out (default: OpenAI's); ``max_n``: the largest ``n`` accepted;
    ``allowed_origins``: browser origins allowed by CORS (None: no CORS headers); ``max_request_bytes``: larger
    request bodies get a 413 before they are read (:mod:`.bodies`); ``drain``: a :class:`~.drain.Drain` (SIGTERM
    answers new requests 503 and lets running ones finish); ``media_path``: the folder ``image_url`` file URLs may
    name (:mod:`.images`; None: data: URLs only); ``max_image_pixels``: the most pixels of one image (None: the
    default of :mod:`.images`); ``model_aliases``, ``accept_any_model_name``: the names requests may give besides
    the engine's (:class:`~qeff_kv.serve.wire.openai_io.ModelNames`)."""
    app = FastAPI(title="qeff-kv", docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False)
    app.add_middleware(BodyLimit, limit=max_request_bytes, respond=http_errors.send_error)
    if drain is not None:
        app.add_middleware(DrainGate, drain=drain)
    discovery.add_cors(app, allowed_origins)
    front = _Frontend(app, engine, text, api_key=api_key, state_dir=state_dir, registry=registry,
                      defaults=defaults if defaults is not None else SamplingDefaults(), max_n=max_n)
    front.media_path, front.max_image_pixels = media_path, max_image_pixels
    front.names = app.state.model_names = ModelNames(engine.model_name, tuple(model_aliases), accept_any_model_name)
    app.state.private_paths = http_errors.server_paths(engine, text, state_dir, media_path)
    http_errors.install(app)
    _add_plain_routes(app, front)
    discovery.add_token_routes(app, engine=engine, text=text, auth=front.auth, json_body=read_json,
                               tool_support=front.tools)
    discovery.add_lora_routes(app, engine=engine, auth=front.auth, json_body=read_json)
    _add_slot_routes(app, front)
    _add_generation_routes(app, front)
    discovery.alias_without_v1(app)   # last: every /v1 route also without the prefix
    return app


class _Frontend:
    """What the routes share: the engine, the text facts, the sampling defaults, the API key check, the metrics,
    and the generation path (check, render and tokenize; submit; answer or stream)."""

    #: the folder image_url file URLs may name (serve/images.py); None: data: URLs only
    media_path: str | None = None
    #: --max-image-pixels (serve/images.py); None: its default
    max_image_pixels: int | None = None

    def __init__(self, app: FastAPI, engine: Engine, text: TextFacts, *, api_key: str | None,
                 state_dir: str | Path | None, registry, defaults: SamplingDefaults, max_n: int):
        self.app, self.engine, self.text, self.api_key = app, engine, text, api_key
        self.defaults, self.max_n = defaults, max_n
        self.token_text = TokenText(text.tokenizer)
        self.metrics = Metrics(engine, registry)
        app.state.engine, app.state.metrics, app.state.text = engine, self.metrics, text
        #: prompt text longer than this cannot fit the context: refused before it is tokenized (None: no such check)
        app.state.text_limit = text_limit(text.tokenizer, engine.ctx_len)
        self.created = int(time.time())
        self.state_dir = Path(state_dir) if state_dir is not None else None
        self.background: set[asyncio.Task] = set()
        self.constraints = Constraints(text.tokenizer, text.eos_token_ids)
        self.constraints.build()   # now, before the server listens: no request's compile time pays for it
        app.state.constraints = self.constraints
        self._tool_support: ToolSupport | None = None   # made on first use (it renders the template once)

    def tools(self) -> ToolSupport:
        if self._tool_support is None:
            self._tool_support = ToolSupport(self.text.tokenizer, self.text.chat_template)
        return self._tool_support

    def auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        given = header[7:].strip() if header[:7].lower() == "bearer " else ""
        if not hmac.compare_digest(given.encode(), self.api_key.encode()):
            raise APIError("invalid or missing API key (Authorization: Bearer KEY)", status=401,
                           code="invalid_api_key")

    def model_card(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "qeff-kv",
                "root": self.engine.model_name, "parent": None, "max_model_len": self.engine.ctx_len,
                "sampling_defaults": self.defaults.shown(), "max_n": self.max_n,
                "kv_cache_dtype": getattr(self.engine, "kv_cache_dtype", None)}

    def model_cards(self) -> list[dict]:
        """The served model under each of its names (an alias as its own entry, as vLLM lists them), then each LoRA
        adapter (vLLM's entries: ``parent`` the served model)."""
        return [self.model_card(n) for n in self.names.listed] + discovery.adapter_cards(self.engine, self.created)

    def reported(self, p: Params) -> str:
        """The ``model`` an answer to ``p`` carries (:meth:`~qeff_kv.serve.wire.openai_io.ModelNames.reported`)."""
        return self.names.reported(p.model, discovery.adapter_names(self.engine))

    # ------------------------------------------------------------------------------------ generation
    def prompt_ids(self, p: Params, tools: ToolRequest | None = None, turn: Turn = Turn()) -> list[int]:
        text, ctx_len = self.text, self.engine.ctx_len
        if p.messages is not None:
            if text.chat_template is None:
                raise bad("this model has no chat template; use /v1/completions", "messages")
            try:
                messages, listed = self.tools().prompt(p.messages, tools)
                rendered = render_chat(text.chat_template, messages, turn, listed)
            except QeffKvError as exc:   # naming the template by its file name, not the server's folder
                source = str(getattr(text.chat_template, "source", "") or "")
                msg = str(exc).replace(source, Path(source).name) if source else str(exc)
                raise bad(msg, "messages") from None
            check_text_fits(rendered, self.app.state.text_limit, ctx_len, "messages")
            return encode_text(text.tokenizer, rendered, add_special_tokens=False)
        if p.prompt_ids is not None:
            return p.prompt_ids
        check_text_fits(p.prompt_text, self.app.state.text_limit, ctx_len, "prompt")
        return encode_text(text.tokenizer, p.prompt_text)

    def prepare(self, body, chat: bool) -> _Prepared:
        """Check, render and tokenize a request, its structured-output field and tools (in a worker thread: none of
        it runs on the event loop)."""
        if chat and isinstance(body, dict):
            check_chat_size(body.get("messages"), self.app.state.text_limit, self.engine.ctx_len)
        adapters = discovery.adapter_names(self.engine)
        p = parse(body, chat=chat, model_name=self.names, ctx_len=self.engine.ctx_len, max_n=self.max_n,
                  kv_role=getattr(getattr(self.engine, "connector", None), "role", None), adapters=adapters)
        lora = discovery.request_lora(self.engine, p.model if p.model in adapters else None, body.get("lora"))
        spec, field = parse_structured(body)
        tools = _tool_request(body, chat, spec)
        parser = self.tools().parser if tools is not None else None
        if tools is not None and tools.forced:
            spec, field = tools.grammar(parser), "tool_choice"
        check_logit_bias(p, self.engine)
        turn, images = parse_turn(body, p.messages) if chat else Turn(), None
        if chat and has_images(p.messages):   # the export's processor and vision stage, as generate --image runs them
            ids, images = image_request(self.engine, p.messages, media_path=self.media_path, tools=tools,
                                        generation_prompt=turn.add_generation_prompt,
                                        kv_transfer=p.kv_transfer_params is not None,
                                        max_image_pixels=self.max_image_pixels)
        else:
            ids = self.prompt_ids(p, tools, turn)
        names = tuple(t["function"]["name"] for t in tools.tools) if tools is not None else ()
        return _Prepared(p, ids, spec, field, parser, names,
                         prepare_kv(self.engine, p, ids, structured=spec is not None, lora=lora), images, lora)

    def submit(self, p: Params, ids: list[int], rid: str, param: str, constraint=None, kv: KVAsk | None = None,
               images=None, lora=None) -> list:
        """The request's choices submitted: one handle per choice (``n``)."""
        engine = self.engine
        if len(ids) > engine.ctx_len:
            raise bad(f"the prompt has {len(ids)} tokens; the model's context holds {engine.ctx_len}", param,
                      "context_length_exceeded")
        try:
            first = sampling_of(p, self.defaults)
        except QeffKvError as exc:
            raise bad(str(exc)) from None
        req = GenerationRequest(
            request_id=rid, prompt=tuple(ids), max_tokens=max_tokens_of(p, self.defaults), sampling=first,
            stop_token_ids=frozenset() if p.ignore_eos else frozenset(self.text.eos_token_ids),
            logprobs=p.logprobs, constraint=constraint, state=kv.state if kv is not None else None,
            kv_transfer_params=kv.params if kv is not None else None, images=images,
            prompt_logprobs=p.logprobs if p.echo else None, lora=lora)
        with http_errors.refused_submission(self.metrics, param):
            if p.n == 1:
                return [engine.submit(req)]
            return engine.submit_n(req, choice_samplings(first, p.n))

    async def generate(self, request: Request, chat: bool):
        arrival = time.monotonic()
        self.auth(request)
        prep = await asyncio.to_thread(self.prepare, await read_json(request), chat)
        p, ids, parser = prep.params, prep.ids, prep.parser
        constraint = await self.constraints.compile(prep.spec, prep.field) if prep.spec is not None else None
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        if p.max_tokens == 0 and p.logprobs is None:   # echo of the prompt alone: nothing to run
            return echo_only(rid, p, ids, self.text.tokenizer, self.reported(p))
        handles = self.submit(p, ids, rid, "messages" if chat else "prompt", constraint, prep.kv, prep.images,
                              prep.lora)
        tokenizer = self.text.tokenizer
        echo = "" if not p.echo else p.prompt_text if p.prompt_text is not None else tokenizer.decode(ids)
        runs = [Run(request, h, p, len(ids), tokenizer, self.metrics, arrival, self.background,
                    logprobs=Logprobs(self.token_text, chat, 0 if p.echo else len(echo))
                    if p.logprobs is not None else None,
                    tools=ToolStream(parser, prep.tool_names) if parser is not None else None, grammar=constraint)
                for h in handles]
        model = self.reported(p)   # an adapter's requests answer with its name (vLLM)
        if p.stream:
            # the background task also runs when the client left before the stream started: the request is cancelled
            return StreamingResponse(sse(runs, rid, chat, created_at=int(time.time()), model=model, echo=echo),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"},
                                     background=BackgroundTask(lambda: [r.abandon() for r in runs]))
        contents = await asyncio.gather(*[collect(r) for r in runs])
        failed = [r for r in runs if r.error is not None]
        if failed:
            raise failed[0].error_object()
        choices = [choice(i, echo + content, r, chat) for i, (r, content) in enumerate(zip(runs, contents))]
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": model, "choices": choices, "usage": usage(runs), **answer_field(self.engine, runs, prep.kv)}


# ============================================================================================ routes, by area
def _add_plain_routes(app: FastAPI, front: _Frontend) -> None:
    """Health, metrics, the chat page, the model list."""
    engine = front.engine

    @app.get("/health")
    async def health():
        why = engine.health()
        if why is not None:   # a load balancer reads the status; a person reads why
            raise APIError(f"unhealthy: {why}", status=503, type="server_error", code="unhealthy")
        return {"status": "ok", "model": engine.model_name, **engine.stats(),
                "sampling_defaults": front.defaults.shown(), "max_n": front.max_n}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(front.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/", response_class=HTMLResponse)
    async def page():
        return HTMLResponse(resources.files("qeff_kv.serve.http").joinpath("static/chat.html").read_text(encoding="utf-8"))

    @app.get("/v1/models")
    async def models(request: Request):
        front.auth(request)
        return {"object": "list", "data": front.model_cards()}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        front.auth(request)
        card = next((c for c in front.model_cards() if c["id"] == model_id), None)
        if card is None:
            served = " or ".join(map(repr, front.names.listed))
            raise APIError(f"the model {model_id!r} does not exist; this server serves {served}",
                           status=404, type="not_found_error", param="model", code="model_not_found")
        return card


def _add_slot_routes(app: FastAPI, front: _Frontend) -> None:
    """The slots API: list the slots; save, restore or erase one (files in ``--state-dir``)."""
    engine = front.engine

    @app.get("/slots")
    async def list_slots(request: Request):
        front.auth(request)
        try:   # llama-server's is_processing beside our state
            return [{**slot, "is_processing": slot.get("state") == "busy"} for slot in engine.slots()]
        except NotImplementedError as exc:
            raise APIError(str(exc), status=501, type="not_supported_error", code="slots_unsupported") from None

    @app.post("/slots/{slot_id}")
    async def slot_action(slot_id: str, request: Request, action: str | None = None):
        front.auth(request)
        if front.state_dir is None:
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
            path = front.state_dir / name
        try:
            return await asyncio.to_thread(engine.slot_action, int(slot_id), action, path)
        except NotImplementedError as exc:
            raise APIError(str(exc), status=501, type="not_supported_error", code="slots_unsupported") from None
        except QeffKvError as exc:
            raise bad(str(exc), "id_slot") from None


def _add_generation_routes(app: FastAPI, front: _Frontend) -> None:
    """OpenAI's completions, chat completions, responses (:mod:`.openai_responses`) and embeddings
    (:mod:`.embeddings_api`)."""

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await front.generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await front.generate(request, chat=True)

    @app.post("/v1/responses")
    async def responses(request: Request):
        return await openai_responses.respond(front, request)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        return await embeddings_api.respond(front, request)


def echo_only(rid: str, p: Params, ids: list[int], tokenizer, model: str):
    """``max_tokens: 0`` with ``echo`` and no logprobs: the prompt's text, nothing generated (streamed: one chunk)."""
    text = p.prompt_text if p.prompt_text is not None else tokenizer.decode(ids)
    body = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": i, "text": text, "logprobs": None, "finish_reason": "length"} for i in range(p.n)],
            "usage": {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}}
    if not p.stream:
        return body
    events = ["data: " + json.dumps({k: v for k, v in body.items() if k != "usage" or p.include_usage}) + "\n\n",
              "data: [DONE]\n\n"]
    return StreamingResponse(iter(events), media_type="text/event-stream")


def check_logit_bias(p: Params, engine) -> None:
    """``logit_bias`` ids inside the model's vocabulary (a 400 naming ``logit_bias``, not the prompt)."""
    vocab = getattr(engine, "vocab_size", None) or getattr(getattr(engine, "session", None), "vocab_size", None)
    outside = [t for t, _ in p.logit_bias if vocab and t >= vocab]
    if outside:
        raise bad(f"logit_bias: token id {outside[0]} is outside the model's vocabulary [0, {vocab})", "logit_bias")


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
