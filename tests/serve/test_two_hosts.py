"""Issue 32, item 4: disaggregated serving across two hosts. Two network namespaces joined by a veth pair
(``tests/helpers/_two_hosts.py``: 10.213.0.1 and 10.213.0.2), a Ray head node in the first (resource ``qeffkv_prefill``) and
a worker node in the second (``qeffkv_decode``); ``qeff-kv serve --disaggregate --ray-address 10.213.0.1:6379``
runs in the first with ``--prefill-resources`` / ``--decode-resources``, so the prefill replica runs on one host and
the decode replica on the other and every KV state crosses the veth. The answers equal a single host's, the bytes
handed off are exactly the prompts' valid positions, and at least as many bytes crossed the veth. All traffic stays
in the namespaces (the client runs in the first one too); everything is torn down at the end, failure included.
Skipped with a one-line reason where namespaces cannot be made.
"""

from __future__ import annotations

import json
import signal
import sys
import time

import pytest

import _two_hosts
from suite import requires_torch

pytestmark = [requires_torch]
pytest.importorskip("ray", reason="disaggregated serving needs the [ray] extra (ray)")
pytest.importorskip("fastapi", reason="needs the [serve] extra")
if (_why := _two_hosts.unavailable()) is not None:
    pytest.skip(f"two hosts need two network namespaces: {_why}", allow_module_level=True)

PROMPTS = [[5, 17, 42, 99, 130, 7, 201, 64, 3, 8, 11], [250, 3, 88, 19, 160], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
NEW = 6
PORT = 8000   # inside the head's namespace: nothing else listens there

#: the client, run inside the head's namespace: the completions of PROMPTS (greedy), then the hand-off counters
CLIENT = """
import json, sys, time, httpx
base, prompts, new = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
out = []
for p in prompts:
    r = httpx.post(base + "/v1/completions", timeout=120, json={"model": "tiny", "prompt": p, "max_tokens": new,
                                                                 "temperature": 0, "ignore_eos": True})
    r.raise_for_status()
    out.append([r.json()["choices"][0]["text"], r.json()["usage"]])
deadline = time.monotonic() + 20   # /metrics reads the replicas' figures of the last second
while True:
    metrics = {}
    for line in httpx.get(base + "/metrics", timeout=30).text.splitlines():
        if line.startswith("qeff_kv_handoff"):
            name, value = line.rsplit(" ", 1)
            metrics[name] = float(value)
    if metrics.get("qeff_kv_handoffs_total", 0) >= len(prompts) or time.monotonic() > deadline:
        break
    time.sleep(0.25)
print(json.dumps({"answers": out, "metrics": metrics}))
"""

#: asks /health from inside the head's namespace until it answers 200
HEALTH = """
import sys, time, httpx
deadline = time.monotonic() + float(sys.argv[2])
while time.monotonic() < deadline:
    try:
        if httpx.get(sys.argv[1] + "/health", timeout=2).status_code == 200:
            sys.exit(0)
    except httpx.HTTPError:
        pass
    time.sleep(0.5)
sys.exit(1)
"""


def _single_host(own_cb_graph) -> list:
    """The same requests through the HTTP app over a single-host Scheduler on the decode export."""
    from fastapi.testclient import TestClient

    from qeff_kv.runtime import Session
    from qeff_kv.serve.http.app import create_app
    from qeff_kv.serve.config import ServeConfig
    from qeff_kv.serve.engine.scheduler import Scheduler
    from qeff_kv.serve.server import text_facts

    sched = Scheduler(Session(own_cb_graph), reuse_prompts=False, model_name="tiny")
    out = []
    try:
        with TestClient(create_app(sched, text=text_facts(ServeConfig(str(own_cb_graph))))) as tc:
            for p in PROMPTS:
                r = tc.post("/v1/completions", json={"model": "tiny", "prompt": p, "max_tokens": NEW,
                                                     "temperature": 0, "ignore_eos": True})
                assert r.status_code == 200, r.text
                out.append([r.json()["choices"][0]["text"], r.json()["usage"]])
    finally:
        sched.close()
    return out


def _actors(hosts, ns: str) -> list[str]:
    """The Ray actor processes (``ray::NAME``) running inside namespace ``ns``."""
    import psutil

    names = []
    for pid in hosts.pids(ns):
        try:
            argv0 = (psutil.Process(pid).cmdline() or [""])[0]
        except psutil.Error:
            continue
        if argv0.startswith("ray::") and "Worker" in argv0:
            names.append(argv0.split()[0].split(".")[0])
    return sorted(names)


def test_prefill_on_one_host_decode_on_the_other(own_cb_graph, own_vllm_graph, tmp_path):
    from qeff_kv.runtime import Session

    reference = _single_host(own_cb_graph)
    bpp = Session(own_vllm_graph).cache.bytes_per_position
    with _two_hosts.two_hosts(tmp_path / "logs") as hosts:
        log = open(tmp_path / "serve.log", "w")
        serve = hosts.popen(hosts.head_ns, [
            sys.executable, "-m", "qeff_kv_cli.main", "serve", str(own_cb_graph), "--disaggregate",
            "--prefill-export", str(own_vllm_graph), "--ray-address", hosts.ray_address, "--port", str(PORT),
            "--model-name", "tiny", "--prefill-resources", json.dumps({_two_hosts.PREFILL_RESOURCE: 1}),
            "--decode-resources", json.dumps({_two_hosts.DECODE_RESOURCE: 1})], stdout=log, stderr=log)
        base = f"http://127.0.0.1:{PORT}"
        up = hosts.run(hosts.head_ns, [sys.executable, "-c", HEALTH, base, "150"], timeout=200)
        assert up.returncode == 0 and serve.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
        assert _actors(hosts, hosts.head_ns) == ["ray::PrefillWorker"]
        assert _actors(hosts, hosts.worker_ns) == ["ray::DecodeWorker"]
        before = hosts.veth_bytes()
        r = hosts.run(hosts.head_ns, [sys.executable, "-c", CLIENT, base, json.dumps(PROMPTS), str(NEW)],
                      capture_output=True, text=True, timeout=300)
        after = hosts.veth_bytes()
        assert r.returncode == 0, r.stderr[-3000:]
        got = json.loads(r.stdout)
        assert got["answers"] == reference
        moved = sum(len(p) for p in PROMPTS) * bpp
        assert got["metrics"] == {"qeff_kv_handoffs_total": len(PROMPTS), "qeff_kv_handoff_bytes_total": moved}
        assert after["rx"] - before["rx"] >= moved   # the states crossed the veth to the decode host
        serve.send_signal(signal.SIGINT)
        t0 = time.monotonic()
        while serve.poll() is None and time.monotonic() - t0 < 30:
            time.sleep(0.1)
        log.close()
        assert serve.returncode == 0, (tmp_path / "serve.log").read_text()[-3000:]
        assert _actors(hosts, hosts.head_ns) == _actors(hosts, hosts.worker_ns) == []   # the replicas stopped
