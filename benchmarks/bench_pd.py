"""vLLM's P/D protocol between separate servers on one machine (issue 32, "Measure"): the time to first token a
producer -> consumer hand-off adds against a single server, and the bytes moved.

Starts a Ray instance in this process (bound to 127.0.0.1), three ``qeff-kv serve`` processes on EXPORT (a single
server; a ``--kv-role producer`` and a ``--kv-role consumer`` joined to that Ray instance) and ``tests/helpers/pd_proxy.py``
(vLLM's toy proxy protocol) over the pair. For each prompt length, ``--repeats`` fresh random prompts (no prompt
reuse anywhere), each sent streamed (greedy, ``--new`` tokens) to the single server and through the proxy, one at a
time:

* TTFT single server / through the proxy (client-side: request sent -> first text chunk), and the difference
  (median of the per-prompt differences);
* the hand-off itself, from the servers' counters: the producer's ``kv_save_seconds`` (extract + ``ray.put`` + hold)
  and the consumer's ``kv_load_seconds`` (find the holder, take, fetch from the object store);
* the pieces of the P/D path, from the direct protocol calls made once more per prompt: the producer's answer
  (prefill + first token + extract + ``ray.put`` + hold) and the consumer's first token with the params (take +
  fetch + checks + import + first chunk);
* bytes moved per request (the consumer's ``kv_load_bytes``) against ``prompt length x bytes per position``;
* whether the texts are identical.

    .venv/bin/python benchmarks/bench_pd.py EXPORT [--prompt-len 128 --prompt-len 1024] [--repeats 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import httpx
import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from bench_serve import Server, free_port, say, stream_one  # noqa: E402


def _serve_argv(export: str, port: int, args, *extra: str) -> list[str]:
    exe = REPO / ".venv" / "bin" / "qeff-kv"
    head = [str(exe)] if exe.is_file() else [sys.executable, "-m", "qeff_kv_cli.main"]
    argv = head + ["serve", export, "--port", str(port), "--no-prompt-reuse", "--model-name", "m", *extra]
    return argv + (["--threads", str(args.threads)] if args.threads else [])


def _server(export: str, args, log: Path, *extra: str) -> Server:
    port = free_port()
    return Server(_serve_argv(export, port, args, *extra), port, log)


def _proxy(prefill: Server, decode: Server, log: Path) -> Server:
    port = free_port()
    argv = [sys.executable, str(REPO / "tests" / "helpers" / "pd_proxy.py"), "--port", str(port),
            "--prefiller-host", "127.0.0.1", "--prefiller-port", str(prefill.port),
            "--decoder-host", "127.0.0.1", "--decoder-port", str(decode.port)]
    return Server(argv, port, log, health="/healthcheck")


def _direct(producer: str, consumer: str, prompt: list[int], new: int) -> dict:
    """The protocol's two calls, timed apart: the producer's answer, then the consumer's first chunk."""
    ask = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None, "remote_block_ids": None,
           "remote_host": None, "remote_port": None}
    t0 = time.perf_counter()
    r = httpx.post(producer + "/v1/completions", timeout=600,
                   json={"model": "m", "prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True,
                         "kv_transfer_params": ask})
    r.raise_for_status()
    produced = time.perf_counter() - t0
    params = r.json()["kv_transfer_params"]
    body = {"model": "m", "prompt": prompt, "max_tokens": new, "temperature": 0, "ignore_eos": True,
            "stream": True, "kv_transfer_params": params}
    t0 = time.perf_counter()
    first = None
    with httpx.stream("POST", consumer + "/v1/completions", json=body, timeout=600) as s:
        s.raise_for_status()
        for line in s.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and first is None:
                if (json.loads(line[6:]).get("choices") or [{}])[0].get("text"):
                    first = time.perf_counter() - t0
    return {"producer_s": produced, "consumer_first_s": first, "transfer_bytes": params["transfer_bytes"],
            "num_tokens": params["num_tokens"]}


def _stats(url: str) -> dict:
    return httpx.get(url + "/health", timeout=30).json()


def measure(servers: dict, length: int, args, rng) -> dict:
    rows = {"single_ttft_s": [], "pd_ttft_s": [], "added_ttft_s": [], "save_s": [], "load_s": [], "producer_s": [],
            "consumer_first_s": []}
    same, moved, expected = True, [], []
    for _ in range(args.repeats):
        prompt = [int(t) for t in rng.integers(3, args.vocab, size=length)]
        alone = stream_one(servers["single"].url, prompt, args.new, "m")
        cons, prod = _stats(servers["consumer"].url), _stats(servers["producer"].url)
        pd = stream_one(servers["proxy"].url, prompt, args.new, "m")
        cons2, prod2 = _stats(servers["consumer"].url), _stats(servers["producer"].url)
        moved.append(cons2["kv_load_bytes"] - cons["kv_load_bytes"])
        rows["load_s"].append(cons2["kv_load_seconds"] - cons["kv_load_seconds"])
        rows["save_s"].append(prod2["kv_save_seconds"] - prod["kv_save_seconds"])
        rows["added_ttft_s"].append(pd["ttft"] - alone["ttft"])
        same = same and pd["text"] == alone["text"]
        rows["single_ttft_s"].append(alone["ttft"])
        rows["pd_ttft_s"].append(pd["ttft"])
        d = _direct(servers["producer"].url, servers["consumer"].url, prompt, args.new)
        rows["producer_s"].append(d["producer_s"])
        rows["consumer_first_s"].append(d["consumer_first_s"])
        expected.append(d["transfer_bytes"])
        say(f"  {length} tokens: single {alone['ttft'] * 1e3:.0f} ms, P/D {pd['ttft'] * 1e3:.0f} ms, "
            f"moved {moved[-1]} bytes")
    med = {k: statistics.median(v) for k, v in rows.items()}
    ms = {k[:-2] + "_ms": round(v * 1e3, 1) for k, v in med.items()}
    return {"prompt_len": length, "repeats": args.repeats, **ms,
            "bytes_moved": moved, "bytes_expected": expected,
            "bytes_per_position": expected[0] // length if expected else None,
            "bytes_equal_valid_positions": moved == expected, "identical_text": same}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("export")
    ap.add_argument("--prompt-len", type=int, action="append", default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1, help="onnxruntime threads per server (default 1)")
    ap.add_argument("--vocab", type=int, default=None, help="random token ids below this (default: the vocabulary)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--logs", default="/tmp/bench_pd")
    args = ap.parse_args()
    lengths = args.prompt_len or [128, 1024]
    import ray

    from qeff_kv.runtime.model_files import resolve_model

    if args.vocab is None:
        cfg = resolve_model(args.export).manifest or {}
        args.vocab = int(cfg.get("vocab_size") or 1000)
    from qeff_kv.serve.cluster.ray_cluster import loopback_node

    with loopback_node(ray):
        ray.init(num_cpus=2, include_dashboard=False, logging_level="warning", log_to_driver=False,
                 _node_ip_address="127.0.0.1")
    address = ray.get_runtime_context().gcs_address
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    servers: dict = {}
    try:
        say("starting the single server, the producer, the consumer and the proxy ...")
        servers["single"] = _server(args.export, args, logs / "single.log")
        servers["producer"] = _server(args.export, args, logs / "producer.log", "--kv-role", "producer",
                                      "--ray-address", address)
        servers["consumer"] = _server(args.export, args, logs / "consumer.log", "--kv-role", "consumer",
                                      "--ray-address", address)
        servers["proxy"] = _proxy(servers["producer"], servers["consumer"], logs / "proxy.log")
        rng = np.random.default_rng(0)
        stream_one(servers["single"].url, [5, 6, 7, 8], 2, "m")   # warm-up
        stream_one(servers["proxy"].url, [5, 6, 7, 8], 2, "m")
        results = [measure(servers, n, args, rng) for n in lengths]
    finally:
        for s in reversed(list(servers.values())):
            s.stop()
        ray.shutdown()
    out = {"export": args.export, "threads": args.threads, "new_tokens": args.new, "results": results}
    print(json.dumps(out, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
