"""SIGTERM (and Ctrl-C) drains the server instead of cutting its clients off.

1. New requests get a 503 in OpenAI's error shape (``server_shutting_down``) from :class:`DrainGate`, which also
   counts the requests in flight; the listening socket stays open so that clients get that answer, not a reset.
2. Running requests have ``grace`` seconds to finish. Those still running then are stopped by closing the engine:
   a stream ends with an error event and ``data: [DONE]``, a non-streamed request gets a 503 (the app turns an
   engine's cancellation that its client did not ask for into an error, never into a normal end).
3. Once nothing is in flight, uvicorn shuts down; :func:`qeff_kv.serve.server.serve` then raises
   :class:`~qeff_kv.errors.Terminated` (exit code 128 + the signal, one line).

A second signal during the drain stops waiting (uvicorn's forced exit).
"""

from __future__ import annotations

import asyncio
import signal
import time

from qeff_kv.serve.http.http_errors import send_error
from qeff_kv.serve.wire.openai_io import APIError

#: the default of ``--drain-seconds``: how long running requests may take to finish after SIGTERM
DEFAULT_GRACE_S = 30.0
#: after the engine was closed: how long its last events may take to reach the clients
FLUSH_S = 10.0


def shutting_down() -> APIError:
    return APIError("the server is shutting down; retry on another server or later", status=503,
                    type="server_error", code="server_shutting_down")


class Drain:
    """The drain's state: whether it started, the signal, the requests in flight."""

    def __init__(self, engine, grace: float = DEFAULT_GRACE_S):
        self.engine, self.grace = engine, grace
        self.signal: int | None = None
        self.draining = False
        self.in_flight = 0
        self.stopped_requests = 0
        self._task: asyncio.Task | None = None

    def request(self, sig: int) -> None:
        """A signal arrived (called from the signal handler: only records it)."""
        if self.signal is None:
            self.signal = sig

    async def run(self, server) -> None:
        """Drain, then tell uvicorn to exit."""
        self.draining = True
        deadline = time.monotonic() + self.grace
        while self.in_flight and time.monotonic() < deadline and not server.force_exit:
            await asyncio.sleep(0.05)
        if self.in_flight:
            self.stopped_requests = self.in_flight
            await asyncio.to_thread(self.engine.close)   # every running request ends; the app reports an error
            deadline = time.monotonic() + FLUSH_S
            while self.in_flight and time.monotonic() < deadline and not server.force_exit:
                await asyncio.sleep(0.05)
        server.should_exit = True

    def start(self, server) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.run(server))


class DrainGate:
    """ASGI middleware: counts HTTP requests in flight and answers 503 to new ones while draining."""

    def __init__(self, app, drain: Drain):
        self.app, self.drain = app, drain

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.drain.draining:
            return await send_error(send, shutting_down(), close=True)
        self.drain.in_flight += 1
        try:
            return await self.app(scope, receive, send)
        finally:
            self.drain.in_flight -= 1


def draining_server(config, drain: Drain):
    """A ``uvicorn.Server`` whose SIGTERM/SIGINT start :meth:`Drain.run` (a second one forces the exit)."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if drain.signal is not None:
                self.force_exit = True
                return
            drain.request(sig)

        async def on_tick(self, counter: int) -> bool:
            if drain.signal is not None:
                drain.start(self)
            return await super().on_tick(counter)

    return DrainingServer(config)


def exit_code(sig: int) -> int:
    """The shell's convention: 128 + the signal number (SIGTERM: 143, SIGINT: 130)."""
    return 128 + int(signal.Signals(sig))
