"""OpenAI's request and error shapes: the body of ``/v1/completions`` and ``/v1/chat/completions`` checked field
by field (a one-line message naming the field), and the error object ``{"error": {message, type, param, code}}``.

Every field is either honoured or refused with a 400 naming it (:data:`HONOURED`, :data:`NO_EFFECT`,
:func:`_refuse_unsupported`); a field this server does not know at all is refused too, so nothing a client sends
is silently ignored. Honoured: ``model``, ``prompt`` (text, token ids, or a list of one of them) / ``messages``,
``max_tokens`` or ``max_completion_tokens``, ``temperature`` [0, 2], ``top_p`` (0, 1], ``seed``, ``stop`` (a
string or a list of up to 16), ``n`` (up to the server's ``--max-n``), ``stream``, ``stream_options``
(``include_usage``), ``logprobs`` / ``top_logprobs`` (chat: a boolean and 0-20; completions: 0-5), ``logit_bias``
(token id -> [-100, 100]), ``presence_penalty`` and ``frequency_penalty`` [-2, 2], ``echo`` (completions; with ``logprobs`` the prompt
tokens' logprobs too, on any export; ``max_tokens: 0`` with it), the
vLLM / llama-server extensions ``top_k``, ``min_p``, ``repetition_penalty`` and ``ignore_eos``, and vLLM's
``kv_transfer_params`` (its P/D protocol, on a server with ``--kv-role``; :mod:`.pd`); ``model`` may name a LoRA
adapter the server serves, and llama-server's ``lora`` (:mod:`.lora_io`) choose one. Accepted with no
effect on the output, as OpenAI defines them: ``user``, ``safety_identifier``, ``prompt_cache_key``,
``metadata``, ``service_tier`` ``auto``/``default``, ``store: false``, ``best_of: 1``. The sampling fields a
request leaves out take the server's defaults (:class:`~.defaults.SamplingDefaults`). Structured output
(``response_format`` and vLLM's / llama-server's extensions, :data:`STRUCTURED`) is read by :mod:`.structured_io`,
tools (:data:`TOOLS`, chat only) by :mod:`.tool_io`; messages may carry an assistant's ``tool_calls`` and
``role: "tool"`` results; ``continue_final_message`` / ``add_generation_prompt`` (assistant prefill) are read by
:mod:`.prefill`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_STOPS = 16
#: OpenAI's bounds: chat top_logprobs 0-20, completions logprobs 0-5
MAX_TOP_LOGPROBS_CHAT = 20
MAX_LOGPROBS_COMPLETIONS = 5

#: the fields honoured on both routes (see the module docstring); chat and completions add their own
HONOURED = frozenset({
    "model", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "stream", "stream_options", "logprobs",
    "logit_bias", "presence_penalty", "frequency_penalty", "top_k", "min_p", "repetition_penalty", "ignore_eos",
    "lora",
})
#: structured output (read by :mod:`.structured_io`): OpenAI's, vLLM's and llama-server's names
STRUCTURED = frozenset({"response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                        "guided_grammar", "json_schema", "grammar"})
#: tool calls (read by :mod:`.tool_io`; chat only)
TOOLS = frozenset({"tools", "tool_choice", "parallel_tool_calls"})
#: assistant prefill (read by :mod:`.prefill`; vLLM's names)
PREFILL = frozenset({"continue_final_message", "add_generation_prompt"})
HONOURED_CHAT = HONOURED | STRUCTURED | TOOLS | PREFILL | {"messages", "max_completion_tokens", "top_logprobs",
                                                           "kv_transfer_params"}
HONOURED_COMPLETIONS = HONOURED | STRUCTURED | {"prompt", "echo", "kv_transfer_params"}
#: vLLM's P/D protocol (serve/pd.py): the keys of ``kv_transfer_params`` read (vLLM's names, then ours); any other
#: key is refused
KV_TRANSFER_KEYS = frozenset({"do_remote_decode", "do_remote_prefill", "remote_engine_id", "remote_block_ids",
                              "remote_host", "remote_port", "remote_request_id", "tp_size",
                              "transfer_id", "num_tokens", "transfer_bytes", "kv_load_failure_policy"})
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")
#: fields that by OpenAI's definition do not change the output (identifiers, cache hints), with the values
#: accepted; any other value is refused
NO_EFFECT = {"user": None, "safety_identifier": None, "prompt_cache_key": None, "metadata": None,
             "service_tier": ("auto", "default"), "store": (False,), "best_of": (1,)}
#: known fields refused when given a value other than these (their "off" values); with a reason
REFUSED = {
    "tools": ((None, []), "tools are supported on /v1/chat/completions only"),
    "tool_choice": ((None, "none"), "tool_choice is supported on /v1/chat/completions only (with tools)"),
    "parallel_tool_calls": ((None,), "parallel_tool_calls is supported on /v1/chat/completions only"),
    "functions": ((None, []), "functions are not supported by this server"),
    "function_call": ((None, "none"), "function_call needs functions, which this server does not support"),
    "audio": ((None,), "audio output is not supported by this server"),
    "modalities": ((None, ["text"]), 'modalities: only ["text"] is supported'),
    "prediction": ((None,), "prediction (predicted outputs) is not supported by this server"),
    "reasoning_effort": ((None,), "reasoning_effort is not supported by this server"),
    "verbosity": ((None,), "verbosity is not supported by this server"),
    "web_search_options": ((None,), "web search is not supported by this server"),
    "prompt_cache_retention": ((None,), "prompt_cache_retention is not supported (cached prompts are kept "
                                        "while their slot is not needed)"),
    "suffix": ((None, ""), "suffix (insertion) is not supported by this server"),
    "moderation": ((None,), "moderation is not supported by this server"),
    "prompt_cache_options": ((None,), "prompt_cache_options is not supported (prompt reuse is automatic)"),
    "repeat_penalty": ((None,), "repeat_penalty (llama-server's, over the last tokens) is not supported; use "
                                "repetition_penalty (over the whole prompt and output)"),
    # vLLM's; its P/D proxy sends them back as null to the decode server
    "min_tokens": ((None, 0), "min_tokens is not supported by this server"),
    "min_completion_tokens": ((None, 0), "min_completion_tokens is not supported by this server"),
}


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


def known_keys(obj: dict, keys, where: str) -> None:
    """A 400 naming the path of the first key of ``obj`` not in ``keys`` (OpenAI's ``unknown_parameter``): a nested
    object's unknown key is refused, never ignored."""
    for key in obj:
        if key not in keys:
            raise bad(f"unknown parameter {where}.{key} (accepted there: {', '.join(keys)})", f"{where}.{key}",
                      "unknown_parameter")


@dataclass
class Params:
    max_tokens: int | None = None
    # sampling: None where the request leaves it to the server's defaults
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None
    n: int = 1
    #: None: no logprobs; else how many alternatives per token (0: the chosen token's only); with ``echo``, the
    #: prompt's tokens get theirs too (the first one None, as vLLM)
    logprobs: int | None = None
    echo: bool = False
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False
    # exactly one of these
    prompt_text: str | None = None
    prompt_ids: list[int] | None = None
    messages: list[dict] | None = None
    #: vLLM's P/D protocol: the request's ``kv_transfer_params`` (checked by :func:`_kv_transfer`), or None
    kv_transfer_params: dict | None = None
    #: the ``model`` given (the served model's name or a LoRA adapter's), or None
    model: str | None = None


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(body: dict, key: str, default, lo: float, hi: float, lo_open: bool = False):
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
    if not is_int(v):
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


def _refuse_unsupported(body: dict, chat: bool) -> None:
    """A 400 for a field not honoured: an unknown one, a refused one set, or a no-effect one with another value."""
    honoured = HONOURED_CHAT if chat else HONOURED_COMPLETIONS
    for key, v in body.items():
        if key in honoured:
            continue
        if key in NO_EFFECT:
            allowed = NO_EFFECT[key]
            if v is not None and allowed is not None and v not in allowed:
                raise bad(f"{key}={v!r} is not supported (accepted: {', '.join(map(repr, allowed))})", key)
            continue
        if key in REFUSED:
            off, why = REFUSED[key]
            if v not in off:
                raise bad(why, key)
            continue
        route = "/v1/chat/completions" if chat else "/v1/completions"
        raise bad(f"unknown field {key!r}: not supported by {route} on this server", key)


@dataclass(frozen=True)
class ModelNames:
    """The names a server answers to: ``name`` (what answers report and ``/v1/models`` lists first), its
    ``aliases`` (vLLM's further ``--served-model-name`` names: accepted in requests, listed, answered as ``name``),
    and ``any_name`` (llama-server's behaviour, ``--accept-any-model-name``: any other name is this model too, and
    the answer repeats the name asked for)."""

    name: str
    aliases: tuple[str, ...] = ()
    any_name: bool = False

    @property
    def listed(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)

    def check(self, model, adapters=()) -> None:
        """``model``, when given, is one of the names or of the LoRA ``adapters`` (or any string with
        ``any_name``); else a 400 ``model_not_found``."""
        if model is None:
            return
        if not isinstance(model, str):
            raise bad(f"model must be a string, got {model!r}", "model")
        if model in self.listed or model in adapters or self.any_name:
            return
        names = " or ".join(map(repr, self.listed))
        also = f" and the LoRA adapters {', '.join(map(repr, adapters))}" if adapters else ""
        raise bad(f"the model {model!r} does not exist; this server serves {names}{also}", "model", "model_not_found")

    def reported(self, model: str | None, adapters=()) -> str:
        """The ``model`` an answer carries: an adapter's own name, the name asked for on a server answering any
        name, else :attr:`name`."""
        if model is not None and (model in adapters or (self.any_name and model not in self.listed)):
            return model
        return self.name


def check_model(model, model_name: "str | ModelNames", adapters=()) -> None:
    """``model``, when given, is the served model's name (one of its :class:`ModelNames`) or one of its LoRA
    ``adapters``; else a 400 ``model_not_found``."""
    names = model_name if isinstance(model_name, ModelNames) else ModelNames(model_name)
    names.check(model, adapters)


def parse(body, *, chat: bool, model_name: "str | ModelNames", ctx_len: int, max_n: int = 1, kv_role: str | None = None,
          adapters=()) -> Params:
    """The checked request (``adapters``: the names of the LoRA adapters served, which ``model`` may name;
    llama-server's ``lora`` is read by :func:`.lora_io.lora_pairs`)."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    check_model(body.get("model"), model_name, adapters)
    _refuse_unsupported(body, chat)
    p = Params(model=body.get("model"))
    mt = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    p.max_tokens = _int(body, mt, 1 if chat else 0, ctx_len)
    _sampling(body, p)
    n = _int(body, "n", 1)
    if n is not None and n > max_n:
        raise bad(f"n must be at most {max_n} (the server's --max-n), got {n}", "n")
    p.n = n or 1
    _logprobs(body, p, chat)
    _output(body, p)
    if chat:
        p.messages = checked_messages(body.get("messages"))
    else:
        p.echo = _bool(body, "echo")
        if p.max_tokens == 0 and not p.echo:
            raise bad("max_tokens 0 goes with echo (the prompt, scored with logprobs)", mt)
        _prompt(body.get("prompt", None), p)
    p.kv_transfer_params = _kv_transfer(body.get("kv_transfer_params"), p, kv_role)
    return p


def _kv_transfer(v, p: Params, kv_role: str | None) -> dict | None:
    """vLLM's ``kv_transfer_params`` (serve/pd.py): an object of :data:`KV_TRANSFER_KEYS`, on a server with a KV role
    that does what it asks: ``do_remote_decode`` (a producer: one token, not streamed, one choice) or
    ``do_remote_prefill`` (a consumer: ``remote_engine_id`` and ``transfer_id`` strings, ``num_tokens`` an integer >= 1
and ``transfer_bytes`` >= 0 where given (not -1, 0, "5", 5.0 or true), one choice, no logprobs)."""
    param = "kv_transfer_params"
    if v is None:
        return None
    if not isinstance(v, dict):
        raise bad(f"kv_transfer_params must be an object, got {v!r}", param)
    if kv_role is None:
        raise bad("kv_transfer_params needs a server started with --kv-role producer, consumer or both", param)
    unknown = sorted(k for k in v if k not in KV_TRANSFER_KEYS)
    if unknown:
        raise bad(f"kv_transfer_params.{unknown[0]} is not supported (known: {', '.join(sorted(KV_TRANSFER_KEYS))})",
                  param)
    for key in ("do_remote_decode", "do_remote_prefill"):
        if v.get(key) is not None and not isinstance(v[key], bool):
            raise bad(f"kv_transfer_params.{key} must be true or false, got {v[key]!r}", param)
    decode, prefill = bool(v.get("do_remote_decode")), bool(v.get("do_remote_prefill"))
    if decode and prefill:
        raise bad("kv_transfer_params: do_remote_decode and do_remote_prefill together", param)
    if (decode or prefill) and p.n != 1:
        raise bad("kv_transfer_params goes with one choice (n = 1)", param)
    if decode:
        if kv_role not in ("producer", "both"):
            raise bad(f"kv_transfer_params.do_remote_decode needs a KV producer; this server is a {kv_role}", param)
        if p.stream or p.max_tokens != 1:
            raise bad("kv_transfer_params.do_remote_decode needs max_tokens 1 and stream false (the producer "
                      "prefills, samples one token and holds the KV)", param)
    if prefill:
        if kv_role not in ("consumer", "both"):
            raise bad(f"kv_transfer_params.do_remote_prefill needs a KV consumer; this server is a {kv_role}", param)
        for key in ("remote_engine_id", "transfer_id"):
            if not isinstance(v.get(key), str) or not v[key] or len(v[key]) > 200:
                raise bad(f"kv_transfer_params.{key} must be the string a producer answered, got {v.get(key)!r}",
                          param)
        for key, lo in (("num_tokens", 1), ("transfer_bytes", 0)):
            if v.get(key) is not None and (not is_int(v[key]) or v[key] < lo):
                raise bad(f"kv_transfer_params.{key} must be the producer's integer (>= {lo}), got {v[key]!r}", param)
        if p.logprobs is not None:
            raise bad("logprobs do not go with kv_transfer_params.do_remote_prefill (the first token was sampled "
                      "by the producer)", param)
    policy = v.get("kv_load_failure_policy")
    if policy is not None and policy not in KV_LOAD_FAILURE_POLICIES:
        raise bad(f"kv_transfer_params.kv_load_failure_policy must be recompute or fail, got {policy!r}", param)
    return dict(v)


def _sampling(body: dict, p: Params) -> None:
    p.temperature = _number(body, "temperature", None, 0.0, 2.0)
    p.top_p = _number(body, "top_p", None, 0.0, 1.0, lo_open=True)
    p.top_k = _int(body, "top_k", 0)
    p.min_p = _number(body, "min_p", None, 0.0, 1.0)
    p.repetition_penalty = _number(body, "repetition_penalty", None, 0.0, 10.0, lo_open=True)
    p.presence_penalty = _number(body, "presence_penalty", 0.0, -2.0, 2.0)
    p.frequency_penalty = _number(body, "frequency_penalty", 0.0, -2.0, 2.0)
    p.seed = _int(body, "seed", 0, 2 ** 63 - 1)
    p.logit_bias = _logit_bias(body.get("logit_bias"))


def _logit_bias(v) -> tuple[tuple[int, float], ...]:
    if v is None:
        return ()
    if not isinstance(v, dict):
        raise bad(f"logit_bias must be an object mapping token ids to biases, got {v!r}", "logit_bias")
    out = {}
    for k, b in v.items():
        if not isinstance(k, str) or not k.isascii() or not k.isdigit():
            raise bad(f"logit_bias keys must be token ids (decimal strings), got {k!r}", "logit_bias")
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b) or not -100 <= b <= 100:
            raise bad(f"logit_bias[{k}] must be a number in [-100, 100], got {b!r}", "logit_bias")
        out[int(k)] = float(b)
    return tuple(sorted(out.items()))


def _logprobs(body: dict, p: Params, chat: bool) -> None:
    if chat:
        want = _bool(body, "logprobs")
        top = _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS_CHAT)
        if top is not None and not want:
            raise bad("top_logprobs needs logprobs: true", "top_logprobs")
        p.logprobs = (top or 0) if want else None
        return
    v = body.get("logprobs")
    if isinstance(v, bool):
        raise bad(f"logprobs must be an integer in [0, {MAX_LOGPROBS_COMPLETIONS}], got {v!r}", "logprobs")
    p.logprobs = _int(body, "logprobs", 0, MAX_LOGPROBS_COMPLETIONS)


def _output(body: dict, p: Params) -> None:
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
        known_keys(so, ("include_usage", "include_obfuscation"), "stream_options")
        for key, v in so.items():
            if v is not None and not isinstance(v, bool):
                raise bad(f"stream_options.{key}={v!r} is not supported (include_usage: true or false)",
                          "stream_options")
        if so.get("include_obfuscation"):
            raise bad("stream_options.include_obfuscation is not supported", "stream_options")
        p.include_usage = bool(so.get("include_usage"))
    p.ignore_eos = _bool(body, "ignore_eos")


def _prompt(v, p: Params) -> None:
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
        v = v[0]   # a batch of one prompt
    if isinstance(v, str):
        if not v:
            raise bad("prompt is empty", "prompt")
        p.prompt_text = v
        return
    if isinstance(v, list) and v and all(is_int(t) for t in v):
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


def checked_messages(v) -> list[dict]:
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
        content, images = _content(m.get("content"), where)
        extra = _tool_fields(m, role, where)
        if images:
            extra["images"] = images
        if content is None and extra.get("tool_calls"):
            content = ""
        if not isinstance(content, str):
            raise bad(f"{where}.content must be a string, got {content!r}", f"{where}.content")
        out.append({"role": "system" if role == "developer" else role, "content": content, **extra})
    return out


def _content(content, where: str) -> tuple:
    """A message's content as text, and its ``image_url`` parts' URLs with their paths (``[(url, where)]``; read
    by :mod:`.images`): content parts are text (joined) and images."""
    if not isinstance(content, list):
        return content, []
    texts, images = [], []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            known_keys(part, ("type", "text"), at)
            texts.append(part["text"])
        elif kind == "image_url" and isinstance(part.get("image_url"), (dict, str)):
            known_keys(part, ("type", "image_url"), at)
            url = part["image_url"]
            if isinstance(url, dict):
                known_keys(url, ("url", "detail"), f"{at}.image_url")
                url = url.get("url")
            if not isinstance(url, str) or not url:
                raise bad(f"{at}.image_url.url must be a data: URL or a file URL", f"{at}.image_url")
            images.append((url, at))
        else:
            raise bad(f"{at} must be a text part ({{\"type\": \"text\", \"text\": ...}}) or an image part "
                      f"({{\"type\": \"image_url\", \"image_url\": {{\"url\": ...}}}})", f"{where}.content")
    return "".join(texts), images


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
