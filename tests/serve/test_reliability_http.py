"""Issue 31 against a live server: the body cap before any work and nothing blocking the event loop (item 2), 400s
instead of 500s for deep JSON and lone surrogates (3), tiny temperatures (9), the queue counted beyond free slots
(10), ASCII slot ids and uvicorn's protocol errors in OpenAI's JSON shape (11).

One server for the module on the tiny continuous-batching export of conftest.py (3 slots, ctx_len 64; its
tokenizer spends one token per byte), with a chat template and a body cap of 2 MiB.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from serve_helpers import LiveServer, SlowDecode, chat_export  # noqa: E402

CAP = 4 << 20   # large enough that tokenizing a prompt near it takes over a second on this machine even when quiet


@pytest.fixture(scope="module")
def served(own_cb_graph, tmp_path_factory):
    from qeff_kv.serve.config import ServeConfig
    from qeff_kv.serve.server import build_engine, text_facts

    root = tmp_path_factory.mktemp("rel-http")
    folder = chat_export(own_cb_graph, root / "tiny-chat")
    (root / "states").mkdir()
    config = ServeConfig(export_dir=str(folder), state_dir=str(root / "states"), max_queue=64)
    engine = build_engine(config)
    srv = LiveServer(engine, text_facts(config), state_dir=config.http.state_dir, max_request_bytes=CAP)
    srv.slow, srv.text = SlowDecode(engine.session), text_facts(config)
    yield srv
    srv.stop()


def _post(served, path, body=None, **kw):
    return httpx.post(served.url + path, timeout=60, **({"json": body} if body is not None else {}), **kw)


def _error(r, status, param=None, code=None):
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and "\n" not in err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def _raw(served, data: bytes, read_timeout=10.0) -> bytes:
    """Send raw bytes, read until the server closes (or the timeout)."""
    with socket.create_connection(("127.0.0.1", served.port), timeout=read_timeout) as s:
        s.sendall(data)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except (socket.timeout, ConnectionResetError):
            pass
    return out


def _json_of(response: bytes) -> tuple[int, dict]:
    head, _, body = response.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    assert b"content-type: application/json" in head.lower(), head
    return status, json.loads(body)


# ------------------------------------------------------------------------------------------ item 2
def test_a_declared_body_over_the_cap_is_refused_before_it_is_sent(served):
    t0 = time.monotonic()
    out = _raw(served, b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                       b"content-length: 40000000\r\n\r\n{\"prompt\": \"")
    status, body = _json_of(out)
    assert status == 413 and body["error"]["code"] == "request_too_large"
    assert f"limit of {CAP} bytes" in body["error"]["message"]
    assert time.monotonic() - t0 < 5   # answered without waiting for 40 MB


def test_a_chunked_body_over_the_cap_is_refused_as_it_arrives(served):
    def chunks():
        yield b'{"prompt": "'
        for _ in range(CAP // (100 << 10) + 20):
            yield b"a" * (100 << 10)
    r = httpx.post(served.url + "/v1/completions", content=chunks(), timeout=60,
                   headers={"content-type": "application/json"})
    _error(r, 413, code="request_too_large")


def _stream_gaps(served, n, out: dict, started: threading.Event):
    stamps = []
    with httpx.stream("POST", served.url + "/v1/completions", timeout=120,
                      json={"prompt": [5, 6, 7], "max_tokens": n, "temperature": 0, "ignore_eos": True,
                            "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                stamps.append(time.monotonic())
                started.set()
    out["stamps"] = stamps


def test_a_huge_prompt_refused_does_not_stall_another_stream(served):
    """Another stream's largest gap between two tokens while a prompt just under the cap is parsed, tokenized and
    refused (its tokens exceed the context) stays far below the time tokenizing it takes."""
    prompt = "hello world, abc " * ((CAP - 4096) // 17)
    t0 = time.perf_counter()
    served.text.tokenizer.encode(prompt)
    tokenize_s = time.perf_counter() - t0
    assert tokenize_s > 1.0, f"tokenizing takes {tokenize_s:.2f} s: too little for the gap to show a stall"
    served.slow.delay = 0.03
    limit, served.app.state.text_limit = served.app.state.text_limit, None   # tokenize it all: the slow path
    try:
        out, started = {}, threading.Event()
        t = threading.Thread(target=_stream_gaps, args=(served, 60, out, started))
        t.start()
        assert started.wait(30)
        a = time.monotonic()
        _error(_post(served, "/v1/completions", {"prompt": prompt, "max_tokens": 1}), 400,
               code="context_length_exceeded")
        _error(_post(served, "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}]}), 400,
               code="context_length_exceeded")
        b = time.monotonic()
        t.join(120)
    finally:
        served.slow.delay = 0.0
        served.app.state.text_limit = limit
    stamps = out["stamps"]
    gaps = [y - x for x, y in zip(stamps, stamps[1:]) if y > a and x < b]
    assert gaps and b - a > tokenize_s   # the refusals overlapped the stream
    assert max(gaps) < max(0.5, tokenize_s / 3), (max(gaps), tokenize_s)


def test_a_template_running_to_its_budget_does_not_stall_another_stream(served, tmp_path):
    """A chat template that loops until its 2 s budget stops it is refused (400) while another stream's gaps stay
    short: rendering runs in a worker thread."""
    from qeff_kv.runtime.text.chat import ChatTemplate

    slow = ChatTemplate(tmp_path / "t.jinja", "{% for i in range(4000) %}{% for j in range(4000) %}{% endfor %}"
                                              "{% endfor %}", {})
    text = served.app.state.text
    normal = text.chat_template
    served.slow.delay = 0.03
    try:
        out, started = {}, threading.Event()
        t = threading.Thread(target=_stream_gaps, args=(served, 60, out, started))
        t.start()
        assert started.wait(30)
        text.chat_template = slow
        a = time.monotonic()
        err = _error(_post(served, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}), 400,
                     param="messages")
        b = time.monotonic()
        t.join(120)
    finally:
        text.chat_template = normal
        served.slow.delay = 0.0
    assert err["message"].startswith("t.jinja: the chat template was stopped: rendering took more than 2 s")
    assert str(tmp_path) not in err["message"] and b - a >= 2.0
    stamps = out["stamps"]
    gaps = [y - x for x, y in zip(stamps, stamps[1:]) if y > a and x < b]
    assert gaps and max(gaps) < 1.0, max(gaps)   # on the loop it was the whole 2 s budget


def test_a_text_that_cannot_fit_is_refused_before_it_is_tokenized(served):
    limit = served.app.state.text_limit
    longest = max(len(t.encode()) for t in served.text.tokenizer.get_vocab(with_added_tokens=True))
    assert limit == 2 * 64 * longest + 64
    t0 = time.monotonic()
    err = _error(_post(served, "/v1/completions", {"prompt": "x" * (CAP - 1024)}), 400, param="prompt",
                 code="context_length_exceeded")
    assert time.monotonic() - t0 < 1.0
    assert err["message"] == (f"the prompt has {CAP - 1024} bytes of text; the model's context of 64 tokens cannot "
                              f"hold more than {limit} (its longest token, twice over)")
    # just under the limit: tokenized, and refused by its token count
    err = _error(_post(served, "/v1/completions", {"prompt": "x" * limit}), 400, code="context_length_exceeded")
    assert err["message"].startswith("the prompt has ") and " tokens; " in err["message"]


# ------------------------------------------------------------------------------------------ item 3
DEEP = "[" * 6000 + "]" * 6000


@pytest.mark.parametrize("path,raw", [
    ("/v1/completions", '{"prompt": ' + DEEP + "}"),
    ("/v1/chat/completions", '{"messages": ' + DEEP + "}"),
    ("/v1/completions", DEEP),
    ("/slots/0?action=save", '{"filename": ' + DEEP + "}"),
])
def test_deep_json_is_a_400(served, path, raw):
    err = _error(httpx.post(served.url + path, content=raw.encode(), timeout=30), 400)
    assert err["message"] == "the request body is nested too deeply"


@pytest.mark.parametrize("path,raw,param", [
    ("/v1/completions", '{"prompt": "ab\\ud800c"}', "prompt"),
    ("/v1/completions", '{"prompt": ["\\udfff"]}', "prompt"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x\\ud800"}]}', "messages"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}',
     "messages"),
    ("/v1/completions", '{"prompt": "a", "stop": ["\\ud800"]}', "stop"),
])
def test_lone_surrogates_are_a_400_naming_the_field(served, path, raw, param):
    err = _error(httpx.post(served.url + path, content=raw.encode(), timeout=30), 400, param=param)
    assert "lone UTF-16 surrogate" in err["message"]


def test_a_proper_surrogate_pair_is_text(served):
    r = httpx.post(served.url + "/v1/completions", content=b'{"prompt": "a\\ud83d\\ude00", "max_tokens": 2}',
                   timeout=30)
    assert r.status_code == 200, r.text


# ------------------------------------------------------------------------------------------ item 9
@pytest.mark.parametrize("temperature", [1e-310, 5e-324, 1e-300])
def test_a_vanishing_temperature_acts_as_greedy(served, temperature):
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 12, "ignore_eos": True}
    greedy = _post(served, "/v1/completions", {**body, "temperature": 0}).json()["choices"][0]["text"]
    for seed in (1, 2):
        r = _post(served, "/v1/completions", {**body, "temperature": temperature, "seed": seed})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == greedy


# ------------------------------------------------------------------------------------------ item 10
def test_a_burst_of_slots_plus_queue_is_all_accepted(own_cb_graph):
    from qeff_kv.runtime import Session
    from qeff_kv.runtime.decoding.sampling import GREEDY
    from qeff_kv.serve.engine.engine import GenerationRequest
    from qeff_kv.serve.engine.scheduler import Scheduler
    from qeff_kv.errors import QueueFullError

    for queue in (0, 2):
        engine = Scheduler(Session(own_cb_graph), max_queue=queue)
        slow = SlowDecode(engine.session)
        slow.delay = 0.05
        try:
            n = engine.max_sequences + queue
            handles = [engine.submit(GenerationRequest(f"b{i}", (5, 6, 7), 4, GREEDY, frozenset()))
                       for i in range(n)]   # a burst: submitted before the engine admits any
            with pytest.raises(QueueFullError):
                engine.submit(GenerationRequest("over", (5, 6, 7), 4, GREEDY, frozenset()))
            for h in handles:
                assert list(h.iter_sync(timeout=60))[-1].finish_reason == "length"
            # once they are done, a request is accepted again, even with max_queue 0
            h = engine.submit(GenerationRequest("after", (5, 6, 7), 2, GREEDY, frozenset()))
            assert list(h.iter_sync(timeout=60))[-1].finish_reason == "length"
        finally:
            engine.close()


# ------------------------------------------------------------------------------------------ item 11
@pytest.mark.parametrize("slot_id", ["\u0661", "\uff11", "1\u0660", "\u00b9"])
def test_slot_ids_are_ascii_digits(served, slot_id):
    _error(_post(served, f"/slots/{slot_id}?action=erase"), 400, param="id_slot")


@pytest.mark.parametrize("request_bytes", [
    b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\ncontent-length: 5\r\n\r\n{}",
    b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
    b"GET /health\r\n\r\n",
    b"GARBAGE\x00\x01 / HTTP/1.1\r\n\r\n",
    b"GET /health HTTP/1.1\r\nhost: x\r\nbad header line\r\n\r\n",
])
def test_malformed_http_gets_a_json_400(served, request_bytes):
    status, body = _json_of(_raw(served, request_bytes))
    assert status == 400 and body["error"]["code"] == "malformed_request"
    assert httpx.get(served.url + "/health", timeout=10).status_code == 200


@pytest.mark.parametrize("method,path,status", [("GET", "/nowhere", 404), ("DELETE", "/v1/completions", 405),
                                                ("PUT", "/slots/0", 405)])
def test_routing_errors_are_json(served, method, path, status):
    _error(httpx.request(method, served.url + path, timeout=10), status)
