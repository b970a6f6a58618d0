"""Discovery and browser access: ``/tokenize`` and ``/detokenize`` (vLLM's shapes), CORS, and the LoRA adapters served
(``/v1/models`` entries, vLLM's load and unload routes, llama-server's ``/lora-adapters``: docs/lora.md#serving).

``POST /tokenize``: ``{"prompt": str, "add_special_tokens": true}`` or ``{"messages": [...],
"add_generation_prompt": true, "continue_final_message": false, "tools": [...]}`` (rendered through the export's
chat template exactly as a chat request is, tools and assistant prefill included; special tokens are then not added
again), optional ``"model"`` and ``"return_token_strs"``; answers ``{"count", "max_model_len", "tokens",
"token_strs"}`` (``token_strs`` null unless asked for, as vLLM answers). ``POST /detokenize``: ``{"tokens":
[ids]}``, answers ``{"prompt": str}``. Every ``/v1/...`` route is also served without the prefix
(:func:`alias_without_v1`). Both need the API key when the server has one. Bounds as the completion routes have
them: a text too long for the context is refused before it is tokenized (``context_length_exceeded``), a chat of
more messages than the context has tokens before it is rendered, ``tokens`` of more ids than the context holds; the
work runs in a worker thread with the tokenizer's GIL-releasing batch call (other streams keep flowing).

CORS (``--allowed-origins``): off by default (no CORS headers: a browser page on another origin cannot call the
server); with origins given (or ``*``), Starlette's CORS middleware answers OPTIONS preflights and adds the
headers to every route; a refused preflight is a 400 in OpenAI's JSON shape (``code`` ``cors_refused``), and a
500 (answered outside that middleware) gets the headers too (:func:`cors_headers`).
"""

from __future__ import annotations

import asyncio
import json

from fastapi import FastAPI, Request

from qeff_kv.errors import QeffKvError
from qeff_kv.serve.http.bodies import check_text_fits, encode_text
from qeff_kv.serve.wire.openai_io import APIError, is_int, checked_messages, bad, check_model


def add_cors(app: FastAPI, origins: list[str] | None) -> None:
    app.state.cors_origins = list(origins or [])
    if not origins:
        return
    from starlette.middleware.cors import CORSMiddleware
    from starlette.responses import Response

    class JsonCORS(CORSMiddleware):
        """Starlette's CORS, its refused preflight answered in OpenAI's JSON shape."""

        def preflight_response(self, request_headers):
            answer = super().preflight_response(request_headers)
            if answer.status_code < 400:
                return answer
            why = answer.body.decode("utf-8", "replace")
            body = APIError(f"{why} (see --allowed-origins)", code="cors_refused").body()
            headers = {k: v for k, v in answer.headers.items() if k.lower().startswith("access-control-")}
            return Response(json.dumps(body, ensure_ascii=True), status_code=answer.status_code, headers=headers,
                            media_type="application/json")

    app.add_middleware(JsonCORS, allow_origins=list(origins), allow_methods=["GET", "POST", "OPTIONS"],
                       allow_headers=["*"], allow_credentials=False, max_age=600)


def cors_headers(app, request) -> dict:
    """The CORS headers an answer made outside the CORS middleware (a 500) carries for ``request``'s origin."""
    origins = getattr(app.state, "cors_origins", None) or []
    origin = request.headers.get("origin")
    if origin is None or not ("*" in origins or origin in origins):
        return {}
    return {"Access-Control-Allow-Origin": "*" if "*" in origins else origin, "Vary": "Origin"}


def check_chat_size(messages, limit: int | None, ctx_len: int) -> None:
    """A chat too large for the context refused before it is checked message by message or rendered: more
    messages than the context has tokens (each renders at least one), or more text than it can hold."""
    if not isinstance(messages, list):
        return
    if len(messages) > ctx_len:
        raise bad(f"messages holds {len(messages)} messages; the model's context of {ctx_len} tokens cannot hold "
                  "them", "messages", "context_length_exceeded")
    text = sum(len(m["content"]) for m in messages if isinstance(m, dict) and isinstance(m.get("content"), str))
    if limit is not None and text > limit:
        raise bad(f"messages hold {text} characters of text; the model's context of {ctx_len} tokens cannot hold "
                  f"more than {limit}", "messages", "context_length_exceeded")


def _check_model(body: dict, engine, names=None) -> None:
    """``model`` one of the served ``names`` (a :class:`~qeff_kv.serve.wire.openai_io.ModelNames`; default: the
    engine's name) or of the adapters."""
    check_model(body.get("model"), names or engine.model_name, adapter_names(engine))


def adapter_names(engine) -> list[str]:
    """The LoRA adapters ``engine`` serves (a request's ``model`` may name one)."""
    table = getattr(engine, "adapters", None)
    return table.names() if table is not None else []


def _flag(body: dict, key: str, default: bool) -> bool:
    v = body.get(key, default)
    if not isinstance(v, bool):
        raise bad(f"{key} must be true or false, got {v!r}", key)
    return v


#: the fields ``/tokenize`` reads (vLLM's)
TOKENIZE_FIELDS = ("model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                   "continue_final_message", "tools", "return_token_strs")


def tokenize(body, *, engine, text, limit: int | None = None, tool_support=None, names=None) -> dict:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    _check_model(body, engine, names)
    unknown = set(body) - set(TOKENIZE_FIELDS)
    if unknown:
        raise bad(f"unknown field {sorted(unknown)[0]!r}: not supported by /tokenize", sorted(unknown)[0])
    if ("prompt" in body) == ("messages" in body):
        raise bad("give exactly one of prompt and messages", "prompt")
    if "messages" in body:
        rendered = _rendered_chat(body, engine, text, limit, tool_support)
        check_text_fits(rendered, limit, engine.ctx_len, "messages")
        ids = encode_text(text.tokenizer, rendered, add_special_tokens=_flag(body, "add_special_tokens", False))
    else:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise bad(f"prompt must be a string, got {prompt!r}", "prompt")
        if body.get("tools") not in (None, []) or body.get("continue_final_message") is not None:
            raise bad("tools and continue_final_message go with messages", "tools")
        check_text_fits(prompt, limit, engine.ctx_len, "prompt")
        ids = encode_text(text.tokenizer, prompt, add_special_tokens=_flag(body, "add_special_tokens", True))
    strs = [text.tokenizer.id_to_token(t) for t in ids] if _flag(body, "return_token_strs", False) else None
    return {"count": len(ids), "max_model_len": engine.ctx_len, "tokens": list(ids), "token_strs": strs}


def _rendered_chat(body: dict, engine, text, limit, tool_support) -> str:
    """``messages`` (and ``tools``) rendered as a chat request renders them, prefill included."""
    from qeff_kv.serve.http.prefill import parse_turn, render
    from qeff_kv.serve.structured.tool_io import parse_tools

    if text.chat_template is None:
        raise bad("this model has no chat template; tokenize a prompt", "messages")
    check_chat_size(body["messages"], limit, engine.ctx_len)
    messages = checked_messages(body["messages"])
    if any(m.get("images") for m in messages):
        raise bad("/tokenize does not take image_url parts (a chat completion does, on a vision-language export)",
                  "messages")
    turn = parse_turn(body, messages)
    tools = parse_tools({"tools": body.get("tools")})
    try:
        if tool_support is not None:
            messages, listed = tool_support().prompt(messages, tools)
        else:
            listed = tools.tools if tools is not None else None
        return render(text.chat_template, messages, turn, listed)
    except QeffKvError as exc:
        raise bad(str(exc), "messages") from None


def detokenize(body, *, engine, text, names=None) -> dict:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    _check_model(body, engine, names)
    unknown = set(body) - {"model", "tokens"}
    if unknown:
        raise bad(f"unknown field {sorted(unknown)[0]!r}: not supported by /detokenize", sorted(unknown)[0])
    ids = body.get("tokens")
    vocab = text.tokenizer.get_vocab_size(with_added_tokens=True)
    if not isinstance(ids, list) or not all(is_int(t) for t in ids):
        raise bad("tokens must be a list of token ids", "tokens")
    if len(ids) > engine.ctx_len:
        raise bad(f"tokens holds {len(ids)} ids; the model's context holds {engine.ctx_len}", "tokens",
                  "context_length_exceeded")
    outside = [t for t in ids if not 0 <= t < vocab]
    if outside:
        raise bad(f"token id {outside[0]} is outside the tokenizer's vocabulary [0, {vocab})", "tokens")
    return {"prompt": text.tokenizer.decode(ids, skip_special_tokens=False)}


def add_token_routes(app: FastAPI, *, engine, text, auth, json_body, tool_support=None) -> None:
    @app.post("/tokenize")
    async def tokenize_route(request: Request):
        auth(request)
        body = await json_body(request)   # tokenizing a large text runs in a worker thread, off the event loop
        return await asyncio.to_thread(tokenize, body, engine=engine, text=text, limit=app.state.text_limit,
                                       tool_support=tool_support, names=getattr(app.state, "model_names", None))

    @app.post("/detokenize")
    async def detokenize_route(request: Request):
        auth(request)
        body = await json_body(request)
        return await asyncio.to_thread(detokenize, body, engine=engine, text=text, names=getattr(app.state, "model_names", None))


def alias_without_v1(app: FastAPI) -> None:
    """Every ``/v1/...`` route also served as ``/...`` (llama-server serves both; an OpenAI client given a
    ``base_url`` without ``/v1`` then works), unless that path is already a route of its own."""
    from fastapi.routing import APIRoute

    taken = {(r.path, m) for r in app.router.routes if isinstance(r, APIRoute) for m in r.methods}
    for r in [r for r in app.router.routes if isinstance(r, APIRoute) and r.path.startswith("/v1/")]:
        methods = [m for m in r.methods if (r.path[3:], m) not in taken]
        if methods:
            app.add_api_route(r.path[3:], r.endpoint, methods=methods, response_class=r.response_class,
                              include_in_schema=False)


# ============================================================================================ LoRA adapters
def request_lora(engine, model: str | None, field) -> tuple[str, float] | None:
    """The LoRA adapter and scale a request runs with (its ``model`` (checked), llama-server's ``lora`` field, the
    global scales: :meth:`~qeff_kv.serve.engine.lora.AdapterTable.resolve`), None for the base model; a 400 naming
    the field otherwise."""
    from qeff_kv.serve.wire.lora_io import lora_pairs

    pairs = lora_pairs(field)
    table = getattr(engine, "adapters", None)
    if table is None:
        if pairs and any(scale != 0 for _, scale in pairs):
            raise bad("this server serves no LoRA adapters (its graph takes none)", "lora")
        return None
    try:
        return table.resolve(model, pairs)
    except QeffKvError as exc:
        raise bad(str(exc), "lora" if pairs is not None else "model") from None


def adapter_cards(engine, created: int) -> list[dict]:
    """``/v1/models`` entries of the LoRA adapters, as vLLM lists them: ``root`` the adapter's folder, ``parent``
    the served model; ``lora_int_id``: the integer id of KV events."""
    table = getattr(engine, "adapters", None)
    return [{"id": a.name, "object": "model", "created": created, "owned_by": "qeff-kv", "root": a.path,
             "parent": engine.model_name, "max_model_len": engine.ctx_len, "lora_int_id": a.lora_int_id}
            for a in (table.listed() if table is not None else [])]


def _updating(engine):
    """The adapter table when the load and unload routes work; else the error answering them."""
    table = getattr(engine, "adapters", None)
    if table is None:
        raise bad("this server serves no LoRA adapters: its graph takes none (export it with --lora name=PEFT_DIR or "
                  "--max-lora-rank R)", "lora_name")
    if not table.updating:
        raise APIError("loading and unloading LoRA adapters at run time is off: start the server with "
                       "--allow-runtime-lora-updating (or VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)", status=404,
                       type="not_found_error", code="runtime_lora_updating_off")
    return table


def _engine_call(fn, *args):
    """``fn(*args)`` (an engine's adapter verb); an engine without it: 501."""
    try:
        return fn(*args)
    except NotImplementedError as exc:
        raise APIError(str(exc), status=501, type="not_supported_error", code="lora_updating_unsupported") from None


def load_adapter(engine, body) -> str:
    """``POST /v1/load_lora_adapter`` (blocking: run it off the event loop): read, fit and serve the adapter."""
    from qeff_kv.serve.engine import lora
    from qeff_kv.serve.wire.lora_io import load_body

    table = _updating(engine)
    name, path = load_body(body)
    try:
        table.check_room(name)
    except QeffKvError as exc:
        raise bad(str(exc), "lora_name") from None
    try:
        _engine_call(engine.update_adapter, "load", name, lora.read(path, name))
    except QeffKvError as exc:   # unreadable, DoRA, a rank above the graph's, ...: one line
        raise bad(str(exc), "lora_path") from None
    return f"Success: LoRA adapter '{name}' added successfully."


def unload_adapter(engine, body) -> str:
    """``POST /v1/unload_lora_adapter`` (blocking): refused while a running or waiting request uses it."""
    from qeff_kv.serve.wire.lora_io import unload_body

    table = _updating(engine)
    name, int_id = unload_body(body)
    served = table.get(name)
    if served is None or (int_id is not None and int_id != served.lora_int_id):
        raise APIError(f"The lora adapter '{name}' cannot be found.", status=404, type="not_found_error",
                       param="lora_name", code="lora_not_found")
    try:
        _engine_call(engine.update_adapter, "unload", name)
    except QeffKvError as exc:
        raise bad(str(exc), "lora_name", "lora_in_use" if "in use" in str(exc) else None) from None
    return f"Success: LoRA adapter '{name}' removed successfully."


def set_scales(engine, body) -> dict:
    """``POST /lora-adapters`` (llama-server's): the global scales, at most one non-zero."""
    from qeff_kv.serve.wire.lora_io import lora_pairs

    pairs = lora_pairs(body, "body")
    table = getattr(engine, "adapters", None)
    if table is None:
        if pairs:
            raise bad("this server serves no LoRA adapters (its graph takes none)", "id")
        return {"success": True}
    try:
        table.set_scales(pairs)
    except QeffKvError as exc:
        raise bad(str(exc), "scale") from None
    return {"success": True}


def add_lora_routes(app: FastAPI, *, engine, auth, json_body) -> None:
    """vLLM's load and unload routes and llama-server's ``/lora-adapters`` (docs/lora.md#serving)."""
    from fastapi.responses import PlainTextResponse

    @app.get("/lora-adapters")
    async def list_adapters(request: Request):
        auth(request)
        table = getattr(engine, "adapters", None)
        return table.scales() if table is not None else []

    @app.post("/lora-adapters")
    async def scales(request: Request):
        auth(request)
        return set_scales(engine, await json_body(request))

    @app.post("/v1/load_lora_adapter")
    async def load(request: Request):
        auth(request)
        body = await json_body(request)
        return PlainTextResponse(await asyncio.to_thread(load_adapter, engine, body))

    @app.post("/v1/unload_lora_adapter")
    async def unload(request: Request):
        auth(request)
        body = await json_body(request)
        return PlainTextResponse(await asyncio.to_thread(unload_adapter, engine, body))
