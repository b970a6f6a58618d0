"""Two "hosts" on one machine for the two-host test and benchmark (issue 32, item 4): two network namespaces joined
by a veth pair on a private test subnet, a Ray head node in the first and a worker node in the second, each with
one custom resource (``qeffkv_prefill`` on the head, ``qeffkv_decode`` on the worker) so that replicas can be placed
on either.

Everything stays inside the namespaces (their own loopback, the veth between them, no route out), and everything is
torn down on exit, failure included: the processes inside each namespace (``ip netns pids``: only ours, never a Ray
process elsewhere on the machine; ``ray stop`` would kill every Ray on the machine, so it is never used), the
namespaces (deleting one deletes its end of the veth, and with it the pair) and Ray's temporary folder.

Needs root and iproute2's ``ip``; :func:`unavailable` says why not in one line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SUBNET = "10.213.0"
HEAD_IP, WORKER_IP = f"{SUBNET}.1", f"{SUBNET}.2"
GCS_PORT = 6379
PREFILL_RESOURCE, DECODE_RESOURCE = "qeffkv_prefill", "qeffkv_decode"
#: each node's object store (the default, 30% of the machine's memory, is far more than a test needs)
OBJECT_STORE_BYTES = 256 << 20


@dataclasses.dataclass
class Hosts:
    head_ns: str
    worker_ns: str
    head_veth: str
    worker_veth: str
    temp_dir: str

    @property
    def ray_address(self) -> str:
        return f"{HEAD_IP}:{GCS_PORT}"

    @property
    def env(self) -> dict[str, str]:
        """The environment of every process of the cluster and its clients: Ray's token authentication on, with
        this cluster's own token (``ray start`` of a worker node does not turn it on by itself)."""
        return {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(Path(self.temp_dir) / "token")}

    def run(self, ns: str, argv: list[str], **kw) -> subprocess.CompletedProcess:
        """``argv`` inside namespace ``ns`` (with :attr:`env`), waited for."""
        return subprocess.run(["ip", "netns", "exec", ns, *argv], env=self.env, **kw)

    def popen(self, ns: str, argv: list[str], **kw) -> subprocess.Popen:
        return subprocess.Popen(["ip", "netns", "exec", ns, *argv], env=self.env, **kw)

    def veth_bytes(self) -> dict[str, int]:
        """Bytes the worker's end of the veth received and sent so far (everything between the two hosts)."""
        out = subprocess.run(["ip", "-n", self.worker_ns, "-s", "-j", "link", "show", self.worker_veth],
                             capture_output=True, text=True, check=True).stdout
        stats = json.loads(out)[0]["stats64"]
        return {"rx": int(stats["rx"]["bytes"]), "tx": int(stats["tx"]["bytes"])}

    def pids(self, ns: str) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]


def unavailable() -> str | None:
    """Why two namespaces cannot be made here (one line), or None."""
    if shutil.which("ip") is None:
        return "iproute2's ip is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    name = f"qkvprobe{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if r.returncode != 0:
        return f"cannot create a network namespace: {r.stderr.strip() or r.returncode}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")


def _network(hosts: Hosts) -> None:
    _ip("netns", "add", hosts.head_ns)
    _ip("netns", "add", hosts.worker_ns)
    _ip("link", "add", hosts.head_veth, "type", "veth", "peer", "name", hosts.worker_veth)
    for ns, veth, ip in ((hosts.head_ns, hosts.head_veth, HEAD_IP), (hosts.worker_ns, hosts.worker_veth, WORKER_IP)):
        _ip("link", "set", veth, "netns", ns)
        _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", veth)
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", ns, "link", "set", veth, "up")


def _ray_start(hosts: Hosts, ns: str, ip: str, resource: str, head: bool, log) -> subprocess.Popen:
    ray_bin = str(Path(sys.executable).with_name("ray"))
    argv = [ray_bin, "start", "--block", "--node-ip-address", ip, "--num-cpus", "1",
            "--resources", json.dumps({resource: 1}), "--object-store-memory", str(OBJECT_STORE_BYTES),
            "--disable-usage-stats"]
    if head:
        argv += ["--head", "--port", str(GCS_PORT), "--include-dashboard", "false", "--temp-dir", hosts.temp_dir]
    else:
        argv += ["--address", hosts.ray_address]
    return hosts.popen(ns, argv, stdout=log, stderr=subprocess.STDOUT)


def _wait_nodes(hosts: Hosts, timeout: float) -> None:
    """Until the cluster lists both nodes alive (asked from inside the head's namespace)."""
    probe = ("import ray, sys; ray.init(address=sys.argv[1], logging_level='error', log_to_driver=False); "
             "print(sum(1 for n in ray.nodes() if n['Alive']))")
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        r = hosts.run(hosts.head_ns, [sys.executable, "-c", probe, hosts.ray_address], capture_output=True,
                      text=True, timeout=120)
        last = (r.stdout.strip().splitlines() or [r.stderr.strip()[-300:]])[-1]
        if r.returncode == 0 and last == "2":
            return
        time.sleep(1)
    raise RuntimeError(f"the two Ray nodes did not come up within {timeout:g} s (last: {last})")


def _teardown(hosts: Hosts) -> None:
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        pids = [p for ns in (hosts.head_ns, hosts.worker_ns) for p in hosts.pids(ns)]
        for p in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, sig)
        deadline = time.monotonic() + wait
        while pids and time.monotonic() < deadline:
            pids = [p for ns in (hosts.head_ns, hosts.worker_ns) for p in hosts.pids(ns)]
            time.sleep(0.1)
        if not pids:
            break
    for ns in (hosts.head_ns, hosts.worker_ns):
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    shutil.rmtree(hosts.temp_dir, ignore_errors=True)


@contextlib.contextmanager
def two_hosts(log_dir: Path, start_timeout: float = 90.0):
    """The two namespaces with a Ray node each (see the module docstring); yields :class:`Hosts`. Ray's output goes
    to ``log_dir``."""
    tag = f"qkv{os.getpid() % 100000}"
    hosts = Hosts(f"{tag}h", f"{tag}w", f"{tag}h0", f"{tag}w0", tempfile.mkdtemp(prefix="qkv2h-", dir="/tmp"))
    log_dir.mkdir(parents=True, exist_ok=True)
    token = Path(hosts.env["RAY_AUTH_TOKEN_PATH"])
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    logs = [open(log_dir / "ray-head.log", "w"), open(log_dir / "ray-worker.log", "w")]
    try:
        _network(hosts)
        _ray_start(hosts, hosts.head_ns, HEAD_IP, PREFILL_RESOURCE, True, logs[0])
        _wait_port(hosts, hosts.head_ns, HEAD_IP, GCS_PORT, start_timeout)
        _ray_start(hosts, hosts.worker_ns, WORKER_IP, DECODE_RESOURCE, False, logs[1])
        _wait_nodes(hosts, start_timeout)
        yield hosts
    finally:
        _teardown(hosts)
        for f in logs:
            f.close()


def _wait_port(hosts: Hosts, ns: str, ip: str, port: int, timeout: float) -> None:
    probe = ("import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1).close()")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if hosts.run(ns, [sys.executable, "-c", probe, ip, str(port)], capture_output=True).returncode == 0:
            return
        time.sleep(0.5)
    raise RuntimeError(f"the Ray head did not listen on {ip}:{port} within {timeout:g} s")
