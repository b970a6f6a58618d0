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
    from qeff_kv.serve.server import build_engine, check_config, text_facts

    root = tmp_path_factory.mktemp("responses")
    out = export_model(None, root / "export", ctx_len=1024, prefill_seq_len=64, verify=False)
    folder = chat_export(out.out_dir, root / MODEL)
    config = ServeConfig(export_dir=str(folder))
    check_config(config)
    srv = LiveServer(build_engine(config), text_facts(config))
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
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]}, "input",
     "input[0].content[0]: only input_text / output_text parts are supported (got 'input_image')"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input",
     "input[0]: items of type 'reasoning' are not supported (message, function_call, function_call_output)"),
    ({"tools": [{"type": "web_search"}]}, "tools", "tools[0]: only function tools are supported (got 'web_search')"),
    ({"text": {"format": {"type": "yaml"}}}, "text", None),
    ({"stream": "yes"}, "stream", "stream must be true or false, got 'yes'"),
    ({"instructions": ["x"]}, "instructions", "instructions must be a string"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input", "input[0].call_id must be a string"),
])
def test_refusals(served, extra, param, message):
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 2, **extra}
    r = httpx.post(served.url + "/v1/responses", json=body, timeout=60)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and "\n" not in err["message"]
    if message is not None:
        assert err["message"] == message
