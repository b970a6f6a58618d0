"""Compute context length (CCL) on the portable graph: decode step time at capacity 4096 vs 256, valid length 128.

    python benchmarks/bench_ccl.py                  # model S (see bench_decode.py), 7 rounds, 2 threads
    python benchmarks/bench_ccl.py --rounds 3       # a smoke run

Model S of bench_decode.py (random seeded weights, fp32) is exported to the portable target at ctx_len 4096
three times: without CCL, with ``--ccl auto`` (512, 1024, 2048, 4096) and with ``--ccl 256,512,1024,2048,4096``.
Each graph runs in qeff-kv's runtime (in-place binding) at capacity 256 and 4096: prefill a 128-token prompt,
then time ``--steps`` decode steps (positions 128..). Every (graph, capacity) pair runs once per round,
interleaved; the figure is the median over rounds of each round's median step time. Greedy tokens of all runs
are compared. Target (issue 12): with CCL, step at 4096 <= 1.3x step at 256. Figures: docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_decode import MODELS, build_model, prompt_ids  # noqa: E402

GRAPHS = {"no CCL": None, "ccl auto": "auto", "ccl 256..4096": "256,512,1024,2048,4096"}
CAPACITIES = (256, 4096)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=HERE / "work", help="models and exports (reused across runs)")
    ap.add_argument("--out", type=Path, default=HERE / "results", help="where ccl.json goes")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    args = ap.parse_args(argv)

    import numpy as np

    from qeff_kv.export import export_model
    from qeff_kv.runtime import Session

    model_dir = build_model("S", args.work)
    work = args.work / "S-ccl-exports"
    sessions = {}
    for label, ccl in GRAPHS.items():
        res = export_model(model_dir, work / label.replace(" ", "-").replace(".", ""), ctx_len=4096,
                           prefill_seq_len=128, target="portable", ccl=ccl)
        for cap in CAPACITIES:
            sessions[(label, cap)] = Session(res.out_dir, ctx_len=cap, threads=args.threads)
    prompt = prompt_ids(args.prompt_len, MODELS["S"]["vocab_size"])

    def run(sess, steps):
        for s in list(sess.sequences):
            sess.remove_sequence(s)
        seq = sess.add_sequence()
        tok = int(np.argmax(sess.prefill(seq, prompt)))
        toks, times = [tok], []
        for _ in range(steps):
            t = time.perf_counter()
            tok = int(np.argmax(sess.decode({seq: tok})[seq]))
            times.append(time.perf_counter() - t)
            toks.append(tok)
        return toks, statistics.median(times), sess.binding.ccl_bound

    for sess in sessions.values():  # warm-up
        run(sess, 4)
    medians = {k: [] for k in sessions}
    tokens, lengths = {}, {}
    for r in range(args.rounds):
        for k, sess in sessions.items():
            toks, med, bound = run(sess, args.steps)
            medians[k].append(med)
            tokens[k], lengths[k] = toks, bound
        print(f"round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
    ref = next(iter(tokens.values()))
    results = {"model": "S", "threads": args.threads, "rounds": args.rounds, "steps": args.steps,
               "prompt_len": args.prompt_len, "tokens_match": all(t == ref for t in tokens.values()), "graphs": {}}
    print(f"\nmodel S, portable graph, valid length {args.prompt_len}, median step time over {args.rounds} rounds")
    for label in GRAPHS:
        row = {}
        for cap in CAPACITIES:
            ms = [1e3 * m for m in medians[(label, cap)]]
            row[str(cap)] = {"step_ms_median": statistics.median(ms), "step_ms_min": min(ms),
                             "step_ms_max": max(ms), "comp_ctx_lengths": lengths[(label, cap)]}
        ratio = row["4096"]["step_ms_median"] / row["256"]["step_ms_median"]
        row["ratio_4096_over_256"] = ratio
        results["graphs"][label] = row
        print(f"  {label:14s} cap 256: {row['256']['step_ms_median']:6.2f} ms (L={row['256']['comp_ctx_lengths']})"
              f"  cap 4096: {row['4096']['step_ms_median']:6.2f} ms (L={row['4096']['comp_ctx_lengths']})"
              f"  ratio {ratio:.2f}x")
    print(f"  greedy tokens equal across all runs: {results['tokens_match']}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ccl.json").write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
