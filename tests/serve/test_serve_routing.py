"""Prefix-aware routing across the disaggregated engine's prefill replicas (issue 32, item 3):
``qeff_kv/serve/cluster/routing.py`` and its use by ``DisaggregatedEngine`` (``--route prefix|load``).

The router's index of what each replica holds is mirrored from the replicas' own reports; its answers equal the
replica's own ``longest_prefix`` (checked here in one process and across Ray). On Ray (2 prefill replicas, 1 decode
replica on the tiny continuous-batching export): requests sharing a long system prompt go to the replica holding
it, even where the least-loaded choice (its round-robin tie-break) would pick the other, with the tokens of a
single host; prompts no replica holds go by load; ``/metrics`` and the stats JSON count the hits. Ray is started
once, or joined where another test module of the session started it.
"""

from __future__ import annotations

import numpy as np
import pytest

from suite import requires_torch

pytestmark = [requires_torch]

SYSTEM = [int(t) for t in np.random.default_rng(32).integers(3, 250, size=40)]   # a "long" system prompt
QUESTIONS = [[11, 12, 13, 14], [21, 22, 23], [31, 32, 33, 34, 35], [41, 42]]
OTHER = [200, 201, 202, 203, 204, 205]
NEW = 4


def _request(rid, prompt, max_tokens=NEW):
    from qeff_kv.runtime import GREEDY
    from qeff_kv.serve.engine.engine import GenerationRequest

    return GenerationRequest(rid, tuple(prompt), max_tokens, GREEDY, frozenset(), None)


def _collect(handle, timeout=120):
    from serve_helpers import collect

    return collect(handle, timeout)


# ============================================================================================ the router alone
def _router(n=2, mode="prefix", min_reuse=2):
    from qeff_kv.serve.cluster.routing import PrefixRouter

    return PrefixRouter(n, min_reuse=min_reuse, mode=mode)


def _held(*seqs, pid=1, call=1, points=None):
    return {"held": [(i, tuple(s), points) for i, s in enumerate(seqs)], "cached": 0, "pid": pid, "call": call}


def test_longest_prefix_wins_ties_and_misses_go_by_load():
    r = _router(3)
    r.reported(0, r.dispatched(0, SYSTEM), _held(SYSTEM[:10]))
    r.reported(1, r.dispatched(1, SYSTEM), _held(SYSTEM + [5]))
    prompt = SYSTEM + QUESTIONS[0]
    assert [r.longest(i, prompt) for i in range(3)] == [10, 40, 0]
    assert r.choose(prompt, load=[0, 5, 0], order=[0, 1, 2]) == 1          # the longest prefix, though busiest
    r.reported(2, r.dispatched(2, SYSTEM), _held(SYSTEM))
    assert r.choose(prompt, load=[0, 5, 3], order=[0, 1, 2]) == 2          # tie (40 and 40): least loaded
    assert r.choose(prompt, load=[0, 3, 3], order=[2, 0, 1]) == 2          # tie and equal load: in turn
    assert r.choose(OTHER, load=[4, 1, 2], order=[0, 1, 2]) == 1           # a miss: least loaded
    assert r.choose(OTHER, load=[1, 1, 1], order=[2, 0, 1]) == 2           # ... ties in turn
    assert r.choose(prompt, load=[0, 1 << 40, 1 << 30], order=[0, 1, 2]) == 0   # stopped / avoided: not by prefix
    assert r.choose(prompt, load=[0, 5, 3], order=[0, 1, 2]) == 2
    load = _router(3, mode="load")
    load.reported(1, load.dispatched(1, SYSTEM), _held(SYSTEM))
    assert load.choose(prompt, load=[0, 0, 1], order=[0, 1, 2]) == 0       # --route load: load alone


def test_reuse_minimum_limit_and_reachable_points():
    r = _router(1, min_reuse=3)
    r.reported(0, r.dispatched(0, [1, 2]), _held([1, 2, 9, 9], [5, 6, 7, 8]))
    assert r.longest(0, [1, 2, 3]) == 0          # 2 < the reuse minimum: none
    assert r.longest(0, [5, 6, 7, 8]) == 3       # at most len(prompt) - 1
    assert r.longest(0, [5, 6, 7, 8, 1]) == 4
    r.reported(0, r.dispatched(0, [1]), _held([5, 6, 7, 8, 9, 10], call=2, points=[0, 4, 6]))
    assert r.longest(0, [5, 6, 7, 8, 9, 0]) == 4     # a recurrent sequence: down to a checkpoint
    assert r.longest(0, [5, 6, 7, 0]) == 0           # the checkpoint below 3 is 0


def test_in_flight_prompts_count_as_held_and_reports_replace_the_index():
    r = _router(2)
    t1 = r.dispatched(0, SYSTEM + QUESTIONS[0])
    assert r.longest(0, SYSTEM + QUESTIONS[1]) == 40 and r.longest(1, SYSTEM + QUESTIONS[1]) == 0
    assert r.choose(SYSTEM + QUESTIONS[1], load=[1, 0], order=[1, 0]) == 0   # a burst follows the first
    t2 = r.dispatched(0, SYSTEM + QUESTIONS[1])
    r.reported(0, t2, {**_held(SYSTEM + QUESTIONS[1], call=2), "cached": 40})
    r.reported(0, t1, _held(SYSTEM + QUESTIONS[0], call=1))    # an older report of the same process: ignored
    assert r.longest(0, SYSTEM + QUESTIONS[0]) == 40 and r.longest(0, SYSTEM + QUESTIONS[1] + [1]) == 43
    r.reported(0, r.dispatched(0, OTHER), _held(OTHER, call=3))  # the replica evicted the system prompt
    assert r.longest(0, SYSTEM + QUESTIONS[2]) == 0
    t = r.dispatched(1, SYSTEM)
    r.dropped(1, t)                                               # a failed call: its prompt is not held
    assert r.longest(1, SYSTEM + [1]) == 0
    r.reported(0, r.dispatched(0, SYSTEM), _held(SYSTEM, pid=2, call=1))   # a restarted replica reports anew
    assert r.longest(0, SYSTEM + [1]) == 40
    stats = r.stats()
    assert stats["route"] == "prefix" and stats["route_decisions"] == 1
    assert (stats["route_prefix_hits"], stats["route_prefix_misses"], stats["route_tokens_reused"]) == (1, 4, 40)


def test_bad_route_refused():
    from qeff_kv.errors import RuntimeInputError

    with pytest.raises(RuntimeInputError, match=r"^--route nearest: expected one of prefix, load$"):
        _router(mode="nearest")


# ============================================================================================ one process
def _mirror(session, prompts, asked):
    """Run ``prompts`` through a Prefiller on ``session``, feeding its reports to a router: before each run,
    ``longest_prefix`` changes nothing and equals the tokens the run reuses; after it, the router's answer for
    every prompt of ``asked`` equals the prefiller's."""
    from qeff_kv.runtime import GREEDY
    from qeff_kv.serve.cluster.routing import PrefixRouter, report
    from qeff_kv.runtime.memory.prefix_cache import MIN_REUSE
    from qeff_kv.serve.cluster.transfer import Prefiller

    pre = Prefiller(session)
    router = PrefixRouter(1, min_reuse=MIN_REUSE)
    for call, p in enumerate(prompts, 1):
        before = [(s.id, list(s.tokens), s.length) for s in pre.session.sequences]
        n = pre.longest_prefix(p)
        assert [(s.id, list(s.tokens), s.length) for s in pre.session.sequences] == before
        ticket = router.dispatched(0, p)
        t = pre.run(f"r{call}", p, GREEDY)
        assert t.cached_tokens == n, (call, p)
        router.reported(0, ticket, report(pre.prefix_cache, t.cached_tokens, call, 1))
        assert [router.longest(0, q) for q in asked] == [pre.longest_prefix(q) for q in asked]
    assert router.stats()["route_tokens_reused"] == pre.reused_tokens > 0
    return pre


def test_prefiller_longest_prefix_is_what_run_reuses_and_the_index_mirrors_it(own_cb_graph):
    """3 slots: the fourth distinct prompt evicts the oldest; the index follows (reports replace it)."""
    from qeff_kv.runtime import Session
    from qeff_kv.serve.cluster.transfer import Prefiller

    rng = np.random.default_rng(5)
    prompts = [SYSTEM + q for q in QUESTIONS] + [OTHER, OTHER[:3] + [9], [7, 8, 9, 10], [60, 61, 62, 63],
                                                  SYSTEM + [1, 2], SYSTEM[:1] + [3], OTHER[:2]]
    asked = prompts + [[int(t) for t in rng.integers(3, 250, size=6)] for _ in range(4)] + [SYSTEM[:3], [4]]
    _mirror(Session(own_cb_graph), prompts, asked)
    assert Prefiller(Session(own_cb_graph), reuse=False).longest_prefix(SYSTEM) == 0


def test_the_index_mirrors_a_recurrent_replica_down_to_its_checkpoints(tmp_path):
    """A hybrid (recurrent + attention) graph, a checkpoint every 8 positions: prefixes end at checkpoints."""
    import _recurrent_graph as rg
    from qeff_kv.runtime import Session

    sess = Session(rg.save(tmp_path / "hybrid.onnx"), ctx_len=64, prefill_seq_len=4, max_sequences=3,
                   checkpoint_every=8, max_checkpoints=4)
    rng = np.random.default_rng(9)
    base = [int(t) for t in rng.integers(0, rg.VOCAB, size=30)]
    prompts = [base, base[:21] + [1, 2, 3], base[:12] + [4, 5], base + [6, 7], base[:5] + [8]]
    asked = prompts + [base[:17] + [0], base[:9] + [9, 9], base[:3], base[:8] + [1]]
    pre = _mirror(sess, prompts, asked)
    assert pre.reused_tokens == 16 + 30          # 21 common tokens -> the checkpoint at 16; then 30 of 30
    # common prefixes of 17 (with a sequence whose points are 0, 29..32) and 12, 9, 8 (one whose points are 0, 8,
    # 13, 14): each down to the checkpoint at 8
    assert [pre.longest_prefix(q) for q in (base[:17] + [0], base[:9] + [9, 9], base[:8] + [1])] == [8, 8, 8]


# ============================================================================================ on Ray
@pytest.fixture(scope="module")
def ray_session():
    """The session's Ray instance (2 CPUs): started here unless another module already did."""
    ray = pytest.importorskip("ray", reason="disaggregated serving needs the [ray] extra (ray)")
    owns = not ray.is_initialized()
    if owns:
        ray.init(num_cpus=2, include_dashboard=False, logging_level="warning", log_to_driver=False)
    yield ray
    if owns:
        ray.shutdown()


@pytest.fixture(scope="module")
def routed(ray_session, own_cb_graph):
    """``get(route)``: a DisaggregatedEngine with 2 prefill replicas and 1 decode replica, one alive at a time."""
    from qeff_kv.serve.config import ServeConfig
    from qeff_kv.serve.server import build_engine

    live: dict = {}

    def get(route):
        if route not in live:
            for old in live.values():
                old.close()
            live.clear()
            live[route] = build_engine(ServeConfig(str(own_cb_graph), disaggregate=True, prefill_replicas=2,
                                                   route=route))
        return live[route]

    yield get
    for eng in live.values():
        eng.close()


@pytest.fixture(scope="module")
def single_host(own_cb_graph):
    """prompt -> greedy tokens of a single-host Scheduler on the same export."""
    from qeff_kv.runtime import Session
    from qeff_kv.serve.engine.scheduler import Scheduler

    sched = Scheduler(Session(own_cb_graph), reuse_prompts=False)
    out = {}

    def get(prompt):
        if tuple(prompt) not in out:
            out[tuple(prompt)] = _collect(sched.submit(_request("ref", prompt)))[0]
        return out[tuple(prompt)]

    yield get
    sched.close()


def _replica_reuse(ray, eng):
    return [ray.get(a.stats.remote())["prompt_tokens_reused"] for a in eng.prefill_actors]


def test_load_routing_sends_the_second_question_elsewhere(routed, ray_session, single_host):
    """The baseline: with equal loads, the round-robin tie-break sends the second request to the other replica,
    which holds nothing of it."""
    eng = routed("load")
    got = [_collect(eng.submit(_request(f"l{i}", SYSTEM + q))) for i, q in enumerate(QUESTIONS[:2])]
    assert [fin.cached_tokens for _, fin in got] == [0, 0]
    assert [toks for toks, _ in got] == [single_host(SYSTEM + q) for q in QUESTIONS[:2]]
    assert sorted(_replica_reuse(ray_session, eng)) == [0, 0]
    stats = eng.stats()
    assert (stats["route"], stats["route_prefix_hits"], stats["route_prefix_misses"]) == ("load", 0, 2)


def test_prefix_routing_sends_questions_to_the_replica_holding_the_system_prompt(routed, ray_session, single_host):
    """One at a time (where load routing alternated) and in a burst: every question after the first goes to the
    replica holding the system prompt and reuses it, with the tokens of a single host; a prompt nobody holds goes
    by load; the index agrees with the replicas' own answers."""
    eng = routed("prefix")
    ask = ray_session.get
    got = [_collect(eng.submit(_request(f"p{i}", SYSTEM + q))) for i, q in enumerate(QUESTIONS[:2])]
    toks, fin = _collect(eng.submit(_request("other", OTHER)))   # a miss: by load (equal loads: in turn)
    assert toks == single_host(OTHER) and fin.cached_tokens == 0
    assert [ask(a.longest_prefix.remote(OTHER + [1])) for a in eng.prefill_actors] == [len(OTHER), 0]
    burst = [eng.submit(_request(f"b{i}", SYSTEM + q)) for i, q in enumerate(QUESTIONS[2:])]
    got += [_collect(h) for h in burst]
    assert [fin.cached_tokens for _, fin in got] == [0, 40, 40, 40]
    assert [toks for toks, _ in got] == [single_host(SYSTEM + q) for q in QUESTIONS]
    assert _replica_reuse(ray_session, eng) == [120, 0]           # all on the replica holding the system prompt
    asked = [SYSTEM + [1], SYSTEM[:20] + [1], OTHER + [1], OTHER[:2], SYSTEM + QUESTIONS[0] + [9], [1, 2, 3]]
    for i, actor in enumerate(eng.prefill_actors):
        assert [eng.router.longest(i, p) for p in asked] == ask([actor.longest_prefix.remote(p) for p in asked])
    stats = eng.stats()
    assert (stats["route"], stats["route_prefix_hits"], stats["route_prefix_misses"]) == ("prefix", 3, 2)
    assert stats["route_tokens_reused"] == stats["route_tokens_predicted"] == 120 == stats["prompt_tokens_reused"]
    assert stats["route_decisions"] == 5 and 0 < stats["route_decision_max_s"] <= stats["route_decision_s"]


def test_metrics_and_stats_json_count_routing(routed, own_cb_graph):
    TestClient = pytest.importorskip("fastapi.testclient", reason="needs the [serve] extra").TestClient
    from qeff_kv.serve.http.app import create_app
    from qeff_kv.serve.config import ServeConfig
    from qeff_kv.serve.server import text_facts

    eng = routed("prefix")
    with TestClient(create_app(eng, text=text_facts(ServeConfig(str(own_cb_graph))))) as tc:
        before = eng.stats()
        body = {"model": eng.model_name, "prompt": SYSTEM + [77, 78], "max_tokens": NEW, "temperature": 0}
        r = tc.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 40
        health = tc.get("/health").json()
        assert health["route_prefix_hits"] == before["route_prefix_hits"] + 1
        assert health["route_tokens_reused"] == before["route_tokens_reused"] + 40
        text = tc.get("/metrics").text
    lines = dict(ln.rsplit(" ", 1) for ln in text.splitlines() if ln.startswith("qeff_kv_route"))
    assert float(lines["qeff_kv_route_prefix_hits_total"]) == health["route_prefix_hits"]
    assert float(lines["qeff_kv_route_prefix_misses_total"]) == health["route_prefix_misses"]
    assert float(lines["qeff_kv_route_prefix_tokens_reused_total"]) == health["route_tokens_reused"]
    assert float(lines["qeff_kv_route_decision_seconds_total"]) > 0
