"""Structured output and tool calls below the HTTP layer: llguidance's constraint over a real tokenizer (the
bundled default model's), the masked sampling, the request fields (response_format, vLLM's and llama-server's
extensions, tools, tool_choice), the tool-call parsers per family and the choice among them from facts.

The live-server tests (the ``openai`` client against SmolLM2) are in tests/serve/test_serve_structured.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("llguidance")

from qeff_kv.errors import RuntimeInputError  # noqa: E402
from qeff_kv.runtime.decoding.sampling import SamplingParams, sample  # noqa: E402
from qeff_kv.serve.structured.constrained import ConstraintError, Grammars, GrammarSpec  # noqa: E402
from qeff_kv.serve.wire.openai_io import APIError  # noqa: E402
from qeff_kv.serve.structured.structured_io import parse_structured  # noqa: E402
from qeff_kv.serve.structured.tool_io import ToolStream, ToolSupport, parse_tools  # noqa: E402
from qeff_kv.serve.structured.toolcalls import ToolFacts, choose_parser  # noqa: E402
from qeff_kv.serve.structured.toolcalls.hermes import HermesParser  # noqa: E402
from qeff_kv.serve.structured.toolcalls.llama3_json import Llama3JsonParser  # noqa: E402
from qeff_kv.serve.structured.toolcalls.mistral import MistralParser  # noqa: E402

TOKENIZER = Path(__file__).resolve().parents[2] / "fixtures" / "default-model" / "tokenizer.json"
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1,
                                                                         "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(TOKENIZER))


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return Grammars(tokenizer, [0])


def _drive(constraint, tokenizer, seed: int, greedy_logits=None, limit: int = 300) -> str:
    """Sample under the constraint from random logits until it allows only the end token; the text."""
    rng = np.random.default_rng(seed)
    ids = []
    for pos in range(limit):
        logits = rng.normal(size=300).astype(np.float32) if greedy_logits is None else greedy_logits
        allowed = constraint.allowed(300)
        assert not allowed[256:].any()          # ids past the tokenizer are never allowed
        tok = sample(logits, SamplingParams(temperature=1.0, seed=seed), pos, allowed=allowed)
        assert allowed[tok]
        if tok == 0:
            assert constraint.accepting       # the end token only where the grammar accepts
            break
        constraint.advance(tok)
        ids.append(tok)
    return tokenizer.decode(ids)


@pytest.mark.parametrize("seed", range(4))
def test_random_logits_under_a_schema_give_valid_json(grammars, tokenizer, seed):
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "c": {"enum": ["red", "green"]},
                                               "t": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
              "required": ["n", "c", "t"], "additionalProperties": False}
    text = _drive(grammars.compile(GrammarSpec("json_schema", schema)), tokenizer, seed)
    jsonschema.validate(json.loads(text), schema)


def test_regex_and_choice_constraints(grammars, tokenizer):
    import re

    text = _drive(grammars.compile(GrammarSpec("regex", r"[a-c]{2,4}-\d")), tokenizer, 1)
    assert re.fullmatch(r"[a-c]{2,4}-\d", text)
    spec, field = parse_structured({"guided_choice": ["yes", "no"]})
    assert field == "guided_choice"
    assert _drive(grammars.compile(spec), tokenizer, 2) in ("yes", "no")


def test_greedy_masked_sampling_picks_the_best_allowed_token():
    logits = np.array([5.0, 4.0, 3.0, 2.0], dtype=np.float32)
    allowed = np.array([False, False, True, True])
    assert sample(logits, SamplingParams(), 0, allowed=allowed) == 2
    assert sample(logits, SamplingParams(), 0) == 0
    for pos in range(20):   # sampling never lands outside the mask
        assert sample(logits, SamplingParams(temperature=2.0, seed=3), pos, allowed=allowed) in (2, 3)


def test_a_schema_the_library_cannot_compile_names_why(grammars):
    with pytest.raises(ConstraintError, match="Invalid type: foo"):
        grammars.compile(GrammarSpec("json_schema", {"type": "object", "properties": {"a": {"type": "foo"}}}))
    with pytest.raises(ConstraintError, match="unclosed group"):
        grammars.compile(GrammarSpec("regex", "a(b"))


@pytest.mark.parametrize("body,kind", [
    ({"response_format": {"type": "json_object"}}, "json_object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"},
                                                                 "strict": True}}}, "json_schema"),
    ({"structured_outputs": {"regex": "a+"}}, "regex"),
    ({"structured_outputs": {"json": {"type": "string"}}}, "json_schema"),
    ({"guided_json": "{\"type\": \"integer\"}"}, "json_schema"),
    ({"guided_grammar": "start: \"a\"+"}, "lark"),
    ({"json_schema": {"type": "object"}}, "json_schema"),
    ({"grammar": "root ::= \"yes\" | \"no\""}, "lark"),
])
def test_structured_fields_give_one_spec(body, kind):
    spec, _ = parse_structured(body)
    assert spec.kind == kind


@pytest.mark.parametrize("body,message", [
    ({"response_format": {"type": "xml"}}, "response_format.type must be text, json_object or json_schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema must be an object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "name must be a non-empty"),
    ({"guided_json": "{not json"}, "guided_json is not valid JSON"),
    ({"guided_regex": "a", "guided_json": {}}, "give one structured-output field, not 2"),
    ({"structured_outputs": {"regex": "a", "json": {}}}, "exactly one of"),
    ({"structured_outputs": {"bogus": 1}}, "structured_outputs.bogus is not supported"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos does not go with"),
])
def test_bad_structured_fields_are_400s_naming_the_field(body, message):
    with pytest.raises(APIError, match=message) as info:
        parse_structured(body)
    assert info.value.status == 400


def test_tool_fields():
    assert parse_tools({}) is None
    assert parse_tools({"tools": [WEATHER], "tool_choice": "none"}) is None
    req = parse_tools({"tools": [WEATHER]})
    assert req.choice == "auto" and not req.forced
    req = parse_tools({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert req.forced and req.named == "get_weather"
    for body, message in (({"tool_choice": "required"}, "tool_choice needs tools"),
                          ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
                           "not in tools"),
                          ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "function.name"),
                          ({"tools": [WEATHER, WEATHER]}, "unique"),
                          ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice must be")):
        with pytest.raises(APIError, match=message):
            parse_tools(body)


def _facts(*tokens, special=True, template="", renders=False) -> ToolFacts:
    return ToolFacts({t: (1000 + i, special) for i, t in enumerate(tokens)}, template, renders)


def test_the_parser_is_chosen_from_tokenizer_and_template_facts():
    assert isinstance(choose_parser(_facts("[TOOL_CALLS]", "[INST]")), MistralParser)
    assert isinstance(choose_parser(_facts("<|python_tag|>", "<|eom_id|>")), Llama3JsonParser)
    assert isinstance(choose_parser(_facts("<tool_call>", "</tool_call>", special=False)), HermesParser)
    assert isinstance(choose_parser(_facts(template="{{ '<tool_call>' }}")), HermesParser)
    assert isinstance(choose_parser(_facts("<|im_start|>")), HermesParser)     # no facts: the fallback's format


@pytest.mark.parametrize("parser,text,content,calls", [
    (HermesParser, 'Sure. <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>\n'
                   '{"name": "g", "arguments": {}}\n</tool_call>', "Sure.", [("f", {"a": 1}), ("g", {})]),
    (HermesParser, '<tool_call>\n{"name": "f", "arguments": {"a": 1}}', None, [("f", {"a": 1})]),
    (HermesParser, "no call here", "no call here", []),
    (HermesParser, "<tool_call>{broken", "<tool_call>{broken", []),
    (Llama3JsonParser, '<|python_tag|>{"name": "f", "parameters": {"x": "y"}}; {"name": "g", "parameters": {}}',
     None, [("f", {"x": "y"}), ("g", {})]),
    (Llama3JsonParser, 'It is {"name": 1}', 'It is {"name": 1}', []),
    (MistralParser, 'ok[TOOL_CALLS][{"name": "f", "arguments": {"q": [1, 2]}}]', "ok", [("f", {"q": [1, 2]})]),
    (MistralParser, "[TOOL_CALLS]nope", "[TOOL_CALLS]nope", []),
])
def test_parsers_read_their_format(parser, text, content, calls):
    got_content, got = parser(ToolFacts()).parse(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert all(c.id.startswith("call_") for c in got)


@pytest.mark.parametrize("cls", [HermesParser, Llama3JsonParser, MistralParser])
def test_each_forced_grammar_gives_calls_its_parser_reads(cls, tokenizer):
    """Random logits under a format's forced grammar: the text parses into calls to the tool with valid args."""
    jsonschema = pytest.importorskip("jsonschema")
    facts = ToolFacts()
    parser = cls(facts)
    grammars = Grammars(tokenizer, [0])
    for seed in range(3):
        c = grammars.compile(GrammarSpec("lark", parser.forced_grammar([WEATHER], several=False)))
        text = _drive(c, tokenizer, seed, limit=400)
        _, calls = parser.parse(text)
        assert [call.name for call in calls] == ["get_weather"], text
        jsonschema.validate(json.loads(calls[0].arguments), WEATHER["function"]["parameters"])


def test_tool_stream_holds_the_calls_and_releases_plain_text():
    s = ToolStream(HermesParser(ToolFacts()))
    pieces = ("Let me ", "check <tool", "_call>\n{\"name\": \"f\", ", "\"arguments\": {}}\n</tool_call>")
    out = [s.feed(p) for p in pieces]
    assert "".join(out) == "Let me check "
    tail, calls = s.finish()
    assert tail == "" and [c.name for c in calls] == ["f"]
    s = ToolStream(HermesParser(ToolFacts()))
    out = [s.feed(p) for p in ("a <tool", "bar> b")]
    assert "".join(out) + s.finish()[0] == "a <toolbar> b"


def test_fallback_prompt_for_a_template_without_tools(tokenizer):
    from qeff_kv.runtime.text.chat import ChatTemplate

    plain = ChatTemplate(Path("t"), "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}")
    support = ToolSupport(tokenizer, plain)
    assert not support.facts.template_renders_tools
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\", \"days\": 1}"}}]},
                {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}]
    out, tools = support.prompt(messages, parse_tools({"tools": [WEATHER]}))
    assert tools is None
    text = plain.render(out)
    assert text.startswith("[system]You can call functions.") and '"name": "get_weather"' in text
    assert '[assistant]<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}\n</tool_call>' \
        in text
    assert text.endswith("[user]<tool_response>\nsunny\n</tool_response>")


def test_a_template_with_tools_gets_them(tokenizer):
    from qeff_kv.runtime.text.chat import ChatTemplate

    tmpl = ChatTemplate(Path("t"), "{% if tools %}TOOLS:{{ tools | tojson }}{% endif %}"
                                   "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}"
                                   "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} "
                                   "{{ c.function.arguments.city }}{% endfor %}{% endfor %}")
    support = ToolSupport(tokenizer, tmpl)
    assert support.facts.template_renders_tools
    messages = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]}]
    out, tools = support.prompt(messages, parse_tools({"tools": [WEATHER]}))
    text = tmpl.render(out, tools=tools)
    assert text.startswith("TOOLS:[{\"type\": \"function\"") and "CALL get_weather Oslo" in text


def test_engines_that_cannot_apply_a_grammar_refuse_it():
    from qeff_kv.serve.engine.engine import GenerationRequest, check_request

    req = GenerationRequest("r", (1, 2), 4, SamplingParams(), frozenset(), constraint=object())
    check_request(req, ctx_len=16, vocab_size=10)
    with pytest.raises(RuntimeInputError, match="not supported with --speculative"):
        check_request(req, ctx_len=16, vocab_size=10,
                      constraint_refused="structured output and forced tool calls are not supported with --speculative")


def test_a_special_marker_token_is_forced_as_that_token(tokenizer):
    """A marker that is a special added token is written ``<[id]>`` in the grammar (its text would not match the
    token); a marker that is plain text stays a string."""
    special = MistralParser(_facts("[TOOL_CALLS]")).forced_grammar([WEATHER], several=False)
    assert special.startswith("start: <[1000]> %json")
    plain = HermesParser(_facts("<tool_call>", "</tool_call>", special=False)).forced_grammar([WEATHER], False)
    assert '"<tool_call>" "\\n" %json' in plain and plain.count("<[") == 0
    # the token form compiles against a real tokenizer (id 0 there)
    from llguidance import LLMatcher

    g = Grammars(tokenizer, [1])
    m = LLMatcher(g.tokenizer, LLMatcher.grammar_from_lark('start: <[0]> "a"'), log_level=0)
    assert not m.is_error() and m.consume_token(0)
