"""OpenAI's request and error shapes: the body of ``/v1/completions`` and ``/v1/chat/completions`` checked field
by field (a one-line message naming the field), and the error object ``{"error": {message, type, param, code}}``.

Accepted: ``model``, ``prompt`` (text, token ids, or a list of one of them) / ``messages``, ``max_tokens`` or
``max_completion_tokens``, ``temperature`` [0, 2], ``top_p`` (0, 1], ``seed``, ``stop`` (a string or a list of up
to 16), ``n`` (1 only), ``stream``, ``stream_options.include_usage``, and two extensions: ``top_k`` and
``ignore_eos``. Structured output (``response_format`` and its extensions) is read by :mod:`.structured_io`, tools
by :mod:`.tool_io`; messages may carry an assistant's ``tool_calls`` and ``role: "tool"`` results. Fields that
would change the output in ways not implemented (``logprobs``, ``echo``, ``best_of`` > 1, ``functions``,
``suffix``) are refused rather than ignored; other unknown fields are ignored, as OpenAI's clients send many.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_STOPS = 16


class APIError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, message: str, *, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(" ".join(str(message).split()))
        self.message = str(self)
        self.status, self.type, self.param, self.code = status, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(message, param=param, code=code)


@dataclass
class Params:
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False
    # exactly one of these
    prompt_text: str | None = None
    prompt_ids: list[int] | None = None
    messages: list[dict] | None = None


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(body: dict, key: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise bad(f"{key} must be a number, got {v!r}", key)
    if v > hi or v < lo or (lo_open and v == lo):
        raise bad(f"{key} must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {v!r}", key)
    return float(v)


def _int(body: dict, key: str, lo: int, hi: int | None = None) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if not _is_int(v):
        raise bad(f"{key} must be an integer, got {v!r}", key)
    if v < lo or (hi is not None and v > hi):
        raise bad(f"{key} must be in [{lo}, {hi}], got {v}" if hi is not None else f"{key} must be >= {lo}, got {v}",
                  key)
    return v


def _bool(body: dict, key: str) -> bool:
    v = body.get(key)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise bad(f"{key} must be true or false, got {v!r}", key)
    return v


def parse(body, *, chat: bool, model_name: str, ctx_len: int) -> Params:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    model = body.get("model")
    if model is not None:
        if not isinstance(model, str):
            raise bad(f"model must be a string, got {model!r}", "model")
        if model != model_name:
            raise bad(f"the model {model!r} does not exist; this server serves {model_name!r}", "model",
                      "model_not_found")
    p = Params()
    mt = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    p.max_tokens = _int(body, mt, 1, ctx_len)
    p.temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    p.top_p = _number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    p.top_k = _int(body, "top_k", 0) or 0
    p.seed = _int(body, "seed", 0, 2 ** 63 - 1)
    n = _int(body, "n", 1)
    if n is not None and n != 1:
        raise bad(f"n must be 1 (one choice per request), got {n}", "n")
    best_of = _int(body, "best_of", 1)
    if best_of is not None and best_of != 1:
        raise bad(f"best_of must be 1, got {best_of}", "best_of")
    for key in ("logprobs", "echo", "top_logprobs", "functions", "suffix"):
        v = body.get(key)
        if v not in (None, False, [], 0, ""):
            raise bad(f"{key} is not supported by this server", key)
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise bad(f"stop must be a string or a list of strings, got {stop!r}", "stop")
        if len(stops) > MAX_STOPS:
            raise bad(f"stop takes at most {MAX_STOPS} strings, got {len(stops)}", "stop")
        p.stop = [s for s in stops if s]
    p.stream = _bool(body, "stream")
    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict):
            raise bad(f"stream_options must be an object, got {so!r}", "stream_options")
        if so.get("include_usage") is not None and not isinstance(so.get("include_usage"), bool):
            raise bad("stream_options.include_usage must be true or false", "stream_options")
        p.include_usage = bool(so.get("include_usage"))
    p.ignore_eos = _bool(body, "ignore_eos")
    if chat:
        p.messages = _messages(body.get("messages"))
    else:
        _prompt(body.get("prompt", None), p)
    return p


def _prompt(v, p: Params) -> None:
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
        v = v[0]   # a batch of one prompt
    if isinstance(v, str):
        if not v:
            raise bad("prompt is empty", "prompt")
        p.prompt_text = v
        return
    if isinstance(v, list) and v and all(_is_int(t) for t in v):
        if any(t < 0 for t in v):
            raise bad("prompt token ids must be >= 0", "prompt")
        p.prompt_ids = list(v)
        return
    if v is None:
        raise bad("prompt is required", "prompt")
    if isinstance(v, list) and len(v) > 1 and all(isinstance(x, (str, list)) for x in v):
        raise bad(f"prompt holds {len(v)} prompts; send one prompt per request", "prompt")
    raise bad("prompt must be a string or a non-empty list of token ids", "prompt")


ROLES = ("system", "developer", "user", "assistant", "tool")


def _messages(v) -> list[dict]:
    if v is None:
        raise bad("messages is required", "messages")
    if not isinstance(v, list) or not v:
        raise bad("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(v):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"{where} must be an object with role and content", where)
        role = m.get("role")
        if role not in ROLES:
            raise bad(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", f"{where}.role")
        content = m.get("content")
        if isinstance(content, list):   # content parts: text only
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad(f"{where}.content[{j}] must be a text part ({{\"type\": \"text\", \"text\": ...}})",
                              f"{where}.content")
                parts.append(part["text"])
            content = "".join(parts)
        extra = _tool_fields(m, role, where)
        if content is None and extra.get("tool_calls"):
            content = ""
        if not isinstance(content, str):
            raise bad(f"{where}.content must be a string, got {content!r}", f"{where}.content")
        out.append({"role": "system" if role == "developer" else role, "content": content, **extra})
    return out


def _tool_fields(m: dict, role: str, where: str) -> dict:
    """An assistant's ``tool_calls`` (``[{id, type: function, function: {name, arguments: JSON text}}]``) and a
    tool result's ``tool_call_id``, checked."""
    out = {}
    calls = m.get("tool_calls")
    if calls not in (None, []):
        if role != "assistant" or not isinstance(calls, list):
            raise bad(f"{where}.tool_calls must be a list on an assistant message", f"{where}.tool_calls")
        for j, c in enumerate(calls):
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                    or not isinstance(fn.get("arguments"), str):
                raise bad(f"{where}.tool_calls[{j}] must be {{id, type: function, function: {{name, arguments}}}} "
                          "with arguments a JSON string", f"{where}.tool_calls")
        out["tool_calls"] = calls
    if role == "tool":
        tid = m.get("tool_call_id")
        if not isinstance(tid, str) or not tid:
            raise bad(f"{where}.tool_call_id is required on a tool message", f"{where}.tool_call_id")
        out["tool_call_id"] = tid
        if isinstance(m.get("name"), str):
            out["name"] = m["name"]
    return out
