"""Every error the server answers, in OpenAI's JSON shape ``{"error": {message, type, param, code}}``.

* :func:`install`: the app's exception handlers (:class:`~qeff_kv.serve.wire.openai_io.APIError`, Starlette's HTTP errors such as
  404 and 405, request validation) and :class:`InternalErrors` (anything unexpected as a 500 without a traceback in
  the body, with CORS headers, the connection kept);
* :func:`send_error`: the same body sent straight on the ASGI channel, for middleware that answers before the
  app runs (a body too large, a server draining);
* :class:`JsonErrorH11Protocol`: uvicorn's h11 protocol whose answer to a malformed request (two Content-Length
  headers, a bad chunk size, HTTP/0.9, a garbled request line) is a 400 in that shape instead of plain text.

Bodies are ASCII JSON: a message quoting a client's string with a lone surrogate still encodes. No server path
reaches a client: a message naming a file under the server's own folders (the export, its chat template, the state
and media folders: :func:`server_paths`) names the file alone (:func:`scrubbed`), whatever route raised it.
"""

from __future__ import annotations

import json
import re
from contextlib import contextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from qeff_kv.errors import QeffKvError, QueueFullError, UnavailableError
from qeff_kv.serve.wire.openai_io import APIError, bad

_KINDS = {401: "authentication_error", 404: "not_found_error", 405: "invalid_request_error",
          413: "invalid_request_error", 429: "rate_limit_error", 503: "server_error"}


@contextmanager
def refused_submission(metrics, param: str):
    """Around a submission to the engine: a full queue answers 429 ``queue_full``, an engine not taking work 503
    ``unavailable``, any other library refusal a 400 naming ``param``; each counted as rejected in ``metrics``."""
    try:
        yield
    except QueueFullError as exc:
        metrics.rejected()
        raise APIError(str(exc), status=429, type="rate_limit_error", code="queue_full") from None
    except UnavailableError as exc:
        metrics.rejected()
        raise APIError(str(exc), status=503, type="server_error", code="unavailable") from None
    except QeffKvError as exc:
        metrics.rejected()
        raise bad(str(exc), param) from None


def error_bytes(exc: APIError) -> bytes:
    return json.dumps(exc.body(), ensure_ascii=True).encode("ascii")


def error_response(exc: APIError, headers: dict | None = None) -> Response:
    if exc.status == 401:
        headers = {**(headers or {}), "WWW-Authenticate": "Bearer"}
    return Response(error_bytes(exc), status_code=exc.status, headers=headers, media_type="application/json")


def server_paths(engine, text, *folders) -> tuple[str, ...]:
    """The server's own folders an error must not show: the export's, its chat template's, and ``folders`` (the
    state and media folders; None skipped), as given and resolved, longest first."""
    found = [getattr(getattr(getattr(engine, "session", None), "files", None), "folder", None),
             getattr(getattr(text, "chat_template", None), "source", None), *folders]
    out = set()
    for f in found:
        if f is None or not str(f):
            continue
        path = Path(f)
        if path.suffix:   # a file (the template's source): its folder
            path = path.parent
        for p in (path, path.resolve()):
            if len(str(p)) > 1:
                out.add(str(p))
    return tuple(sorted(out, key=len, reverse=True))


def scrubbed(exc: APIError, paths) -> APIError:
    """``exc`` with every path under one of ``paths`` shown as its file name alone (the folder itself as its
    name)."""
    if not paths:
        return exc
    pattern = re.compile("(?:" + "|".join(re.escape(p) for p in paths) + r")(?:/[^\s'\":,;()]*)*")
    message = pattern.sub(lambda m: Path(m.group(0)).name or "the server's folder", exc.message)
    if message == exc.message:
        return exc
    return APIError(message, status=exc.status, type=exc.type, param=exc.param, code=exc.code)


def install(app: FastAPI) -> None:
    """Register the error handlers on ``app``."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(scrubbed(exc, getattr(request.app.state, "private_paths", ())))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = _KINDS.get(exc.status_code, "invalid_request_error")
        return error_response(APIError(f"{request.method} {request.url.path}: {exc.detail}", status=exc.status_code,
                                       type=kind), headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        first = (exc.errors() or [{}])[0]
        where = ".".join(str(p) for p in first.get("loc", ()) if p not in ("query", "path", "body"))
        return error_response(APIError(f"{where or 'the request'}: {first.get('msg', 'invalid')}",
                                       param=where or None))

    app.add_middleware(InternalErrors)


class InternalErrors:
    """ASGI middleware (outside every other): anything unexpected before the answer started is a 500 in OpenAI's
    shape, with the CORS headers the request's origin gets (:func:`~.discovery.cors_headers`), and the connection
    stays open (Starlette's own handler re-raises, and uvicorn then closes it)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracked(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:   # noqa: BLE001 - answered, not raised, when nothing was sent yet
            if started:
                raise
            from qeff_kv.serve.http.discovery import cors_headers

            request = Request(scope)
            err = APIError(f"internal error: {type(exc).__name__}: {exc}", status=500, type="server_error")
            answer = error_response(scrubbed(err, getattr(request.app.state, "private_paths", ())),
                                    headers=cors_headers(request.app, request))
            await answer(scope, receive, send)


async def send_error(send, exc: APIError, *, close: bool = False) -> None:
    """Answer ``exc`` on a raw ASGI ``send`` (before the app has started a response)."""
    body = error_bytes(exc)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _malformed_body() -> bytes:
    return error_bytes(APIError("malformed HTTP request (the server could not parse it)", code="malformed_request"))


try:
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol
except ImportError:   # pragma: no cover - uvicorn without h11
    JsonErrorH11Protocol = None
else:
    class JsonErrorH11Protocol(H11Protocol):
        """uvicorn's h11 protocol answering a malformed request with a JSON 400 (then closing the connection)."""

        def send_400_response(self, msg: str) -> None:
            body = _malformed_body()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                       (b"connection", b"close")]
            try:
                self.transport.write(self.conn.send(h11.Response(status_code=400, headers=headers,
                                                                 reason=b"Bad Request")))
                self.transport.write(self.conn.send(h11.Data(data=body)))
                self.transport.write(self.conn.send(h11.EndOfMessage()))
            except h11.LocalProtocolError:   # h11 cannot answer in this state (an HTTP/0.9 request line)
                self.transport.write(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
                                     b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n"
                                     + body)
            self.transport.close()
