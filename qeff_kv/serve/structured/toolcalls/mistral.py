"""Mistral calls: the ``[TOOL_CALLS]`` token, then a JSON list of ``{"name", "arguments"}`` objects; text before
the token is content. (The later ``[TOOL_CALLS]name[ARGS]{...}`` form of Mistral's v11 tokenizers is not read.)

Chosen when the tokenizer has the ``[TOOL_CALLS]`` token.
"""

from __future__ import annotations

import json

from qeff_kv.serve.structured.toolcalls.base import (ToolFacts, ToolParser, any_call_schema, call_from_json, json_item, marker, strip_defs,
                   with_defs_at_root)

TAG = "[TOOL_CALLS]"


class MistralParser(ToolParser):
    name = "mistral"
    starts = (TAG,)

    @classmethod
    def matches(cls, facts: ToolFacts) -> bool:
        return facts.has_token(TAG)

    def parse(self, text: str):
        at = text.find(TAG)
        if at < 0:
            return (text or None), []
        try:
            items, _ = json.JSONDecoder().raw_decode(text[at + len(TAG):].strip())
        except ValueError:
            return (text or None), []
        items = items if isinstance(items, list) else [items]
        calls = [call_from_json(obj, "arguments") for obj in items]
        if not calls or any(c is None for c in calls):
            return (text or None), []
        content = text[:at].strip()
        return (content or None), calls

    def forced_grammar(self, tools, several):
        call = any_call_schema(tools, "arguments")
        items = {"type": "array", "items": strip_defs(call), "minItems": 1}
        if not several:
            items["maxItems"] = 1
        items = with_defs_at_root(items, call)
        return f"start: {marker(TAG, self.facts)} {json_item(items)}\n"

    def format_calls(self, calls):
        return TAG + json.dumps([{"name": c["name"], "arguments": c["arguments"]} for c in calls],
                                ensure_ascii=False)
