"""OpenAI's Responses API, ``POST /v1/responses``, over the chat path: a request's ``input`` items and
``instructions`` become chat messages, its ``tools`` / ``tool_choice`` / ``text.format`` the chat request's tools and
``response_format``, and the answer (text, ``function_call`` items) comes back as a ``response`` object or, with
``stream``, as the Responses server-sent events (``response.created`` ... ``response.output_text.delta`` ...
``response.function_call_arguments.done`` ... ``response.completed``).

Stateless: nothing is stored, so ``store: true``, ``previous_response_id``, ``conversation`` and ``background`` are
refused in one line (a client keeps the conversation itself, sending earlier ``function_call`` and
``function_call_output`` items back in ``input``, as openai-agents does). Every field is honoured or refused
(:data:`FIELDS`); input items and content parts of other kinds (images, files, reasoning) are refused naming where
they are.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from qeff_kv.serve.http.bodies import read_json
from qeff_kv.serve.wire.openai_io import bad
from qeff_kv.serve.http.responses import Run, collect
from qeff_kv.serve.structured.tool_io import ToolStream

#: top-level fields: honoured (None), or accepted only with one of these values (with the reason otherwise)
FIELDS = {
    "model": None, "input": None, "instructions": None, "max_output_tokens": None, "temperature": None,
    "top_p": None, "stream": None, "tools": None, "tool_choice": None, "parallel_tool_calls": None, "text": None,
    "metadata": None, "user": None, "safety_identifier": None, "prompt_cache_key": None,
    "store": ((False,), "store: true is not supported: this server keeps no responses (send the conversation in "
                       "input)"),
    "previous_response_id": ((), "previous_response_id is not supported: this server keeps no responses (send the "
                                 "earlier items in input)"),
    "conversation": ((), "conversation is not supported: this server keeps no conversations"),
    "background": ((False,), "background responses are not supported"),
    "truncation": (("disabled",), "truncation: only \"disabled\" is supported"),
    "include": (([],), "include is not supported (no reasoning, search or logprob items)"),
    "reasoning": (({},), "reasoning is not supported by this server"),
    "service_tier": (("auto", "default"), "service_tier: only auto or default"),
    "stream_options": (({}, {"include_obfuscation": False}), "stream_options is not supported"),
    "top_logprobs": ((0,), "top_logprobs is not supported on /v1/responses"),
    "max_tool_calls": ((), "max_tool_calls is not supported"),
    "prompt": ((), "prompt templates are not supported"),
}


def check_fields(body) -> None:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    for key, v in body.items():
        if key not in FIELDS:
            raise bad(f"unknown field {key!r}: not supported by /v1/responses on this server", key)
        rule = FIELDS[key]
        if rule is not None and v is not None and v not in rule[0]:
            raise bad(rule[1], key)


def _text_of(content, where: str) -> str:
    """A message's content: a string, or a list of ``input_text`` / ``output_text`` parts (joined)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"{where}.content must be a string or a list of text parts", "input")
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise bad(f"{where}.content[{j}]: only input_text / output_text parts are supported (got {kind!r})",
                      "input")
        out.append(part["text"])
    return "".join(out)


def messages_of(body: dict) -> list[dict]:
    """``instructions`` and ``input`` as chat messages (function calls as an assistant's ``tool_calls``, their
    outputs as ``role: tool`` messages)."""
    items = body.get("input")
    msgs = [{"role": "system", "content": body["instructions"]}] if isinstance(body.get("instructions"), str) else []
    if isinstance(items, str):
        return msgs + [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad("input must be a string or a non-empty list of items", "input")
    for i, it in enumerate(items):
        where = f"input[{i}]"
        kind = it.get("type", "message") if isinstance(it, dict) else None
        if kind == "message" and it.get("role") in ("user", "system", "developer", "assistant"):
            msgs.append({"role": it["role"], "content": _text_of(it.get("content"), where)})
        elif kind in ("function_call", "function_call_output") and not isinstance(it.get("call_id"), str):
            raise bad(f"{where}.call_id must be a string", "input")
        elif kind == "function_call":
            call = {"id": it.get("call_id"), "type": "function",
                    "function": {"name": it.get("name"), "arguments": it.get("arguments")}}
            if msgs and msgs[-1]["role"] == "assistant" and msgs[-1].get("tool_calls"):
                msgs[-1]["tool_calls"].append(call)   # parallel calls: one assistant turn
            else:
                msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            out = it.get("output")
            msgs.append({"role": "tool", "tool_call_id": it.get("call_id"),
                         "content": out if isinstance(out, str) else _text_of(out, where)})
        else:
            raise bad(f"{where}: items of type {kind!r} are not supported (message, function_call, "
                      "function_call_output)", "input")
    return msgs


def chat_body(body: dict) -> dict:
    """The chat-completions request that answers ``body``."""
    check_fields(body)
    if body.get("stream") not in (None, True, False):
        raise bad(f"stream must be true or false, got {body['stream']!r}", "stream")
    if body.get("instructions") is not None and not isinstance(body["instructions"], str):
        raise bad("instructions must be a string", "instructions")
    chat = {"messages": messages_of(body)}
    for src, dst in (("model", "model"), ("max_output_tokens", "max_tokens"), ("temperature", "temperature"),
                     ("top_p", "top_p"), ("parallel_tool_calls", "parallel_tool_calls")):
        if body.get(src) is not None:
            chat[dst] = body[src]
    tools = body.get("tools")
    if tools not in (None, []):
        if not isinstance(tools, list):
            raise bad("tools must be a list", "tools")
        chat["tools"] = [_tool(t, i) for i, t in enumerate(tools)]
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise bad("tool_choice must be auto, none, required or {type: function, name}", "tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    if choice is not None:
        chat["tool_choice"] = choice
    fmt = _format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    return chat


def _tool(t, i: int) -> dict:
    if not isinstance(t, dict) or t.get("type") != "function":
        kind = t.get("type") if isinstance(t, dict) else t
        raise bad(f"tools[{i}]: only function tools are supported (got {kind!r})", "tools")
    unknown = sorted(set(t) - {"type", "name", "description", "parameters", "strict"})
    if unknown:
        raise bad(f"tools[{i}].{unknown[0]} is not supported", "tools")
    return {"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters", "strict")
                                             if t.get(k) is not None}}


def _format(text) -> dict | None:
    """``text.format`` as chat's ``response_format`` (None: plain text)."""
    if text is None:
        return None
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"} or text.get("verbosity") not in (None,
                                                                                                          "medium"):
        raise bad("text takes format only (verbosity is not supported)", "text")
    fmt = text.get("format")
    if fmt is None or fmt == {"type": "text"}:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_object" and set(fmt) == {"type"}:
        return {"type": "json_object"}
    if kind == "json_schema" and not set(fmt) - {"type", "name", "schema", "strict", "description"}:
        return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    raise bad(f"text.format must be text, json_object or json_schema {{name, schema, strict, description}}, got "
              f"{fmt!r}"[:300], "text")


# ============================================================================================ the answer
class Answer:
    """What a response object repeats from its request, and its ids."""

    def __init__(self, body: dict, model: str):
        self.id = "resp_" + uuid.uuid4().hex
        self.msg_id = "msg_" + uuid.uuid4().hex
        self.created = int(time.time())
        self.body, self.model = body, model

    def response(self, status: str, output: list, run: Run | None = None) -> dict:
        b = self.body
        incomplete = status == "incomplete"
        out = {"id": self.id, "object": "response", "created_at": self.created, "status": status,
               "error": None, "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
               "instructions": b.get("instructions"), "max_output_tokens": b.get("max_output_tokens"),
               "model": self.model, "output": output, "parallel_tool_calls": b.get("parallel_tool_calls", True),
               "previous_response_id": None, "reasoning": None, "store": False,
               "temperature": b.get("temperature"), "text": b.get("text") or {"format": {"type": "text"}},
               "tool_choice": b.get("tool_choice") or "auto", "tools": b.get("tools") or [],
               "top_p": b.get("top_p"), "truncation": "disabled", "metadata": b.get("metadata") or {},
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


async def respond(front, request):
    """``POST /v1/responses``: check and translate, submit, answer (or stream)."""
    arrival = time.monotonic()
    front.auth(request)
    body = await read_json(request)
    chat = await asyncio.to_thread(chat_body, body)
    prep = await asyncio.to_thread(front.prepare, chat, True)
    p = prep.params
    constraint = await front.constraints.compile(prep.spec, prep.field) if prep.spec is not None else None
    answer = Answer(body, p.model or front.engine.model_name)
    handle = front.submit(p, prep.ids, answer.id, "input", constraint, None, lora=prep.lora)[0]
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
    output = ([answer.message(text or "")] if text or not calls else []) + [call_item(c) for c in calls]
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
        output.append(answer.message(text))
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

