"""Issue 31, item 4: the disaggregated engine. A prefill export with a smaller context is refused at start-up; the
replicas' restarts are budgeted per window (a crash-looping replica is stopped, and health says so: 503); no HTTP
route waits on Ray (``/health`` answers at once while a replica restarts); ``--ray-address`` that nothing answers
is one line at once.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from concurrent.futures import Future

import pytest

from qeff_kv.errors import UnavailableError


# ------------------------------------------------------------------------------------------ without Ray
def test_a_prefill_export_with_a_smaller_context_is_refused(own_vllm_graph):
    from qeff_kv.runtime import Session
    from qeff_kv.serve.cluster.transfer import facts, pair_refusal

    dec = facts(Session(own_vllm_graph))
    pre = dict(dec, ctx_len=dec["ctx_len"] // 2)
    why = pair_refusal(pre, dec)
    assert why == (f"prefill export {pre['onnx']} holds {pre['ctx_len']} positions, decode export {dec['onnx']} "
                   f"{dec['ctx_len']}: prompts the decode side accepts would not fit the prefill side (give the "
                   "prefill export at least the decode context)")
    assert pair_refusal(dict(dec, ctx_len=dec["ctx_len"] * 2), dec) is None   # a larger prefill context is fine


class _FakeActor:
    """An actor whose ``stats.remote()`` answers ``{"pid": self.pid}``, or fails while ``self.down``."""

    def __init__(self):
        self.pid, self.down = 100, False
        outer = self

        class _Stats:
            @staticmethod
            def remote():
                fut: Future = Future()
                if outer.down:
                    fut.set_exception(RuntimeError("restarting"))
                else:
                    fut.set_result({"pid": outer.pid, "kv_bytes_used": 7})
                return type("Ref", (), {"future": lambda self: fut})()
        self.stats = _Stats()


class _FakeRay:
    def __init__(self):
        self.killed = []

    def kill(self, actor, no_restart):
        self.killed.append((actor, no_restart))


def test_restarts_are_budgeted_per_window():
    from qeff_kv.serve.cluster.replicas import ReplicaWatch

    ray, pre, dec = _FakeRay(), _FakeActor(), _FakeActor()
    watch = ReplicaWatch(ray, {"prefill": [pre], "decode": [dec]}, budget=2, window=0.5)

    def read():
        asyncio.run(watch.read_all())

    read()
    assert watch.problem() is None and watch.figures() == [{"pid": 100, "kv_bytes_used": 7}] * 2
    for pid in (101, 102):          # two restarts: within the budget
        dec.pid = pid
        read()
    assert watch.problem() is None and not ray.killed
    time.sleep(0.6)                 # the window moves on: old restarts no longer count
    for pid in (103, 104):
        dec.pid = pid
        read()
    assert watch.problem() is None
    dec.pid = 105                   # the third within the window: stopped for good
    read()
    assert ray.killed == [(dec, True)]
    assert watch.problem() == "every decode replica is stopped (decode replica 0 restarted 3 times within 0.5 s)"
    assert watch.stopped("decode") == {0} and watch.figures() == [{"pid": 100, "kv_bytes_used": 7}]


def test_a_replica_unreachable_too_long_is_stopped():
    from qeff_kv.serve.cluster.replicas import ReplicaWatch

    ray, pre = _FakeRay(), _FakeActor()
    watch = ReplicaWatch(ray, {"prefill": [pre]}, unreachable=0.3)
    asyncio.run(watch.read_all())
    pre.down = True
    asyncio.run(watch.read_all())
    assert watch.problem() is None       # restarting: not yet judged
    time.sleep(0.35)
    asyncio.run(watch.read_all())
    assert watch.problem() == "every prefill replica is stopped (prefill replica 0 could not be reached for 0.3 s)"


def test_a_ray_address_nothing_answers_is_one_line_at_once(own_cb_graph):
    pytest.importorskip("ray")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "qeff_kv_cli.main", "serve", str(own_cb_graph), "--disaggregate",
                        "--ray-address", "127.0.0.1:1"], capture_output=True, text=True, timeout=120)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and lines == ["error: --ray-address 127.0.0.1:1: nothing answers there (Connection "
                                           "refused); is the Ray cluster running?"], r.stderr
    assert time.monotonic() - t0 < 60


# ------------------------------------------------------------------------------------------ on Ray
@pytest.fixture(scope="module")
def engine(own_vllm_graph, own_cb_graph):
    ray = pytest.importorskip("ray", reason="disaggregated serving needs the [ray] extra (ray)")
    from qeff_kv.serve.config import ServeConfig
    from qeff_kv.serve.server import build_engine

    owns = not ray.is_initialized()
    if owns:
        ray.init(num_cpus=2, include_dashboard=False, logging_level="warning", log_to_driver=False)
    eng = build_engine(ServeConfig(str(own_cb_graph), prefill_export=str(own_vllm_graph), disaggregate=True))
    yield eng
    eng.close()
    if owns:
        ray.shutdown()


def _wait(cond, timeout=90.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def _decode_pid(eng):
    [r] = [r for r in eng.watch.replicas if r.kind == "decode"]
    return r.pid


def test_health_answers_at_once_while_a_replica_restarts_and_a_crash_loop_is_a_503(engine, own_cb_graph):
    TestClient = pytest.importorskip("fastapi.testclient").TestClient
    import ray

    from qeff_kv.serve.http.app import create_app
    from qeff_kv.serve.config import ServeConfig
    from qeff_kv.serve.server import text_facts

    _wait(lambda: _decode_pid(engine) is not None)
    engine.watch.budget = 1
    body = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    with TestClient(create_app(engine, text=text_facts(ServeConfig(str(own_cb_graph))))) as tc:
        assert tc.post("/v1/completions", json=body).status_code == 200
        slowest = 0.0
        for round_ in range(2):   # two restarts: the second is one over the budget
            pid = _decode_pid(engine)
            ray.kill(engine.decode_actors[0], no_restart=False)
            deadline = time.monotonic() + 90
            while _decode_pid(engine) == pid and engine.health() is None:
                t0 = time.monotonic()
                r = tc.get("/health")
                slowest = max(slowest, time.monotonic() - t0)
                if r.status_code == 503 and engine.health() is not None:
                    break   # the second restart landed between the loop's check and the request: the crash loop
                assert r.status_code == 200
                assert time.monotonic() < deadline, "the replica did not come back"
                time.sleep(0.05)
        assert slowest < 0.5, slowest   # never waited on Ray
        _wait(lambda: engine.health() is not None)
        assert engine.health() == "every decode replica is stopped (decode replica 0 restarted 2 times within 600 s)"
        r = tc.get("/health")
        assert r.status_code == 503 and r.json()["error"]["code"] == "unhealthy"
        assert r.json()["error"]["message"].startswith("unhealthy: every decode replica is stopped")
        r = tc.post("/v1/completions", json=body)
        assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable", r.text
    with pytest.raises(UnavailableError):
        from qeff_kv.runtime.decoding.sampling import GREEDY
        from qeff_kv.serve.engine.engine import GenerationRequest

        engine.submit(GenerationRequest("x", (5, 6), 2, GREEDY, frozenset()))
