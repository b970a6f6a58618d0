"""Hermes-style calls, also Qwen 2.5 / Qwen 3's: each call a JSON object ``{"name", "arguments"}`` between
``<tool_call>`` and ``</tool_call>``, one after another; text before the first call is content.

Chosen when the tokenizer has a ``<tool_call>`` token or the chat template writes ``<tool_call>``; also the format
of the fallback prompt for templates that do not render tools (see :mod:`..tool_io`).
"""

from __future__ import annotations

import json
import re

from qeff_kv.serve.structured.toolcalls.base import (ToolFacts, ToolParser, any_call_schema, call_from_json,
                                                     complete_json, drop_cut_marker, json_item, marker)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*(?:" + re.escape(CLOSE) + r"|$)", re.S)


class HermesParser(ToolParser):
    name = "hermes"
    starts = (OPEN,)

    @classmethod
    def matches(cls, facts: ToolFacts) -> bool:
        return facts.has_token(OPEN) or OPEN in facts.template_text

    def parse(self, text: str, cut: bool = False):
        if cut:
            text = drop_cut_marker(text, self.starts)
        at = text.find(OPEN)
        if at < 0:
            return (text or None), []
        calls = []
        blocks = list(_CALL.finditer(text, at))
        for k, m in enumerate(blocks):
            call = _read(m.group(1))
            if call is None and cut and k == len(blocks) - 1 and not m.group(0).endswith(CLOSE):
                call = _read_cut(m.group(1))
                if call is None:   # the unfinished call the limit ended: dropped
                    break
            if call is None:
                return (text or None), []
            calls.append(call)
        content = text[:at].strip()
        return (content or None), calls

    def forced_grammar(self, tools, several):
        one = f"{marker(OPEN, self.facts)} \"\\n\" {json_item(any_call_schema(tools, 'arguments'))} " \
              f"\"\\n\" {marker(CLOSE, self.facts)}"
        more = ' ("\\n" call)*' if several else ""
        return f"start: call{more}\ncall: {one}\n"

    def format_calls(self, calls):
        return "\n".join(f"{OPEN}\n" + json.dumps({"name": c["name"], "arguments": c["arguments"]},
                                                   ensure_ascii=False) + f"\n{CLOSE}" for c in calls)


def _read(body: str):
    try:
        return call_from_json(json.loads(body), "arguments")
    except ValueError:
        return None


def _read_cut(body: str):
    """The call of a last block the limit ended after its JSON object (in the closing marker), else None."""
    whole = complete_json(body)
    if whole is None or not CLOSE.startswith(body[whole[1]:].strip() or CLOSE):
        return None
    return call_from_json(whole[0], "arguments")
