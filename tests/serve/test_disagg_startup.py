"""Issue 32, item 5: the disaggregated engine's start-up. The recurrent checkpoint options reach the prefill
replicas (a hybrid export served disaggregated reuses prompts at the same checkpoints as a single host); ``/slots``
answers 501 in OpenAI's error shape, as docs/serving.md says; the Ray instance ``qeff-kv serve --disaggregate``
starts listens on 127.0.0.1 only; ``--prefill-resources`` / ``--decode-resources`` that the cluster lacks are one
line at start-up.
"""

from __future__ import annotations

import ipaddress
import signal
import subprocess
import sys
import time

import pytest

import _recurrent_graph as rg
from suite import requires_torch

ray = pytest.importorskip("ray", reason="disaggregated serving needs the [ray] extra (ray)")

#: the hybrid graph's serving options: checkpoints every 8 positions, at most 4 kept, chunks of 4
CKPT = {"ctx_len": 64, "prefill_seq_len": 4, "checkpoint_every": 8, "max_checkpoints": 4}
BASE = (9, 8, 7, 6, 5, 4, 3, 20, 21, 22, 23, 24, 25)     # 13 tokens
OTHER = BASE[:11] + (40, 41)                              # shares 11: the checkpoint at 8 is reusable


@pytest.fixture(scope="module")
def hybrid_graph(tmp_path_factory):
    return rg.save(tmp_path_factory.mktemp("hybrid") / "hybrid.onnx")


def _run(engine, rid, prompt, n=5):
    from qeff_kv.runtime import GREEDY
    from qeff_kv.serve.engine.engine import Finished, GenerationRequest, TokenOut

    evs = list(engine.submit(GenerationRequest(rid, tuple(prompt), n, GREEDY, frozenset())).iter_sync(timeout=120))
    assert isinstance(evs[-1], Finished) and all(isinstance(e, TokenOut) for e in evs[:-1]), evs[-1]
    assert evs[-1].finish_reason == "length", evs[-1]
    return [e.token for e in evs[:-1]], evs[-1].cached_tokens


def _single_host(graph, **options):
    """(tokens, cached tokens) of BASE then OTHER on a single-host Scheduler with the same options."""
    from qeff_kv.serve.config import ServeConfig
    from qeff_kv.serve.engine.scheduler import Scheduler
    from qeff_kv.serve.engine.session_from_config import open_session

    config = ServeConfig(str(graph), **options)
    sched = Scheduler(open_session(config.engine, config.served_model()))
    try:
        return [_run(sched, "a", BASE), _run(sched, "b", OTHER)]
    finally:
        sched.close()


def test_checkpoint_options_reach_the_prefill_replicas(hybrid_graph):
    """The prefill replica keeps BASE with checkpoints every 8 positions, so OTHER starts from position 8 there as
    on a single host with the same options (without them no checkpoint at or below 11 is kept but 0: nothing is
    reused); the tokens are the single host's."""
    from qeff_kv.serve.config import ServeConfig
    from qeff_kv.serve.server import build_engine

    ref = _single_host(hybrid_graph, **CKPT)
    assert [cached for _, cached in ref] == [0, 8]
    without = {k: v for k, v in CKPT.items() if k in ("ctx_len", "prefill_seq_len")}
    assert [cached for _, cached in _single_host(hybrid_graph, **without)] == [0, 0]
    eng = build_engine(ServeConfig(str(hybrid_graph), prefill_export=str(hybrid_graph), disaggregate=True,
                                   **CKPT))
    try:
        got = [_run(eng, "a", BASE), _run(eng, "b", OTHER)]
        assert got == ref
        replica = eng.prefill_actors[0]
        assert ray.get(replica.stats.remote())["prompt_tokens_reused"] == 8
        assert eng.stats()["handoff_bytes"] == _moved(hybrid_graph)
    finally:
        eng.close()


def _moved(graph) -> int:
    """Bytes a prefill session with the same options hands off for BASE then OTHER (valid KV positions, recurrent
    states and their checkpoints)."""
    from qeff_kv.runtime import GREEDY
    from qeff_kv.serve.config import ServeConfig
    from qeff_kv.serve.engine.session_from_config import open_prefill_session
    from qeff_kv.serve.cluster.transfer import Prefiller

    pre = Prefiller(open_prefill_session(ServeConfig(str(graph), **CKPT).engine, str(graph)))
    return sum(pre.run(rid, p, GREEDY).nbytes for rid, p in (("a", BASE), ("b", OTHER)))


def test_resources_the_cluster_lacks_are_one_line(hybrid_graph):
    from qeff_kv.errors import RuntimeInputError
    from qeff_kv.serve.config import ServeConfig
    from qeff_kv.serve.server import build_engine

    for kw, msg in [({"prefill_resources": {"qeffkv_nowhere": 1}},
                     r"^--prefill-resources: 1 prefill replica\(s\) need 1 of 'qeffkv_nowhere'; the Ray cluster has 0 "
                     r"\(its custom resources: [^)]*\)$"),
                    ({"decode_resources": {"qeffkv_decode": 0}},
                     r"^--decode-resources: the amount of 'qeffkv_decode' must be a positive number, got 0$"),
                    ({"decode_resources": {"CPU": 1}}, r"^--decode-resources: 'CPU' is not a custom resource")]:
        with pytest.raises(RuntimeInputError, match=msg):
            build_engine(ServeConfig(str(hybrid_graph), disaggregate=True, ctx_len=64, **kw))


# ------------------------------------------------------------------------------------------ the served process
def _listening(root_pid: int) -> dict[str, list[str]]:
    """``{process name: [listening TCP addresses and bound UDP addresses]}`` of ``root_pid`` and its descendants."""
    psutil = pytest.importorskip("psutil")
    root = psutil.Process(root_pid)
    out: dict[str, list[str]] = {}
    for p in [root, *root.children(recursive=True)]:
        try:
            conns = p.net_connections(kind="inet")
            name = p.name()
        except psutil.NoSuchProcess:
            continue
        except psutil.AccessDenied:
            pytest.skip("the sockets of the server's processes cannot be read here (psutil: access denied)")
        for c in conns:
            if c.status == psutil.CONN_LISTEN or (c.type == 2 and not c.raddr):
                out.setdefault(name, []).append(c.laddr.ip)
    return out


def _loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%")[0])
    mapped = getattr(addr, "ipv4_mapped", None)
    return (mapped or addr).is_loopback


@requires_torch
def test_served_disaggregated_listens_on_loopback_only_and_slots_answer_501(own_cb_graph):
    """``qeff-kv serve --disaggregate`` (a local Ray instance): every socket its process tree listens on (the HTTP
    server, the GCS, the raylet, the object manager, the workers, the agents) is on 127.0.0.1; ``GET /slots``
    answers 501 in OpenAI's error shape, as docs/serving.md says, while completions work."""
    httpx = pytest.importorskip("httpx")
    from serve_helpers import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "qeff_kv_cli.main", "serve", str(own_cb_graph), "--disaggregate",
                             "--port", str(port), "--model-name", "tiny"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, proc.stderr.read()
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        r = httpx.post(f"{base}/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0,
                             "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
        r = httpx.get(f"{base}/slots", timeout=10)
        assert r.status_code == 501
        assert r.json() == {"error": {"message": "/slots is not available with --disaggregate: sequences live in the "
                                                 "Ray replicas (prompts kept for reuse on the prefill replicas, "
                                                 "running requests on the decode replicas), not in one slot table; "
                                                 "see /metrics for their figures",
                                      "type": "not_supported_error", "param": None, "code": "slots_unsupported"}}
        listening = _listening(proc.pid)
        assert {"gcs_server", "raylet"} <= set(listening), listening   # Ray's own servers are among them
        assert sum(len(v) for v in listening.values()) >= 6, listening
        wide = {name: ips for name, ips in listening.items() if not all(_loopback(ip) for ip in ips)}
        assert not wide, f"listening beyond 127.0.0.1: {wide}"
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
        assert proc.returncode == 0, proc.stderr.read()
    finally:
        _kill_tree(proc)


def _kill_tree(proc) -> None:
    """``proc`` and whatever it started (Ray's processes), when a failed test leaves them running."""
    if proc.poll() is not None:
        return
    try:
        import psutil

        rest = psutil.Process(proc.pid).children(recursive=True)
    except Exception:   # noqa: BLE001 - psutil missing or the process just ended
        rest = []
    proc.kill()
    proc.wait(timeout=10)
    for p in rest:
        try:
            p.kill()
        except Exception:   # noqa: BLE001 - already gone
            pass


def test_resource_options_on_the_command_line(hybrid_graph):
    from click.testing import CliRunner

    from qeff_kv_cli.main import main

    runner = CliRunner()
    for args, needle in [(["--disaggregate", "--prefill-resources", "qeffkv_prefill"],
                          "'qeffkv_prefill' is not a JSON object of Ray resources"),
                         (["--disaggregate", "--decode-resources", "[1]"], "'[1]' is not a JSON object of Ray resources"),
                         (["--decode-resources", '{"qeffkv_decode": 1}'], "--decode-resources go with --disaggregate")]:
        r = runner.invoke(main, ["serve", str(hybrid_graph), *args])
        lines = [ln for ln in r.output.splitlines() if ln.strip()]
        assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], \
            r.output
