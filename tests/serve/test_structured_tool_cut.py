"""Tool calls the token limit ended (issue 52, class 10), below the HTTP layer: every format's parser and the
streamed :class:`ToolStream` given a forced output cut anywhere return exactly the calls whose JSON object is
complete, drop the unfinished one (no markup as content), and with none complete give no calls and no content.

The forced outputs are real: each format's forced grammar (several calls) driven by random logits over the bundled
default model's tokenizer with the end token banned, so the output runs on into a further call until the cut.
Which calls are complete in a prefix is read by a scanner of JSON brackets here, not by the parsers under test.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("llguidance")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from qeff_kv.runtime.decoding.sampling import SamplingParams, sample  # noqa: E402
from qeff_kv.serve.structured.constrained import Grammars, GrammarSpec  # noqa: E402
from qeff_kv.serve.structured.tool_io import ToolStream  # noqa: E402
from qeff_kv.serve.structured.toolcalls import ToolFacts  # noqa: E402
from qeff_kv.serve.structured.toolcalls.hermes import HermesParser  # noqa: E402
from qeff_kv.serve.structured.toolcalls.llama3_json import Llama3JsonParser  # noqa: E402
from qeff_kv.serve.structured.toolcalls.mistral import MistralParser  # noqa: E402

TOKENIZER = Path(__file__).resolve().parents[2] / "fixtures" / "default-model" / "tokenizer.json"
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "t", "parameters": {"type": "object", "properties": {}}}},
]
#: the depth of JSON brackets a call object opens at: inside Mistral's list, else at the top
CALL_DEPTH = {HermesParser: 0, Llama3JsonParser: 0, MistralParser: 1}
EOS = 0
#: tokens of each forced output (one per byte: room for a few calls)
LENGTH = 320


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(TOKENIZER))


@pytest.fixture(scope="module")
def outputs(tokenizer):
    """``(format, seed) -> token ids`` of the forced output (memoised: hypothesis draws the same ones again)."""
    grammars, cache = Grammars(tokenizer, [EOS]), {}

    def get(cls, seed: int) -> list[int]:
        if (cls, seed) not in cache:
            c = grammars.compile(GrammarSpec("lark", cls(ToolFacts()).forced_grammar(TOOLS, several=True)))
            rng, ids = np.random.default_rng(seed), []
            for pos in range(LENGTH):
                allowed = c.allowed(300)
                allowed[EOS] = False          # never ends while a further call may come
                if not allowed.any():         # Mistral's list closed: the output is whole
                    break
                tok = sample(rng.normal(size=300).astype(np.float32), SamplingParams(temperature=1.0, seed=seed),
                             pos, allowed=allowed)
                c.advance(tok)
                ids.append(tok)
            cache[cls, seed] = ids
        return cache[cls, seed]

    return get


def complete_calls(text: str, depth: int) -> int:
    """How many objects opened at bracket depth ``depth`` are closed in ``text`` (strings and escapes skipped)."""
    level, closed, in_string, escaped = 0, 0, False, False
    for ch in text:
        if in_string:
            escaped, in_string = (False, True) if escaped else (ch == "\\", ch != '"')
            continue
        if ch == '"':
            in_string = True
        elif ch in "{[":
            level += 1
        elif ch in "}]":
            level -= 1
            closed += ch == "}" and level == depth
    return closed


def _calls(calls) -> list:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(cls=st.sampled_from([HermesParser, Llama3JsonParser, MistralParser]), seed=st.integers(0, 3),
       cut=st.integers(1, LENGTH), pieces=st.lists(st.integers(1, 9), min_size=1, max_size=40))
def test_a_cut_forced_output_gives_exactly_its_complete_calls(outputs, tokenizer, cls, seed, cut, pieces):
    ids = outputs(cls, seed)
    parser, full = cls(ToolFacts()), tokenizer.decode(ids)
    every = parser.parse(full, cut=True)[1]
    assert every, full
    text = tokenizer.decode(ids[:cut])
    n = complete_calls(text, CALL_DEPTH[cls])
    content, calls = parser.parse(text, cut=True)
    assert content is None, text               # no markup as content
    assert _calls(calls) == _calls(every[:n]), text
    stream, shown, at = ToolStream(parser, [t["function"]["name"] for t in TOOLS]), "", 0
    for size in pieces * (len(text) // max(1, sum(pieces)) + 1):
        shown += stream.feed(text[at:at + size])
        at += size
    tail, streamed = stream.finish(cut=True)
    assert shown + tail == "" and _calls(streamed) == _calls(calls)


@pytest.mark.parametrize("cls,text,content,calls", [
    # text before the calls stays content; an unfinished call after a complete one is dropped
    (HermesParser, 'Sure. <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>\n{"na',
     "Sure.", [("f", {"a": 1})]),
    (HermesParser, 'Sure. <tool_call>\n{"name": "f", "arguments": {"a"', "Sure.", []),
    (HermesParser, "Sure. <tool_c", "Sure. ", []),     # a cut marker dropped, the text kept as it is
    # a cut answer without any call is content as it is
    (HermesParser, "just text, cut", "just text, cut", []),
    (Llama3JsonParser, '<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "param', None, [("f", {})]),
    (Llama3JsonParser, "<|python_tag|>", None, []),
    (Llama3JsonParser, 'It is {"answer": 4', 'It is {"answer": 4', []),
    (MistralParser, 'ok[TOOL_CALLS][{"name": "f", "arguments": {"q": [1]}}, {"name": "g", "ar', "ok",
     [("f", {"q": [1]})]),
    (MistralParser, "ok[TOOL_CALLS]", "ok", []),
    (MistralParser, "ok[TOOL_CA", "ok", []),
])
def test_cut_answers_of_each_format(cls, text, content, calls):
    got_content, got = cls(ToolFacts()).parse(text, cut=True)
    assert (got_content, _calls(got)) == (content, calls)


def test_a_cut_stream_sends_the_content_before_the_calls_once():
    stream = ToolStream(HermesParser(ToolFacts()))
    text = 'Let me see. <tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "g'
    shown = "".join(stream.feed(text[i:i + 5]) for i in range(0, len(text), 5))
    tail, calls = stream.finish(cut=True)
    assert (shown, tail, _calls(calls)) == ("Let me see. ", "", [("f", {})])
    plain = ToolStream(HermesParser(ToolFacts()))
    shown = "".join(plain.feed(p) for p in ("a text cut at <", "tool"))
    assert shown + plain.finish(cut=True)[0] == "a text cut at "
