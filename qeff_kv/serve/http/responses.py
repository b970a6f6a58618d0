"""A request's run turned into OpenAI's answers: the engine's events as text deltas (stop strings, the incremental
detokenizer, logprobs, tool-call text held back), a non-streamed choice, and the server-sent events of a stream
(``n`` choices interleaved). The routes that make runs are in :mod:`.app`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

from qeff_kv.serve.http.choices import Logprobs
from qeff_kv.serve.http.drain import shutting_down
from qeff_kv.serve.http.http_errors import scrubbed
from qeff_kv.serve.engine.engine import Finished, PromptLogprobs, TokenOut
from qeff_kv.serve.http.metrics import Metrics
from qeff_kv.serve.wire.openai_io import APIError, Params
from qeff_kv.serve.http.text import Detokenizer, StopMatcher
from qeff_kv.serve.structured.tool_io import ToolStream, calls_json

#: a client that stops reading is noticed within this many seconds even while no token comes
DISCONNECT_POLL_S = 0.5


async def within(awaitable, seconds: float):
    """``await awaitable``, ``asyncio.TimeoutError`` after ``seconds``: ``asyncio.timeout`` where there is one
    (Python 3.11: no task per wait, as ``wait_for`` makes before 3.12)."""
    if _timeout is None:
        return await asyncio.wait_for(awaitable, seconds)
    async with _timeout(seconds):
        return await awaitable


_timeout = getattr(asyncio, "timeout", None)


async def collect(run: "Run") -> str:
    return "".join([d async for d in run.deltas()])


def choice(index: int, content: str, run: "Run", chat: bool) -> dict:
    logprobs = run.logprobs.all() if run.logprobs is not None else None
    if not chat:
        return {"index": index, "text": content, "logprobs": logprobs, "finish_reason": run.finish_reason}
    message = {"role": "assistant", "content": content}
    if run.tools is not None:   # the calls parsed out of the text (the parser the template's facts chose)
        content, calls = run.tools.calls_in(content, cut=run.finish_reason == "length")
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls_json(calls)
            run.finish_reason = tool_finish(run)
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": run.finish_reason}


def usage(runs: list["Run"]) -> dict:
    """One prompt, every choice's completion tokens."""
    usage = runs[0].usage()
    completion = sum(r.tokens for r in runs)
    return {**usage, "completion_tokens": completion, "total_tokens": usage["prompt_tokens"] + completion}


async def merged(runs: list["Run"]):
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

    async def pump(i: int, run: "Run") -> None:
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


async def sse(runs: list["Run"], rid: str, chat: bool, *, created_at: int, model: str, echo: str = ""):
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
    async for i, delta in merged(runs):
        tools = runs[i].tools
        if delta is not None:
            if tools is not None:   # text that may open a tool call is held until it is known not to
                delta = tools.feed(delta)
                if not delta:
                    continue
            yield chunk(i, delta, None)
        elif runs[i].error is None:
            if tools is not None:
                for piece in tool_chunks(i, runs[i], chunk):
                    yield piece
            yield chunk(i, None, runs[i].finish_reason)
    failed = [r for r in runs if r.error is not None]
    if failed:
        yield "data: " + json.dumps(failed[0].error_object().body()) + "\n\n"
    elif runs[0].params.include_usage:
        yield "data: " + json.dumps({"id": rid, "object": obj, "created": created_at, "model": model,
                                     "choices": [], "usage": usage(runs)}) + "\n\n"
    yield "data: [DONE]\n\n"


def tool_chunks(i: int, run: "Run", chunk):
    """The end of a streamed answer with tools: held content, then one ``delta.tool_calls`` chunk per call."""
    tail, calls = run.tools.finish(cut=run.finish_reason == "length")
    if tail:
        yield chunk(i, tail, None)
    for j, call in enumerate(calls_json(calls)):
        yield chunk(i, {"tool_calls": [{"index": j, **call}]}, None)
    if calls:
        run.finish_reason = tool_finish(run)


def tool_finish(run: "Run") -> str:
    """The finish reason of an answer with calls: ``tool_calls``, or ``length`` when the token limit ended it (the
    unfinished call after the complete ones dropped), as OpenAI answers."""
    return "length" if run.finish_reason == "length" else "tool_calls"


class Run:
    """One request's events turned into text deltas (stop strings applied), with timing metrics. With ``tools``
    (a :class:`~.tool_io.ToolStream`), special tokens are kept in the text (tool-call markers may be special)."""

    def __init__(self, request, handle, params: Params, prompt_tokens: int, tokenizer, metrics: Metrics,
                 arrival: float, background: set, logprobs: Logprobs | None = None, tools: ToolStream | None = None,
                 grammar=None):
        self.request, self.handle, self.params = request, handle, params
        self.grammar = grammar   # the request's constraint: its failure is the request's fault (400), not ours
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
        why = getattr(self.grammar, "failed", None)
        if why is not None:
            return APIError(f"the request's grammar failed while generating: {why}", param=None,
                            code="invalid_grammar")
        failed = APIError(f"generation failed: {self.error}", status=500, type="server_error")
        return scrubbed(failed, getattr(self.request.app.state, "private_paths", ()))   # in a stream too

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
                return await within(self._queue.get(), DISCONNECT_POLL_S)
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
                if isinstance(ev, PromptLogprobs):
                    if self.logprobs is not None:
                        self.logprobs.add_prompt(ev.entries)
                    continue
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
