"""OpenAI's ``POST /v1/embeddings`` from a decoder export with the ``hidden_states`` output (``qeff-kv export
--hidden-states``): each input is a request of the engine (``GenerationRequest.embed``,
:meth:`~.scheduler.Scheduler.submit_batch`): it waits its turn in the queue as a completion does (a full queue: 429
``queue_full``; a list of inputs counts as one request there), is prefilled in the same chunks as prompts between
other sequences' decode steps, and pooled (:func:`qeff_kv.runtime.embeddings.pooled`: the last token's final hidden
state, L2-normalised); its sequence is kept for prompt reuse as a finished prompt's. A client that leaves while its
inputs wait or run cancels them. ``input``: a string, token ids, or a list of up to :data:`MAX_INPUTS` of either
(the answer in input order); ``encoding_format`` ``float`` (default) or ``base64`` (little-endian float32, as
OpenAI's); ``dimensions`` refused; ``user`` a string, accepted. An export without the output, the disaggregated
engine and a vision-language graph are refused in one line.
"""

from __future__ import annotations

import asyncio
import base64
import uuid

from fastapi.responses import Response

from qeff_kv.runtime import embeddings
from qeff_kv.runtime.decoding.sampling import SamplingParams
from qeff_kv.serve.engine.engine import Embedding, Finished, GenerationRequest
from qeff_kv.serve.http import http_errors
from qeff_kv.serve.http.bodies import check_text_fits, encode_text, read_json
from qeff_kv.serve.http.responses import DISCONNECT_POLL_S
from qeff_kv.serve.wire.openai_io import APIError, bad

MAX_INPUTS = 64
_FIELDS = {"model", "input", "encoding_format", "user", "dimensions"}


def inputs_of(body, front) -> list[list[int]]:
    """The request's inputs as token id lists (checked: kind, count, vocabulary, context)."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    unknown = sorted(set(body) - _FIELDS)
    if unknown:
        raise bad(f"unknown field {unknown[0]!r}: not supported by /v1/embeddings on this server", unknown[0])
    front.names.check(body.get("model"))
    if body.get("dimensions") is not None:
        raise bad("dimensions is not supported (the embedding is the model's hidden size)", "dimensions")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise bad(f"user must be a string, got {type(body['user']).__name__}", "user")
    if body.get("encoding_format") not in (None, "float", "base64"):
        raise bad(f"encoding_format must be float or base64, got {body['encoding_format']!r}", "encoding_format")
    v = body.get("input")
    one = isinstance(v, str) or (isinstance(v, list) and v and all(_is_id(t) for t in v))
    items = [v] if one else v
    if not isinstance(items, list) or not items or len(items) > MAX_INPUTS:
        raise bad(f"input must be a string, token ids, or a list of 1 to {MAX_INPUTS} of them", "input")
    out = []
    for i, it in enumerate(items):
        if isinstance(it, str):
            check_text_fits(it, front.app.state.text_limit, front.engine.ctx_len, "input")
            ids = encode_text(front.text.tokenizer, it)
        elif isinstance(it, list) and all(_is_id(t) for t in it):
            ids = list(it)
        else:
            raise bad(f"input[{i}] must be a string or a list of token ids", "input")
        vocab = front.engine.session.vocab_size
        if not ids or len(ids) > front.engine.ctx_len or any(t >= vocab for t in ids):
            raise bad(f"input[{i}] must hold 1 to {front.engine.ctx_len} tokens, each below {vocab}", "input")
        out.append(ids)
    return out


def _is_id(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and t >= 0


async def respond(front, request):
    """``POST /v1/embeddings``."""
    front.auth(request)
    engine = front.engine
    session = getattr(engine, "session", None)
    if session is None or not hasattr(engine, "submit_batch"):
        raise bad("/v1/embeddings is not served by the disaggregated engine", "input")
    why = embeddings.unsupported(session)
    if why is not None:
        raise bad(why, "model")
    body = await read_json(request)
    items = await asyncio.to_thread(inputs_of, body, front)
    rid = "embd-" + uuid.uuid4().hex
    reqs = [GenerationRequest(f"{rid}-{i}", tuple(ids), 0, SamplingParams(), frozenset(), embed=True)
            for i, ids in enumerate(items)]
    with http_errors.refused_submission(front.metrics, "input"):
        handles = engine.submit_batch(reqs)
    try:
        vectors = await _vectors(request, handles)
    finally:   # a client gone (or this handler cancelled): the inputs still waiting or running leave
        for h in handles:
            if not h.finished:
                h.cancel()
    if vectors is None:   # the client left; nobody reads the answer
        return Response(status_code=499)
    data = [{"object": "embedding", "index": i, "embedding": _encoded(vec, body.get("encoding_format"))}
            for i, vec in enumerate(vectors)]
    tokens = sum(len(ids) for ids in items)
    return {"object": "list", "data": data, "model": front.names.reported(body.get("model")),
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


async def _vectors(request, handles: list) -> list | None:
    """Each input's vector, in input order, once every input ran; None when the client left meanwhile (looked for
    every :data:`~.responses.DISCONNECT_POLL_S`); an input that failed or was cancelled by the engine: its error."""
    tasks = [asyncio.ensure_future(_vector(h)) for h in handles]
    try:
        while True:
            done, pending = await asyncio.wait(tasks, timeout=DISCONNECT_POLL_S)
            if not pending:
                return [t.result() for t in tasks]
            if await request.is_disconnected():
                return None
    finally:
        for t in tasks:
            t.cancel()


async def _vector(handle):
    vector, final = None, None
    async for ev in handle:
        if isinstance(ev, Embedding):
            vector = ev.vector
        elif isinstance(ev, Finished):
            final = ev
    if vector is not None:
        return vector
    if final is not None and final.finish_reason == "cancelled":
        raise APIError("the embedding was cancelled: the server is shutting down", status=503, type="server_error",
                       code="unavailable")
    raise APIError(f"embedding failed: {final.error if final is not None else 'no answer'}", status=500,
                   type="server_error")


def _encoded(vec, encoding_format):
    if encoding_format == "base64":   # little-endian float32, as OpenAI's
        return base64.b64encode(vec.astype("<f4").tobytes()).decode()
    return [float(x) for x in vec]
