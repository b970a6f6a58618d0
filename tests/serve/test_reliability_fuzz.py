"""Issue 31: hypothesis fuzzes request bodies (types, sizes, Unicode with lone surrogates, nesting, raw bytes) against
a live server. Every answer is a 200 or a 4xx in OpenAI's JSON error shape (a stream: JSON events then ``[DONE]``,
no error event), the server keeps serving (``/health`` after each), and fixed probe requests (greedy, chat, seeded
sampling) answer exactly as before the fuzzing.

One server on the tiny continuous-batching export of conftest.py (3 slots, ctx_len 64) with a chat template, a
state folder and a 64 KiB body cap. About 30-60 s.
"""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from serve_helpers import LiveServer, chat_export  # noqa: E402

CAP = 64 << 10
NAME = "tiny-chat"


@pytest.fixture(scope="module")
def served(own_cb_graph, tmp_path_factory):
    from qeff_kv.serve.config import ServeConfig
    from qeff_kv.serve.server import build_engine, text_facts

    root = tmp_path_factory.mktemp("fuzz")
    folder = chat_export(own_cb_graph, root / NAME)
    (root / "states").mkdir()
    config = ServeConfig(export_dir=str(folder), state_dir=str(root / "states"), max_queue=8)
    srv = LiveServer(build_engine(config), text_facts(config), state_dir=config.http.state_dir, max_request_bytes=CAP)
    srv.client = httpx.Client(base_url=srv.url, timeout=60)
    yield srv
    srv.client.close()
    srv.stop()


PROBES = [
    ("/v1/completions", {"prompt": [5, 6, 7, 8, 9], "max_tokens": 12, "temperature": 0, "ignore_eos": True}),
    ("/v1/completions", {"prompt": "hello there", "max_tokens": 10, "temperature": 0.8, "seed": 7,
                         "ignore_eos": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0,
                              "ignore_eos": True}),
    ("/v1/completions", {"prompt": [9, 8, 7], "max_tokens": 6, "temperature": 0, "stream": True,
                         "ignore_eos": True}),
]


def _probe(client) -> list:
    out = []
    for path, body in PROBES:
        r = client.post(path, json=body)
        assert r.status_code == 200, r.text
        if body.get("stream"):
            out.append(r.text.count("data: ") and [ln for ln in r.text.splitlines() if ln.startswith("data: ")
                                                   and '"created"' not in ln] + [_stream_text(r.text)])
        else:
            choice = r.json()["choices"][0]
            out.append((choice.get("text") or choice["message"]["content"], choice["finish_reason"]))
    return out


def _stream_text(text: str) -> str:
    parts = []
    for ln in text.splitlines():
        if ln.startswith("data: {"):
            for c in json.loads(ln[6:])["choices"]:
                parts.append(c.get("text") or c.get("delta", {}).get("content") or "")
    return "".join(parts)


# ------------------------------------------------------------------------------------------ strategies
_TEXT = st.one_of(st.text(max_size=24),
                  st.text(alphabet=st.characters(categories=["Cs", "Ll", "Nd", "Zs", "Cc", "So"]), max_size=12))
_SCALAR = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70),
                    st.floats(allow_nan=True, allow_infinity=True), _TEXT)
_JSON = st.recursive(_SCALAR, lambda c: st.lists(c, max_size=4) | st.dictionaries(_TEXT, c, max_size=4),
                     max_leaves=10)


def _or_junk(s):
    return st.one_of(s, _JSON)


_SAMPLING = {
    "model": _or_junk(st.sampled_from([NAME, "other", ""])),
    "max_tokens": _or_junk(st.integers(-2, 80)),
    "max_completion_tokens": _or_junk(st.integers(-2, 80)),
    "temperature": _or_junk(st.one_of(st.floats(-1, 3), st.sampled_from([0, 1e-310, 5e-324, 2.0, 2.0000001]))),
    "top_p": _or_junk(st.floats(-0.5, 1.5)),
    "top_k": _or_junk(st.integers(-2, 300)),
    "seed": _or_junk(st.integers(-2, 2 ** 64)),
    "stop": _or_junk(st.one_of(_TEXT, st.lists(_TEXT, max_size=18))),
    "stream": _or_junk(st.booleans()),
    "stream_options": _or_junk(st.fixed_dictionaries({}, optional={"include_usage": _or_junk(st.booleans())})),
    "n": _or_junk(st.integers(0, 3)),
    "ignore_eos": _or_junk(st.booleans()),
    "logprobs": _JSON,
    "response_format": _or_junk(st.just({"type": "text"})),
}
_PROMPT = st.one_of(_TEXT, st.lists(st.integers(-3, 300), max_size=70), st.lists(_TEXT, max_size=3),
                    st.lists(st.lists(st.integers(0, 255), max_size=5), max_size=2), _JSON)
_MESSAGE = st.fixed_dictionaries({}, optional={
    "role": _or_junk(st.sampled_from(["system", "developer", "user", "assistant", "tool"])),
    "content": st.one_of(_TEXT, st.lists(st.fixed_dictionaries({}, optional={
        "type": _or_junk(st.just("text")), "text": _or_junk(_TEXT)}), max_size=3), _JSON)})
_COMPLETION = st.fixed_dictionaries({}, optional={"prompt": _PROMPT, **_SAMPLING})
_CHAT = st.fixed_dictionaries({}, optional={"messages": _or_junk(st.lists(_MESSAGE, max_size=4)), **_SAMPLING})


def _url_safe(t: str) -> bool:
    """A path segment the client can send (no separator, no ASCII control character, no lone surrogate)."""
    return (not any(c in t for c in "/?#%\\") and t not in (".", "..")
            and not any(c.isascii() and not c.isprintable() for c in t) and t.encode("utf-8", "replace") ==
            t.encode("utf-8", "surrogatepass"))


# requests that are valid but for their values: they reach the engine, the detokenizer and the stop matcher
_GOOD_TEXT = st.text(st.characters(codec="utf-8"), min_size=1, max_size=30)
_VALID_SAMPLING = {
    "max_tokens": st.integers(1, 20), "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1),
    "top_k": st.integers(0, 300), "seed": st.integers(0, 2 ** 63 - 1),
    "stop": st.lists(st.text(st.characters(codec="utf-8"), min_size=1, max_size=3), max_size=4),
    "stream": st.booleans(), "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "ignore_eos": st.booleans(), "model": st.just(NAME),
}
_VALID_COMPLETION = st.fixed_dictionaries(
    {"prompt": st.one_of(_GOOD_TEXT, st.lists(st.integers(0, 255), min_size=1, max_size=40))},
    optional=_VALID_SAMPLING)
_VALID_CHAT = st.fixed_dictionaries(
    {"messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                                 "content": st.text(st.characters(codec="utf-8"), max_size=12)}),
                          min_size=1, max_size=3)}, optional=_VALID_SAMPLING)


def _encode(value) -> bytes:
    return json.dumps(value, allow_nan=True).encode()


_BODY = st.one_of(
    _JSON.map(_encode),
    st.binary(max_size=64),
    st.integers(1, 30000).map(lambda n: ("[" * n + "]" * n).encode()),
    st.integers(CAP - 64, CAP + 64).map(lambda n: _encode({"prompt": "a" * n})),
)
_REQUEST = st.one_of(
    st.tuples(st.just("/v1/completions"), st.one_of(_COMPLETION.map(_encode), _BODY)),
    st.tuples(st.just("/v1/chat/completions"), st.one_of(_CHAT.map(_encode), _BODY)),
    st.tuples(st.just("/v1/completions"), _VALID_COMPLETION.map(_encode)),
    st.tuples(st.just("/v1/chat/completions"), _VALID_CHAT.map(_encode)),
    st.tuples(st.builds(lambda i, a: f"/slots/{i}?action={a}",
                        st.one_of(st.integers(-1, 4).map(str), _TEXT.filter(_url_safe)),
                        st.sampled_from(["save", "restore", "erase", "fly", ""])),
              st.one_of(st.fixed_dictionaries({}, optional={"filename": _or_junk(
                  st.sampled_from(["a.safetensors", "b", ".x", "..", "a/b", ""]))}).map(_encode), _BODY)),
)


def _check_answer(r: httpx.Response) -> None:
    assert r.status_code == 200 or 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    if r.status_code != 200:
        assert r.headers["content-type"].startswith("application/json"), r.headers
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str)
        assert "\n" not in err["message"] and "Traceback" not in err["message"]
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        lines = [ln for ln in r.text.splitlines() if ln]
        assert lines[-1] == "data: [DONE]", lines[-3:]
        for ln in lines[:-1]:
            event = json.loads(ln[len("data: "):])
            assert "error" not in event, event
        return
    body = r.json()
    assert isinstance(body, (dict, list))
    if isinstance(body, dict) and "choices" in body:
        assert body["choices"][0]["finish_reason"] in ("stop", "length")
        assert math.isfinite(body["usage"]["total_tokens"])


@pytest.fixture(scope="module")
def before(served):
    return _probe(served.client)


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck), derandomize=False)
@given(req=_REQUEST)
def test_fuzzed_bodies_get_200_or_a_json_4xx_and_the_server_keeps_serving(served, before, req):
    path, data = req
    r = served.client.post(path, content=data, headers={"content-type": "application/json"})
    event(f"status {r.status_code}")
    _check_answer(r)
    assert served.client.get("/health").status_code == 200


def test_answers_after_the_fuzzing_are_unchanged(served, before):
    assert _probe(served.client) == before
    slots = served.client.get("/slots").json()
    assert not [s for s in slots if s["state"] == "busy"]   # nothing left running
