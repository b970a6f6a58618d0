"""Issue 52 against a live server: a forced tool call cut by ``max_tokens`` (class 10) and the first constrained
request of a fresh server (class 11).

* Cut by the limit, an answer keeps its complete calls as ``tool_calls`` (exactly the call an uncut answer makes),
  drops the unfinished one (no markup in ``content``) and says ``finish_reason: "length"``, as OpenAI does;
  streamed the same; cut inside the first call: no calls, no content. ``max_tokens`` comes from the token count
  of the complete call, measured here. The Responses route: the complete call as a ``function_call`` item.
* llguidance's tokenizer is built with the app, before the server listens: a build slower than the compile time
  (injected) no longer fails the first constrained request; without llguidance the server starts and a
  constrained request is a 400 naming it.

One export for the module: the bundled tiny Llama (a token per byte) with ctx_len 256 and a chat template that
renders ``tools`` itself (a short prompt); the calls are Hermes blocks (the format of a tokenizer without markers).
"""

from __future__ import annotations

import json
import sys
import time

import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from serve_helpers import CHAT_TEMPLATE, LiveServer, chat_export  # noqa: E402

MODEL = "tiny-cut"
TEMPLATE = "{% for t in tools or [] %}t:{{ t['function']['name'] }}\n{% endfor %}" + CHAT_TEMPLATE
PARAMS = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["n"], "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "pick", "description": "Pick a number", "parameters": PARAMS}}
NAMED = {"type": "function", "function": {"name": "pick"}}
ASK = [{"role": "user", "content": "pick"}]


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    from qeff_kv.export import export_model

    root = tmp_path_factory.mktemp("toolcut")
    out = export_model(None, root / "export", ctx_len=256, prefill_seq_len=32, verify=False)
    folder = chat_export(out.out_dir, root / MODEL)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TEMPLATE}))
    return folder


def _server(folder):
    from qeff_kv.serve.config import ServeConfig

    return LiveServer.from_config(ServeConfig(export_dir=str(folder)))


@pytest.fixture(scope="module")
def served(export):
    srv = _server(export)
    yield srv
    srv.stop()


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0, timeout=120)


def _kw(served, **kw) -> dict:
    """Greedy, the end token banned: a forced answer with several calls runs on until ``max_tokens``."""
    bias = {str(t): -100 for t in served.text.eos_token_ids}
    return dict(model=MODEL, messages=ASK, tools=[TOOL], temperature=0, logit_bias=bias, **kw)


@pytest.fixture(scope="module")
def whole(served):
    """The complete call (a named function: one call, then the end) and its tokens."""
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0, timeout=120)
    out = client.chat.completions.create(**_kw(served, tool_choice=NAMED, max_tokens=120, stream=True,
                                              stream_options={"include_usage": True}))
    chunks = list(out)
    calls = [c for ch in chunks for choice in ch.choices for c in (choice.delta.tool_calls or [])]
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"
    assert len(calls) == 1 and calls[0].function.name == "pick"
    tokens = chunks[-1].usage.completion_tokens
    markup = "<tool_call>\n" + json.dumps({"name": "pick", "arguments": json.loads(calls[0].function.arguments)}) \
        + "\n</tool_call>"
    assert tokens - len(markup.encode()) in (0, 1), (tokens, markup)   # the call, and the end token if counted
    return calls[0].function, len(markup.encode())


def _streamed(client, **kw):
    chunks = list(client.chat.completions.create(stream=True, **kw))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or [])]
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return content, calls, finish


def test_a_second_call_cut_by_the_limit_leaves_the_first_as_tool_calls(client, served, whole):
    fn, k = whole
    kw = _kw(served, tool_choice="required", max_tokens=k + k // 2)   # the limit falls inside the second call
    out = client.chat.completions.create(**kw).choices[0]
    assert out.finish_reason == "length"
    assert out.message.content is None
    assert [(c.function.name, c.function.arguments) for c in out.message.tool_calls] == [(fn.name, fn.arguments)]
    content, calls, finish = _streamed(client, **kw)
    assert content == "" and finish == ["length"]
    assert [(c.index, c.function.name, c.function.arguments) for c in calls] == [(0, fn.name, fn.arguments)]


@pytest.mark.parametrize("choice", ["required", "named"])
def test_a_first_call_cut_by_the_limit_gives_no_calls_and_no_markup(client, served, whole, choice):
    kw = _kw(served, tool_choice=NAMED if choice == "named" else "required", max_tokens=whole[1] // 2)
    out = client.chat.completions.create(**kw).choices[0]
    assert (out.finish_reason, out.message.content, out.message.tool_calls) == ("length", None, None)
    assert _streamed(client, **kw) == ("", [], ["length"])


@pytest.mark.parametrize("cut", ["second", "first"])
def test_the_responses_route_answers_as_the_chat_route(client, served, whole, cut):
    """``function_call`` items for the chat route's complete calls (greedy, the end token allowed: the Responses
    body has no ``logit_bias``), no markup in any message."""
    k = whole[1]
    limit = k + k // 2 if cut == "second" else k // 2
    chat = client.chat.completions.create(model=MODEL, messages=ASK, tools=[TOOL], tool_choice="required",
                                          temperature=0, max_tokens=limit).choices[0]
    body = {"model": MODEL, "input": "pick", "tools": [{"type": "function", **TOOL["function"]}],
            "tool_choice": "required", "temperature": 0, "max_output_tokens": limit}
    r = httpx.post(served.url + "/v1/responses", json=body, timeout=120).json()
    assert r["status"] == ("incomplete" if chat.finish_reason == "length" else "completed"), r
    want = [(c.function.name, c.function.arguments) for c in chat.message.tool_calls or []]
    assert [(o["name"], o["arguments"]) for o in r["output"] if o["type"] == "function_call"] == want
    assert len(want) == (1 if cut == "second" else 0)
    texts = [p["text"] for o in r["output"] if o["type"] == "message" for p in o["content"]]
    assert all("<tool" not in t and "{" not in t for t in texts), r["output"]
    events = httpx.post(served.url + "/v1/responses", json={**body, "stream": True}, timeout=120).text
    assert "<tool" not in events and events.count('"type": "response.function_call_arguments.done"') == len(want)


# ============================================================================ class 11: the grammar tokenizer
def test_a_slow_tokenizer_build_no_longer_fails_the_first_constrained_request(export, monkeypatch):
    """The build (made slower than the compile time) happens with the app: the fresh server's first constrained
    request compiles within the time."""
    from qeff_kv.serve.structured import constrained, structured_io

    class Slow(constrained.Grammars):
        def __init__(self, *a, **kw):
            time.sleep(1.0)
            super().__init__(*a, **kw)

    monkeypatch.setattr(constrained, "Grammars", Slow)
    monkeypatch.setattr(structured_io, "COMPILE_TIMEOUT_S", 0.5)
    srv = _server(export)
    try:
        assert httpx.get(srv.url + "/health", timeout=30).status_code == 200
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": ASK, "max_tokens": 4, "response_format": {"type": "json_object"}})
        assert r.status_code == 200, r.text
        constraints = srv.app.state.constraints
        assert (constraints.built, constraints.unavailable, constraints.timeout) == (True, None, 0.5)
    finally:
        srv.stop()


def test_a_request_waits_for_the_build_outside_its_compile_time(monkeypatch):
    import asyncio

    from tokenizers import Tokenizer

    from qeff_kv.serve.structured import constrained
    from qeff_kv.serve.structured.constrained import GrammarSpec
    from qeff_kv.serve.structured.structured_io import Constraints
    from suite import REPO

    class Slow(constrained.Grammars):
        def __init__(self, *a, **kw):
            time.sleep(0.6)
            super().__init__(*a, **kw)

    monkeypatch.setattr(constrained, "Grammars", Slow)
    c = Constraints(Tokenizer.from_file(str(REPO / "fixtures" / "default-model" / "tokenizer.json")), [0],
                    timeout=0.3)
    assert not c.built
    got = asyncio.run(c.compile(GrammarSpec("json_object"), "response_format"))
    assert c.built and got.first is not None


def test_without_llguidance_the_server_starts_and_a_constrained_request_names_it(export, monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)   # import llguidance: ImportError
    srv = _server(export)
    try:
        assert srv.app.state.constraints.built
        assert httpx.get(srv.url + "/health", timeout=30).status_code == 200
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": ASK, "max_tokens": 4, "response_format": {"type": "json_object"}})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"] == ("response_format: structured output needs the 'llguidance' "
                                                "package (pip install 'qeff-kv[serve]')")
        plain = httpx.post(srv.url + "/v1/chat/completions", timeout=60,
                           json={"model": MODEL, "messages": ASK, "max_tokens": 2})
        assert plain.status_code == 200, plain.text
    finally:
        srv.stop()


def test_a_tokenizer_llguidance_cannot_take_leaves_plain_serving_and_names_why(monkeypatch):
    import asyncio

    from qeff_kv.serve.structured import constrained
    from qeff_kv.serve.structured.constrained import GrammarSpec
    from qeff_kv.serve.structured.structured_io import Constraints
    from qeff_kv.serve.wire.openai_io import APIError

    def refuse(*a, **kw):
        raise ValueError("bad merges")

    monkeypatch.setattr(constrained, "Grammars", refuse)
    c = Constraints(object(), [0])
    c.build()                                   # no exception: the app still starts
    assert c.built
    with pytest.raises(APIError) as exc:
        asyncio.run(c.compile(GrammarSpec("json_object"), "response_format"))
    assert (exc.value.status, exc.value.message) == (400, "response_format: structured output is unavailable: "
                                                          "llguidance cannot take this export's tokenizer "
                                                          "(ValueError: bad merges)")
