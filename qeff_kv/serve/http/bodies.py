"""Request bodies without blocking the event loop: a size cap checked before any work, and JSON read in a thread.

* :class:`BodyLimit` (ASGI middleware): a request whose ``Content-Length`` exceeds ``--max-request-bytes`` gets a
  413 before one byte of its body is read; a body sent without a length (chunked) is counted as it arrives and
  refused the moment it passes the cap.
* :func:`read_json`: the body parsed in a worker thread (:func:`~qeff_kv.serve.wire.json_values.decode_json`: JSON
  nested too deeply and strings no UTF-8 can carry refused as a 400 naming where they are).
* :func:`encode_text`: tokenizing in the tokenizer's GIL-releasing batch call, so that other streams keep flowing
  while a long prompt is tokenized (``Tokenizer.encode`` holds the GIL for its whole run);
* :func:`text_limit` / :func:`check_text_fits`: a prompt text too long to fit the context whatever it tokenizes to
  is refused before it is tokenized (tokenizing megabytes costs seconds of CPU): no token of the vocabulary covers
  more than its longest entry's bytes, so a context of ``C`` tokens holds at most ``C`` times that (doubled, for
  normalizers that drop characters).
"""

from __future__ import annotations

import asyncio

from qeff_kv.serve.wire.json_values import decode_json
from qeff_kv.serve.wire.openai_io import APIError, bad

#: the default of ``--max-request-bytes``: far above any prompt a context holds, far below what stalls a server
DEFAULT_MAX_REQUEST_BYTES = 8 << 20


def too_large(limit: int) -> APIError:
    return APIError(f"the request body is larger than this server's limit of {limit} bytes (--max-request-bytes)",
                    status=413, code="request_too_large")


class BodyLimit:
    """ASGI middleware refusing HTTP request bodies over ``limit`` bytes (413 in OpenAI's error shape)."""

    def __init__(self, app, limit: int, respond):
        self.app, self.limit, self.respond = app, limit, respond

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = _content_length(scope)
        if declared is not None and declared > self.limit:
            return await self.respond(send, too_large(self.limit), close=True)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise too_large(self.limit)
            return message

        return await self.app(scope, counted, send)


def _content_length(scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def read_json(request):
    """The request's JSON body, read with the size cap of :class:`BodyLimit` and parsed off the event loop."""
    raw = await request.body()
    return await asyncio.to_thread(decode_json, raw)


def encode_text(tokenizer, text: str, *, add_special_tokens: bool = True) -> list[int]:
    """``tokenizer.encode(text).ids``, computed by the batch call (it releases the GIL while it works)."""
    batch = getattr(tokenizer, "encode_batch", None)
    if batch is None:   # another tokenizer object: the plain call
        return list(tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)
    return list(batch([text], add_special_tokens=add_special_tokens)[0].ids)


def text_limit(tokenizer, ctx_len: int) -> int | None:
    """The most UTF-8 bytes of prompt text that could fit ``ctx_len`` tokens (see the module docstring); None when
    the tokenizer cannot tell its vocabulary."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return None
    longest = max((len(t.encode("utf-8", "replace")) for t in get_vocab(with_added_tokens=True)), default=0)
    return 2 * ctx_len * max(longest, 1) + 64 if longest else None


def check_text_fits(text: str, limit: int | None, ctx_len: int, param: str) -> None:
    """Refuse (400 ``context_length_exceeded``) a text longer than ``limit`` bytes, before it is tokenized."""
    if limit is not None and len(text) > limit // 4 and len(text.encode("utf-8", "replace")) > limit:
        raise bad(f"the prompt has {len(text.encode('utf-8', 'replace'))} bytes of text; the model's context of "
                  f"{ctx_len} tokens cannot hold more than {limit} (its longest token, twice over)", param,
                  "context_length_exceeded")
