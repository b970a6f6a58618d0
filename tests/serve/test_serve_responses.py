"""``POST /v1/responses`` (issue 41), through the official ``openai`` client's ``responses.create`` as it sends it:
text equal to the chat route's answer to the same messages; the streamed events (their order, the deltas adding up
to the text, ``response.completed`` / ``response.incomplete``); a forced function call (``tool_choice``) as a
``function_call`` item whose arguments are the chat route's, streamed too; the conversation sent back in
``input`` (``function_call`` and ``function_call_output`` items); ``text.format`` json_schema giving JSON of the
schema; the one-line refusals of a stateless server (``store: true``, ``previous_response_id``), of unknown fields
and of item kinds it does not serve.

One server for the module: the bundled tiny Llama exported with ctx_len 1024 (its tokenizer spends a token per
byte, and the tool prompt is long), with :data:`serve_helpers.CHAT_TEMPLATE`.
"""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from serve_helpers import LiveServer, chat_export  # noqa: E402

MODEL = "tiny-resp"
TOOL = {"type": "function", "name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                       "required": ["city"], "additionalProperties": False}}
CHAT_TOOL = {"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from qeff_kv.export import export_model
    from qeff_kv.serve.config import ServeConfig

    root = tmp_path_factory.mktemp("responses")
    out = export_model(None, root / "export", ctx_len=1024, prefill_seq_len=64, verify=False)
    srv = LiveServer.from_config(ServeConfig(export_dir=str(chat_export(out.out_dir, root / MODEL))))
    yield srv
    srv.stop()


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0, timeout=120)


def _chat(client, messages, **kw):
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kw).choices[0]


def test_text_equals_the_chat_answer(client):
    r = client.responses.create(model=MODEL, input="hello", instructions="be brief", max_output_tokens=6,
                                temperature=0)
    want = _chat(client, [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}],
                 max_tokens=6)
    assert r.object == "response" and r.output_text == want.message.content
    assert r.status == ("incomplete" if want.finish_reason == "length" else "completed")
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.usage.output_tokens == 6 and r.usage.input_tokens > 0 and r.store is False


def test_stream_events(client):
    kw = dict(model=MODEL, input=[{"role": "user", "content": [{"type": "input_text", "text": "abc"}]}],
              max_output_tokens=5, temperature=0)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text


def test_forced_function_call_equals_the_chat_tool_call(client):
    r = client.responses.create(model=MODEL, input="weather in Paris?", tools=[TOOL], tool_choice="required",
                                temperature=0, max_output_tokens=160)
    want = _chat(client, [{"role": "user", "content": "weather in Paris?"}], tools=[CHAT_TOOL],
                 tool_choice="required", max_tokens=160).message.tool_calls[0]
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" == want.function.name
    assert calls[0].arguments == want.function.arguments and set(json.loads(calls[0].arguments)) == {"city"}
    assert calls[0].call_id.startswith("call_")
    # streamed: the arguments' done event, and the same item at the end
    events = list(client.responses.create(model=MODEL, input="weather in Paris?", tools=[TOOL], stream=True,
                                          tool_choice={"type": "function", "name": "get_weather"},
                                          temperature=0, max_output_tokens=160))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].arguments == calls[0].arguments and done[0].name == "get_weather"
    assert events[-1].type == "response.completed"
    assert [o.type for o in events[-1].response.output] == ["function_call"]
    # the conversation sent back: the call and its output as input items
    again = client.responses.create(model=MODEL, tools=[TOOL], temperature=0, max_output_tokens=4, input=[
        {"role": "user", "content": "weather in Paris?"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
         "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}])
    assert again.status in ("completed", "incomplete") and again.usage.input_tokens > r.usage.input_tokens


def test_text_format_json_schema(client):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    r = client.responses.create(model=MODEL, input="a number", temperature=0, max_output_tokens=40,
                                text={"format": {"type": "json_schema", "name": "num", "schema": schema,
                                                 "strict": True}})
    value = json.loads(r.output_text)
    assert set(value) == {"n"} and 0 <= value["n"] <= 9


@pytest.mark.parametrize("extra, param, message", [
    ({"store": True}, "store", "store: true is not supported: this server keeps no responses (send the "
                               "conversation in input)"),
    ({"previous_response_id": "resp_1"}, "previous_response_id",
     "previous_response_id is not supported: this server keeps no responses (send the earlier items in input)"),
    ({"frobnicate": 1}, "frobnicate", "unknown field 'frobnicate': not supported by /v1/responses on this server"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]},
     "input[0].content[0]", "input[0].content[0]: only input_text / output_text parts are supported (got "
                            "'input_image')"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type",
     "input[0]: items of type 'reasoning' are not supported (message, function_call, function_call_output)"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type",
     "tools[0]: only function tools are supported (got 'web_search')"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format", None),
    ({"stream": "yes"}, "stream", "stream must be true or false, got 'yes'"),
    ({"instructions": ["x"]}, "instructions", "instructions must be a string, got ['x']"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id",
     "input[0].call_id must be a string, got None"),
])
def test_refusals(served, extra, param, message):
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 2, **extra}
    r = httpx.post(served.url + "/v1/responses", json=body, timeout=60)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and "\n" not in err["message"]
    if message is not None:
        assert err["message"] == message


# ============================================================================================ issue 52, item 8
def _post(served, body, route="/v1/responses"):
    return httpx.post(served.url + route, json=body, timeout=120)


@pytest.mark.parametrize("extra, param, message", [
    ({"stream": 1}, "stream", "stream must be true or false, got 1"),
    ({"store": 0}, "store", "store must be true or false, got 0"),
    ({"background": 0}, "background", "background must be true or false, got 0"),
    ({"parallel_tool_calls": "true"}, "parallel_tool_calls", "parallel_tool_calls must be true or false, got 'true'"),
    ({"user": 5}, "user", "user must be a string, got 5"),
    ({"metadata": ["a"]}, "metadata", "metadata must be an object of string values, got ['a']"),
    ({"metadata": {"a": 1}}, "metadata", "metadata['a'] must be a string of at most 512 characters, got 1"),
    ({"metadata": {"a": "x" * 513}}, "metadata", None),
    ({"metadata": {"k" * 65: "v"}}, "metadata", "metadata keys are at most 64 characters, got 65"),
    ({"metadata": {str(i): "v" for i in range(17)}}, "metadata", "metadata holds 17 keys; at most 16"),
    ({"top_logprobs": False}, "top_logprobs", "top_logprobs must be an integer, got False"),
    ({"stream_options": {"include_obfuscation": 0}}, "stream_options", "stream_options is not supported"),
    ({"max_output_tokens": 2.0}, "max_output_tokens", "max_output_tokens must be an integer, got 2.0"),
    ({"input": [{"role": "user", "content": "hi", "name": "x"}]}, "input[0].name", None),
    ({"input": [{"type": "function_call", "call_id": "c1", "name": "f"}]}, "input[0].arguments",
     "input[0].arguments must be a string, got None"),
    ({"tools": [{**TOOL, "function": {}}]}, "tools[0].function", None),
])
def test_types_are_strict(served, extra, param, message):
    """Booleans are JSON booleans, metadata OpenAI's map, unknown keys refused at every level."""
    r = _post(served, {"model": MODEL, "input": "hi", "max_output_tokens": 2, **extra})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param, r.text
    if message is not None:
        assert err["message"] == message


def test_what_clients_send_is_accepted(served):
    """openai-agents' bodies: the earlier turn's output items sent back as they came (ids, statuses,
    annotations, logprobs), ``include: []``, ``store: false`` and the identifiers."""
    first = _post(served, {"model": MODEL, "input": "hi", "max_output_tokens": 2, "temperature": 0}).json()
    body = {"model": MODEL, "max_output_tokens": 2, "temperature": 0, "store": False, "background": False,
            "include": [], "truncation": "disabled", "parallel_tool_calls": False, "user": "u",
            "metadata": {"k": "v" * 512, "k" * 64: ""}, "safety_identifier": "s", "prompt_cache_key": "p",
            "service_tier": "auto", "top_logprobs": 0, "stream_options": None, "reasoning": None,
            "input": [{"role": "user", "content": "hi"}, *first["output"],
                      {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
                       "arguments": "{}", "status": "completed"},
                      {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
                      {"role": "user", "content": [{"type": "input_text", "text": "and?"}]}]}
    r = _post(served, body)
    assert r.status_code == 200, r.text
    assert r.json()["metadata"] == body["metadata"] and r.json()["user"] == "u"


def test_every_openai_field_is_known():
    """Each top-level field of the installed ``openai`` package's ``responses.create`` is honoured or refused with
    its reason, never "unknown"."""
    from openai.types.responses import response_create_params

    from qeff_kv.serve.wire.responses_io import TYPES

    base = response_create_params.ResponseCreateParamsBase
    fields = set(base.__required_keys__ | base.__optional_keys__) | {"stream"}
    assert not fields - set(TYPES), f"classify these fields of openai {openai.__version__}"


@pytest.mark.parametrize("extra, param, banned", [
    ({"max_output_tokens": 5000}, "max_output_tokens", "max_tokens"),
    ({"temperature": 3}, "temperature", None),
    ({"input": "x" * 300_000}, "input", "messages"),
    ({"instructions": "x" * 300_000}, "input", "messages"),   # the whole chat: instructions and input
    ({"text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": "nothing"}}}}, "text.format",
     "response_format"),
    ({"text": {"format": {"type": "json_schema", "name": "n", "schema": {}, "strict": "yes"}}}, "text.format",
     "response_format"),
    ({"tools": [{**TOOL, "name": 5}]}, "tools", "function"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "function."),
])
def test_errors_after_translation_name_the_responses_fields(served, extra, param, banned):
    """An error the chat path raises names ``max_output_tokens``, ``input``, ``text.format``... (the fields the
    client sent), never the chat fields it was translated to."""
    r = _post(served, {"model": MODEL, "input": "hi", "max_output_tokens": 2, **extra})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"].startswith(param), r.text
    if banned is not None:
        assert banned not in err["message"] and banned not in err["param"], r.text


def test_tokenize_errors_show_no_server_path(served):
    """A chat template that fails names itself by its file name, never the export folder (any route)."""
    from starlette.testclient import TestClient

    from qeff_kv.runtime.text.chat import ChatTemplate
    from qeff_kv.serve.http.app import TextFacts, create_app

    folder = served.engine.session.files.folder
    failing = ChatTemplate(folder / "tokenizer_config.json", "{{ raise_exception('no system role') }}")
    app = create_app(served.engine, text=TextFacts(served.app.state.text.tokenizer, failing))
    with TestClient(app) as tc:
        for route, body in (("/tokenize", {"messages": [{"role": "user", "content": "hi"}]}),
                            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                            ("/v1/responses", {"input": "hi"})):
            r = tc.post(route, json=body)
            err = r.json()["error"]
            assert r.status_code == 400 and "tokenizer_config.json: the chat template failed" in err["message"]
            assert str(folder) not in r.text and str(folder.resolve()) not in r.text and folder.name not in r.text
            assert err["param"] == ("input" if route == "/v1/responses" else "messages")


# ============================================================================================ issue 52, item 12
def test_cut_by_the_limit_the_message_is_incomplete_and_the_applied_sampling_echoed(served):
    """Cut by ``max_output_tokens``: the message item is ``incomplete`` like the response (streamed too); the
    response echoes the sampling applied: the server's defaults for what the request left out."""
    from starlette.testclient import TestClient

    from qeff_kv.serve.engine.defaults import SamplingDefaults
    from qeff_kv.serve.http.app import create_app

    app = create_app(served.engine, text=served.app.state.text, defaults=SamplingDefaults(temperature=0.0, top_p=0.95))
    body = {"model": MODEL, "input": "hello", "max_output_tokens": 3}
    with TestClient(app) as tc:
        r = tc.post("/v1/responses", json=body).json()
        assert r["status"] == "incomplete" and r["incomplete_details"] == {"reason": "max_output_tokens"}
        assert [o["status"] for o in r["output"]] == ["incomplete"]
        assert (r["temperature"], r["top_p"], r["max_output_tokens"]) == (0.0, 0.95, 3)
        with tc.stream("POST", "/v1/responses", json={**body, "stream": True}) as s:
            events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
        done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
        assert [i["status"] for i in done] == ["incomplete"] and events[-1]["type"] == "response.incomplete"
        assert events[-1]["response"]["output"][0]["status"] == "incomplete"
        assert events[-1]["response"]["top_p"] == 0.95
        other = tc.post("/v1/responses", json={**body, "max_output_tokens": 40, "temperature": 0.5}).json()
    assert other["output"][0]["status"] == other["status"]   # completed, or cut again: the item says the same
    assert (other["temperature"], other["top_p"], other["max_output_tokens"]) == (0.5, 0.95, 40)


# ============================================================================================ property (issue 52)
_CHAT_ONLY = re.compile(r"\b(messages|max_tokens|max_completion_tokens|response_format|tool_calls|tool_call_id)\b")


def _bodies():
    """Random Responses bodies: every field valid or of another JSON type, unknown keys, nested input items."""
    from hypothesis import strategies as st

    from qeff_kv.serve.wire.responses_io import TYPES

    words = st.text(alphabet="abz ", max_size=6)
    scalar = st.none() | st.booleans() | st.integers(-3, 3000) | st.floats(-3, 3, allow_nan=False) | words
    json = st.recursive(scalar, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(words, inner,
                                                                                             max_size=3), max_leaves=6)
    part = st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text", "input_image", 3]),
                                  "text": st.sampled_from(["hi", 5, None])}) | json
    item_keys = st.sampled_from(["type", "role", "content", "call_id", "name", "arguments", "output", "id",
                                 "status", "annotations", "x_odd"])
    item = st.one_of(
        st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "tool", 1]),
                               "content": words | st.lists(part, max_size=2)}),
        st.fixed_dictionaries({"type": st.just("function_call"), "call_id": st.sampled_from(["c1", 1]),
                               "name": st.sampled_from(["get_weather", None]),
                               "arguments": st.sampled_from(['{"city": "x"}', {}, None])}),
        st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": st.sampled_from(["c1", None]),
                               "output": words | st.lists(part, max_size=2)}),
        st.dictionaries(item_keys, json, max_size=4), json)
    valid = {
        "model": st.sampled_from([MODEL, "gpt-4.1"]), "input": words | st.lists(item, min_size=1, max_size=3),
        "instructions": words, "max_output_tokens": st.sampled_from([1, 2, 0, 5000]),
        "temperature": st.sampled_from([0, 0.5, 3]), "top_p": st.sampled_from([0.5, 1, 0]),
        "stream": st.booleans(), "tools": st.lists(st.sampled_from([TOOL, {"type": "web_search"}, {**TOOL, "x": 1}]),
                                                   max_size=2),
        "tool_choice": st.sampled_from(["auto", "none", "required", {"type": "function", "name": "get_weather"},
                                        {"type": "function", "name": "zz"}, {"type": "x"}]),
        "text": st.sampled_from([{"format": {"type": "text"}}, {"format": {"type": "json_object"}},
                                 {"format": {"type": "json_schema", "name": "n", "schema": {"type": "integer"}}},
                                 {"verbosity": "low"}, {"format": {"type": "yaml"}}]),
        "metadata": st.dictionaries(words, words | st.integers(), max_size=3),
    }
    field = st.sampled_from(sorted(TYPES) + ["x_unknown"])
    value = st.deferred(lambda: json)

    @st.composite
    def body(draw):
        out = {}
        keys = draw(st.lists(st.sampled_from(sorted(valid)), max_size=5)) + draw(st.lists(field, max_size=2))
        for key in dict.fromkeys(keys):   # the honoured fields drawn more often than the others
            out[key] = draw(valid[key] | json) if key in valid else draw(value)
        out.setdefault("input", draw(valid["input"]))
        if out.get("max_output_tokens") is None:   # short answers: the property is about the checks
            out["max_output_tokens"] = 2
        return out

    return body()


def test_property_random_bodies_answer_200_or_a_4xx_naming_their_fields(served):
    """Random bodies: 200 (a stream read to its end) or a 4xx in OpenAI's error shape whose ``param`` is a field
    the body used or the Responses API defines and whose message names no chat field; never a 500."""
    from hypothesis import HealthCheck, given, settings

    from qeff_kv.serve.wire.responses_io import TYPES

    @settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(body=_bodies())
    def check(body):
        r = httpx.post(served.url + "/v1/responses", json=body, timeout=120)
        if r.status_code == 200:
            if body.get("stream") is True:
                assert "event: response.completed" in r.text or "event: response.incomplete" in r.text, r.text
            else:
                assert r.json()["object"] == "response"
            return
        assert 400 <= r.status_code < 500, (body, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and "\n" not in err["message"]
        root = re.split(r"[.\[]", err["param"])[0] if err["param"] else None
        assert root is None or root in body or root in TYPES, (body, err)
        assert not _CHAT_ONLY.search(err["message"]) and not _CHAT_ONLY.search(err["param"] or ""), (body, err)

    check()
