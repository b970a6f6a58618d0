"""What real clients needed (issue 41), against a live server with the official ``openai`` client and plain HTTP:
strict shapes inside nested objects (unknown keys refused with their path), llama-server's ``schema`` inside
``json_object`` honoured, undeclared keys forbidden by a forced grammar, vLLM's assistant prefill
(``continue_final_message`` / ``add_generation_prompt``) on chat and ``/tokenize`` (with ``tools`` and
``token_strs``), llama-server's ``is_processing`` in ``/slots``, the routes without ``/v1``, and the sampling
defaults without a generation config (llama-server's).

One server for the module on the tiny continuous-batching export of conftest.py (ctx_len 64, one token per byte)
with the short chat template of serve_helpers.py and no generation_config.json.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from serve_helpers import CHAT_TEMPLATE, LiveServer, chat_export  # noqa: E402

HI = [{"role": "user", "content": "hi"}]
#: serve_helpers' short template, writing the names of the tools it is given (a template that renders tools)
TEMPLATE = "{% for t in tools or [] %}t:{{ t['function']['name'] }}\n{% endfor %}" + CHAT_TEMPLATE


@pytest.fixture(scope="module")
def served(own_cb_graph, tmp_path_factory):
    from qeff_kv.serve.config import ServeConfig
    from qeff_kv.serve.server import build_engine, check_config, sampling_defaults, text_facts

    folder = chat_export(own_cb_graph, tmp_path_factory.mktemp("gaps") / "tiny-gaps")
    (folder / "generation_config.json").unlink(missing_ok=True)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TEMPLATE}))
    config = ServeConfig(export_dir=str(folder))
    check_config(config)
    engine = build_engine(config)
    srv = LiveServer(engine, text_facts(config), defaults=sampling_defaults(config))
    srv.text = text_facts(config)
    yield srv
    srv.stop()


def _post(srv, path, body):
    return httpx.post(srv.url + path, json=body, timeout=120)


def _ids(srv, text: str) -> list[int]:
    return list(srv.text.tokenizer.encode(text, add_special_tokens=False).ids)


def _refused(r, param: str, code: str | None = "unknown_parameter"):
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"], err["type"]) == (param, code, "invalid_request_error"), err
    assert "\n" not in err["message"] and param in err["message"]


# ------------------------------------------------------------------------------- strict nested request shapes
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_object", "scheme": {}}}, "response_format.scheme"),
    ({"response_format": {"type": "text", "json_schema": {}}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {}, "strickt": True}}},
     "response_format.json_schema.strickt"),
    ({"tools": [{**TOOL, "cache": 1}]}, "tools[0].cache"),
    ({"tools": [TOOL, {"type": "function", "function": {**TOOL["function"], "name": "g", "params": {}}}]},
     "tools[1].function.params"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "f", "arguments": "{}"}}},
     "tool_choice.function.arguments"),
    ({"stream": True, "stream_options": {"include_usage": True, "continuous_usage": True}},
     "stream_options.continuous_usage"),
])
def test_unknown_nested_keys_are_refused_with_their_path(served, extra, param):
    _refused(_post(served, "/v1/chat/completions", {"messages": HI, "max_tokens": 2, **extra}), param)


def test_the_openai_client_sees_the_path(served):
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny-gaps", messages=HI, max_tokens=2,
                                       response_format={"type": "json_object", "schema_": {}})
    assert info.value.body["param"] == "response_format.schema_" and info.value.code == "unknown_parameter"


def test_llama_server_schema_in_json_object_is_honoured_and_closed(served):
    """``{"type": "json_object", "schema": ...}`` (llama-server's): the schema is enforced, and with no
    ``additionalProperties`` the object holds the declared key only (llama.cpp's reading): one answer is possible."""
    schema = {"type": "object", "properties": {"a": {"const": "x"}}, "required": ["a"]}
    for rf in ({"type": "json_object", "schema": schema},
               {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}):
        r = _post(served, "/v1/chat/completions", {"messages": HI, "max_tokens": 30, "temperature": 0,
                                                   "response_format": rf})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == '{"a": "x"}', rf


def test_the_compiled_grammar_refuses_an_undeclared_key(served):
    """The grammar itself (llguidance, the tiny tokenizer): an undeclared key is not a valid continuation of a
    schema that declares properties and says nothing of others; ``additionalProperties: true`` still allows it."""
    from qeff_kv.serve.structured.constrained import Grammars
    from qeff_kv.serve.structured.structured_io import parse_structured

    grammars = Grammars(served.text.tokenizer, served.text.eos_token_ids)
    props = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    for schema, extra_ok in ((props, False), ({**props, "additionalProperties": True}, True)):
        spec, _ = parse_structured({"response_format": {"type": "json_object", "schema": schema}})
        for text, ok in (('{"a": "x"}', True), ('{"a": "x", "b": "y"}', extra_ok)):
            matcher = grammars.compile(spec).matcher
            ids = _ids(served, text)
            assert all(matcher.consume_token(t) for t in ids) is ok, (schema, text)


def test_closed_objects_rule():
    from qeff_kv.serve.structured.schemas import close_objects

    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {}}},
                                               "c": {"type": "object"},
                                               "d": {"type": "object", "properties": {}, "additionalProperties": {}}},
              "$defs": {"E": {"properties": {"e": {}}}},
              "allOf": [{"properties": {"f": {}}}]}
    closed = close_objects(schema)
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]["c"]          # any object stays any object
    assert closed["properties"]["d"]["additionalProperties"] == {}          # what the schema says is kept
    assert closed["$defs"]["E"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["allOf"][0] and "additionalProperties" not in closed  # allOf: open
    assert "additionalProperties" not in schema["properties"]["a"]          # the request's schema is not changed


# ------------------------------------------------------------------------------------------ assistant prefill
PREFILL = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The c"}]


@pytest.mark.parametrize("flags", [{"continue_final_message": True, "add_generation_prompt": False},
                                   {"continue_final_message": True}, {"add_generation_prompt": False}, {}],
                         ids=["both", "continue", "no-generation-prompt", "default"])
def test_a_trailing_assistant_message_is_continued(served, flags):
    want = _ids(served, "u:hi\na:The c")          # no end of turn after the final message, no new "a:"
    tok = _post(served, "/tokenize", {"messages": PREFILL, **flags}).json()
    assert tok["tokens"] == want and tok["token_strs"] is None
    chat = _post(served, "/v1/chat/completions", {"messages": PREFILL, "max_tokens": 5, "temperature": 0,
                                                  **flags}).json()
    plain = _post(served, "/v1/completions", {"prompt": want, "max_tokens": 5, "temperature": 0}).json()
    assert chat["usage"]["prompt_tokens"] == len(want)
    assert chat["choices"][0]["message"]["content"] == plain["choices"][0]["text"]   # the continuation only


def test_prefill_refusals_and_a_new_turn(served):
    tok = _post(served, "/tokenize", {"messages": PREFILL, "add_generation_prompt": True}).json()
    assert tok["tokens"] == _ids(served, "u:hi\na:The c\na:")
    _refused(_post(served, "/v1/chat/completions", {"messages": PREFILL, "continue_final_message": True,
                                                    "add_generation_prompt": True}), "continue_final_message", None)
    _refused(_post(served, "/tokenize", {"messages": HI, "continue_final_message": True}),
             "continue_final_message", None)


def test_tokenize_with_tools_and_token_strs(served):
    tools = [{"type": "function", "function": {"name": "f", "description": "d",
                                               "parameters": {"type": "object", "properties": {}}}}]
    r = _post(served, "/tokenize", {"messages": HI, "tools": tools, "return_token_strs": True})
    assert r.status_code == 200, r.text
    tok = r.json()
    want = _ids(served, "t:f\nu:hi\na:")      # as a chat request with these tools renders it
    assert tok["tokens"] == want and tok["count"] == len(want)
    assert tok["token_strs"] == [served.text.tokenizer.id_to_token(t) for t in want]


# ------------------------------------------------------------------------------ slots, routes, defaults
def test_slots_say_is_processing(served):
    slots = httpx.get(served.url + "/slots", timeout=10).json()
    assert slots and all(s["is_processing"] is (s["state"] == "busy") for s in slots)


def test_routes_without_v1(served):
    client = openai.OpenAI(base_url=served.url, api_key="none", max_retries=0, timeout=60)   # no /v1
    assert [m.id for m in client.models.list().data] == ["tiny-gaps"]
    got = client.completions.create(model="tiny-gaps", prompt="the cat", max_tokens=4, temperature=0)
    want = _post(served, "/v1/completions", {"prompt": "the cat", "max_tokens": 4, "temperature": 0}).json()
    assert got.choices[0].text == want["choices"][0]["text"]
    chat = client.chat.completions.create(model="tiny-gaps", messages=HI, max_tokens=3, temperature=0)
    assert chat.choices[0].message.content is not None


def test_defaults_without_a_generation_config_are_llama_servers(served, tmp_path):
    from qeff_kv.serve.engine.defaults import resolve_defaults

    shown = httpx.get(served.url + "/v1/models", timeout=10).json()["data"][0]["sampling_defaults"]
    assert {k: shown[k] for k in ("temperature", "top_k", "top_p", "min_p")} == \
        {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
    assert shown["source"] == {"temperature": "llama-server", "top_k": "llama-server", "top_p": "llama-server",
                               "min_p": "llama-server", "repetition_penalty": "openai", "max_tokens": "openai"}
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 9, "eos_token_id": 2}))
    d = resolve_defaults(tmp_path, {"top_k": 5})          # no sampling field in the file: still llama-server's
    assert (d.temperature, d.top_k, d.top_p, d.min_p, d.max_tokens) == (0.8, 5, 0.95, 0.05, 9)
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6}))
    d = resolve_defaults(tmp_path, {})                      # the model's authors chose: the rest OpenAI's
    assert (d.temperature, d.top_k, d.top_p, d.min_p) == (0.6, 0, 1.0, 0.0)
    assert d.source["top_p"] == "openai"


def test_images_on_a_text_only_export_are_refused_in_one_line(served):
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    r = _post(served, "/v1/chat/completions", {"messages": [{"role": "user", "content": [part]}], "max_tokens": 2})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["message"] == "image_url parts need a vision-language export; this one is text-only"
    assert err["param"] == "messages[0].content[0]"
