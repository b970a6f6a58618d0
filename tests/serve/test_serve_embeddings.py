"""``POST /v1/embeddings`` (issue 41) from a decoder exported with ``hidden_states=True`` (``--hidden-states``):
through the official ``openai`` client, each input's embedding equal to transformers' final hidden state of its
last token on the same weights, L2-normalised (a text and token ids; the ids longer than the engine's prefill
chunk, ``--prefill-chunk 8``); base64 equal to float; served on a lock-step session while the slots keep serving
completions; the one-line refusals (an export without the output, ``dimensions``, an unknown field, an id outside
the vocabulary); the option leaves an export without it unchanged (its options hash).

Issue 52: an embedding input is a request of the engine: it waits for a busy sequence (no more 503), a full queue
answers 429 ``queue_full`` (a list of inputs counts as one request there), it is prefilled in the engine's chunks
with a running stream's decode steps between them, a client gone while it waits frees its place, and hypothesis's
bodies answer 200 or a 4xx, never a 500.
"""

from __future__ import annotations

import base64
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("torch")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from serve_helpers import LiveServer, chat_export  # noqa: E402

IDS = [int(t) for t in np.random.RandomState(7).randint(3, 250, 21)]
TEXT = "embeddings, please"


def _serve(folder, **kw):
    from qeff_kv.serve.config import ServeConfig

    return LiveServer.from_config(ServeConfig(export_dir=str(folder), **kw))


@pytest.fixture(scope="module")
def hidden_export(tmp_path_factory):
    from qeff_kv.export import export_model

    return export_model(None, tmp_path_factory.mktemp("emb") / "hid", ctx_len=64, prefill_seq_len=8, verify=False,
                        hidden_states=True, speculative_tokens=2)


@pytest.fixture(scope="module")
def served(hidden_export, tmp_path_factory):
    srv = _serve(chat_export(hidden_export.out_dir, tmp_path_factory.mktemp("emb-served") / "tiny-emb"),
                 prefill_chunk=8, max_sequences=2)
    srv.client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    yield srv
    srv.stop()


def _reference(own_graphs, ids: list[int]) -> np.ndarray:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(own_graphs.llama_hf, attn_implementation="eager")
    with torch.no_grad():
        h = model.eval().model(torch.tensor([ids])).last_hidden_state[0, -1].double().numpy()
    return h / np.linalg.norm(h)


def test_embeddings_equal_transformers(served, own_graphs):
    text_ids = list(served.text.tokenizer.encode(TEXT).ids)
    out = served.client.embeddings.create(model="tiny-emb", input=[TEXT, IDS])
    assert [d.index for d in out.data] == [0, 1] and out.usage.prompt_tokens == len(text_ids) + len(IDS)
    np.testing.assert_allclose(out.data[0].embedding, _reference(own_graphs, text_ids), atol=1e-4)
    np.testing.assert_allclose(out.data[1].embedding, _reference(own_graphs, IDS), atol=1e-4)
    raw = httpx.post(served.url + "/v1/embeddings", json={"input": IDS, "encoding_format": "base64"}, timeout=60)
    vec = np.frombuffer(base64.b64decode(raw.json()["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_array_equal(vec, np.asarray(out.data[1].embedding, dtype=np.float32))


def test_completions_still_served_beside_embeddings(served):
    """After an embedding, steps of other shapes (prompt logprobs' rows, two rows of lock step) run as before."""
    import concurrent.futures

    def ask(prompt):
        return served.client.completions.create(model="tiny-emb", prompt=prompt, max_tokens=6, temperature=0,
                                                echo=True, logprobs=1).choices[0]

    before = [ask(p) for p in ("abc", "xyz xyz")]
    served.client.embeddings.create(model="tiny-emb", input=TEXT)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        after = list(pool.map(ask, ("abc", "xyz xyz")))
    assert [a.text for a in after] == [b.text for b in before]
    for a, b in zip(after, before):
        np.testing.assert_allclose(a.logprobs.token_logprobs[1:], b.logprobs.token_logprobs[1:], atol=1e-5)


@pytest.mark.parametrize("body, param, message", [
    ({"input": "x", "dimensions": 8}, "dimensions",
     "dimensions is not supported (the embedding is the model's hidden size)"),
    ({"input": "x", "frob": 1}, "frob", "unknown field 'frob': not supported by /v1/embeddings on this server"),
    ({"input": [[1, 2, 100000]]}, "input", "input[0] must hold 1 to 63 tokens, each below 256"),
    ({"input": []}, "input", "input must be a string, token ids, or a list of 1 to 64 of them"),
])
def test_refusals(served, body, param, message):
    r = httpx.post(served.url + "/v1/embeddings", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param and r.json()["error"]["message"] == message


def test_refused_without_the_output(own_cb_graph, tmp_path):
    srv = _serve(chat_export(own_cb_graph, tmp_path / "plain"))
    try:
        r = httpx.post(srv.url + "/v1/embeddings", json={"input": "x"}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["message"] == (
            "the graph has no hidden_states output; export it with --hidden-states for /v1/embeddings")
    finally:
        srv.stop()


def test_the_option_leaves_other_exports_unchanged():
    from qeff_kv.export.options import ExportOptions

    plain = ExportOptions(ctx_len=64, prefill_seq_len=8).to_json()
    assert "hidden_states" not in plain and ExportOptions(ctx_len=64, prefill_seq_len=8, hidden_states=True).to_json()["hidden_states"]


# ------------------------------------------------------------------------------------------ issue 52: queued, chunked
LONG = [int(t) for t in np.random.RandomState(9).randint(3, 250, 40)]   # five chunks of 8


class _Spy:
    """The session calls the engine makes, in order: ``("prefill", sequence id, tokens)``, ``("decode", rows)``;
    each decode step waits ``slow`` seconds (a stream stays busy a while); ``on_prefill(tokens)`` runs first."""

    def __init__(self, session, slow: float = 0.0, on_prefill=None):
        self.session, self.slow, self.on_prefill, self.calls = session, slow, on_prefill, []
        self._prefill, self._decode = session.prefill, session.decode
        session.prefill, session.decode = self.prefill, self.decode

    def prefill(self, seq, tokens, *a, **kw):
        self.calls.append(("prefill", seq.id, list(tokens)))
        if self.on_prefill is not None:
            self.on_prefill(list(tokens))
        return self._prefill(seq, tokens, *a, **kw)

    def decode(self, feeds):
        self.calls.append(("decode", len(feeds)))
        time.sleep(self.slow)
        return self._decode(feeds)

    def remove(self, _sched=None):
        self.session.prefill, self.session.decode = self._prefill, self._decode


def _embed_req(i, ids):
    from qeff_kv.runtime import SamplingParams
    from qeff_kv.serve.engine.engine import GenerationRequest

    return GenerationRequest(f"e{i}", tuple(ids), 0, SamplingParams(), frozenset(), embed=True)


def _engine_with_spy(hidden_export, **spy):
    from qeff_kv.runtime import Session
    from qeff_kv.serve.engine.scheduler import Scheduler

    session = Session(hidden_export.out_dir, max_sequences=2)
    return Scheduler(session, prefill_chunk=8), _Spy(session, **spy)


def test_a_long_embedding_is_prefilled_in_chunks_between_decode_steps(hidden_export, own_graphs):
    """A 40-token input with ``prefill_chunk=8`` beside a running stream: five chunks of 8, a decode step of the
    stream between each two; its vector still transformers' (last token, normalised); it ends ``stop``, nothing
    generated."""
    from qeff_kv.runtime import SamplingParams
    from qeff_kv.serve.engine.engine import Embedding, Finished, GenerationRequest

    sched, spy = _engine_with_spy(hidden_export, slow=0.005)
    try:
        stream = sched.submit(GenerationRequest("s", (5, 6, 7), 40, SamplingParams(), frozenset()))
        deadline = time.monotonic() + 30
        while not any(c[0] == "decode" for c in spy.calls) and time.monotonic() < deadline:
            time.sleep(0.001)   # the stream is running
        [handle] = sched.submit_batch([_embed_req(0, LONG)])
        events = list(handle.iter_sync(timeout=60))
        assert list(stream.iter_sync(timeout=60))[-1].finish_reason == "length"
        kept = sched.run_on_engine(("call", lambda s: [list(q.tokens) for q in s.prefix_cache.kept])).result(60)
    finally:
        sched.close()
    assert [type(e) for e in events] == [Embedding, Finished]
    assert (events[1].finish_reason, events[1].prompt_tokens, events[1].completion_tokens) == ("stop", 40, 0)
    np.testing.assert_allclose(events[0].vector, _reference(own_graphs, LONG), atol=1e-4)
    chunks = [i for i, c in enumerate(spy.calls) if c[0] == "prefill" and c[1] != spy.calls[0][1]]
    assert [spy.calls[i][2] for i in chunks] == [LONG[k:k + 8] for k in range(0, 40, 8)]
    for i, j in zip(chunks, chunks[1:]):   # the stream's decode step between two chunks of the embedding
        assert any(c[0] == "decode" for c in spy.calls[i + 1:j]), spy.calls
    assert all(t[:40] != LONG for t in kept)   # its sequence freed, not kept: only the stream's


def test_an_embedding_cancelled_while_it_runs_frees_its_sequence(hidden_export):
    """Cancelled at its second chunk: it ends ``cancelled`` without a vector, is fed no further, its sequence
    freed; the next embedding runs in its place."""
    from qeff_kv.serve.engine.engine import Finished

    box = {}

    def cancel_at_second_chunk(tokens):
        if tokens == LONG[8:16]:
            deadline = time.monotonic() + 30
            while "h" not in box and time.monotonic() < deadline:
                time.sleep(0.001)
            box["h"].cancel()

    sched, spy = _engine_with_spy(hidden_export, on_prefill=cancel_at_second_chunk)
    try:
        [box["h"]] = sched.submit_batch([_embed_req(0, LONG)])
        events = list(box["h"].iter_sync(timeout=60))
        kept, busy = sched.run_on_engine(("call", lambda s: (len(s.prefix_cache), s.busy_slots()))).result(60)
        [again] = sched.submit_batch([_embed_req(1, IDS)])
        assert len(list(again.iter_sync(timeout=60))) == 2
    finally:
        sched.close()
    assert [type(e) for e in events] == [Finished] and events[0].finish_reason == "cancelled"
    assert [c[2] for c in spy.calls if c[0] == "prefill"][:2] == [LONG[:8], LONG[8:16]]
    assert LONG[16:24] not in [c[2] for c in spy.calls if c[0] == "prefill"]
    assert kept == 0 and busy == set()


def _stream(url, prompt):
    body = {"prompt": prompt, "max_tokens": 50, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        return "".join(r.iter_text())


def test_an_embedding_waits_for_a_busy_sequence(served):
    """Both sequences busy with streams: an embedding answers 429 ``queue_full`` with ``max_queue`` 0, else waits
    its turn (no more 503): it is prefilled only once a stream ended, and its vectors (a list of three, in input
    order) are the same bit for bit as on the idle server. A list longer than the queue counts as one request."""
    engine = served.engine
    alone = [d.embedding for d in served.client.embeddings.create(model="tiny-emb", input=[TEXT, IDS]).data]
    spy = engine.run_on_engine(("call", lambda s: _Spy(s.session, slow=0.02))).result(timeout=60)
    try:
        with ThreadPoolExecutor(2) as pool:
            streams = [pool.submit(_stream, served.url, p) for p in ([5, 6, 7], [9, 8, 7])]
            deadline = time.monotonic() + 30
            while sum(s["state"] == "busy" for s in engine.slots()) < 2 and time.monotonic() < deadline:
                time.sleep(0.002)
            engine.max_queue = 0
            try:
                full = httpx.post(served.url + "/v1/embeddings", json={"input": "x"}, timeout=60)
            finally:
                engine.max_queue = 64
            mark = len(spy.calls)
            r = httpx.post(served.url + "/v1/embeddings", json={"input": [TEXT, IDS, TEXT]}, timeout=60)
            [f.result() for f in streams]
    finally:
        engine.run_on_engine(("call", spy.remove)).result(timeout=60)
    assert full.status_code == 429 and full.json()["error"]["code"] == "queue_full", full.text
    assert r.status_code == 200, r.text
    assert [d["embedding"] for d in r.json()["data"]] == [alone[0], alone[1], alone[0]]
    calls = spy.calls[mark:]
    first = next(i for i, c in enumerate(calls) if c[0] == "prefill")
    assert ("decode", 2) in calls[:first]   # it waited while both streams ran
    assert all(c[1] <= 1 for c in calls[first:] if c[0] == "decode")   # and took a stream's place once it ended
    with ThreadPoolExecutor(1) as pool:   # a list longer than max_queue + the free sequences: one request
        engine.max_queue = 0
        try:
            many = pool.submit(httpx.post, served.url + "/v1/embeddings", json={"input": [IDS] * 5}, timeout=60)
            assert many.result().status_code == 200 and len(many.result().json()["data"]) == 5
        finally:
            engine.max_queue = 64


def test_a_client_gone_while_its_embedding_waits_frees_its_place(served):
    """The engine held up (a control action waits), a client sends a long embedding and leaves (read timeout): the
    handler notices within the disconnect poll and cancels it, so it is never prefilled; the server answers the
    next one."""
    engine, gate = served.engine, threading.Event()
    spy = engine.run_on_engine(("call", lambda s: _Spy(s.session))).result(timeout=60)
    held = engine.run_on_engine(("call", lambda s: gate.wait(60)))
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(served.url + "/v1/embeddings", json={"input": LONG}, timeout=httpx.Timeout(60, read=0.5))
        deadline = time.monotonic() + 30   # the waiting request's handle cancelled by its handler
        while not (engine.inbox.waiting and engine.inbox.waiting[0][0].cancelled) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        gate.set()
    held.result(timeout=60)
    engine.run_on_engine(("call", spy.remove)).result(timeout=60)
    assert not [c for c in spy.calls if c[0] == "prefill"], spy.calls
    assert engine.stats()["queue_depth"] == 0
    assert httpx.post(served.url + "/v1/embeddings", json={"input": LONG}, timeout=60).status_code == 200


# ------------------------------------------------------------------------------------------ property test
_ID = st.one_of(st.integers(-3, 300), st.integers(2 ** 31, 2 ** 70), st.booleans(), st.floats(0, 10))
_IDS = st.lists(_ID, max_size=70)
_ONE = st.one_of(st.text(max_size=30), _IDS, st.lists(st.integers(0, 255), min_size=1, max_size=70))
_ODD = st.one_of(st.none(), st.booleans(), st.integers(-3, 5000), st.floats(allow_nan=False, allow_infinity=False),
                 st.text(max_size=8), st.lists(st.integers(0, 9), max_size=2),
                 st.dictionaries(st.text(max_size=3), st.integers(), max_size=1))
_INPUT = st.one_of(_ONE, st.lists(_ONE, max_size=4), st.lists(st.lists(_IDS, max_size=2), max_size=2), _ODD,
                   st.integers(60, 70).map(lambda n: [[7, 8]] * n),
                   st.integers(60, 5000).map(lambda n: [9] * n))
_EMBED_BODY = st.fixed_dictionaries({}, optional={
    "input": _INPUT, "model": st.one_of(st.just("tiny-emb"), _ODD),
    "encoding_format": st.one_of(st.sampled_from(["float", "base64"]), _ODD),
    "dimensions": _ODD, "user": st.one_of(st.text(max_size=10), _ODD)})


@pytest.fixture(scope="module")
def hidden_size(served):
    return len(served.client.embeddings.create(model="tiny-emb", input="x").data[0].embedding)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=_EMBED_BODY)
def test_property_embedding_bodies(served, hidden_size, body):
    """Random bodies: 200 with one vector of the hidden size per input (floats, or base64 of float32), in input
    order; or a 4xx in OpenAI's error shape; never a 500, and the server stays healthy."""
    r = httpx.post(served.url + "/v1/embeddings", content=json.dumps(body), timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code == 200 or 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    if r.status_code != 200:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and "\n" not in err["message"]
    else:
        v = body["input"]
        n = 1 if isinstance(v, str) or all(isinstance(t, int) for t in v) else len(v)
        data = r.json()["data"]
        assert [d["index"] for d in data] == list(range(n))
        for d in data:
            vec = (np.frombuffer(base64.b64decode(d["embedding"]), "<f4")
                   if body.get("encoding_format") == "base64" else np.asarray(d["embedding"]))
            assert vec.shape == (hidden_size,) and abs(np.linalg.norm(vec) - 1) < 1e-4
    assert httpx.get(served.url + "/health", timeout=60).status_code == 200
