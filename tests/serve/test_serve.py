"""``qeff-kv serve`` against a live server (uvicorn in a thread on 127.0.0.1): the official ``openai`` client,
greedy text equal to the same prompt run alone in a plain ``Session``, concurrency, cancellation, a full queue,
OpenAI-shaped errors, the API key, prompt reuse, slot save/restore, metrics.

One server for the module, on the tiny continuous-batching export of conftest.py (3 slots, ctx_len 64, prefill
chunks of 8) with a short chat template added.
"""

from __future__ import annotations

import json
import random
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from serve_helpers import LiveServer, SlowDecode, chat_export  # noqa: E402

KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def served(own_cb_graph, tmp_path_factory):
    from qeff_kv.serve.config import ServeConfig
    from qeff_kv.serve.server import build_engine, check_config, text_facts

    root = tmp_path_factory.mktemp("serve")
    folder = chat_export(own_cb_graph, root / "tiny-chat")
    config = ServeConfig(export_dir=str(folder), api_key=KEY, state_dir=str(root / "states"), max_queue=64)
    check_config(config)
    engine = build_engine(config)
    slow = SlowDecode(engine.session)
    srv = LiveServer(engine, text_facts(config), api_key=KEY, state_dir=config.http.state_dir)
    srv.slow, srv.folder, srv.text = slow, folder, text_facts(config)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reference(served):
    """``ref(prompt_ids, n, stop=True) -> (text, tokens, finish)``: the prompt run alone in a plain Session."""
    from qeff_kv.runtime import Session

    session = Session(served.folder, max_sequences=1)
    tok = served.text.tokenizer
    cache: dict = {}

    def ref(ids, n, stop=True):
        key = (tuple(ids), n, stop)
        if key not in cache:
            [g] = session.generate([list(ids)], max_new_tokens=n, stop_tokens=None if stop else [])
            session.remove_sequence(g.sequence)
            toks = g.tokens[:-1] if g.finish_reason == "stop" else g.tokens
            cache[key] = (tok.decode(toks, skip_special_tokens=True), g.tokens, g.finish_reason)
        return cache[key]

    return ref


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def _ids(served, text):
    return list(served.text.tokenizer.encode(text).ids)


def _chat_ids(served, messages):
    rendered = served.text.chat_template.render(messages, add_generation_prompt=True)
    return list(served.text.tokenizer.encode(rendered, add_special_tokens=False).ids)


def _metrics(served) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    body = httpx.get(served.url + "/metrics", timeout=10).text
    out = {}
    for fam in text_string_to_metric_families(body):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _metric(m, name, **labels):
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def _wait_idle(served, timeout=20):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        h = httpx.get(served.url + "/health", timeout=10).json()
        if h["sequences_active"] == 0 and h["queue_depth"] == 0:
            return h
        time.sleep(0.02)
    raise AssertionError(f"the server did not become idle: {h}")


# ------------------------------------------------------------------------------------------ OpenAI routes
def test_models(client, served):
    [m] = client.models.list().data
    assert m.id == "tiny-chat" and served.engine.model_name == "tiny-chat"


def test_completion_equals_session(client, served, reference):
    prompt = "Once upon a time"
    want, toks, finish = reference(_ids(served, prompt), 10)
    r = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=10, temperature=0)
    assert r.choices[0].text == want
    assert r.choices[0].finish_reason == ("stop" if finish == "stop" else "length")
    assert r.usage.prompt_tokens == len(_ids(served, prompt))
    assert r.usage.completion_tokens == len(toks)


def test_completion_stream_equals_session(client, served, reference):
    prompt = "The quick brown fox"
    want, toks, _ = reference(_ids(served, prompt), 12, stop=False)
    stream = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12 == len(toks)


def test_chat_equals_session(client, served, reference):
    messages = [{"role": "user", "content": "Tell me a story"}]
    want, _, _ = reference(_chat_ids(served, messages), 10)
    r = client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=10, temperature=0)
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model="tiny-chat", messages=messages, max_completion_tokens=10,
                                            temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want


def test_stop_strings(client, served, reference):
    prompt = "stop strings"
    full, _, _ = reference(_ids(served, prompt), 16, stop=False)
    # stop at a piece of the greedy continuation: the text ends just before it, finish_reason "stop"
    cut = next(i for i in range(3, len(full) - 1) if "\ufffd" not in full[i:i + 2] and full.find(full[i:i + 2]) == i)
    stop = full[cut:cut + 2]
    for stream in (False, True):
        r = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=16, temperature=0,
                                      stop=["\u2603never", stop], stream=stream, extra_body={"ignore_eos": True})
        if stream:
            chunks = [c for c in r if c.choices]
            text, finish = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        else:
            text, finish = r.choices[0].text, r.choices[0].finish_reason
        assert (text, finish) == (full[:cut], "stop")
    _wait_idle(served)


def test_seeded_sampling_repeats(client):
    kw = dict(model="tiny-chat", prompt=[5, 17, 42, 99], max_tokens=8, temperature=0.9, top_p=0.9, seed=7,
              extra_body={"ignore_eos": True})
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    assert a == b


# ------------------------------------------------------------------------------------------ concurrency
def test_concurrent_clients_match_alone(served, reference):
    rng = random.Random(3)
    jobs = [[(rng.choice([False, True]), [rng.randrange(3, 256) for _ in range(rng.randrange(1, 40))],
              rng.randrange(1, 16)) for _ in range(3)] for _ in range(8)]
    for client_jobs in jobs:
        for _, ids, n in client_jobs:
            reference(ids, n, stop=False)
    before = _metrics(served)
    results: dict = {}
    errors: list = []

    def worker(c):
        cl = openai.OpenAI(base_url=served.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        try:
            for j, (stream, ids, n) in enumerate(jobs[c]):
                kw = dict(model="tiny-chat", prompt=ids, max_tokens=n, temperature=0, extra_body={"ignore_eos": True})
                if stream:
                    text = "".join(ch.choices[0].text for ch in cl.completions.create(stream=True, **kw) if ch.choices)
                else:
                    text = cl.completions.create(**kw).choices[0].text
                results[(c, j)] = text
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(repr(exc))

    threads = [threading.Thread(target=worker, args=(c,)) for c in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert len(results) == 24
    for c in range(8):
        for j, (_, ids, n) in enumerate(jobs[c]):
            assert results[(c, j)] == reference(ids, n, stop=False)[0], (c, j)
    _wait_idle(served)
    after = _metrics(served)
    total_new = sum(n for cj in jobs for _, _, n in cj)
    total_prompt = sum(len(ids) for cj in jobs for _, ids, _ in cj)
    assert _metric(after, "qeff_kv_requests_total", outcome="length") - \
        _metric(before, "qeff_kv_requests_total", outcome="length") == 24
    assert _metric(after, "qeff_kv_generation_tokens_total") - _metric(before, "qeff_kv_generation_tokens_total") \
        == total_new
    assert _metric(after, "qeff_kv_prompt_tokens_total") - _metric(before, "qeff_kv_prompt_tokens_total") \
        == total_prompt
    ttft = "qeff_kv_time_to_first_token_seconds_count"
    assert _metric(after, ttft) - _metric(before, ttft) == 24
    itl = "qeff_kv_inter_token_latency_seconds_count"
    assert _metric(after, itl) - _metric(before, itl) == total_new - 24


# ------------------------------------------------------------------------------------------ cancellation, queue
def test_disconnect_frees_the_sequence(served, reference):
    before = _metrics(served)
    served.slow.delay = 0.05
    try:
        body = {"model": "tiny-chat", "prompt": [7, 8, 9], "max_tokens": 50, "temperature": 0, "stream": True,
                "ignore_eos": True}
        with httpx.Client(timeout=30) as c:
            with c.stream("POST", served.url + "/v1/completions", json=body, headers=AUTH) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                got = [next(lines) for _ in range(4)]
                assert any(line.startswith("data: {") for line in got)
        # the client is gone: its sequence is freed long before its 50 tokens (2.5 s at this pace) could finish
        t0 = time.monotonic()
        _wait_idle(served, timeout=5)
        assert time.monotonic() - t0 < 2.0
    finally:
        served.slow.delay = 0.0
    after = _metrics(served)
    assert _metric(after, "qeff_kv_requests_total", outcome="cancelled") - \
        _metric(before, "qeff_kv_requests_total", outcome="cancelled") == 1
    assert _metric(after, "qeff_kv_generation_tokens_total") - _metric(before, "qeff_kv_generation_tokens_total") < 50
    # and the next request runs (its slot is free), with the right tokens
    ids = [11, 12, 13, 14]
    r = httpx.post(served.url + "/v1/completions", headers=AUTH, timeout=30,
                   json={"prompt": ids, "max_tokens": 6, "temperature": 0, "ignore_eos": True})
    assert r.json()["choices"][0]["text"] == reference(ids, 6, stop=False)[0]


def test_full_queue_is_429(served):
    engine = served.engine
    served.slow.delay = 0.05
    old = engine.max_queue
    engine.max_queue = 1
    streams = []
    try:
        c = httpx.Client(timeout=30)
        body = {"prompt": [20, 21, 22], "max_tokens": 40, "temperature": 0, "stream": True, "ignore_eos": True}
        deadline = time.monotonic() + 10
        for i in range(3):   # every slot busy (each admitted before the next comes: the queue holds one)
            cm = c.stream("POST", served.url + "/v1/completions", json=body, headers=AUTH)
            r = cm.__enter__()
            streams.append(cm)
            assert r.status_code == 200
            while engine.stats()["sequences_active"] < i + 1 and time.monotonic() < deadline:
                time.sleep(0.01)
        cm = c.stream("POST", served.url + "/v1/completions", json=body, headers=AUTH)   # waits in the queue
        r = cm.__enter__()
        streams.append(cm)
        assert r.status_code == 200
        while engine.stats()["queue_depth"] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        full = httpx.post(served.url + "/v1/completions", json=dict(body, stream=False), headers=AUTH, timeout=30)
        assert full.status_code == 429
        err = full.json()["error"]
        assert err["code"] == "queue_full" and "queue is full" in err["message"]
    finally:
        engine.max_queue = old
        served.slow.delay = 0.0
        for cm in streams:
            cm.__exit__(None, None, None)
        c.close()
    _wait_idle(served)


# ------------------------------------------------------------------------------------------ errors
BAD = [
    ("not json", b"{bad", None),
    ("array body", b"[1, 2]", None),
    ("unknown model", {"model": "gpt-9", "prompt": "hi"}, "model"),
    ("max_tokens 0", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("max_tokens string", {"prompt": "hi", "max_tokens": "5"}, "max_tokens"),
    ("max_tokens too large", {"prompt": "hi", "max_tokens": 10 ** 6}, "max_tokens"),
    ("temperature 3", {"prompt": "hi", "temperature": 3}, "temperature"),
    ("top_p 0", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("n 2", {"prompt": "hi", "n": 2}, "n"),
    ("no prompt", {"max_tokens": 3}, "prompt"),
    ("prompt too long", {"prompt": [5] * 65}, "prompt"),
    ("token id out of vocabulary", {"prompt": [5, 100000]}, "prompt"),
    ("stop of ints", {"prompt": "hi", "stop": [1, 2]}, "stop"),
    ("stream yes", {"prompt": "hi", "stream": "yes"}, "stream"),
    ("seed -1", {"prompt": "hi", "seed": -1}, "seed"),
    ("logprobs 6", {"prompt": "hi", "logprobs": 6}, "logprobs"),
    ("unknown field", {"prompt": "hi", "mirostat": 2}, "mirostat"),
]
BAD_CHAT = [
    ("messages missing", {"max_tokens": 3}, "messages"),
    ("messages not a list", {"messages": "hi"}, "messages"),
    ("bad role", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ("content int", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ("chat too long", {"messages": [{"role": "user", "content": "x" * 80}]}, "messages"),
]


@pytest.mark.parametrize("route,name,body,param",
                         [("completions", *b) for b in BAD] + [("chat/completions", *b) for b in BAD_CHAT],
                         ids=[b[0] for b in BAD] + [b[0] for b in BAD_CHAT])
def test_bad_requests_are_400_in_openai_shape(served, route, name, body, param):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{served.url}/v1/{route}", content=data, timeout=30,
                   headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]
    assert "\n" not in err["message"]


def test_server_keeps_serving_after_bad_requests(client, served, reference):
    for _, body, _ in BAD:
        httpx.post(served.url + "/v1/completions", content=body if isinstance(body, bytes) else json.dumps(body),
                   headers=AUTH, timeout=30)
    want = reference([5, 6, 7], 5)[0]
    assert client.completions.create(model="tiny-chat", prompt=[5, 6, 7], max_tokens=5, temperature=0) \
        .choices[0].text == want
    assert httpx.get(served.url + "/health", timeout=10).json()["status"] == "ok"


def test_api_key(served):
    body = {"prompt": "hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(served.url + "/v1/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(served.url + "/v1/models", timeout=10).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=served.url + "/v1", api_key="nope", max_retries=0).models.list()
    assert httpx.get(served.url + "/health", timeout=10).status_code == 200
    assert httpx.get(served.url + "/nowhere", timeout=10).json()["error"]["type"] == "not_found_error"


# ------------------------------------------------------------------------------------------ prompt reuse
def test_prompt_reuse_reports_cached_tokens_and_same_output(client, served, reference):
    system = "Be brief."
    before = _metrics(served)
    outs = []
    for question in ("Why is the sky blue?", "Why is the sea wet?"):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        want = reference(_chat_ids(served, messages), 8)[0]
        r = client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=8, temperature=0)
        assert r.choices[0].message.content == want
        outs.append(r.usage.prompt_tokens_details.cached_tokens)
    shared = len(_chat_ids(served, [{"role": "system", "content": system}, {"role": "user", "content": "Why is "}])) - 1
    assert outs[1] >= shared > 0
    after = _metrics(served)
    reused = "qeff_kv_prompt_tokens_reused_total"
    assert _metric(after, reused) - _metric(before, reused) == sum(outs)
    # the same prompt again: everything but its last token is reused, the output is unchanged
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Why is the sea wet?"}]
    ids = _chat_ids(served, messages)
    r = client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=8, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(r)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reference(ids, 8)[0]
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == len(ids) - 1


# ------------------------------------------------------------------------------------------ slots
def test_slot_save_erase_restore(served, reference):
    ids = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49]
    post = lambda path, **kw: httpx.post(served.url + path, headers=AUTH, timeout=30, **kw)  # noqa: E731
    r = post("/v1/completions", json={"prompt": ids, "max_tokens": 5, "temperature": 0, "ignore_eos": True})
    want = r.json()["choices"][0]["text"]
    assert want == reference(ids, 5, stop=False)[0]
    _wait_idle(served)
    slots = httpx.get(served.url + "/slots", headers=AUTH, timeout=10).json()
    [slot] = [s["id"] for s in slots if s["state"] == "cached" and s["n_tokens"] == len(ids) + 4]
    saved = post(f"/slots/{slot}?action=save", json={"filename": "ten.safetensors"}).json()
    assert saved["id_slot"] == slot and saved["n_saved"] == len(ids) + 4 and saved["n_written"] > 0
    assert post(f"/slots/{slot}?action=erase").json()["n_erased"] == len(ids) + 4
    states = {s["id"]: s["state"] for s in httpx.get(served.url + "/slots", headers=AUTH, timeout=10).json()}
    assert states[slot] == "free"
    restored = post(f"/slots/{slot}?action=restore", json={"filename": "ten.safetensors"}).json()
    assert restored["n_restored"] == len(ids) + 4
    r = post("/v1/completions", json={"prompt": ids, "max_tokens": 5, "temperature": 0, "ignore_eos": True}).json()
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == len(ids) - 1
    assert r["choices"][0]["text"] == want


@pytest.mark.parametrize("path,body,status,param", [
    ("/slots/0?action=save", {"filename": "../escape.safetensors"}, 400, "filename"),
    ("/slots/0?action=save", {"filename": "a/b.safetensors"}, 400, "filename"),
    ("/slots/0?action=save", {}, 400, "filename"),
    ("/slots/0?action=fly", {"filename": "x.safetensors"}, 400, "action"),
    ("/slots/99?action=save", {"filename": "x.safetensors"}, 400, "id_slot"),
    ("/slots/0?action=restore", {"filename": "missing.safetensors"}, 400, "id_slot"),
])
def test_slot_refusals(served, path, body, status, param):
    r = httpx.post(served.url + path, json=body, headers=AUTH, timeout=30)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


def test_slots_need_a_state_dir(served):
    from fastapi.testclient import TestClient

    from qeff_kv.serve.http.app import create_app

    app = create_app(served.engine, text=served.text)   # same engine, no --state-dir
    with TestClient(app) as tc:
        r = tc.post("/slots/0?action=save", json={"filename": "x.safetensors"})
    assert r.status_code == 501
    assert r.json()["error"]["code"] == "slots_disabled"
