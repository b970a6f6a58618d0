"""Where a served load's time goes, without HTTP: bench_serve.py's requests run straight on the engine.

    python benchmarks/bench_engine.py smollm2-int4/ --clients 8 --requests 2 --threads 2 [--prefill-chunk N|auto]
        [--prompt-min 64 --prompt-max 1024 --new-min 64 --new-max 256] [--prefill-seq-len N] [--rounds 3]

``C`` client threads submit the same seeded requests as ``bench_serve.py --clients C`` (prompts cut from
fixtures/text/gettysburg.txt, greedy, every token up to the request's count) to a
:class:`~qeff_kv.serve.engine.scheduler.Scheduler` over one session (``--max-sequences C`` unless given, no prompt reuse
unless ``--reuse``: with it, finished sequences stay kept in their slots, as ``qeff-kv serve`` keeps them). Printed per
round: aggregate tokens/s and time to first token p50 / p99, then the engine's split: time in decode steps (steps,
ms a step, rows a step run and rows that decoded a token), time in prefill (tokens/s), and the rest (sampling,
events, admission). Set beside the same load over HTTP (bench_serve.py), the difference is the frontend's share.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def jobs_for(export: str, clients: int, requests: int, args) -> list[list[tuple[list[int], int]]]:
    """bench_serve.py's requests for ``clients`` clients (its Corpus and seed)."""
    from bench_serve import Corpus, concurrency_jobs

    return concurrency_jobs(clients, requests, args, Corpus(export), seed=clients)


def one_round(export: str, clients: int, jobs, args) -> dict:
    from qeff_kv.runtime import SamplingParams, Session
    from qeff_kv.serve.engine.engine import GenerationRequest, TokenOut
    from qeff_kv.serve.engine.scheduler import Scheduler

    from bench_serve import run_clients

    session = Session(export, max_sequences=args.max_sequences or clients, threads=args.threads,
                      prefill_seq_len=args.prefill_seq_len)
    chunk = args.prefill_chunk if args.prefill_chunk in (None, "auto") else int(args.prefill_chunk)
    sched = Scheduler(session, max_queue=1024, reuse_prompts=args.reuse, prefill_chunk=chunk)
    ttft: list[float] = []
    tokens = [0]

    def client(i: int) -> None:
        for j, (prompt, new) in enumerate(jobs[i]):
            t0 = time.perf_counter()
            handle = sched.submit(GenerationRequest(f"{i}-{j}", tuple(prompt), new, SamplingParams(temperature=0),
                                                    frozenset()))
            first = True
            for ev in handle.iter_sync(timeout=600):
                if isinstance(ev, TokenOut):
                    if first:
                        ttft.append(time.perf_counter() - t0)
                        first = False
                    tokens[0] += 1

    wall = run_clients(client, clients)
    sched.close()
    tm = session.timings
    ttft.sort()
    return {"clients": clients, "wall_s": round(wall, 3), "tokens": tokens[0],
            "tok_per_s": round(tokens[0] / wall, 1),
            "ttft_p50_ms": round(1e3 * ttft[len(ttft) // 2], 1),
            "ttft_p99_ms": round(1e3 * ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))], 1),
            "decode_s": round(tm.decode_s, 3), "decode_steps": tm.decode_steps,
            "ms_per_step": round(1e3 * tm.decode_s / max(1, tm.decode_steps), 2),
            "rows_per_step": round(tm.decode_rows / max(1, tm.decode_steps), 2),
            "tokens_per_step": round((tokens[0] - len(ttft)) / max(1, tm.decode_steps), 2),
            "prefill_s": round(tm.prefill_s, 3), "prefill_tokens": tm.prefill_tokens,
            "prefill_tok_per_s": round(tm.prefill_tokens / max(1e-9, tm.prefill_s), 1),
            "other_s": round(wall - tm.decode_s - tm.prefill_s, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("export")
    ap.add_argument("--clients", default="1,8")
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--prompt-min", type=int, default=64)
    ap.add_argument("--prompt-max", type=int, default=1024)
    ap.add_argument("--new-min", type=int, default=64)
    ap.add_argument("--new-max", type=int, default=256)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--prefill-chunk", default=None, help="the Scheduler's prefill_chunk (N or auto)")
    ap.add_argument("--prefill-seq-len", type=int, default=None, help="the Session's prefill length")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--max-sequences", type=int, default=None, help="the session's sequences (default: --clients)")
    ap.add_argument("--reuse", action="store_true",
                    help="keep finished sequences for prompt reuse (the server's default; off by default here)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    rows = []
    for c in [int(x) for x in args.clients.split(",")]:
        jobs = jobs_for(args.export, c, args.requests, args)
        runs = [one_round(args.export, c, jobs, args) for _ in range(args.rounds)]
        for r in runs:
            print(json.dumps(r), flush=True)
        best = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        rows.append(best)
    print("| clients | tok/s | TTFT p50 / p99 ms | decode s (steps, ms a step, rows run / decoded a step) | "
          "prefill s (tok/s) | other s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['clients']} | {r['tok_per_s']} | {r['ttft_p50_ms']} / {r['ttft_p99_ms']} | {r['decode_s']} "
              f"({r['decode_steps']}, {r['ms_per_step']}, {r['rows_per_step']} / {r['tokens_per_step']}) | "
              f"{r['prefill_s']} ({r['prefill_tok_per_s']}) | {r['other_s']} |")
    if args.out:
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=1))
        tmp.replace(args.out)


if __name__ == "__main__":
    main()
