"""Joining a Ray cluster started the usual way (issue 41): ``ray start --head`` turns Ray 2.60's token
authentication on when a token exists (``~/.ray/auth_token``), and ``qeff-kv serve --kv-role producer --ray-address``
then joins it with that token, as Ray's own CLI does; with token authentication turned off for the server
(``RAY_AUTH_MODE=disabled``) the refusal is one line naming the cause and the fix.

The cluster runs with its own HOME (its token) and ``--temp-dir``; it is stopped by the ids of its own processes
(never ``ray stop``, which stops every Ray on the machine).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

pytest.importorskip("ray")
pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from serve_helpers import free_port  # noqa: E402


def _pids_with(text: str) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if text.encode() in (d / "cmdline").read_bytes():
                    out.append(int(d.name))
            except OSError:
                pass
    return [p for p in out if p != os.getpid()]


@pytest.fixture(scope="module")
def cluster():
    ray_bin = Path(sys.executable).with_name("ray")
    if not ray_bin.exists() or not Path("/proc").is_dir():
        pytest.skip("needs the ray command and /proc")
    root = Path(tempfile.mkdtemp(prefix="qkvray"))      # short: Ray's socket paths live under --temp-dir
    (root / "home" / ".ray").mkdir(parents=True)
    (root / "home" / ".ray" / "auth_token").write_text(uuid.uuid4().hex)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["HOME"] = str(root / "home")
    port = free_port()
    started = subprocess.run([str(ray_bin), "start", "--head", "--node-ip-address", "127.0.0.1", "--port",
                              str(port), "--num-cpus", "1", "--include-dashboard", "false", "--disable-usage-stats",
                              "--temp-dir", str(root / "ray")], env=env, capture_output=True, text=True, timeout=180)
    try:
        assert started.returncode == 0, started.stderr[-2000:]
        yield env, f"127.0.0.1:{port}"
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in _pids_with(str(root / "ray")):
                try:
                    os.kill(pid, sig)
                except OSError:
                    pass
            time.sleep(3)
        shutil.rmtree(root, ignore_errors=True)


def _serve(export: Path, address: str, env: dict, port: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "qeff_kv_cli.main", "serve", str(export), "--port", str(port),
                             "--model-name", "tiny", "--kv-role", "producer", "--ray-address", address],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def test_producer_joins_a_token_cluster_as_the_readme_says(cluster, own_cb_graph):
    env, address = cluster
    env = {**env, "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    port = free_port()
    proc = _serve(own_cb_graph, address, env, port)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        assert proc.poll() is None, proc.stderr.read()[-2000:]
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60, json={
            "prompt": [5, 6, 7], "max_tokens": 1, "temperature": 0,
            "kv_transfer_params": {"do_remote_decode": True}})
        assert r.status_code == 200 and r.json()["kv_transfer_params"]["transfer_id"], r.text
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def test_without_the_token_the_refusal_names_cause_and_fix(cluster, own_cb_graph):
    env, address = cluster
    env = {**env, "PYTHONPATH": os.environ.get("PYTHONPATH", ""), "RAY_AUTH_MODE": "disabled"}
    proc = _serve(own_cb_graph, address, env, free_port())
    _, err = proc.communicate(timeout=180)
    last = [ln for ln in err.splitlines() if ln.strip()][-1]
    assert proc.returncode != 0
    assert last.startswith(f"error: --ray-address {address}: cannot join the cluster (")
    assert "token authentication" in last and "RAY_AUTH_TOKEN" in last and "~/.ray/auth_token" in last
