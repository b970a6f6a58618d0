"""Issue 43 against a live server: the constrained-decoding surface under hostile clients.

Logprobs under a grammar are finite JSON (1); JSON inside JSON strings is a 400 naming the field (2); grammar work
does not stall other streams (3); grammars that compile but cannot run are 400 ``invalid_grammar`` (4); ``/tokenize``
and ``/detokenize`` are bounded (5); calls to tools not offered are text, CORS refusals and 500s, ``logit_bias``
(8); a hypothesis fuzz of the surface (9): never a 5xx, every body strict JSON.

One server for the module on the tiny continuous-batching export of conftest.py (3 slots, ctx_len 64; its
tokenizer spends one token per byte) with a chat template and one allowed CORS origin.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
httpx = pytest.importorskip("httpx")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from serve_helpers import LiveServer, SlowDecode, chat_export  # noqa: E402

ORIGIN = "http://good.example"


@pytest.fixture(scope="module")
def served(own_cb_graph, tmp_path_factory):
    from qeff_kv.serve.config import ServeConfig
    from qeff_kv.serve.server import build_engine, text_facts

    folder = chat_export(own_cb_graph, tmp_path_factory.mktemp("rel-grammar") / "tiny-chat")
    config = ServeConfig(export_dir=str(folder), max_queue=64)
    engine = build_engine(config)
    srv = LiveServer(engine, text_facts(config), max_n=2, allowed_origins=[ORIGIN])
    srv.slow = SlowDecode(engine.session)
    srv.client = httpx.Client(base_url=srv.url, timeout=60)
    yield srv
    srv.client.close()
    srv.stop()


def _no_constant(name):
    raise ValueError(f"not JSON: {name}")


def strict(text: str):
    """``json.loads`` refusing ``NaN``, ``Infinity`` and ``-Infinity`` (which Python's parser accepts)."""
    return json.loads(text, parse_constant=_no_constant)


def check(r: httpx.Response) -> list:
    """Never a 5xx; the body (every SSE event) strict JSON; a 4xx in OpenAI's shape. The parsed bodies."""
    assert r.status_code < 500, (r.status_code, r.text[:300])
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        lines = [ln for ln in r.text.splitlines() if ln]
        assert lines[-1] == "data: [DONE]", lines[-3:]
        return [strict(ln[len("data: "):]) for ln in lines[:-1]]
    body = strict(r.text)
    if r.status_code >= 400:
        assert set(body["error"]) == {"message", "type", "param", "code"}, body
        assert "\n" not in body["error"]["message"]
    return [body]


def refused(r: httpx.Response, param: str | None = None, code: str | None = None) -> dict:
    assert r.status_code == 400, (r.status_code, r.text[:300])
    err = check(r)[0]["error"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


CHAT = "/v1/chat/completions"
DONE = "/v1/completions"


def _ask(text="hi"):
    return [{"role": "user", "content": text}]


# ============================================================================================ 1. logprobs
def test_logprobs_under_a_grammar_are_finite_json_over_the_allowed_tokens(served):
    c = served.client
    r = c.post(DONE, json={"prompt": "Answer:", "guided_choice": ["yes", "no"], "logprobs": 5, "max_tokens": 8})
    assert r.status_code == 200, r.text
    body = check(r)[0]
    lp = body["choices"][0]["logprobs"]
    assert body["choices"][0]["text"] in ("yes", "no")
    assert lp["tokens"] and all(v > -9999.0 for v in lp["token_logprobs"])
    assert len(lp["top_logprobs"][0]) == 2          # 'y' and 'n': the allowed tokens only, not 5
    assert abs(sum(2.718281828 ** v for v in lp["top_logprobs"][0].values()) - 1) < 1e-6   # renormalised over them
    assert all(len(top) == 1 for top in lp["top_logprobs"][1:])   # one allowed token each after the first
    for stream in (False, True):
        r = c.post(CHAT, json={"messages": _ask(), "response_format": {"type": "json_object"}, "logprobs": True,
                               "top_logprobs": 20, "max_tokens": 12, "stream": stream, "n": 2})
        assert r.status_code == 200, r.text
        for event in check(r):
            for ch in event.get("choices", []):
                for item in (ch.get("logprobs") or {}).get("content") or []:
                    assert 1 <= len(item["top_logprobs"]) <= 20
                    assert all(t["logprob"] > -9999.0 for t in item["top_logprobs"])


def test_best_logprobs_never_lists_excluded_tokens():
    import numpy as np

    from qeff_kv.runtime.decoding.sampling import SamplingParams, TokenPicker

    allowed = np.zeros(10, dtype=bool)
    allowed[[2, 7]] = True
    pick = TokenPicker(SamplingParams(temperature=0.0)).pick(np.arange(10.0), 0, top_logprobs=5, allowed=allowed)
    assert pick.token == 7 and [t for t, _ in pick.top] == [7, 2]
    assert all(np.isfinite(v) for _, v in pick.top)


# ============================================================================================ 2. JSON in strings
def _nested(depth: int) -> str:
    s = '{"type": "string"}'
    for _ in range(depth):
        s = '{"type": "object", "properties": {"a": ' + s + '}}'
    return s


def test_json_inside_json_strings_is_a_400_naming_the_field(served):
    c = served.client
    deep = _nested(400)
    refused(c.post(DONE, json={"prompt": "x", "guided_json": deep}), "guided_json")
    refused(c.post(DONE, json={"prompt": "x", "structured_outputs": {"json": deep}}), "structured_outputs.json")
    refused(c.post(DONE, json={"prompt": "x", "json_schema": "[" * 5000 + "]" * 5000}), "json_schema")
    refused(c.post(CHAT, json={"messages": _ask(), "response_format": {"type": "json_schema", "json_schema": {
        "name": "n", "schema": json.loads(_nested(100))}}}), "response_format.json_schema.schema", "invalid_grammar")
    refused(c.post(DONE, json={"prompt": "x", "guided_json": '{"type": "string", "pattern": "\\ud800"}'}),
            "guided_json")
    where = "messages[1].tool_calls[0].function.arguments"
    for args in ("[" * 5000 + "]" * 5000, '{"a": "\\udc00"}', json.dumps(json.loads(_nested(80)))):
        msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": args}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
        r = c.post(CHAT, json={"messages": msgs, "max_tokens": 2})
        refused(r, where)
        assert r.headers.get("connection") != "close"      # the keep-alive connection stays usable
    assert c.post(DONE, json={"prompt": "x", "max_tokens": 2}).status_code == 200


# ============================================================================================ 3. no stall
WORST = [
    {"prompt": "a", "guided_regex": "(a{1000}){1000}", "max_tokens": 3},
    {"prompt": "a", "guided_regex": "(a{1000}){1000}", "max_tokens": 3},
    {"prompt": "a", "guided_regex": "((ab|ba){200}c){300}", "max_tokens": 3},
    {"prompt": "a", "guided_json": {"type": "object", "properties": {f"p{i}": {"type": "string"}
                                                                     for i in range(10000)}}, "max_tokens": 3},
    {"prompt": "a", "grammar": "start: r0\n" + "".join(f'r{i}: "a" r{i + 1} | "b"\n' for i in range(1400))
     + 'r1400: "z"\n', "max_tokens": 3},
]


HEAVY = [("/tokenize", {"prompt": "x" * (3 << 20)}),
         (CHAT, {"messages": [{"role": "user", "content": "x"}] * 100_000, "max_tokens": 2}),
         ("/detokenize", {"tokens": [5] * 500_000})]


def test_worst_case_grammars_do_not_stall_a_running_stream(served):
    served.slow.delay = 0.04
    gaps, errors = [], []

    def flood():
        with httpx.Client(base_url=served.url, timeout=120) as c:
            for path, body in [(DONE, b) for b in WORST] + HEAVY:
                r = c.post(path, json=body)
                if r.status_code >= 500:
                    errors.append(r.text)
    try:
        floods = [threading.Thread(target=flood) for _ in range(2)]
        with httpx.stream("POST", served.url + DONE, timeout=120, json={
                "prompt": "b", "max_tokens": 60, "ignore_eos": True, "temperature": 0, "stream": True}) as s:
            last = None
            for line in s.iter_lines():
                if not line.startswith("data: "):
                    continue
                now = time.monotonic()
                if last is None:
                    for t in floods:
                        t.start()
                else:
                    gaps.append(now - last)
                last = now
        for t in floods:
            t.join(timeout=120)
    finally:
        served.slow.delay = 0.0
    assert not errors, errors
    assert len(gaps) > 20 and max(gaps) < 0.8, (max(gaps), sorted(gaps)[-5:])


# ============================================================================================ 4. cannot run
LARK_CHAIN = "start: r0\n" + "".join(f'r{i}: "a" r{i + 1} | "b"\n' for i in range(3000)) + 'r3000: "z"\n'
CANNOT_RUN = [
    ({"grammar": 'root ::= "a" root'}, None),
    ({"grammar": 'root ::= "a"{100000}'}, None),
    ({"grammar": "root ::= [a-z]{60000}"}, None),
    ({"guided_json": {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}}, None),
    ({"guided_json": {"$ref": "#"}}, "invalid_grammar"),
    ({"guided_json": {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}},
     "invalid_grammar"),
    ({"guided_json": {"allOf": [{"type": "string"}, {"type": "integer"}]}}, "invalid_grammar"),
    ({"guided_choice": [f"c{i}" for i in range(10000)]}, "invalid_grammar"),
    ({"grammar": LARK_CHAIN}, "invalid_grammar"),
    ({"guided_regex": "(?<=a)b"}, "invalid_grammar"),
    ({"guided_regex": "a{5000000}"}, None),
    ({"grammar": "start: %json {\"$ref\": \"#\"}"}, "invalid_grammar"),
    ({"guided_json": {"type": "string", "minLength": 100000}}, None),
    ({"guided_json": {"type": "array", "minItems": 100000, "items": {"type": "integer"}}}, None),
    ({"grammar": "start: x\nx: x"}, "invalid_grammar"),
]


@pytest.mark.parametrize("field,code", CANNOT_RUN, ids=[f"case{i}" for i in range(len(CANNOT_RUN))])
def test_grammars_that_cannot_run_are_the_requests_fault(served, field, code):
    for stream in (False, True):
        r = served.client.post(DONE, json={"prompt": "a", "max_tokens": 40, "stream": stream, **field})
        events = check(r)
        if code is not None:
            refused(r, code=code)
        elif r.status_code == 400:
            assert events[0]["error"]["code"] == "invalid_grammar", events
        elif stream:   # streamed: an error event, if any, in OpenAI's shape with the grammar's code
            errs = [e["error"] for e in events if "error" in e]
            assert all(e["code"] == "invalid_grammar" and e["type"] == "invalid_request_error" for e in errs), errs


def test_forced_tool_with_a_self_referencing_schema_is_refused(served):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"$ref": "#"}}}
    for stream in (False, True):
        r = served.client.post(CHAT, json={"messages": _ask(), "tools": [tool], "tool_choice": "required",
                                           "max_tokens": 40, "stream": stream})
        refused(r, "tools[0].function.parameters", "invalid_grammar")


def test_a_grammar_failing_mid_generation_is_invalid_grammar_not_server_error():
    from qeff_kv.serve.structured.constrained import GrammarFailure, TokenConstraint
    from qeff_kv.serve.http.responses import Run

    class Broken:
        def is_error(self):
            return True

        def get_error(self):
            return "step_max_items exceeded"

    c = TokenConstraint(Broken(), 8)
    twin = TokenConstraint.__new__(TokenConstraint)
    twin.__dict__.update(c.__dict__)
    with pytest.raises(GrammarFailure):
        twin.allowed(8)
    assert c.failed == "the grammar failed: step_max_items exceeded"    # the forks share their failure
    run = Run.__new__(Run)
    run.stopped_by_server, run.grammar, run.error = False, c, "sampling failed: ..."
    err = run.error_object()
    assert (err.status, err.code, err.type) == (400, "invalid_grammar", "invalid_request_error")


# ============================================================================================ 5. /tokenize
def test_tokenize_and_detokenize_are_bounded_before_the_work(served):
    c = served.client
    t0 = time.monotonic()
    refused(c.post("/tokenize", json={"prompt": "x" * (3 << 20)}), "prompt", "context_length_exceeded")
    refused(c.post("/tokenize", json={"messages": [{"role": "user", "content": "x"}] * 100_000}), "messages",
            "context_length_exceeded")
    refused(c.post(CHAT, json={"messages": [{"role": "user", "content": "x"}] * 100_000}), "messages",
            "context_length_exceeded")
    refused(c.post("/detokenize", json={"tokens": [5] * 100_000}), "tokens", "context_length_exceeded")
    assert time.monotonic() - t0 < 5.0
    r = c.post("/tokenize", json={"prompt": "hello"})
    assert r.status_code == 200 and r.json()["count"] >= 5
    assert c.post("/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"].endswith("hello")


# ============================================================================================ 8. accepted nonsense
def test_a_call_to_a_function_not_offered_is_text():
    from qeff_kv.serve.structured.tool_io import ToolStream
    from qeff_kv.serve.structured.toolcalls import ToolFacts
    from qeff_kv.serve.structured.toolcalls.hermes import HermesParser

    text = '<tool_call>\n{"name": "evil", "arguments": {}}\n</tool_call>'
    s = ToolStream(HermesParser(ToolFacts()), offered=["get_weather"])
    assert s.feed(text) == "" and s.finish() == (text, [])
    ok = text.replace("evil", "get_weather")
    content, calls = ToolStream(HermesParser(ToolFacts()), offered=["get_weather"]).calls_in(ok)
    assert [c.name for c in calls] == ["get_weather"] and not content


def test_cors_refusals_are_json_and_500s_carry_cors_headers(served):
    c = served.client
    r = c.options(CHAT, headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
    err = refused(r, code="cors_refused")
    assert "origin" in err["message"]
    r = c.options(CHAT, headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    health = served.engine.health

    def broken():
        raise RuntimeError("engine fault")
    served.engine.health = broken
    try:
        r = c.get("/health", headers={"Origin": ORIGIN})
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        assert r.headers["access-control-allow-origin"] == ORIGIN
        assert "access-control-allow-origin" not in c.get("/health", headers={"Origin": "http://x.example"}).headers
    finally:
        served.engine.health = health


def test_logit_bias_outside_the_vocabulary_names_logit_bias(served):
    refused(served.client.post(DONE, json={"prompt": "x", "logit_bias": {"99999999": 1}}), "logit_bias")


# ============================================================================================ 9. the fuzz
_NAMES = st.sampled_from(["f", "get", "a.b", "x-y"])
_SCHEMAS = st.recursive(
    st.sampled_from([{"type": "string"}, {"type": "integer"}, {"type": "boolean"}, {"type": "null"}, {},
                     {"$ref": "#"}, {"enum": ["a", 1, None]}, {"type": "string", "maxLength": 3},
                     {"type": "number", "minimum": 5, "maximum": 1}, {"not": {}}, {"type": "string", "pattern": "a+"},
                     {"const": "x"}, {"type": "integer", "minimum": 0, "maximum": 10000000000},
                     {"type": "string", "format": "date-time"}, {"type": ["string", "null"]}, {"pattern": "("},
                     {"type": "string", "minLength": -1}, {"type": "array", "maxItems": 10 ** 12},
                     {"type": "object", "additionalProperties": {"type": "integer"}}, {"type": "frob"},
                     {"$ref": "#/$defs/missing"}, {"type": "string", "pattern": "^(a{100}){100}$"},
                     {"type": "number", "multipleOf": 0}, {"oneOf": []}, {"enum": []}, True, False]),
    lambda inner: st.one_of(
        st.builds(lambda p, r: {"type": "object", "properties": p, "required": r},
                  st.dictionaries(st.sampled_from("abc"), inner, max_size=3), st.lists(st.sampled_from("abcd"),
                                                                                        max_size=2)),
        st.builds(lambda i, n: {"type": "array", "items": i, "minItems": n}, inner, st.integers(0, 3)),
        st.lists(inner, min_size=1, max_size=3).map(lambda xs: {"anyOf": xs}),
        st.lists(inner, min_size=1, max_size=3).map(lambda xs: {"allOf": xs})),
    max_leaves=6)
_REGEX = st.one_of(st.sampled_from(["a+", "(a|b){3}", "[0-9]{2,4}", "(", "a{99999}", "(a*)*b", "\\d", "", "[z-a]",
                                    "(?i)ab", "a{2,1}", ".*", "(a{50}){50}"]),
                   st.text(alphabet="ab()|*+?[]{}0123456789,.\\^$", max_size=12))
_GBNF = st.one_of(st.sampled_from(['root ::= "a" root', 'root ::= "yes" | "no"', "root ::= [a-c]+", 'root ::= x',
                                   "start: %json {}", 'root ::= "a"{3,2}', "start: start", "root ::= ", "start: /a+/"]),
                  st.text(alphabet='rot:=|"ab()*+[]{} \n', max_size=20))
_FIELD = st.one_of(
    _SCHEMAS.map(lambda s: {"guided_json": s}),
    _SCHEMAS.map(lambda s: {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": s}}}),
    _SCHEMAS.map(lambda s: {"structured_outputs": {"json": json.dumps(s)}}),
    _REGEX.map(lambda r: {"guided_regex": r}),
    _GBNF.map(lambda g: {"grammar": g}),
    st.lists(st.text(max_size=4), min_size=1, max_size=4).map(lambda c: {"guided_choice": c}),
    st.builds(lambda n, s, choice: {"tools": [{"type": "function", "function": {"name": n, "parameters": s}}],
                                    "tool_choice": choice}, _NAMES, _SCHEMAS,
              st.sampled_from(["auto", "required", "none", {"type": "function", "function": {"name": "f"}}])),
)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(field=_FIELD, logprobs=st.booleans(), n=st.sampled_from([1, 2]), stream=st.booleans(),
       chat=st.booleans())
def test_fuzzed_constrained_requests_never_5xx_and_answer_strict_json(served, field, logprobs, n, stream, chat):
    body = {"max_tokens": 6, "n": n, "stream": stream, **field}
    if chat or "tools" in field:
        body["messages"] = _ask()
        if logprobs:
            body.update(logprobs=True, top_logprobs=3)
    else:
        body["prompt"] = "q:"
        if logprobs:
            body["logprobs"] = 3
    r = served.client.post(CHAT if "messages" in body else DONE, json=body)
    for event in check(r):
        err = event.get("error")
        assert err is None or err["type"] == "invalid_request_error", event


# ============================================================================================ 3. where it compiles
def test_a_deep_grammar_compiles_on_the_big_stack_threads_without_killing_the_process():
    """3,000 chained Lark rules overflow a default 8 MiB thread stack inside llguidance (a segfault: the whole
    server gone); on the grammar threads it compiles. In a child process, so that a crash fails this test only."""
    import subprocess
    import sys
    from pathlib import Path

    tokenizer = Path(__file__).resolve().parents[2] / "fixtures" / "default-model" / "tokenizer.json"
    code = f"""
import asyncio
from tokenizers import Tokenizer
from qeff_kv.serve.structured.constrained import GrammarSpec
from qeff_kv.serve.structured.structured_io import Constraints
chain = {LARK_CHAIN!r}
c = Constraints(Tokenizer.from_file({str(tokenizer)!r}), [0])
got = asyncio.run(c.compile(GrammarSpec("lark", chain), "grammar"))
print("ok", int(got.first.sum()))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.split() == ["ok", "2"], (r.returncode, r.stderr[-500:])


def test_a_grammar_over_the_compile_time_is_a_400_naming_the_field():
    from tokenizers import Tokenizer

    from qeff_kv.serve.structured.constrained import GrammarSpec
    from qeff_kv.serve.wire.openai_io import APIError
    from qeff_kv.serve.structured.structured_io import Constraints

    tok = Tokenizer.from_file(str(__import__("pathlib").Path(__file__).resolve().parents[2] / "fixtures"
                                  / "default-model" / "tokenizer.json"))
    c = Constraints(tok, [0], timeout=1e-4)
    with pytest.raises(APIError) as exc:
        import asyncio
        asyncio.run(c.compile(GrammarSpec("regex", "(a{1000}){1000}"), "guided_regex"))
    assert (exc.value.param, exc.value.code) == ("guided_regex", "invalid_grammar")
    assert exc.value.message == "guided_regex: the grammar did not compile within 0.0001 s"
