"""OpenAI's Responses request (``POST /v1/responses``) checked strictly and translated into the chat-completions body
that answers it; and the table that gives the chat route's errors back the names the client sent.

* :func:`check_fields`: every top-level field is one OpenAI's Responses API defines (:data:`TYPES`), of its JSON
  type (a boolean is ``true``/``false``, never ``0`` or ``1``; ``metadata`` a map of at most 16 string keys of
  <= 64 characters to strings of <= 512), and either honoured or, when set to anything but its "off" value
  (compared with its JSON type: ``store: 0`` is not ``store: false``), refused with the reason (:data:`REFUSED`).
* :func:`messages_of`: ``instructions`` and ``input`` as chat messages, each input item checked (its keys those
  OpenAI defines for its kind; ids, statuses, annotations and logprobs that clients send back accepted and not
  read), with where each message came from.
* :func:`chat_body`: the chat request, and a :class:`Names` that :meth:`~Names.renamed` turns an error raised
  after the translation (``max_tokens`` out of range, ``response_format`` that does not compile, a message the
  template refuses) into one naming ``max_output_tokens``, ``text.format``, ``input[i]``.
"""

from __future__ import annotations

import re

from qeff_kv.serve.wire.openai_io import APIError, bad, is_int, known_keys

_NUMBER = "a number"
#: every top-level field of OpenAI's Responses API (``responses.create``), with the JSON types it takes (null: as
#: if left out) and how they are named in an error
TYPES = {
    "model": (str, "a string"), "input": ((str, list), "a string or a list of items"),
    "instructions": (str, "a string"), "max_output_tokens": ("int", "an integer"),
    "temperature": ("number", _NUMBER), "top_p": ("number", _NUMBER), "stream": (bool, "true or false"),
    "tools": (list, "a list of tools"), "tool_choice": ((str, dict), "auto, none, required or {type: function, "
                                                                      "name}"),
    "parallel_tool_calls": (bool, "true or false"), "text": (dict, "an object {format, verbosity}"),
    "metadata": (dict, "an object of string values"), "user": (str, "a string"),
    "safety_identifier": (str, "a string"), "prompt_cache_key": (str, "a string"), "store": (bool, "true or false"),
    "previous_response_id": (str, "a string"), "conversation": ((str, dict), "a string or an object"),
    "background": (bool, "true or false"), "truncation": (str, "auto or disabled"),
    "include": (list, "a list"), "reasoning": (dict, "an object"), "service_tier": (str, "a string"),
    "stream_options": (dict, "an object"), "top_logprobs": ("int", "an integer"),
    "max_tool_calls": ("int", "an integer"), "prompt": (dict, "an object"),
    "prompt_cache_retention": (str, "a string"), "prompt_cache_options": (dict, "an object"),
    "access_programs": (dict, "an object"), "background_options": (dict, "an object"),
    "context_management": (list, "a list"), "image": (dict, "an object"), "moderation": (dict, "an object"),
}
#: the fields accepted only with one of these values (null always), with the reason given for any other
REFUSED = {
    "store": ((False,), "store: true is not supported: this server keeps no responses (send the conversation in "
                        "input)"),
    "previous_response_id": ((), "previous_response_id is not supported: this server keeps no responses (send the "
                                  "earlier items in input)"),
    "conversation": ((), "conversation is not supported: this server keeps no conversations"),
    "background": ((False,), "background responses are not supported"),
    "background_options": ((), "background responses are not supported"),
    "truncation": (("disabled",), "truncation: only \"disabled\" is supported"),
    "include": (([],), "include is not supported (no reasoning, search or logprob items)"),
    "reasoning": (({},), "reasoning is not supported by this server"),
    "service_tier": (("auto", "default"), "service_tier: only auto or default"),
    "stream_options": (({}, {"include_obfuscation": False}), "stream_options is not supported"),
    "top_logprobs": ((0,), "top_logprobs is not supported on /v1/responses"),
    "max_tool_calls": ((), "max_tool_calls is not supported"),
    "prompt": ((), "prompt templates are not supported"),
    "prompt_cache_retention": ((), "prompt_cache_retention is not supported (cached prompts are kept while their "
                                   "slot is not needed)"),
    "prompt_cache_options": ((), "prompt_cache_options is not supported (prompt reuse is automatic)"),
    "access_programs": ((), "access_programs is not supported by this server"),
    "context_management": (([],), "context_management is not supported by this server"),
    "image": ((), "image settings are not supported (no image input on /v1/responses)"),
    "moderation": ((), "moderation is not supported by this server"),
}
#: OpenAI's bounds on ``metadata``
METADATA_KEYS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512


def same(a, b) -> bool:
    """``a == b`` as JSON values: a boolean equals only a boolean (Python's ``0 == False`` is not JSON's)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _of_type(v, kind) -> bool:
    if kind == "int":
        return is_int(v)
    if kind == "number":
        return not isinstance(v, bool) and isinstance(v, (int, float))
    return isinstance(v, kind) and (kind is bool or not isinstance(v, bool))


def check_fields(body) -> None:
    """A 400 naming the first field of ``body`` that is unknown, of the wrong type or refused."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    for key, v in body.items():
        if key not in TYPES:
            raise bad(f"unknown field {key!r}: not supported by /v1/responses on this server", key,
                      "unknown_parameter")
        if v is None:
            continue
        kind, named = TYPES[key]
        if not _of_type(v, kind):
            raise bad(f"{key} must be {named}, got {_shown(v)}", key)
        rule = REFUSED.get(key)
        if rule is not None and not any(same(v, off) for off in rule[0]):
            raise bad(rule[1], key)
    _check_metadata(body.get("metadata"))


def _shown(v) -> str:
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


def _check_metadata(meta) -> None:
    if not meta:
        return
    if len(meta) > METADATA_KEYS:
        raise bad(f"metadata holds {len(meta)} keys; at most {METADATA_KEYS}", "metadata")
    for k, v in meta.items():
        if len(k) > METADATA_KEY_CHARS:
            raise bad(f"metadata keys are at most {METADATA_KEY_CHARS} characters, got {len(k)}", "metadata")
        if not isinstance(v, str) or len(v) > METADATA_VALUE_CHARS:
            raise bad(f"metadata[{k!r}] must be a string of at most {METADATA_VALUE_CHARS} characters, got "
                      f"{_shown(v)}"[:300], "metadata")


# ============================================================================================ input items
#: the keys OpenAI defines on the input items served (read or accepted unread: ids, statuses, phases)
MESSAGE_KEYS = ("type", "role", "content", "id", "status", "phase")
CALL_KEYS = ("type", "id", "call_id", "name", "arguments", "status", "namespace", "caller")
OUTPUT_KEYS = ("type", "id", "call_id", "output", "status", "caller", "name", "namespace")
PART_KEYS = {"input_text": ("type", "text", "prompt_cache_breakpoint"),
             "output_text": ("type", "text", "annotations", "logprobs"), "text": ("type", "text")}
ROLES = ("user", "system", "developer", "assistant")
STATUSES = ("in_progress", "completed", "incomplete")


def _text_of(content, where: str, field: str = "content") -> str:
    """A message's content (or an output's ``output``): a string, or a list of ``input_text`` / ``output_text``
    parts (joined)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"{where}.{field} must be a string or a list of text parts", f"{where}.{field}")
    out = []
    for j, part in enumerate(content):
        at = f"{where}.{field}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in PART_KEYS:
            raise bad(f"{at}: only input_text / output_text parts are supported (got {_shown(kind)})", at)
        known_keys(part, PART_KEYS[kind], at)
        if not isinstance(part.get("text"), str):
            raise bad(f"{at}.text must be a string, got {_shown(part.get('text'))}", f"{at}.text")
        out.append(part["text"])
    return "".join(out)


def _strings(it: dict, where: str, keys, required=()) -> None:
    for key in keys:
        v = it.get(key)
        if (v is not None or key in required) and not isinstance(v, str):
            raise bad(f"{where}.{key} must be a string, got {_shown(v)}", f"{where}.{key}")
    if it.get("status") is not None and it["status"] not in STATUSES:
        raise bad(f"{where}.status must be one of {', '.join(STATUSES)}, got {_shown(it['status'])}",
                  f"{where}.status")


def _item(msgs: list, origins: list, it, where: str) -> None:
    """One input item appended as chat messages (with its origin)."""
    if not isinstance(it, dict):
        raise bad(f"{where} must be an object (a message, function_call or function_call_output item)", where)
    kind = it.get("type", "message")
    if kind == "message":
        known_keys(it, MESSAGE_KEYS, where)
        if it.get("role") not in ROLES:
            raise bad(f"{where}.role must be one of {', '.join(ROLES)}, got {_shown(it.get('role'))}",
                      f"{where}.role")
        _strings(it, where, ("id",))
        msgs.append({"role": it["role"], "content": _text_of(it.get("content"), where)})
    elif kind == "function_call":
        known_keys(it, CALL_KEYS, where)
        _strings(it, where, ("call_id", "name", "arguments", "id", "namespace"), ("call_id", "name", "arguments"))
        call = {"id": it["call_id"], "type": "function", "function": {"name": it["name"], "arguments": it["arguments"]}}
        if msgs and msgs[-1]["role"] == "assistant" and msgs[-1].get("tool_calls"):
            msgs[-1]["tool_calls"].append(call)   # parallel calls: one assistant turn
            return
        msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})
    elif kind == "function_call_output":
        known_keys(it, OUTPUT_KEYS, where)
        _strings(it, where, ("call_id", "id", "name", "namespace"), ("call_id",))
        out = it.get("output")
        msgs.append({"role": "tool", "tool_call_id": it["call_id"],
                     "content": out if isinstance(out, str) else _text_of(out, where, "output")})
    else:
        raise bad(f"{where}: items of type {_shown(kind)} are not supported (message, function_call, "
                  "function_call_output)", f"{where}.type")
    origins.append(where)


def messages_of(body: dict) -> tuple[list[dict], list[str]]:
    """``instructions`` and ``input`` as chat messages (function calls as an assistant's ``tool_calls``, their
    outputs as ``role: tool`` messages), and where each came from (``instructions``, ``input``, ``input[i]``)."""
    items = body.get("input")
    msgs, origins = [], []
    if body.get("instructions") is not None:
        msgs.append({"role": "system", "content": body["instructions"]})
        origins.append("instructions")
    if isinstance(items, str):
        return msgs + [{"role": "user", "content": items}], origins + ["input"]
    if not isinstance(items, list) or not items:
        raise bad("input must be a string or a non-empty list of items", "input")
    for i, it in enumerate(items):
        _item(msgs, origins, it, f"input[{i}]")
    return msgs, origins


# ============================================================================================ the chat request
def chat_body(body) -> tuple[dict, "Names"]:
    """The chat-completions request that answers ``body``, and the names to give its errors back."""
    check_fields(body)
    messages, origins = messages_of(body)
    chat = {"messages": messages}
    for src, dst in (("model", "model"), ("max_output_tokens", "max_tokens"), ("temperature", "temperature"),
                     ("top_p", "top_p"), ("parallel_tool_calls", "parallel_tool_calls")):
        if body.get(src) is not None:
            chat[dst] = body[src]
    tools = body.get("tools")
    if tools:
        chat["tools"] = [_tool(t, i) for i, t in enumerate(tools)]
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        known_keys(choice, ("type", "name"), "tool_choice")
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise bad("tool_choice must be auto, none, required or {type: function, name}", "tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    if choice is not None:
        chat["tool_choice"] = choice
    fmt = _format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    return chat, Names(origins)


def _tool(t, i: int) -> dict:
    where = f"tools[{i}]"
    if not isinstance(t, dict) or t.get("type") != "function":
        kind = t.get("type") if isinstance(t, dict) else t
        raise bad(f"{where}: only function tools are supported (got {_shown(kind)})", f"{where}.type")
    known_keys(t, ("type", "name", "description", "parameters", "strict"), where)
    return {"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters", "strict")
                                             if t.get(k) is not None}}


def _format(text) -> dict | None:
    """``text.format`` as chat's ``response_format`` (None: plain text)."""
    if text is None:
        return None
    known_keys(text, ("format", "verbosity"), "text")
    if text.get("verbosity") not in (None, "medium"):
        raise bad(f"text.verbosity {_shown(text['verbosity'])} is not supported (medium only)", "text.verbosity")
    fmt = text.get("format")
    if fmt is None or same(fmt, {"type": "text"}):
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_object":
        known_keys(fmt, ("type",), "text.format")
        return {"type": "json_object"}
    if kind == "json_schema":
        known_keys(fmt, ("type", "name", "schema", "strict", "description"), "text.format")
        return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    raise bad(f"text.format must be text, json_object or json_schema {{name, schema, strict, description}}, got "
              f"{_shown(fmt)}", "text.format")


# ============================================================================================ errors renamed
#: chat names -> the Responses names (longest first; ``messages[i]`` is mapped through the item origins)
RENAMES = (("response_format.json_schema", "text.format"), ("response_format", "text.format"),
           ("max_completion_tokens", "max_output_tokens"), ("max_tokens", "max_output_tokens"),
           ("tool_choice.function", "tool_choice"))
_NAME = re.compile(r"\bmessages\[(\d+)\]|\bmessages\b|\b(tools\[\d+\])\.function\b|"
                   + "|".join(rf"\b{re.escape(a)}\b" for a, _ in RENAMES))


class Names:
    """What an error raised on the chat request calls the client's fields."""

    def __init__(self, origins: list[str]):
        self.origins = origins

    def _one(self, m: re.Match) -> str:
        if m.group(1) is not None:   # messages[i]: the item (or instructions) it came from
            i = int(m.group(1))
            return self.origins[i] if i < len(self.origins) else "input"
        if m.group(2) is not None:
            return m.group(2)
        return dict(RENAMES).get(m.group(0), "input")

    def rename(self, text: str) -> str:
        return _NAME.sub(self._one, text).replace("input hold ", "input holds ")   # "messages hold ..."

    def renamed(self, exc: APIError) -> APIError:
        """``exc`` with its param and message in the Responses names (``prompt`` as a param is ``input``)."""
        param = "input" if exc.param == "prompt" else exc.param
        return APIError(self.rename(exc.message), status=exc.status, type=exc.type,
                        param=self.rename(param) if param is not None else None, code=exc.code)
