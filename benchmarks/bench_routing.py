"""Prefix-aware routing across prefill replicas against routing by load (issue 32, item 3).

``--prefill-replicas`` (4) prefill replicas and one decode replica of ``qeff-kv serve --disaggregate`` (the
:class:`~qeff_kv.serve.cluster.disagg.DisaggregatedEngine`, driven in process: no HTTP in the way), one onnxruntime
thread each. The workload: ``--system-prompts`` (8) random system prompts of ``--system-len`` tokens, each with
``--questions`` (8) random questions of ``--question-len`` tokens, all 64 requests in one seeded random order,
``--clients`` (4) at a time, ``--max-tokens`` (4) greedy tokens each. Each route runs on fresh replicas (cold
caches), in turn ``--rounds`` times.

Reported per route: prompt tokens reused (the sum of the requests' ``cached_tokens``) against the ideal of one
replica holding everything (every question after the first of each system prompt reuses its system prompt:
``system_prompts x (questions - 1) x system_len``; target for prefix routing: >= 85%), p50/p90 time to first
token (submit to first token), wall time, and the router's decision time (mean and max per request). ``load``
is the engine's routing by load (the least loaded replica, ties in turn: round-robin when the replicas keep
pace), the baseline.

Without ``--export``, the bundled default model is exported once (continuous batching, ``--slots`` sequences per
replica, ``--ctx-len``, prefix VLLM) into ``--work``.

    .venv/bin/python benchmarks/bench_routing.py [--export DIR] [--rounds 2] --json benchmarks/results/routing.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def export_default(args) -> str:
    from qeff_kv.export import export_model

    out = Path(args.work) / f"default-cb{args.slots}-ctx{args.ctx_len}"
    if not (out / "model.onnx").exists() and not any(out.glob("*.onnx")):
        say(f"exporting the bundled default model to {out} ...")
        export_model(None, out, ctx_len=args.ctx_len, prefill_seq_len=32, kv_cache_prefix="VLLM",
                     continuous_batching=True, full_batch_size=args.slots, verify=False)
    return str(out)


def workload(args, vocab: int) -> list[tuple[int, list[int]]]:
    """(system prompt index, prompt) of every request, in the seeded random order."""
    rng = np.random.default_rng(args.seed)
    systems = [rng.integers(3, vocab, size=args.system_len).tolist() for _ in range(args.system_prompts)]
    reqs = [(s, systems[s] + rng.integers(3, vocab, size=args.question_len).tolist())
            for s in range(args.system_prompts) for _ in range(args.questions)]
    order = rng.permutation(len(reqs))
    return [reqs[i] for i in order]


def run_route(args, export: str, route: str, reqs) -> dict:
    from qeff_kv.runtime import GREEDY
    from qeff_kv.serve.config import ServeConfig
    from qeff_kv.serve.server import build_engine
    from qeff_kv.serve.engine.engine import Finished, GenerationRequest, TokenOut

    eng = build_engine(ServeConfig(export, disaggregate=True, prefill_replicas=args.prefill_replicas,
                                   decode_replicas=1, threads=1, route=route, max_queue=256))
    results: list = [None] * len(reqs)
    nxt = iter(range(len(reqs)))
    lock = threading.Lock()

    def client():
        while True:
            with lock:
                i = next(nxt, None)
            if i is None:
                return
            t0 = time.perf_counter()
            h = eng.submit(GenerationRequest(f"q{i}", tuple(reqs[i][1]), args.max_tokens, GREEDY, frozenset(), None))
            ttft, toks, fin = None, [], None
            for ev in h.iter_sync(timeout=600):
                if isinstance(ev, TokenOut):
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    toks.append(ev.token)
                elif isinstance(ev, Finished):
                    fin = ev
            if fin is None or fin.finish_reason not in ("length", "stop"):
                raise RuntimeError(f"request {i} failed: {fin}")
            results[i] = (ttft, fin.cached_tokens, toks)

    try:
        t0 = time.perf_counter()
        threads = [threading.Thread(target=client) for _ in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        stats = eng.stats()
    finally:
        eng.close()
    ttfts = sorted(r[0] for r in results)
    ideal = args.system_prompts * (args.questions - 1) * args.system_len
    reused = sum(r[1] for r in results)
    decisions = max(1, stats["route_decisions"])
    return {"route": route, "prompt_tokens": sum(len(p) for _, p in reqs), "reused": reused, "ideal": ideal,
            "reuse_of_ideal": reused / ideal, "ttft_p50_s": statistics.median(ttfts),
            "ttft_p90_s": ttfts[int(0.9 * (len(ttfts) - 1))], "wall_s": wall,
            "route_prefix_hits": stats["route_prefix_hits"], "route_prefix_misses": stats["route_prefix_misses"],
            "decision_mean_ms": 1e3 * stats["route_decision_s"] / decisions,
            "decision_max_ms": 1e3 * stats["route_decision_max_s"],
            "tokens": [r[2] for r in results]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--export", default=None, help="a continuous-batching export (default: the bundled model)")
    ap.add_argument("--work", default="/tmp/qeff-kv-bench-routing")
    ap.add_argument("--ctx-len", type=int, default=256)
    ap.add_argument("--slots", type=int, default=4, help="sequences per replica (the default export's)")
    ap.add_argument("--prefill-replicas", type=int, default=4)
    ap.add_argument("--system-prompts", type=int, default=8)
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--system-len", type=int, default=192)
    ap.add_argument("--question-len", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--routes", default="prefix,load")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import ray

    from qeff_kv.runtime import Session

    export = args.export or export_default(args)
    vocab = Session(export).vocab_size
    reqs = workload(args, vocab)
    ray.init(num_cpus=2, include_dashboard=False, logging_level="warning", log_to_driver=False)
    runs: list[dict] = []
    try:
        for rnd in range(args.rounds):
            for route in args.routes.split(","):
                say(f"round {rnd + 1}: --route {route} ...")
                r = run_route(args, export, route, reqs)
                say(f"  reused {r['reused']} / ideal {r['ideal']} ({100 * r['reuse_of_ideal']:.1f}%), "
                    f"TTFT p50 {1e3 * r['ttft_p50_s']:.1f} ms, wall {r['wall_s']:.1f} s, "
                    f"decision {r['decision_mean_ms']:.3f} ms (max {r['decision_max_ms']:.3f})")
                runs.append({"round": rnd + 1, **r})
    finally:
        ray.shutdown()
    same = all(r["tokens"] == runs[0]["tokens"] for r in runs)
    summary = {}
    for route in args.routes.split(","):
        mine = [r for r in runs if r["route"] == route]
        summary[route] = {k: statistics.median(r[k] for r in mine)
                          for k in ("reused", "reuse_of_ideal", "ttft_p50_s", "ttft_p90_s", "wall_s",
                                    "decision_mean_ms", "decision_max_ms")}
    print(f"{'route':8} {'reused':>8} {'of ideal':>9} {'TTFT p50':>10} {'TTFT p90':>10} {'wall':>8} "
          f"{'decision':>10}")
    for route, s in summary.items():
        print(f"{route:8} {s['reused']:8.0f} {100 * s['reuse_of_ideal']:8.1f}% {1e3 * s['ttft_p50_s']:8.1f}ms "
              f"{1e3 * s['ttft_p90_s']:8.1f}ms {s['wall_s']:7.1f}s {s['decision_mean_ms']:8.3f}ms")
    print(f"same tokens under every route: {same}")
    if args.json:
        params = {k: v for k, v in vars(args).items() if k not in ("json", "work")}
        Path(args.json).write_text(json.dumps({"params": params, "export": export, "same_tokens": same,
                                               "summary": summary,
                                               "runs": [{k: v for k, v in r.items() if k != "tokens"} for r in runs]},
                                              indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
