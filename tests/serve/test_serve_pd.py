"""vLLM's P/D protocol between separate servers (issue 32, item 1; ``qeff_kv/serve/cluster/pd.py``, the connector of
``qeff_kv/serve/cluster/kv_connector.py``): two ``qeff-kv serve`` processes, a producer and a consumer joined to ONE Ray
cluster (started once by this module in the test process, or the session's one where it already runs), driven by
``tests/helpers/pd_proxy.py`` (vLLM's toy proxy protocol), answer as one server does, without the consumer prefilling.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from suite import requires_torch

pytestmark = [requires_torch]
pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

PROMPTS = [[5, 17, 42, 99, 130, 7, 201, 64, 3, 8, 11], [250, 3, 88, 19, 160], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
NEW = 6
HOLD_S = 6.0
SAMPLINGS = [{"temperature": 0}, {"temperature": 0.9, "seed": 7}]


# ============================================================================================ the request field
@pytest.mark.parametrize("params, role, body, message", [
    ({"do_remote_decode": True}, None, {},
     "kv_transfer_params needs a server started with --kv-role producer, consumer or both"),
    ({"do_remote_decode": True}, "consumer", {}, "kv_transfer_params.do_remote_decode needs a KV producer; this "
                                                 "server is a consumer"),
    ({"do_remote_decode": True}, "producer", {"max_tokens": 5}, "kv_transfer_params.do_remote_decode needs "
                                                                "max_tokens 1 and stream false"),
    ({"do_remote_prefill": True, "remote_engine_id": "e", "transfer_id": "t"}, "producer", {},
     "kv_transfer_params.do_remote_prefill needs a KV consumer; this server is a producer"),
    ({"do_remote_prefill": True, "remote_engine_id": "e"}, "consumer", {},
     "kv_transfer_params.transfer_id must be the string a producer answered, got None"),
    ({"do_remote_prefill": True, "do_remote_decode": True}, "both", {},
     "kv_transfer_params: do_remote_decode and do_remote_prefill together"),
    ({"do_remote_decode": True, "blocks": [1]}, "both", {}, "kv_transfer_params.blocks is not supported"),
    ({"do_remote_prefill": True, "remote_engine_id": "e", "transfer_id": "t", "kv_load_failure_policy": "retry"},
     "both", {}, "kv_transfer_params.kv_load_failure_policy must be recompute or fail, got 'retry'"),
    ({"do_remote_prefill": True, "remote_engine_id": "e", "transfer_id": "t"}, "both", {"logprobs": 1},
     "logprobs do not go with kv_transfer_params.do_remote_prefill"),
    ("yes", "both", {}, "kv_transfer_params must be an object, got 'yes'"),
    *[({"do_remote_prefill": True, "remote_engine_id": "e", "transfer_id": "t", "num_tokens": n}, "consumer", {},
       f"kv_transfer_params.num_tokens must be the producer's integer (>= 1), got {n!r}")
      for n in (-1, 0, "5", 5.0, True)],
])
def test_kv_transfer_params_checked(params, role, body, message):
    from qeff_kv.serve.wire.openai_io import APIError, parse

    req = {"prompt": [5, 6], "max_tokens": 1, **body, "kv_transfer_params": params}
    with pytest.raises(APIError) as exc:
        parse(req, chat=False, model_name="m", ctx_len=64, kv_role=role)
    assert exc.value.message.startswith(message) and exc.value.param == "kv_transfer_params"


def test_kv_transfer_params_accepted_and_vllm_nulls_allowed():
    from qeff_kv.serve.wire.openai_io import parse

    ask = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None, "remote_block_ids": None,
           "remote_host": None, "remote_port": None}
    p = parse({"prompt": [5, 6], "max_tokens": 1, "stream": False, "kv_transfer_params": ask}, chat=False,
              model_name="m", ctx_len=64, kv_role="producer")
    assert p.kv_transfer_params == ask
    p = parse({"prompt": [5], "min_tokens": None, "min_completion_tokens": None}, chat=False, model_name="m",
              ctx_len=64)
    assert p.kv_transfer_params is None


# ============================================================================================ two servers
@pytest.fixture(scope="module")
def ray_address():
    """The Ray cluster of the test session: the one already running in this process, else one started here (on
    127.0.0.1 only) and stopped at the end of the module."""
    ray = pytest.importorskip("ray", reason="the P/D protocol needs the [ray] extra (ray)")
    from qeff_kv.serve.cluster.ray_cluster import loopback_node

    owns = not ray.is_initialized()
    if owns:
        with loopback_node(ray):
            ray.init(num_cpus=2, include_dashboard=False, logging_level="warning", log_to_driver=False,
                     _node_ip_address="127.0.0.1")
    yield ray.get_runtime_context().gcs_address
    if owns:
        ray.shutdown()


def _start(export, role: str, address: str, *extra: str):
    from serve_helpers import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "qeff_kv_cli.main", "serve", str(export), "--port", str(port),
                             "--model-name", "tiny", "--kv-role", role, "--ray-address", address, *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return proc, f"http://127.0.0.1:{port}"


def _wait(proc, url: str) -> None:
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, proc.stderr.read()
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the server did not come up"
        time.sleep(0.2)


class _Proxy:
    def __init__(self, prefill: str, decode: str):
        import uvicorn

        from pd_proxy import make_app
        from serve_helpers import free_port

        self.app = make_app([prefill], [decode])
        self.url = f"http://127.0.0.1:{free_port()}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=int(self.url.rsplit(":", 1)[1]),
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def pd(ray_address, own_cb_graph, tmp_path_factory):
    """A producer and a consumer process on one export (with a chat template), and the proxy over them."""
    from serve_helpers import chat_export

    export = chat_export(own_cb_graph, tmp_path_factory.mktemp("pd") / "tiny")
    procs = [_start(export, "producer", ray_address, "--kv-hold-seconds", str(HOLD_S)),
             _start(export, "consumer", ray_address)]
    try:
        for proc, url in procs:
            _wait(proc, url)
        proxy = _Proxy(procs[0][1], procs[1][1])
        yield {"producer": procs[0][1], "consumer": procs[1][1], "proxy": proxy.url, "export": export}
        proxy.stop()
    finally:
        for proc, _ in procs:
            proc.terminate()
        for proc, _ in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.fixture(scope="module")
def bytes_per_position(own_cb_graph):
    from qeff_kv.runtime import Session

    return Session(own_cb_graph).cache.bytes_per_position


def _post(url: str, body: dict, route: str = "/v1/completions") -> httpx.Response:
    return httpx.post(url + route, json={"model": "tiny", **body}, timeout=60)


def _stream(url: str, body: dict, route: str = "/v1/completions") -> tuple[str, dict | None]:
    text, use = [], None
    with httpx.stream("POST", url + route, json={"model": "tiny", **body, "stream": True,
                                                 "stream_options": {"include_usage": True}}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            if chunk.get("usage"):
                use = chunk["usage"]
            for c in chunk["choices"]:
                text.append(c.get("text") or (c.get("delta") or {}).get("content") or "")
    return "".join(text), use


def _stats(url: str) -> dict:
    return httpx.get(url + "/health", timeout=10).json()


def test_proxy_answers_as_one_server_without_prefilling_twice(pd, bytes_per_position):
    """Greedy and seeded, streamed and not: the proxy's answers are the single server's; the consumer prefilled
    nothing, reports every prompt token cached, and took exactly the prompts' valid positions."""
    before_c, before_p = _stats(pd["consumer"]), _stats(pd["producer"])
    moved = 0
    for prompt in PROMPTS:
        for sampling in SAMPLINGS:
            body = {"prompt": prompt, "max_tokens": NEW, "ignore_eos": True, **sampling}
            alone = _post(pd["producer"], body).json()   # one server, no kv_transfer_params
            assert alone["kv_transfer_params"] is None
            r = _post(pd["proxy"], body)
            assert r.status_code == 200, r.text
            got = r.json()
            assert got["choices"][0]["text"] == alone["choices"][0]["text"], (prompt, sampling)
            assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt)
            assert got["usage"]["completion_tokens"] == NEW
            text, use = _stream(pd["proxy"], body)
            assert text == alone["choices"][0]["text"]
            assert use["prompt_tokens_details"]["cached_tokens"] == len(prompt)
            moved += 2 * len(prompt) * bytes_per_position
    after_c, after_p = _stats(pd["consumer"]), _stats(pd["producer"])
    assert after_c["prefill_chunks"] == before_c["prefill_chunks"]           # the consumer prefilled nothing
    assert after_c["kv_loads"] - before_c["kv_loads"] == 4 * len(PROMPTS)
    assert after_c["kv_load_bytes"] - before_c["kv_load_bytes"] == moved    # valid positions only
    assert after_p["kv_save_bytes"] - before_p["kv_save_bytes"] == moved
    assert after_c["kv_load_failures"] == before_c["kv_load_failures"]
    metrics = httpx.get(pd["consumer"] + "/metrics", timeout=10).text
    assert f"qeff_kv_kv_load_bytes_total {float(after_c['kv_load_bytes'])}" in metrics


def test_chat_through_the_proxy(pd):
    body = {"messages": [{"role": "user", "content": "hi there"}], "max_tokens": NEW, "ignore_eos": True,
            "temperature": 0.8, "seed": 3}
    alone = _post(pd["producer"], body, "/v1/chat/completions").json()
    got = _post(pd["proxy"], body, "/v1/chat/completions").json()
    assert got["choices"][0]["message"] == alone["choices"][0]["message"]
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == alone["usage"]["prompt_tokens"]


def test_producer_answer_names_the_held_state(pd, bytes_per_position):
    prompt = PROMPTS[1]
    ask = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None, "remote_block_ids": None,
           "remote_host": None, "remote_port": None}
    r = _post(pd["producer"], {"prompt": prompt, "max_tokens": 1, "kv_transfer_params": ask})
    assert r.status_code == 200, r.text
    params = r.json()["kv_transfer_params"]
    port = int(pd["producer"].rsplit(":", 1)[1])
    assert {k: params[k] for k in ("do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_host",
                                   "remote_port", "num_tokens", "transfer_bytes")} == {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": None, "remote_host": "127.0.0.1",
        "remote_port": port, "num_tokens": len(prompt), "transfer_bytes": len(prompt) * bytes_per_position}
    assert params["remote_engine_id"] and params["transfer_id"]
    # taken once: the first consumer request gets it, the second falls back to prefilling
    body = {"prompt": prompt, "max_tokens": NEW, "ignore_eos": True, "temperature": 0, "kv_transfer_params": params}
    first = _post(pd["consumer"], body).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt)
    assert first["kv_transfer_params"] is None
    again = _post(pd["consumer"], dict(body, kv_transfer_params=dict(params, kv_load_failure_policy="fail")))
    assert again.status_code == 410
    err = again.json()["error"]
    assert err["code"] == "kv_transfer_unavailable"
    assert err["message"] == (f"kv_transfer_params: producer {params['remote_engine_id']} holds no state "
                              f"{params['transfer_id']} (taken already, or freed after its hold time)")


def test_a_refused_consumer_request_leaves_the_state_for_its_owner(pd):
    """Issue 43: the same kv_transfer_params with another prompt of the same length is refused before anything is
    taken (from the held state's metadata); the request they were made for then gets the state."""
    prompt, other = [12, 13, 14, 15, 16], [12, 13, 14, 15, 99]
    params = _post(pd["producer"], {"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {
        "do_remote_decode": True}}).json()["kv_transfer_params"]
    before = _stats(pd["consumer"])
    body = {"max_tokens": 3, "ignore_eos": True, "temperature": 0, "kv_transfer_params": params}
    for stranger in (other, other[:4]):
        r = _post(pd["consumer"], dict(body, prompt=stranger, kv_transfer_params=dict(params, num_tokens=None)))
        assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params", r.text
        assert r.json()["error"]["message"] == (
            f"kv_transfer_params (state {params['transfer_id']} of producer {params['remote_engine_id']}) holds "
            f"another prompt (5 tokens) than this request's ({len(stranger)} tokens)")
    owner = _post(pd["consumer"], dict(body, prompt=prompt)).json()
    assert owner["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt)
    after = _stats(pd["consumer"])
    assert after["kv_take_refusals"] == before["kv_take_refusals"] + 2
    assert after["kv_load_fallbacks"] == before["kv_load_fallbacks"]


def test_held_state_freed_after_the_hold_time_and_the_consumer_falls_back(pd, ray_address):
    import ray

    from qeff_kv.serve.cluster.kv_connector import NAMESPACE, holder_name

    prompt = [9, 8, 7, 6, 5, 4, 3]
    ask = {"do_remote_decode": True, "do_remote_prefill": False}
    params = _post(pd["producer"], {"prompt": prompt, "max_tokens": 1, "kv_transfer_params": ask}).json()[
        "kv_transfer_params"]
    holder = ray.get_actor(holder_name(params["remote_engine_id"]), namespace=NAMESPACE)
    held = ray.get(holder.stats.remote(), timeout=10)
    assert held["holding"] >= 1
    expired = held["expired"]
    time.sleep(HOLD_S + 1.0)
    after = ray.get(holder.stats.remote(), timeout=10)
    assert after["holding"] == 0 and after["holding_bytes"] == 0 and after["expired"] >= expired + 1
    body = {"prompt": prompt, "max_tokens": NEW, "ignore_eos": True, "temperature": 0}
    alone = _post(pd["producer"], body).json()
    before = _stats(pd["consumer"])
    r = _post(pd["consumer"], dict(body, kv_transfer_params=params))
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["choices"][0]["text"] == alone["choices"][0]["text"]
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert got["kv_transfer_params"]["kv_load"] == "recomputed"
    assert "holds no state" in got["kv_transfer_params"]["kv_load_error"]
    stats = _stats(pd["consumer"])
    assert stats["kv_load_fallbacks"] == before["kv_load_fallbacks"] + 1
    assert stats["prefill_chunks"] > before["prefill_chunks"]   # it prefilled the prompt itself


def test_producer_gone_falls_back_or_fails_as_asked(pd):
    params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "no-such-engine",
              "transfer_id": "x"}
    body = {"prompt": [4, 5, 6, 7], "max_tokens": 3, "ignore_eos": True, "temperature": 0}
    got = _post(pd["consumer"], dict(body, kv_transfer_params=params)).json()
    assert got["kv_transfer_params"] == {
        "kv_load": "recomputed",
        "kv_load_error": "producer no-such-engine is gone (no KV holder of that engine in the Ray cluster)"}
    assert got["usage"]["completion_tokens"] == 3
    r = _post(pd["consumer"], dict(body, kv_transfer_params=dict(params, kv_load_failure_policy="fail")))
    assert r.status_code == 410 and r.json()["error"]["message"] == (
        "kv_transfer_params: producer no-such-engine is gone (no KV holder of that engine in the Ray cluster)")
    # the params name a state of another length than the prompt: refused before anything is taken
    r = _post(pd["consumer"], dict(body, kv_transfer_params=dict(params, num_tokens=9)))
    assert r.status_code == 400 and r.json()["error"]["message"] == (
        "kv_transfer_params names a state of 9 positions; this request's prompt has 4 tokens")
    # a consumer refuses do_remote_decode
    r = _post(pd["consumer"], dict(body, kv_transfer_params={"do_remote_decode": True}, max_tokens=1))
    assert r.status_code == 400 and "needs a KV producer; this server is a consumer" in r.json()["error"]["message"]


def test_state_of_another_checkpoint_refused_in_one_line(pd, ray_address, own_graphs):
    """This process holds a state of the tiny Qwen2 export as a producer would: the (Llama) consumer refuses it."""
    from qeff_kv.runtime import GREEDY, Session
    from qeff_kv.serve.cluster.kv_connector import RayHoldConnector
    from qeff_kv.serve.cluster.transfer import Prefiller

    qwen = Session(own_graphs.export("qeff_qwen2_vllm.onnx").out_dir)
    prompt = PROMPTS[2]
    producer = RayHoldConnector("producer", hold_seconds=30)
    try:
        params = producer.save("q", Prefiller(qwen, reuse=False).run("q", prompt, GREEDY))
        r = _post(pd["consumer"], {"prompt": prompt, "max_tokens": 3, "kv_transfer_params": params})
        assert r.status_code == 400
        msg = r.json()["error"]["message"]
        assert msg.startswith(f"kv_transfer_params (state {params['transfer_id']} of producer "
                              f"{params['remote_engine_id']}): saved from another model (same KV contract, "
                              "checkpoint "), msg
        assert "\n" not in msg
    finally:
        producer.close()


def test_the_holder_caps_evict_the_oldest_and_refuse_a_state_over_the_byte_cap(ray_address, own_cb_graph):
    """Issue 43: a producer's holder keeps at most its count and byte caps: the oldest held state is dropped first,
    a state larger alone than the byte cap is not held; both counted (``/health``, ``/metrics``)."""
    from prometheus_client import CollectorRegistry, generate_latest

    from qeff_kv.errors import KVLoadError
    from qeff_kv.runtime import GREEDY, Session
    from qeff_kv.serve.cluster.kv_connector import RayHoldConnector
    from qeff_kv.serve.http.metrics import Metrics
    from qeff_kv.serve.cluster.transfer import Prefiller

    session = Session(own_cb_graph)
    states = [Prefiller(session, reuse=False).run(f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS)]
    cap = max(t.nbytes for t in states[1:])
    producer = RayHoldConnector("producer", hold_seconds=30, max_states=1, max_bytes=cap)
    try:
        held = [producer.save("r1", states[1])]
        held.append(producer.save("r2", states[2]))     # one state at most: r1's is dropped
        assert states[0].nbytes > cap
        with pytest.raises(KVLoadError, match="larger than the holder's cap"):
            producer.save("r0", states[0])
        stats = producer.holder_stats()
        assert (stats["evicted"], stats["refused"], stats["holding"]) == (1, 1, 1)
        assert producer.stats()["kv_hold_evictions"] == 1 and producer.stats()["kv_hold_refusals"] == 1
        with pytest.raises(KVLoadError, match="holds no state"):   # the evicted one
            producer.peek(held[0])
        assert producer.peek(held[1])["valid_length"] == str(len(PROMPTS[2]))
        text = generate_latest(Metrics(SimpleEngine(producer.stats()), CollectorRegistry()).registry).decode()
        assert "\nqeff_kv_kv_hold_evictions_total 1.0" in text and "\nqeff_kv_kv_hold_refusals_total 1.0" in text
    finally:
        producer.close()


class SimpleEngine:
    """An engine whose stats are given (the metrics read nothing else of it here)."""

    def __init__(self, stats):
        self._stats = stats

    def stats(self):
        return dict(self._stats)


# ============================================================================================ memory kinds
def _collect(handle, timeout=120):
    from serve_helpers import collect

    return collect(handle, timeout)


def _hand_off_through_schedulers(make_session, prompts):
    """A producer Scheduler and a consumer Scheduler, each with its RayHoldConnector (this process is the Ray
    driver): do_remote_decode, load, admit; the consumer's tokens equal a single Scheduler's."""
    from qeff_kv.runtime import GREEDY, SamplingParams
    from qeff_kv.serve.engine.engine import GenerationRequest
    from qeff_kv.serve.cluster.kv_connector import RayHoldConnector
    from qeff_kv.serve.engine.scheduler import Scheduler

    producer = Scheduler(make_session(), connector=RayHoldConnector("producer", hold_seconds=30))
    consumer = Scheduler(make_session(), connector=RayHoldConnector("consumer"))
    single = Scheduler(make_session(), reuse_prompts=False)
    try:
        for i, prompt in enumerate(prompts):
            for sampling in (GREEDY, SamplingParams(temperature=0.9, seed=11 + i)):
                def req(rid, n, **kw):
                    return GenerationRequest(rid, tuple(prompt), n, sampling, frozenset(), **kw)

                alone, _ = _collect(single.submit(req("a", NEW)))
                first, fin = _collect(producer.submit(req("p", 1, kv_transfer_params={"do_remote_decode": True})))
                params = fin.kv_transfer_params
                assert first == alone[:1] and params["num_tokens"] == len(prompt)
                t = consumer.connector.load(params)
                assert t.nbytes == params["transfer_bytes"]
                toks, fin = _collect(consumer.submit(req("c", NEW, state=t.state, kv_transfer_params=params)))
                assert toks == alone, (prompt, sampling)
                assert fin.cached_tokens == len(prompt)
        assert consumer.stats()["prefill_chunks"] == 0
        # vLLM's get_finished: the requests whose state left (producer) and arrived (consumer) since the last call
        assert producer.connector.get_finished() == ({"p"}, set())
        assert consumer.connector.get_finished() == (set(), {"p"})
        assert producer.connector.get_finished() == (set(), set())
        return t
    finally:
        for s in (producer, consumer, single):
            s.close()


def test_recurrent_hybrid_state_hands_off_with_its_checkpoints(ray_address, tmp_path):
    import _recurrent_graph as rg

    from qeff_kv.runtime import Session

    graph = rg.save(tmp_path / "hybrid.onnx")
    rng = np.random.default_rng(5)
    prompts = [[int(x) for x in rng.integers(0, rg.VOCAB, size=n)] for n in (13, 21)]
    t = _hand_off_through_schedulers(lambda: Session(graph, ctx_len=64, prefill_seq_len=4, max_sequences=2,
                                                     checkpoint_every=8, max_checkpoints=4), prompts)
    assert any(n.startswith(("conv_state", "recurrent_state")) for n in t.state.tensors)
    assert "Specs" in t.slicing


def test_ring_buffers_hand_off_the_slots_they_hold(ray_address, family_exports):
    from families import SW
    from qeff_kv.runtime import Session

    export = family_exports("gemma2_sw", "onnxruntime").out_dir
    prompt = [int(x) for x in np.random.default_rng(3).integers(3, 120, size=3 * SW)]
    t = _hand_off_through_schedulers(lambda: Session(export), [prompt])
    rings = Session(export).rings.capacities
    assert rings and all(t.state.tensors[n].shape[2] == SW for n in rings)


def test_both_role_is_producer_and_consumer(ray_address, own_cb_graph):
    """One ``--kv-role both`` server behind the proxy as prefill and decode server (built in this process, joined
    to the module's Ray cluster: build_engine with ray_address): the single server's answers, the prompt cached."""
    from serve_helpers import LiveServer

    from qeff_kv.serve.config import ServeConfig
    from qeff_kv.serve.server import build_engine, text_facts

    config = ServeConfig(str(own_cb_graph), kv_role="both", ray_address=ray_address, model_name="tiny")
    srv = LiveServer(build_engine(config), text_facts(config))
    proxy = _Proxy(srv.url, srv.url)
    try:
        for prompt in PROMPTS[:2]:
            body = {"prompt": prompt, "max_tokens": NEW, "ignore_eos": True, "temperature": 0.7, "seed": 5}
            alone = _post(srv.url, body).json()
            got = _post(proxy.url, body).json()
            assert got["choices"][0]["text"] == alone["choices"][0]["text"]
            assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt)
        assert srv.engine.stats()["kv_loads"] == srv.engine.stats()["kv_saves"] == 2
    finally:
        proxy.stop()
        srv.stop()
