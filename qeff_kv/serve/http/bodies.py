"""Request bodies without blocking the event loop: a size cap checked before any work, and JSON read in a thread.

* :class:`BodyLimit` (ASGI middleware): a request whose ``Content-Length`` exceeds ``--max-request-bytes`` gets a
  413 before one byte of its body is read; a body sent without a length (chunked) is counted as it arrives and
  refused the moment it passes the cap.
* :func:`read_json`: the body parsed in a worker thread, with JSON nested too deeply (``RecursionError``) and
  strings no UTF-8 can carry (a lone surrogate such as ``"\\ud800"``) refused as a 400 naming where they are.
* :func:`json_in_string`: JSON given inside a JSON string (a schema, a past tool call's ``arguments``) parsed with
  the same refusals, plus a depth bound (:data:`MAX_INNER_DEPTH`), as a 400 naming the field;
* :func:`encode_text`: tokenizing in the tokenizer's GIL-releasing batch call, so that other streams keep flowing
  while a long prompt is tokenized (``Tokenizer.encode`` holds the GIL for its whole run);
* :func:`text_limit` / :func:`check_text_fits`: a prompt text too long to fit the context whatever it tokenizes to
  is refused before it is tokenized (tokenizing megabytes costs seconds of CPU): no token of the vocabulary covers
  more than its longest entry's bytes, so a context of ``C`` tokens holds at most ``C`` times that (doubled, for
  normalizers that drop characters).
"""

from __future__ import annotations

import asyncio
import json
import re

from qeff_kv.serve.http.openai_io import APIError, bad

#: the default of ``--max-request-bytes``: far above any prompt a context holds, far below what stalls a server
DEFAULT_MAX_REQUEST_BYTES = 8 << 20
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
#: the deepest nesting accepted in JSON given inside a string, and in a schema (no schema or argument object a
#: person writes comes near it; deeper ones made Python's and llguidance's recursion fail)
MAX_INNER_DEPTH = 64


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


def decode_json(raw: bytes):
    """The JSON value of a request body; 400 for invalid JSON, deep nesting or a lone surrogate."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise bad("the request body is nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad(f"the request body is not valid JSON ({exc})") from None
    if _SURROGATE_ESCAPE.search(raw):
        where = _unencodable(body, "")
        if where is not None:
            raise bad(f"{where or 'the body'} holds a lone UTF-16 surrogate (an escape like \\ud800 that is not "
                      "half of a pair); text must be valid Unicode", where.split("[")[0].split(".")[0] or None)
    return body


def json_in_string(text: str, where: str, *, keep_text: bool = False):
    """The JSON value of ``text`` (a string inside the request), or a 400 naming ``where``: not JSON (``keep_text``:
    the text itself is returned instead), nested deeper than :data:`MAX_INNER_DEPTH`, or holding a lone surrogate."""
    try:
        value = json.loads(text)
    except RecursionError:
        value = None
        depth = MAX_INNER_DEPTH + 1
    except ValueError as exc:
        if keep_text:
            return text
        raise bad(f"{where} is not valid JSON ({exc})", where) from None
    else:
        depth = json_depth(value)
    if depth > MAX_INNER_DEPTH:
        raise bad(f"{where} is nested deeper than {MAX_INNER_DEPTH} levels", where)
    check_encodable(value, where)
    return value


def check_encodable(value, where: str) -> None:
    """A 400 naming ``where`` when a string in ``value`` holds a lone surrogate."""
    bad_at = _unencodable(value, "")
    if bad_at is not None:
        raise bad(f"{where}{'.' + bad_at if bad_at else ''} holds a lone UTF-16 surrogate (an escape like \\ud800 "
                  "that is not half of a pair); text must be valid Unicode", where)


def json_depth(value) -> int:
    """How deeply ``value`` nests objects and lists (0: a scalar); iterative (no recursion limit)."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            stack.extend((x, d + 1) for x in v.values())
        elif isinstance(v, list):
            stack.extend((x, d + 1) for x in v)
        else:
            deepest = max(deepest, d)
            continue
        deepest = max(deepest, d + 1)
    return deepest


def _unencodable(value, where: str) -> str | None:
    """The path of the first string (or key) in ``value`` that UTF-8 cannot encode, else None."""
    stack = [(value, where)]
    while stack:
        v, w = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return w
        elif isinstance(v, dict):
            for k, x in v.items():
                name = f"{w}.{k}" if w else str(k)
                if not isinstance(k, str) or _unencodable(k, "") is not None:
                    return w or "a key"
                stack.append((x, name))
        elif isinstance(v, list):
            stack.extend((x, f"{w}[{i}]") for i, x in enumerate(v))
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
