"""The KV hand-off of disaggregated serving across two hosts (issue 32, item 4): hand-off time and bytes across the
link between them.

The two hosts are the two network namespaces of ``tests/helpers/_two_hosts.py`` (a veth pair, 10.213.0.1 and 10.213.0.2,
a Ray head node with resource ``qeffkv_prefill`` and a worker node with ``qeffkv_decode``; one CPU each). Inside the
head's namespace this script runs again (``--inside``) as a Ray driver: the real
:class:`qeff_kv.serve.cluster.disagg.PrefillWorker` (placed by ``qeffkv_prefill`` on the head) prefills a ``--prompt-len``
prompt, and its :class:`~qeff_kv.serve.cluster.transfer.KVTransfer` goes by reference to a receiving actor on the worker node
(``qeffkv_decode``) that installs it into its own session, as a decode replica does; then, for comparison, the same
with the receiver on the head beside the prefill replica (one host: the same cluster, load and code). Per hand-off:

* hand-off = the driver's wall time of the call chain minus the prefill (extraction, the object store, the transfer
  across the veth, deserialization, validation, the install, Ray's call overheads);
* bytes: the KV state's (= the valid positions, ``prompt_len x bytes_per_position``) and what the head's end of the
  veth sent meanwhile (the state plus Ray's protocol).

Needs root and ``ip`` (network namespaces). Prints a table and writes ``--json``:

    .venv/bin/python benchmarks/bench_two_hosts.py EXPORT [--prompt-len 1024] [--repeats 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "helpers"))


def _tx_bytes(veth: str) -> int:
    """Bytes the head's end of the veth sent so far (read inside the head's namespace: its own sysfs)."""
    return int(Path(f"/sys/class/net/{veth}/statistics/tx_bytes").read_text())


class Receiver:
    """The decode side of a hand-off: installs a :class:`KVTransfer` into its own session, as a decode replica
    admits one (then frees it)."""

    def __init__(self, export, ctx_len, threads):
        from qeff_kv.runtime import Session

        self.session = Session(export, ctx_len=ctx_len, threads=threads)

    def install(self, transfer):
        from qeff_kv.serve.cluster.transfer import install

        t0 = time.perf_counter()
        seq = install(self.session, transfer)
        took = time.perf_counter() - t0
        self.session.remove_sequence(seq)
        return took, transfer.prefill_s, transfer.extract_s, transfer.nbytes


def inside(args) -> dict:
    """The measurement, run as a Ray driver inside the head's namespace: the receiver on the worker node (two
    hosts), then on the head beside the prefill replica (one host, for comparison: the same cluster and load)."""
    import ray

    import _two_hosts

    ray.init(address=args.inside, logging_level="warning", log_to_driver=False)
    try:
        pre, dec = _two_hosts.PREFILL_RESOURCE, _two_hosts.DECODE_RESOURCE
        return {"two_hosts": _measure(args, dict(num_cpus=1, resources={pre: 1}),
                                      dict(num_cpus=1, resources={dec: 1})),
                "one_host": _measure(args, dict(num_cpus=0.5, resources={pre: 0.5}),
                                     dict(num_cpus=0.5, resources={pre: 0.5}))}
    finally:
        ray.shutdown()


def _measure(args, pre_opts: dict, rec_opts: dict) -> dict:
    import numpy as np
    import ray

    from qeff_kv.runtime import GREEDY
    from qeff_kv.serve.cluster.disagg import PrefillWorker

    pre = ray.remote(PrefillWorker).options(**pre_opts).remote(args.export, args.ctx_len, None, args.threads)
    rec = ray.remote(Receiver).options(**rec_opts).remote(args.export, args.ctx_len, args.threads)
    try:
        facts = ray.get(pre.facts.remote())
        prompt = tuple(int(t) for t in np.random.default_rng(0).integers(3, facts["vocab_size"] or 1000,
                                                                         size=args.prompt_len))
        ray.get(rec.install.remote(pre.prefill.remote("warm", prompt[:64], GREEDY)))
        rows = {k: [] for k in ("wall_s", "prefill_s", "extract_s", "install_s", "handoff_s", "veth_bytes")}
        nbytes = 0
        for i in range(args.repeats):
            p = (i + 3,) + prompt[1:]   # another first token each time: the replica's prompt reuse finds nothing
            sent, t0 = _tx_bytes(args.veth), time.perf_counter()
            install_s, prefill_s, extract_s, nbytes = ray.get(rec.install.remote(pre.prefill.remote(f"r{i}", p,
                                                                                                     GREEDY)))
            wall = time.perf_counter() - t0
            rows["veth_bytes"].append(_tx_bytes(args.veth) - sent)
            for k, v in (("wall_s", wall), ("prefill_s", prefill_s), ("extract_s", extract_s),
                         ("install_s", install_s), ("handoff_s", wall - prefill_s)):
                rows[k].append(v)
    finally:
        for a in (pre, rec):
            ray.kill(a)
    out = {k: statistics.median(v) for k, v in rows.items()}
    out.update(bytes=nbytes, bytes_expected=args.prompt_len * facts["bytes_per_position"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("export", help="the export (folder) both hosts serve")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--ctx-len", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1, help="onnxruntime threads per session (default 1)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--inside", default=None, help=argparse.SUPPRESS)   # the Ray address: run as the driver
    ap.add_argument("--veth", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.inside:
        print(json.dumps(inside(args)))
        return
    import _two_hosts

    why = _two_hosts.unavailable()
    if why is not None:
        sys.exit(f"bench_two_hosts needs two network namespaces: {why}")
    with _two_hosts.two_hosts(Path("/tmp/bench_two_hosts_logs")) as hosts:
        argv = [sys.executable, __file__, str(Path(args.export).resolve()), "--prompt-len", str(args.prompt_len),
                "--threads", str(args.threads), "--repeats", str(args.repeats), "--inside", hosts.ray_address,
                "--veth", hosts.head_veth] + (["--ctx-len", str(args.ctx_len)] if args.ctx_len else [])
        r = hosts.run(hosts.head_ns, argv, capture_output=True, text=True, timeout=1800)
        if r.returncode != 0:
            sys.exit(f"the driver in the head's namespace failed:\n{r.stderr[-3000:]}")
        res = json.loads(r.stdout.strip().splitlines()[-1])
    res = {"export": args.export, "prompt_len": args.prompt_len, "threads": args.threads, "repeats": args.repeats,
           **res}
    for label, key in (("two hosts (across the veth)", "two_hosts"), ("one host (the head alone)", "one_host")):
        t = res[key]
        print(f"{label}: prompt {args.prompt_len} tokens, KV moved {t['bytes'] / 1e6:.1f} MB (valid positions "
              f"{t['bytes_expected'] / 1e6:.1f} MB), the head's veth sent {t['veth_bytes'] / 1e6:.1f} MB | prefill "
              f"{t['prefill_s'] * 1e3:.0f} ms | hand-off {t['handoff_s'] * 1e3:.1f} ms ({t['handoff_s'] / t['prefill_s']:.1%} "
              f"of the prefill; extract {t['extract_s'] * 1e3:.1f} ms, install {t['install_s'] * 1e3:.1f} ms)")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
