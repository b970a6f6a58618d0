"""Tool-call formats per model family, one module each behind :class:`~.base.ToolParser`, chosen by
:func:`choose_parser` from facts about the tokenizer and the chat template (never from the model's name).

Order: Mistral (``[TOOL_CALLS]`` token), Llama 3 JSON (``<|python_tag|>`` token), Hermes / Qwen (``<tool_call>``
token or text in the template); with none of these facts, Hermes, the format the fallback prompt teaches.
"""

from __future__ import annotations

from qeff_kv.serve.structured.toolcalls.base import ToolCall, ToolFacts, ToolParser
from qeff_kv.serve.structured.toolcalls.hermes import HermesParser
from qeff_kv.serve.structured.toolcalls.llama3_json import Llama3JsonParser
from qeff_kv.serve.structured.toolcalls.mistral import MistralParser

PARSERS: tuple[type[ToolParser], ...] = (MistralParser, Llama3JsonParser, HermesParser)


def choose_parser(facts: ToolFacts) -> ToolParser:
    """The first parser whose facts hold; Hermes when none does."""
    for cls in PARSERS:
        if cls.matches(facts):
            return cls(facts)
    return HermesParser(facts)


__all__ = ["PARSERS", "ToolCall", "ToolFacts", "ToolParser", "choose_parser"]
