"""OpenAI's ``POST /v1/embeddings`` from a decoder export with the ``hidden_states`` output (``qeff-kv export
--hidden-states``): each input is prefilled into a sequence of its own on the engine thread, between two turns
(:meth:`~.scheduler.Scheduler.run_on_engine`), and pooled by :func:`qeff_kv.runtime.embeddings.embed` (the last
token's final hidden state, L2-normalised); the sequence is freed afterwards. ``input``: a string, token ids, or a
list of up to :data:`MAX_INPUTS` of either; ``encoding_format`` ``float`` (default) or ``base64`` (little-endian
float32, as OpenAI's); ``dimensions`` refused; ``user`` accepted. An export without the output, the disaggregated
engine and a vision-language graph are refused in one line.
"""

from __future__ import annotations

import asyncio
import base64

from qeff_kv.errors import QeffKvError
from qeff_kv.runtime import embeddings
from qeff_kv.serve.http.bodies import check_text_fits, encode_text, read_json
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


def _one(ids: list[int]):
    def run(scheduler):
        seq = scheduler.prefix_cache.fresh()
        try:
            return embeddings.embed(scheduler.session, seq, ids)
        finally:
            scheduler.prefix_cache.release(seq, keep=False)
    return run


async def respond(front, request):
    """``POST /v1/embeddings``."""
    front.auth(request)
    engine = front.engine
    session = getattr(engine, "session", None)
    if session is None or not hasattr(engine, "run_on_engine"):
        raise bad("/v1/embeddings is not served by the disaggregated engine", "input")
    why = embeddings.unsupported(session)
    if why is not None:
        raise bad(why, "model")
    body = await read_json(request)
    items = await asyncio.to_thread(inputs_of, body, front)
    data = []
    for i, ids in enumerate(items):
        try:
            vec = await asyncio.wrap_future(engine.run_on_engine(("call", _one(ids))))
        except QeffKvError as exc:
            raise APIError(f"embedding failed: {exc}", status=503, type="server_error", code="unavailable") from None
        value = (base64.b64encode(vec.astype("<f4").tobytes()).decode() if body.get("encoding_format") == "base64"
                 else [float(x) for x in vec])
        data.append({"object": "embedding", "index": i, "embedding": value})
    tokens = sum(len(ids) for ids in items)
    return {"object": "list", "data": data, "model": engine.model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
