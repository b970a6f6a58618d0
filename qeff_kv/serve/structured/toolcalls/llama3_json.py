"""Llama 3.1 / 3.2 JSON calls: the answer is a JSON object ``{"name", "parameters"}`` (several separated by ``;``),
optionally after the ``<|python_tag|>`` token; an answer that is not such JSON is content.

Chosen when the tokenizer has the ``<|python_tag|>`` token (Llama 3.1's tool-call marker).
"""

from __future__ import annotations

import json

from qeff_kv.serve.structured.toolcalls.base import (ToolFacts, ToolParser, any_call_schema, call_from_json,
                                                     drop_cut_marker, json_item, opens_call)

TAG = "<|python_tag|>"


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    starts = (TAG, "{\"name\"", "{ \"name\"")

    @classmethod
    def matches(cls, facts: ToolFacts) -> bool:
        return facts.has_token(TAG)

    def parse(self, text: str, cut: bool = False):
        if cut:
            text = drop_cut_marker(text, self.starts)
        body = text.strip()
        if body.startswith(TAG):
            body = body[len(TAG):].strip()
            if cut and not body:   # the limit ended the answer right after the tag
                return None, []
        if not body.startswith("{"):
            return (text or None), []
        decoder, calls, i = json.JSONDecoder(), [], 0
        while i < len(body):
            try:
                obj, i = decoder.raw_decode(body, i)
            except ValueError:
                if cut and opens_call(body[i:], self.starts):   # the unfinished call the limit ended: dropped
                    break
                return (text or None), []
            call = call_from_json(obj, "parameters")
            if call is None:
                return (text or None), []
            calls.append(call)
            while i < len(body) and body[i] in " \n\t;":
                i += 1
        return None, calls

    def forced_grammar(self, tools, several):
        one = json_item(any_call_schema(tools, "parameters"))
        more = ' ("; " call)*' if several else ""
        return f"start: call{more}\ncall: {one}\n"

    def format_calls(self, calls):
        return "; ".join(json.dumps({"name": c["name"], "parameters": c["arguments"]}, ensure_ascii=False)
                         for c in calls)
