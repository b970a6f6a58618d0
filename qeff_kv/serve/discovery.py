"""Discovery and browser access: ``/tokenize`` and ``/detokenize`` (vLLM's shapes), and CORS.

``POST /tokenize``: ``{"prompt": str, "add_special_tokens": true}`` or ``{"messages": [...],
"add_generation_prompt": true}`` (rendered through the export's chat template, as a chat request is; special
tokens are then not added again), optional ``"model"`` and ``"return_token_strs"``; answers ``{"count",
"max_model_len", "tokens"}`` (and ``"token_strs"``). ``POST /detokenize``: ``{"tokens": [ids]}``, answers
``{"prompt": str}``. Both need the API key when the server has one.

CORS (``--allowed-origins``): off by default (no CORS headers: a browser page on another origin cannot call the
server); with origins given (or ``*``), Starlette's CORS middleware answers OPTIONS preflights and adds the
headers to every route.
"""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request

from ..errors import QeffKvError
from .openai_io import _is_int, _messages, bad


def add_cors(app: FastAPI, origins: list[str] | None) -> None:
    if not origins:
        return
    from starlette.middleware.cors import CORSMiddleware

    app.add_middleware(CORSMiddleware, allow_origins=list(origins), allow_methods=["GET", "POST", "OPTIONS"],
                       allow_headers=["*"], allow_credentials=False, max_age=600)


def _check_model(body: dict, engine) -> None:
    model = body.get("model")
    if model is not None and model != engine.model_name:
        raise bad(f"the model {model!r} does not exist; this server serves {engine.model_name!r}", "model",
                  "model_not_found")


def _flag(body: dict, key: str, default: bool) -> bool:
    v = body.get(key, default)
    if not isinstance(v, bool):
        raise bad(f"{key} must be true or false, got {v!r}", key)
    return v


def tokenize(body, *, engine, text) -> dict:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    _check_model(body, engine)
    unknown = set(body) - {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                           "return_token_strs"}
    if unknown:
        raise bad(f"unknown field {sorted(unknown)[0]!r}: not supported by /tokenize", sorted(unknown)[0])
    if ("prompt" in body) == ("messages" in body):
        raise bad("give exactly one of prompt and messages", "prompt")
    if "messages" in body:
        if text.chat_template is None:
            raise bad("this model has no chat template; tokenize a prompt", "messages")
        try:
            rendered = text.chat_template.render(_messages(body["messages"]),
                                                 add_generation_prompt=_flag(body, "add_generation_prompt", True))
        except QeffKvError as exc:
            raise bad(str(exc), "messages") from None
        ids = text.tokenizer.encode(rendered, add_special_tokens=_flag(body, "add_special_tokens", False)).ids
    else:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise bad(f"prompt must be a string, got {prompt!r}", "prompt")
        ids = text.tokenizer.encode(prompt, add_special_tokens=_flag(body, "add_special_tokens", True)).ids
    out = {"count": len(ids), "max_model_len": engine.ctx_len, "tokens": list(ids)}
    if _flag(body, "return_token_strs", False):
        out["token_strs"] = [text.tokenizer.id_to_token(t) for t in ids]
    return out


def detokenize(body, *, engine, text) -> dict:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    _check_model(body, engine)
    unknown = set(body) - {"model", "tokens"}
    if unknown:
        raise bad(f"unknown field {sorted(unknown)[0]!r}: not supported by /detokenize", sorted(unknown)[0])
    ids = body.get("tokens")
    vocab = text.tokenizer.get_vocab_size(with_added_tokens=True)
    if not isinstance(ids, list) or not all(_is_int(t) for t in ids):
        raise bad("tokens must be a list of token ids", "tokens")
    outside = [t for t in ids if not 0 <= t < vocab]
    if outside:
        raise bad(f"token id {outside[0]} is outside the tokenizer's vocabulary [0, {vocab})", "tokens")
    return {"prompt": text.tokenizer.decode(ids, skip_special_tokens=False)}


def add_token_routes(app: FastAPI, *, engine, text, auth, json_body) -> None:
    @app.post("/tokenize")
    async def tokenize_route(request: Request):
        auth(request)
        body = await json_body(request)   # tokenizing a large text runs in a worker thread, off the event loop
        return await asyncio.to_thread(tokenize, body, engine=engine, text=text)

    @app.post("/detokenize")
    async def detokenize_route(request: Request):
        auth(request)
        body = await json_body(request)
        return await asyncio.to_thread(detokenize, body, engine=engine, text=text)
