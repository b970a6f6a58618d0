"""Tool calls: the ``tools`` and ``tool_choice`` fields, the prompt they make, and the calls read back from the output.

* :func:`parse_tools` checks ``tools`` (``[{"type": "function", "function": {"name", "description", "parameters"}}]``),
  ``tool_choice`` (``"auto"`` (default), ``"none"``, ``"required"``, ``{"type": "function", "function": {"name"}}``)
  and ``parallel_tool_calls``. With ``"none"`` the tools are not shown to the model and the answer is plain text.
* :class:`ToolSupport` (one per served export) holds the facts about the tokenizer and the chat template, and the
  :class:`~.toolcalls.ToolParser` they choose. :meth:`ToolSupport.prompt` gives the messages and ``tools`` to render:
  a template that renders ``tools`` itself gets them (and earlier ``tool_calls`` / ``role: tool`` turns as
  transformers passes them: arguments as objects); a template that does not gets the fallback: a system-prompt
  paragraph listing the functions (JSON) and asking for Hermes-style ``<tool_call>`` blocks, earlier calls written
  in that format, tool results as user turns wrapped in ``<tool_response>``.
* ``required`` and a named function are forced by a grammar (:meth:`ToolRequest.grammar`): the output is the
  format's call(s) with arguments valid against the function's ``parameters`` (vLLM's rule); ``auto`` is free text
  whose calls, if any, are parsed afterwards.
* :class:`ToolStream` turns the streamed text into content deltas (held back from a format's opening text on) and,
  at the end, the calls. An answer the token limit ended (``finish_reason: "length"``) keeps its complete calls;
  the unfinished call after them is dropped, never shown as content (OpenAI's ``finish_reason`` stays ``length``).
  Calls are only to offered tools: text whose parsed calls name a function not in the request's ``tools`` is
  content, not calls.

Bounds: at most :data:`MAX_TOOLS` tools (OpenAI's), each ``parameters`` within the schema bounds of
:mod:`.structured_io`; a past call's ``arguments`` nested deeper than :data:`~qeff_kv.serve.wire.json_values.MAX_INNER_DEPTH` or holding a
lone surrogate is a 400 naming it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from qeff_kv.serve.wire.json_values import json_in_string
from qeff_kv.serve.structured.constrained import GrammarSpec
from qeff_kv.serve.wire.openai_io import bad, known_keys
from qeff_kv.serve.structured.structured_io import check_schema_size
from qeff_kv.serve.structured.toolcalls import ToolFacts, ToolParser, choose_parser

#: the most tools in one request (OpenAI's limit)
MAX_TOOLS = 128
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_PROBE_TOOL = {"type": "function", "function": {"name": "qeff_kv_probe_fn", "description": "probe",
                                                "parameters": {"type": "object", "properties": {}}}}


@dataclass(frozen=True)
class ToolRequest:
    tools: list[dict]
    choice: str              # "auto" | "required" | "named"
    named: str | None = None
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "named")

    def grammar(self, parser: ToolParser) -> GrammarSpec:
        """The grammar forcing the call(s): to the named function only, or one or more (``parallel_tool_calls``)
        to any of the tools."""
        tools = [t for t in self.tools if t["function"]["name"] == self.named] if self.named else self.tools
        return GrammarSpec("lark", parser.forced_grammar(tools, several=self.parallel and not self.named))


def parse_tools(body: dict) -> ToolRequest | None:
    """The request's tools (None: no tools, or ``tool_choice: "none"``)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools in (None, []):
        if choice not in (None, "none", "auto"):
            raise bad("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise bad("tools must be a list of function tools", "tools")
    if len(tools) > MAX_TOOLS:
        raise bad(f"tools holds {len(tools)} tools; the limit is {MAX_TOOLS}", "tools")
    checked = [_tool(t, i) for i, t in enumerate(tools)]
    names = [t["function"]["name"] for t in checked]
    if len(set(names)) != len(names):
        raise bad("tools: function names must be unique", "tools")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad("parallel_tool_calls must be true or false", "parallel_tool_calls")
    if choice in (None, "auto"):
        return ToolRequest(checked, "auto", parallel=parallel is not False)
    if choice == "none":
        return None
    if choice == "required":
        return ToolRequest(checked, "required", parallel=parallel is not False)
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    if isinstance(fn, dict):
        known_keys(choice, ("type", "function"), "tool_choice")
        known_keys(fn, ("name",), "tool_choice.function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise bad("tool_choice must be auto, none, required or {\"type\": \"function\", \"function\": {\"name\": "
                  f"...}}, got {choice!r}", "tool_choice")
    if name not in names:
        raise bad(f"tool_choice names the function {name!r}, which is not in tools", "tool_choice")
    return ToolRequest(checked, "named", name, parallel=False)


def _tool(t, i: int) -> dict:
    where = f"tools[{i}]"
    if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
        raise bad(f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}", where)
    fn = t["function"]
    known_keys(t, ("type", "function"), where)
    known_keys(fn, ("name", "description", "parameters", "strict"), f"{where}.function")
    if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
        raise bad(f"{where}.function.strict must be true or false", f"{where}.function.strict")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise bad(f"{where}.function.name must be 1-64 letters, digits, '_', '.' or '-', got {name!r}", where)
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise bad(f"{where}.function.parameters must be a JSON schema object", where)
    if params is not None:
        check_schema_size(params, f"{where}.function.parameters")
    if fn.get("description") is not None and not isinstance(fn.get("description"), str):
        raise bad(f"{where}.function.description must be a string", where)
    out = {"name": name, "parameters": params or {"type": "object", "properties": {}}}
    if fn.get("description"):
        out["description"] = fn["description"]
    return {"type": "function", "function": out}


def tool_facts(tokenizer, template) -> ToolFacts:
    """The facts a format is chosen from (added tokens, template text, whether it renders ``tools``)."""
    added = {tok.content: (int(i), bool(tok.special)) for i, tok in tokenizer.get_added_tokens_decoder().items()}
    renders = False
    if template is not None:
        probe = [{"role": "user", "content": "hi"}]
        try:
            renders = template.render(probe, tools=[_PROBE_TOOL]) != template.render(probe)
        except Exception:   # noqa: BLE001 - a template that fails with tools does not render them
            renders = False
    return ToolFacts(added, template.template if template is not None else "", renders)


class ToolSupport:
    """One export's tool-call facts, format and prompt rules."""

    def __init__(self, tokenizer, template):
        self.facts = tool_facts(tokenizer, template)
        self.parser = choose_parser(self.facts)

    def prompt(self, messages: list[dict], req: ToolRequest | None) -> tuple[list[dict], list[dict] | None]:
        """The messages and the ``tools`` argument to render the chat template with."""
        tools = req.tools if req is not None else None
        if self.facts.template_renders_tools:
            return [_native_message(m, i) for i, m in enumerate(messages)], tools
        out = [_fallback_message(m, self.parser, i) for i, m in enumerate(messages)]
        if tools:
            out = _with_system(out, fallback_system_text(tools))
        return out, None


def _arguments_object(arguments: str, where: str):
    """A past call's ``arguments`` as the object the template renders (text that is not JSON stays text); a 400
    naming ``where`` when nested too deeply or holding a lone surrogate."""
    return json_in_string(arguments, where, keep_text=True)


def _call_arguments(m: dict, i: int) -> list:
    return [_arguments_object(c["function"]["arguments"], f"messages[{i}].tool_calls[{j}].function.arguments")
            for j, c in enumerate(m["tool_calls"])]


def _native_message(m: dict, i: int) -> dict:
    if m.get("tool_calls"):
        calls = [{"type": "function", "id": c.get("id"), "function": {"name": c["function"]["name"], "arguments": a}}
                 for c, a in zip(m["tool_calls"], _call_arguments(m, i))]
        return {**m, "content": m.get("content") or "", "tool_calls": calls}
    return m


def _fallback_message(m: dict, parser: ToolParser, i: int) -> dict:
    if m["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
    if m.get("tool_calls"):
        calls = [{"name": c["function"]["name"], "arguments": a}
                 for c, a in zip(m["tool_calls"], _call_arguments(m, i))]
        text = "\n".join(s for s in (m.get("content") or "", parser.format_calls(calls)) if s)
        return {"role": "assistant", "content": text}
    return {k: v for k, v in m.items() if k in ("role", "content")}


def fallback_system_text(tools: list[dict]) -> str:
    """The paragraph that shows the tools to a model whose template does not render them (Hermes format)."""
    listing = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    return ("You can call functions. Their signatures (JSON schema) are listed between <tools> and </tools>:\n"
            f"<tools>\n{listing}\n</tools>\n"
            "To call a function, answer with one block per call:\n"
            "<tool_call>\n{\"name\": \"<function name>\", \"arguments\": {<arguments as a JSON object>}}\n"
            "</tool_call>")


def _with_system(messages: list[dict], text: str) -> list[dict]:
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": f"{messages[0]['content']}\n\n{text}"}] + messages[1:]
    return [{"role": "system", "content": text}] + messages


def calls_json(calls) -> list[dict]:
    """OpenAI's ``message.tool_calls``."""
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]


class ToolStream:
    """Streamed text -> content deltas, holding everything from the first opening text of the format on (and a
    tail that could begin one); :meth:`finish` parses the whole text into calls, or releases the held text as
    content when it holds none."""

    def __init__(self, parser: ToolParser, offered=None):
        self.parser = parser
        #: the names of the request's tools (None: any name)
        self.offered = None if offered is None else frozenset(offered)
        self.text = ""
        self.sent = 0          # characters of self.text emitted as content
        self.in_calls = False

    def feed(self, delta: str) -> str:
        self.text += delta
        if self.in_calls:
            return ""
        starts = [i for i in (self.text.find(s, self.sent) for s in self.parser.starts) if i >= 0]
        if starts:
            self.in_calls = True
            return self._emit_to(min(starts))
        hold = 0
        for s in self.parser.starts:
            for k in range(min(len(s) - 1, len(self.text) - self.sent), hold, -1):
                if self.text.endswith(s[:k]):
                    hold = k
                    break
        return self._emit_to(len(self.text) - hold)

    def _emit_to(self, end: int) -> str:
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return out

    def calls_in(self, text: str, cut: bool = False) -> tuple[str, list]:
        """``text`` parsed into content and calls; all of it content when a call names a function not offered.
        ``cut``: the token limit ended the text (the unfinished call at its end dropped: :meth:`ToolParser.parse`)."""
        content, calls = self.parser.parse(text, cut)
        if calls and self.offered is not None and any(c.name not in self.offered for c in calls):
            return text, []
        return content, calls

    def finish(self, cut: bool = False) -> tuple[str, list]:
        """The content not yet emitted and the calls (``cut``: as :meth:`calls_in`; the held text of an unfinished
        call is never released as content)."""
        content, calls = self.calls_in(self.text, cut)
        if calls:
            return "", calls
        if not cut:
            return self._emit_to(len(self.text)), []
        return self._emit_to(len(content) if content and self.text.startswith(content) else 0), []
