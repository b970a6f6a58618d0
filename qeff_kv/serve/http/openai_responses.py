"""OpenAI's Responses API, ``POST /v1/responses``, over the chat path: a request's ``input`` items and
``instructions`` become chat messages, its ``tools`` / ``tool_choice`` / ``text.format`` the chat request's tools and
``response_format``, and the answer (text, ``function_call`` items) comes back as a ``response`` object or, with
``stream``, as the Responses server-sent events (``response.created`` ... ``response.output_text.delta`` ...
``response.function_call_arguments.done`` ... ``response.completed``).

Stateless: nothing is stored, so ``store: true``, ``previous_response_id``, ``conversation`` and ``background`` are
refused in one line (a client keeps the conversation itself, sending earlier ``function_call`` and
``function_call_output`` items back in ``input``, as openai-agents does). The body is checked strictly and
translated by :mod:`~qeff_kv.serve.wire.responses_io` (every field honoured or refused, of its JSON type; input
items and content parts of other kinds refused naming where they are); an error the chat path raises afterwards
names the client's own fields (``max_output_tokens``, ``text.format``, ``input[i]``). The response echoes the
sampling applied (the server's defaults for what the request left out); one cut by ``max_output_tokens`` is
``incomplete``, and so is its message item.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from qeff_kv.serve.http.bodies import read_json
from qeff_kv.serve.http.choices import max_tokens_of, sampling_of
from qeff_kv.serve.http.responses import Run, collect
from qeff_kv.serve.wire.openai_io import APIError
from qeff_kv.serve.wire.responses_io import chat_body
from qeff_kv.serve.structured.tool_io import ToolStream

# ============================================================================================ the answer
class Answer:
    """What a response object repeats from its request, and its ids."""

    def __init__(self, body: dict, model: str, applied: dict):
        self.id = "resp_" + uuid.uuid4().hex
        self.msg_id = "msg_" + uuid.uuid4().hex
        self.created = int(time.time())
        self.body, self.model = body, model
        self.applied = applied   # max_output_tokens, temperature, top_p as run (the server's defaults filled in)

    def response(self, status: str, output: list, run: Run | None = None) -> dict:
        b = self.body
        incomplete = status == "incomplete"
        out = {"id": self.id, "object": "response", "created_at": self.created, "status": status,
               "error": None, "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
               "instructions": b.get("instructions"), "max_output_tokens": self.applied["max_output_tokens"],
               "model": self.model, "output": output, "parallel_tool_calls": b.get("parallel_tool_calls", True),
               "previous_response_id": None, "reasoning": None, "store": False,
               "temperature": self.applied["temperature"], "text": b.get("text") or {"format": {"type": "text"}},
               "tool_choice": b.get("tool_choice") or "auto", "tools": b.get("tools") or [],
               "top_p": self.applied["top_p"], "truncation": "disabled", "metadata": b.get("metadata") or {},
               "user": b.get("user"), "usage": None}
        if run is not None:
            u = run.usage()
            out["usage"] = {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"],
                            "total_tokens": u["total_tokens"],
                            "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
                            "output_tokens_details": {"reasoning_tokens": 0}}
        return out

    def message(self, text: str, status: str = "completed") -> dict:
        return {"type": "message", "id": self.msg_id, "status": status, "role": "assistant",
                "content": [] if status == "in_progress" else [_part(text)]}


def _part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(call, status: str = "completed") -> dict:
    return {"type": "function_call", "id": "fc_" + call.id.removeprefix("call_"), "call_id": call.id,
            "name": call.name, "arguments": call.arguments if status == "completed" else "", "status": status}


def status_of(run: Run) -> str:
    return "incomplete" if run.finish_reason == "length" else "completed"


def applied(p, defaults) -> dict:
    """What the response echoes of its sampling: the values run (the request's, else the server's defaults)."""
    s = sampling_of(p, defaults)
    return {"max_output_tokens": max_tokens_of(p, defaults), "temperature": s.temperature, "top_p": s.top_p}


async def respond(front, request):
    """``POST /v1/responses``: check and translate, submit, answer (or stream)."""
    arrival = time.monotonic()
    front.auth(request)
    body = await read_json(request)
    chat, names = await asyncio.to_thread(chat_body, body)
    try:   # errors of the chat path, named as the client named its fields
        prep = await asyncio.to_thread(front.prepare, chat, True)
        p = prep.params
        constraint = await front.constraints.compile(prep.spec, prep.field) if prep.spec is not None else None
        answer = Answer(body, front.reported(p), applied(p, front.defaults))
        handle = front.submit(p, prep.ids, answer.id, "input", constraint, None, lora=prep.lora)[0]
    except APIError as exc:
        raise names.renamed(exc) from None
    tools = ToolStream(prep.parser, prep.tool_names) if prep.parser is not None else None
    run = Run(request, handle, p, len(prep.ids), front.text.tokenizer, front.metrics, arrival, front.background,
              tools=tools, grammar=constraint)
    if body.get("stream"):
        from fastapi.responses import StreamingResponse
        from starlette.background import BackgroundTask

        return StreamingResponse(events(answer, run), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"}, background=BackgroundTask(run.abandon))
    text = await collect(run)
    if run.error is not None:
        raise run.error_object()
    text, calls = tools.calls_in(text, run.finish_reason == "length") if tools is not None else (text, [])
    output = ([answer.message(text or "", status_of(run))] if text or not calls else []) + [call_item(c) for c in calls]
    return answer.response(status_of(run), output, run)


async def events(answer: Answer, run: Run):
    """The Responses server-sent events of one answer."""
    seq = iter(range(1 << 62))

    def ev(kind: str, **data) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': next(seq), **data})}\n\n"

    yield ev("response.created", response=answer.response("in_progress", []))
    yield ev("response.in_progress", response=answer.response("in_progress", []))
    text, opened, where = "", False, dict(item_id=answer.msg_id, output_index=0, content_index=0)
    async for delta in run.deltas():
        if run.tools is not None:
            delta = run.tools.feed(delta)
        if not delta:
            continue
        if not opened:
            opened = True
            yield ev("response.output_item.added", output_index=0, item=answer.message("", "in_progress"))
            yield ev("response.content_part.added", part=_part(""), **where)
        text += delta
        yield ev("response.output_text.delta", delta=delta, logprobs=[], **where)
    if run.error is not None:
        err = run.error_object()
        yield ev("error", code=err.code or err.type, message=err.message, param=err.param)
        return
    calls = []
    if run.tools is not None:
        tail, calls = run.tools.finish(run.finish_reason == "length")
        if tail:
            for piece in _open_and_delta(ev, answer, where, tail, opened):
                yield piece
            text, opened = text + tail, True
    output = []
    if opened:
        yield ev("response.output_text.done", text=text, logprobs=[], **where)
        yield ev("response.content_part.done", part=_part(text), **where)
        output.append(answer.message(text, status_of(run)))
        yield ev("response.output_item.done", output_index=0, item=output[-1])
    for c in calls:
        for piece in _call_events(ev, c, len(output)):
            yield piece
        output.append(call_item(c))
    yield ev("response.completed" if status_of(run) == "completed" else "response.incomplete",
             response=answer.response(status_of(run), output, run))


def _open_and_delta(ev, answer: Answer, where: dict, delta: str, opened: bool):
    if not opened:
        yield ev("response.output_item.added", output_index=0, item=answer.message("", "in_progress"))
        yield ev("response.content_part.added", part=_part(""), **where)
    yield ev("response.output_text.delta", delta=delta, logprobs=[], **where)


def _call_events(ev, call, index: int):
    item = call_item(call)
    yield ev("response.output_item.added", output_index=index, item=call_item(call, "in_progress"))
    yield ev("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
             delta=call.arguments)
    yield ev("response.function_call_arguments.done", item_id=item["id"], output_index=index, name=call.name,
             arguments=call.arguments)
    yield ev("response.output_item.done", output_index=index, item=item)

