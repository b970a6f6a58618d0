"""The OpenAI API's sampling and discovery fields against a live ``qeff-kv serve`` (the official ``openai``
client): logprobs, ``n``, ``logit_bias``, penalties, ``top_k`` / ``min_p``, ``echo``, every request field of the
installed ``openai`` package honoured or refused, sampling defaults from ``generation_config.json``,
``/v1/models/{id}``, ``/tokenize`` / ``/detokenize`` and CORS. Served tokens are compared with the same request
run alone through ``Session.generate`` (what ``qeff-kv generate`` runs) with the same sampling.

One server for the module on the tiny continuous-batching export of conftest.py (3 slots, ctx_len 64), with a
short chat template and a generation_config.json holding sampling defaults.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from serve_helpers import LiveServer, SlowDecode, chat_export  # noqa: E402

from qeff_kv.runtime.decoding.sampling import SamplingParams  # noqa: E402

#: the export's generation_config.json: what a request that gives no sampling fields gets
GEN_CONFIG = {"temperature": 0.8, "top_p": 0.9, "top_k": 7, "max_new_tokens": 6, "do_sample": True}
PROMPT = "the cat sat"


@pytest.fixture(scope="module")
def served(own_cb_graph, tmp_path_factory):
    from qeff_kv.serve.config import ServeConfig
    from qeff_kv.serve.server import build_engine, check_config, check_max_n, sampling_defaults, text_facts

    root = tmp_path_factory.mktemp("serve-api")
    folder = chat_export(own_cb_graph, root / "tiny-api")
    (folder / "generation_config.json").write_text(json.dumps(GEN_CONFIG))
    config = ServeConfig(export_dir=str(folder), min_p=0.01)   # one default from a flag
    check_config(config)
    engine = build_engine(config)
    slow = SlowDecode(engine.session)
    defaults = sampling_defaults(config)
    srv = LiveServer(engine, text_facts(config), defaults=defaults, max_n=check_max_n(config, engine))
    srv.folder, srv.text, srv.slow = folder, text_facts(config), slow
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def session(served):
    from qeff_kv.runtime import Session

    return Session(served.folder, max_sequences=1)


@pytest.fixture(scope="module")
def run_alone(served, session):
    """``run_alone(ids, n, **sampling) -> tokens``: the prompt alone through Session.generate (eos stops)."""
    def run(ids, n, **sampling):
        [g] = session.generate([list(ids)], max_new_tokens=n, sampling=SamplingParams(**sampling))
        session.remove_sequence(g.sequence)
        return g.tokens

    return run


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0, timeout=60)


def _ids(served, text):
    return list(served.text.tokenizer.encode(text).ids)


def _text(served, tokens):
    eos = set(served.text.eos_token_ids)
    return served.text.tokenizer.decode([t for t in tokens if t not in eos], skip_special_tokens=True)


def _post(served, route, body, **kw):
    return httpx.post(f"{served.url}{route}", json=body, timeout=60, **kw)


# ------------------------------------------------------------------------------------------ logprobs
def test_chat_logprobs_are_the_greedy_distribution(client, served, session):
    messages = [{"role": "user", "content": "hi there"}]
    r = client.chat.completions.create(model="tiny-api", messages=messages, max_tokens=5, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens or r.choices[0].finish_reason == "stop"
    for item in content:
        assert item.top_logprobs[0].token == item.token          # greedy: the chosen token is the most likely
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob)
        assert len(item.top_logprobs) == 3
        assert [t.logprob for t in item.top_logprobs] == sorted([t.logprob for t in item.top_logprobs], reverse=True)
        assert bytes(item.bytes).decode("utf-8", "replace") == item.token
    # the first token's logprob is the log-softmax of the prompt's logits
    rendered = served.text.chat_template.render(messages, add_generation_prompt=True)
    ids = list(served.text.tokenizer.encode(rendered, add_special_tokens=False).ids)
    seq = session.cache.create()
    logits = np.asarray(session.prefill(seq, ids), dtype=np.float64).reshape(-1)
    session.remove_sequence(seq)
    lp = logits - (logits.max() + np.log(np.exp(logits - logits.max()).sum()))
    first = int(np.argmax(logits))
    assert content[0].logprob == pytest.approx(lp[first], abs=1e-4)
    assert content[0].top_logprobs[1].logprob == pytest.approx(np.sort(lp)[-2], abs=1e-4)


def test_completion_logprobs_shape_and_greedy(client, served, run_alone):
    ids = _ids(served, PROMPT)
    r = client.completions.create(model="tiny-api", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    want = run_alone(ids, 6)
    shown = [t for t in want if t not in served.text.eos_token_ids]
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(shown)
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert max(top.values()) == pytest.approx(value) and value <= 0
        assert tok in top
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert r.choices[0].text == _text(served, want)


def test_streamed_logprobs_match_non_streamed(client):
    kw = dict(model="tiny-api", messages=[{"role": "user", "content": "abc"}], max_tokens=6, temperature=0,
              logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**kw).choices[0].logprobs.content
    parts = []
    for chunk in client.chat.completions.create(stream=True, **kw):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            parts.extend(chunk.choices[0].logprobs.content)
    assert [(p.token, round(p.logprob, 6)) for p in parts] == [(w.token, round(w.logprob, 6)) for w in whole]


def test_sampled_logprobs_follow_the_seeded_token(client, served, run_alone):
    r = client.completions.create(model="tiny-api", prompt=PROMPT, max_tokens=6, temperature=1.0, seed=11,
                                  top_p=1.0, extra_body={"top_k": 0, "min_p": 0.0}, logprobs=1)
    want = run_alone(_ids(served, PROMPT), 6, temperature=1.0, seed=11)
    assert r.choices[0].text == _text(served, want)
    assert all(v <= 0 and math.isfinite(v) for v in r.choices[0].logprobs.token_logprobs)


# ------------------------------------------------------------------------------------------ n
def test_n_seeded_is_repeatable_and_each_choice_equals_its_seed_alone(client, served, run_alone):
    kw = dict(model="tiny-api", prompt=PROMPT, max_tokens=8, temperature=1.0, top_p=1.0,
              extra_body={"top_k": 0, "min_p": 0.0}, seed=100, n=3)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert [c.index for c in a.choices] == [0, 1, 2]
    ids = _ids(served, PROMPT)
    alone = [run_alone(ids, 8, temperature=1.0, seed=100 + i) for i in range(3)]
    assert [c.text for c in a.choices] == [_text(served, t) for t in alone]
    assert len({c.text for c in a.choices}) > 1      # different seeds, different streams
    assert a.usage.prompt_tokens == len(ids)
    assert a.usage.completion_tokens == sum(len(t) for t in alone)


def test_n_streamed_equals_non_streamed(client):
    kw = dict(model="tiny-api", messages=[{"role": "user", "content": "yo"}], max_tokens=6, temperature=1.0,
              seed=5, n=3, extra_body={"top_k": 0, "min_p": 0.0})
    whole = client.chat.completions.create(**kw)
    texts = {0: "", 1: "", 2: ""}
    finished = set()
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished.add(c.index)
    assert [texts[i] for i in range(3)] == [c.message.content for c in whole.choices]
    assert finished == {0, 1, 2}


def test_n_above_max_n_is_refused(served):
    r = _post(served, "/v1/completions", {"prompt": "hi", "n": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


# ------------------------------------------------------------------------------------------ bias and penalties
def test_logit_bias_bans_the_greedy_token(client, served, run_alone):
    ids = _ids(served, PROMPT)
    greedy = run_alone(ids, 4)
    banned = greedy[0]
    r = client.completions.create(model="tiny-api", prompt=PROMPT, max_tokens=4, temperature=0,
                                  logit_bias={str(banned): -100}, logprobs=0)
    want = run_alone(ids, 4, logit_bias=((banned, -100.0),))
    assert want[0] != banned
    assert r.choices[0].text == _text(served, want)
    assert banned not in [served.text.tokenizer.token_to_id(t) for t in r.choices[0].logprobs.tokens]


def test_penalties_change_a_repetitive_answer(client, served, run_alone):
    ids = _ids(served, PROMPT)
    greedy = run_alone(ids, 30)
    assert len(set(greedy)) < len(greedy), "the precondition: greedy output repeats tokens"
    for field, value, params in [("frequency_penalty", 2.0, {"frequency_penalty": 2.0}),
                                 ("presence_penalty", 2.0, {"presence_penalty": 2.0}),
                                 ("repetition_penalty", 1.8, {"repetition_penalty": 1.8})]:
        r = _post(served, "/v1/completions", {"prompt": PROMPT, "max_tokens": 30, "temperature": 0, field: value})
        assert r.status_code == 200, r.text
        want = run_alone(ids, 30, **params)
        assert want != greedy, field
        assert r.json()["choices"][0]["text"] == _text(served, want), field


def test_top_k_min_p_seeded_equal_session(served, run_alone):
    ids = _ids(served, PROMPT)
    for extra in ({"top_k": 3}, {"min_p": 0.2}, {"top_k": 5, "min_p": 0.05, "top_p": 0.8}):
        body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 1.2, "seed": 9, "top_p": 1.0, "top_k": 0,
                "min_p": 0.0, **extra}
        r = _post(served, "/v1/completions", body)
        want = run_alone(ids, 8, temperature=1.2, seed=9, **{"top_p": 1.0, **extra})
        assert r.json()["choices"][0]["text"] == _text(served, want), extra


def test_denormal_temperature_is_greedy(served, run_alone):
    r = _post(served, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 1e-310, "seed": 3})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == _text(served, run_alone(_ids(served, PROMPT), 6))


def test_echo_prepends_the_prompt(served, run_alone):
    r = _post(served, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "echo": True})
    assert r.json()["choices"][0]["text"] == PROMPT + _text(served, run_alone(_ids(served, PROMPT), 4))
    chunks = httpx.post(f"{served.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0,
                                                             "echo": True, "stream": True}, timeout=60).text
    texts = [json.loads(line[6:])["choices"][0]["text"] for line in chunks.splitlines()
             if line.startswith("data: {")]
    assert "".join(texts) == r.json()["choices"][0]["text"]


# ------------------------------------------------------------------------------------------ every field
#: a value for every request field of the installed openai package: honoured fields (200) take an effect-bearing
#: value; refused ones (400 naming the field) a value that would change the output or cannot be honoured
HONOURED_CHAT = {
    "messages": [{"role": "user", "content": "hi"}], "model": "tiny-api", "frequency_penalty": 0.5,
    "logit_bias": {"5": 3}, "logprobs": True, "max_completion_tokens": 3, "max_tokens": 3, "n": 2,
    "presence_penalty": 0.5, "seed": 1, "stop": ["zz"], "stream_options": None, "temperature": 0.5,
    "top_logprobs": 2, "top_p": 0.9, "user": "u1", "safety_identifier": "s1", "prompt_cache_key": "k",
    "metadata": {"a": "b"}, "service_tier": "auto", "store": False,
    "response_format": {"type": "json_object"}, "parallel_tool_calls": True, "tool_choice": "auto",
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
}
REFUSED_CHAT = {
    "audio": {"voice": "alloy", "format": "wav"}, "function_call": "auto",
    "functions": [{"name": "f", "parameters": {}}], "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "x"},
    "reasoning_effort": "high", "verbosity": "low",
    "web_search_options": {}, "prompt_cache_retention": "24h", "moderation": {"model": "x"},
    "prompt_cache_options": {"ttl": 5},
}
HONOURED_COMPLETIONS = {
    "model": "tiny-api", "prompt": "hi", "best_of": 1, "echo": True, "frequency_penalty": 0.5,
    "logit_bias": {"5": 3}, "logprobs": 2, "max_tokens": 3, "n": 2, "presence_penalty": 0.5, "seed": 1,
    "stop": "zz", "stream_options": None, "temperature": 0.5, "top_p": 0.9, "user": "u1",
}
REFUSED_COMPLETIONS = {"suffix": "end", "best_of": 3}


def _openai_fields(module) -> set[str]:
    base = module.CompletionCreateParamsBase
    return set(base.__required_keys__ | base.__optional_keys__) - {"stream"}


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_every_openai_request_field_is_honoured_or_refused(served, chat):
    from openai.types import completion_create_params
    from openai.types.chat import completion_create_params as chat_create_params

    fields = _openai_fields(chat_create_params if chat else completion_create_params)
    honoured = HONOURED_CHAT if chat else HONOURED_COMPLETIONS
    refused = REFUSED_CHAT if chat else REFUSED_COMPLETIONS
    unclassified = fields - set(honoured) - set(refused)
    assert not unclassified, f"classify these fields of openai {openai.__version__}: {sorted(unclassified)}"
    route = "/v1/chat/completions" if chat else "/v1/completions"
    base = {"messages": HONOURED_CHAT["messages"]} if chat else {"prompt": "hi"}
    for field in sorted(fields):
        if field in honoured:
            body = {**base, "max_tokens": 3, field: honoured[field]}
            if field == "top_logprobs":
                body["logprobs"] = True
            if field == "max_completion_tokens":
                del body["max_tokens"]
            r = _post(served, route, body)
            if field == "tools" and r.status_code == 400:   # rendered into the prompt: more than the tiny context
                assert r.json()["error"]["code"] == "context_length_exceeded", r.text
                continue
            assert r.status_code == 200, (field, r.text)
        if field in refused:
            r = _post(served, route, {**base, "max_tokens": 3, field: refused[field]})
            assert r.status_code == 400, (field, r.text)
            assert r.json()["error"]["param"] == field, (field, r.text)


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"repeat_penalty": 1.1}, "repeat_penalty"), ({"mirostat": 1}, "mirostat"),
    ({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"), ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"100000": -1}}, "logit_bias"), ({"presence_penalty": 3}, "presence_penalty"),
    ({"min_p": 1.5}, "min_p"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"stream_options": {"include_obfuscation": True}}, "stream_options"),
])
def test_bad_sampling_fields_are_400(served, body, param):
    r = _post(served, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and "\n" not in err["message"]


def test_completion_echo_with_logprobs_scores_a_plain_export(served):
    """Prompt logprobs on a graph returning its last row only: scored position by position (issue 52; the values
    against transformers: tests/serve/test_serve_prompt_logprobs.py)."""
    r = _post(served, "/v1/completions", {"prompt": "hi there", "echo": True, "logprobs": 1, "max_tokens": 1})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["token_logprobs"][0] is None and all(v <= 0 for v in lp["token_logprobs"][1:])
    assert len(lp["tokens"]) == r.json()["usage"]["prompt_tokens"] + 1


# ------------------------------------------------------------------------------------------ defaults, discovery
def test_defaults_from_generation_config_are_shown(client, served):
    [m] = client.models.list().data
    shown = m.model_extra["sampling_defaults"]
    assert shown["temperature"] == 0.8 and shown["top_p"] == 0.9 and shown["top_k"] == 7
    assert shown["max_tokens"] == 6 and shown["min_p"] == 0.01 and shown["repetition_penalty"] == 1.0
    assert shown["source"] == {"temperature": "generation_config.json", "top_p": "generation_config.json",
                               "top_k": "generation_config.json", "max_tokens": "generation_config.json",
                               "min_p": "flag", "repetition_penalty": "openai"}
    assert m.model_extra["max_n"] == 3
    health = httpx.get(served.url + "/health", timeout=10).json()
    assert health["sampling_defaults"] == shown


def test_defaults_are_used(served, run_alone):
    r = _post(served, "/v1/completions", {"prompt": PROMPT, "seed": 21}).json()
    want = run_alone(_ids(served, PROMPT), 6, temperature=0.8, top_p=0.9, top_k=7, min_p=0.01, seed=21)
    assert r["choices"][0]["text"] == _text(served, want)
    assert r["usage"]["completion_tokens"] == len(want) <= 6


def test_flags_override_generation_config(tmp_path):
    from qeff_kv.errors import RuntimeInputError
    from qeff_kv.serve.engine.defaults import resolve_defaults

    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_k": -1}))
    d = resolve_defaults(tmp_path, {"temperature": 0.2, "top_p": None})
    assert (d.temperature, d.top_k, d.top_p) == (0.2, 0, 1.0)
    assert d.source["temperature"] == "flag" and d.source["top_k"] == "generation_config.json"
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": "high"}))
    with pytest.raises(RuntimeInputError, match="top_p"):
        resolve_defaults(tmp_path, {})
    with pytest.raises(RuntimeInputError, match="min_p"):
        resolve_defaults(tmp_path / "none", {"min_p": 3.0})


def test_model_by_id(client, served):
    m = client.models.retrieve("tiny-api")
    assert m.id == "tiny-api" and m.model_extra["max_model_len"] == served.engine.ctx_len
    assert m.model_extra["kv_cache_dtype"] == "float32"   # a router reads the cache dtype (int8: --kv-cache-dtype)
    r = httpx.get(served.url + "/v1/models/gpt-9", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_tokenize_detokenize(served):
    r = _post(served, "/tokenize", {"prompt": PROMPT}).json()
    assert r["tokens"] == _ids(served, PROMPT) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == served.engine.ctx_len
    messages = [{"role": "user", "content": "hi"}]
    chat = _post(served, "/tokenize", {"messages": messages}).json()
    rendered = served.text.chat_template.render(messages, add_generation_prompt=True)
    assert chat["tokens"] == list(served.text.tokenizer.encode(rendered, add_special_tokens=False).ids)
    back = _post(served, "/detokenize", {"tokens": r["tokens"]}).json()
    assert back == {"prompt": served.text.tokenizer.decode(r["tokens"], skip_special_tokens=False)}
    for route, body, param in [("/tokenize", {"prompt": 5}, "prompt"), ("/tokenize", {}, "prompt"),
                               ("/detokenize", {"tokens": [10 ** 9]}, "tokens"),
                               ("/tokenize", {"prompt": "x", "model": "other"}, "model")]:
        bad = _post(served, route, body)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, (route, body)


def test_cors_off_by_default_and_preflight_when_on(served):
    pre = {"Origin": "http://page.example", "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization,content-type"}
    off = httpx.options(served.url + "/v1/chat/completions", headers=pre, timeout=10)
    assert "access-control-allow-origin" not in off.headers
    from qeff_kv.serve.http.app import create_app
    from starlette.testclient import TestClient

    app = create_app(served.engine, text=served.text, allowed_origins=["http://page.example"])
    with TestClient(app) as tc:
        r = tc.options("/v1/chat/completions", headers=pre)
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "http://page.example"
        assert "POST" in r.headers["access-control-allow-methods"]
        other = tc.options("/v1/chat/completions", headers={**pre, "Origin": "http://evil.example"})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        got = tc.get("/v1/models", headers={"Origin": "http://page.example"})
        assert got.headers["access-control-allow-origin"] == "http://page.example"


def test_n_prefills_the_prompt_once(served):
    prompt = "zyxwvutsrqponm"          # 14 tokens: 2 prefill chunks of 8
    before = httpx.get(served.url + "/health", timeout=10).json()
    r = _post(served, "/v1/completions", {"prompt": prompt, "max_tokens": 3, "temperature": 1.0, "seed": 2,
                                          "n": 3})
    assert r.status_code == 200 and len(r.json()["choices"]) == 3
    after = httpx.get(served.url + "/health", timeout=10).json()
    assert after["prefill_chunks"] - before["prefill_chunks"] == 2
    assert after["sequences_active"] == 0


def test_n_without_copy_prefills_each_choice_with_the_same_tokens(served, run_alone):
    from qeff_kv.errors import RuntimeInputError

    session = served.engine.session

    def no_copy(*args, **kwargs):
        raise RuntimeInputError("copy refused (test)")

    prompt = "qwertyuiopasdf"          # 14 tokens: 2 chunks per choice when each prefills
    before = httpx.get(served.url + "/health", timeout=10).json()
    session.copy = no_copy
    try:
        r = _post(served, "/v1/completions", {"prompt": prompt, "max_tokens": 5, "temperature": 1.0, "seed": 40,
                                              "top_p": 1.0, "top_k": 0, "min_p": 0.0, "n": 3, "ignore_eos": True})
    finally:
        del session.copy
    after = httpx.get(served.url + "/health", timeout=10).json()
    assert r.status_code == 200, r.text
    ids = _ids(served, prompt)
    want = [_text(served, run_alone(ids, 5, temperature=1.0, seed=40 + i)) for i in range(3)]
    assert [c["text"] for c in r.json()["choices"]] == want
    assert after["prefill_chunks"] - before["prefill_chunks"] >= 4   # the prompt prefilled again, not copied


def test_closing_an_n_stream_frees_every_choice(served):
    """With 0.1 s per decode step the 50 tokens would take 5 s: the choices end when the client leaves."""
    import time

    served.slow.delay = 0.1
    try:
        _closing_an_n_stream(served)
    finally:
        served.slow.delay = 0.0


def _closing_an_n_stream(served):
    import time

    steps = httpx.get(served.url + "/health", timeout=10).json()["decode_steps"]
    with httpx.stream("POST", served.url + "/v1/completions", timeout=60,
                      json={"prompt": "a b c", "max_tokens": 50, "temperature": 1.0, "seed": 1, "n": 3,
                            "stream": True, "ignore_eos": True}) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                break
    closed = time.monotonic()
    while time.monotonic() < closed + 3:
        h = httpx.get(served.url + "/health", timeout=10).json()
        if h["sequences_active"] == 0 and h["queue_depth"] == 0:
            break
        time.sleep(0.05)
    assert h["sequences_active"] == 0 and h["queue_depth"] == 0, h
    assert h["decode_steps"] - steps < 40, h     # stopped, not run to the 50 tokens
