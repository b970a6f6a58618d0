"""One interface for the tool-call formats of model families (:class:`ToolParser`), and the facts a format is
chosen from (:class:`ToolFacts`: the tokenizer's added tokens and what the chat template renders).

A parser knows three things about its format: whether the facts say the model speaks it (:meth:`matches`), how to
read calls out of generated text (:meth:`parse`; ``cut=True`` for text the token limit ended: the calls whose JSON
object is complete, the unfinished one after them dropped, never returned as content), and the Lark grammar that
forces one call or several to a given set of functions with arguments valid against their parameter schemas
(:meth:`forced_grammar`, for ``tool_choice`` ``required`` or a named function).
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from qeff_kv.serve.structured.constrained import lark_json, lark_string
from qeff_kv.serve.structured.schemas import nested_parameters


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])


@dataclass(frozen=True)
class ToolFacts:
    """What a format is chosen from: the tokenizer's added tokens (text -> id, ``special`` flag), the chat
    template's text, and whether the template renders a ``tools`` list itself."""

    added_tokens: dict = field(default_factory=dict)      # content -> (id, special)
    template_text: str = ""
    template_renders_tools: bool = False

    def has_token(self, text: str) -> bool:
        return text in self.added_tokens


def call_schema(tool: dict, args_key: str, index: int = 0) -> dict:
    """The JSON schema of one call object ``{"name": <const>, <args_key>: <parameters>}``: the parameters closed
    and, when they hold ``$ref`` pointers, placed in the root's ``$defs`` with the pointers rewritten
    (:mod:`..schemas`)."""
    fn = tool["function"]
    args, defs = nested_parameters(fn.get("parameters") or {"type": "object"}, index)
    out = {"type": "object", "properties": {"name": {"const": fn["name"]}, args_key: args},
           "required": ["name", args_key], "additionalProperties": False}
    return {**out, "$defs": defs} if defs else out


def any_call_schema(tools: list[dict], args_key: str) -> dict:
    """One call to any of ``tools``; every tool's moved definitions in the root's ``$defs`` (see
    :func:`with_defs_at_root` for a schema that nests this one)."""
    schemas = [call_schema(t, args_key, i) for i, t in enumerate(tools)]
    if len(schemas) == 1:
        return schemas[0]
    defs = {k: v for s in schemas for k, v in s.pop("$defs", {}).items()}
    return {"anyOf": schemas, **({"$defs": defs} if defs else {})}


def with_defs_at_root(schema: dict, inner: dict) -> dict:
    """``schema`` (which nests ``inner``) with ``inner``'s ``$defs`` moved to its root, where the pointers look."""
    if "$defs" not in inner:
        return schema
    return {**schema, "$defs": inner["$defs"]}


def strip_defs(schema: dict) -> dict:
    return {k: v for k, v in schema.items() if k != "$defs"}


def marker(text: str, facts: ToolFacts) -> str:
    """``text`` as a Lark item: the token itself (``<[id]>``) when it is a special added token, else the string."""
    tok = facts.added_tokens.get(text)
    if tok is not None and tok[1]:
        return f"<[{tok[0]}]>"
    return lark_string(text)


def call_from_json(obj, args_key: str) -> ToolCall | None:
    """A :class:`ToolCall` from a decoded ``{"name", <args_key>}`` object (``arguments`` / ``parameters``)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class ToolParser(ABC):
    """A family's tool-call format."""

    #: the format's name (docs/serving.md lists them)
    name: str
    #: texts that open the tool calls in the model's output (the streamed content is held back from there on)
    starts: tuple[str, ...]

    def __init__(self, facts: ToolFacts):
        self.facts = facts

    @classmethod
    @abstractmethod
    def matches(cls, facts: ToolFacts) -> bool:
        """The facts say the model speaks this format."""

    @abstractmethod
    def parse(self, text: str, cut: bool = False) -> tuple[str | None, list[ToolCall]]:
        """The content before the calls (None when empty) and the calls, from the whole generated text. Text that
        does not parse as calls is returned as content, with no calls. ``cut``: the token limit ended the text, so
        an unfinished call at its end (and a part of an opening marker) is dropped: the calls before it are
        returned, and with none the content before it (a call counts once its JSON object is complete)."""

    @abstractmethod
    def forced_grammar(self, tools: list[dict], several: bool) -> str:
        """Lark: exactly one call (``several`` False) or one or more, each to one of ``tools`` with arguments
        valid against its parameters."""

    def format_calls(self, calls: list[dict]) -> str:
        """An assistant turn's earlier calls (OpenAI's ``tool_calls``) as this format writes them (for templates
        that do not render ``tool_calls`` themselves)."""
        raise NotImplementedError


def drop_cut_marker(text: str, markers) -> str:
    """``text`` without a tail that is the beginning of one of ``markers`` (a marker cut by the token limit)."""
    for k in range(max((len(m) for m in markers), default=0) - 1, 0, -1):
        if any(len(m) > k and text.endswith(m[:k]) for m in markers):
            return text[:-k]
    return text


def opens_call(tail: str, starts) -> bool:
    """``tail`` (non-empty) begins as a call of the format does (one of ``starts``, or a beginning of one)."""
    tail = tail.lstrip()
    return bool(tail) and any(tail.startswith(s) or s.startswith(tail) for s in starts)


def complete_json(text: str):
    """The JSON value at the start of ``text`` (after whitespace) and where it ends, or None when it is not whole."""
    start = len(text) - len(text.lstrip())
    try:
        return json.JSONDecoder().raw_decode(text, start)
    except ValueError:
        return None


def json_item(schema: dict) -> str:
    return lark_json(schema)
