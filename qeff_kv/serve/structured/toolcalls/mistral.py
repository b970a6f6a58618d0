"""Mistral calls: the ``[TOOL_CALLS]`` token, then a JSON list of ``{"name", "arguments"}`` objects; text before
the token is content. (The later ``[TOOL_CALLS]name[ARGS]{...}`` form of Mistral's v11 tokenizers is not read.)

Chosen when the tokenizer has the ``[TOOL_CALLS]`` token.
"""

from __future__ import annotations

import json

from qeff_kv.serve.structured.toolcalls.base import (ToolFacts, ToolParser, any_call_schema, call_from_json,
                                                     complete_json, drop_cut_marker, json_item, marker, strip_defs,
                                                     with_defs_at_root)

TAG = "[TOOL_CALLS]"


class MistralParser(ToolParser):
    name = "mistral"
    starts = (TAG,)

    @classmethod
    def matches(cls, facts: ToolFacts) -> bool:
        return facts.has_token(TAG)

    def parse(self, text: str, cut: bool = False):
        if cut:
            text = drop_cut_marker(text, self.starts)
        at = text.find(TAG)
        if at < 0:
            return (text or None), []
        whole = complete_json(text[at + len(TAG):])
        if whole is None and not cut:
            return (text or None), []
        items = whole[0] if whole is not None else _whole_items(text[at + len(TAG):])
        items = items if isinstance(items, list) else [items]
        calls = [call_from_json(obj, "arguments") for obj in items]
        content = text[:at].strip()
        if any(c is None for c in calls) or not (calls or cut):
            return (text or None), []
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


def _whole_items(rest: str) -> list:
    """The complete objects of a call list the token limit ended (``[{...}, {...}, {"na``: the first two)."""
    rest = rest.lstrip()
    if not rest.startswith("["):
        return []
    items, i = [], 1
    while True:
        found = complete_json(rest[i:])
        if found is None:
            return items
        items.append(found[0])
        i += found[1]
        tail = rest[i:].lstrip()
        if not tail.startswith(","):
            return items
        i = len(rest) - len(tail) + 1
