"""Batched decode: aggregate decode tokens/s of 1, 2 and 4 sequences decoding together (issue 11, item 3).

    python benchmarks/bench_batched.py                 # model M, 5 rounds, 2 threads
    python benchmarks/bench_batched.py --model S --rounds 2      # a smoke run

Model M of bench_decode.py (random seeded weights, fp32) exported to ``onnxruntime-fused`` (ctx_len 4096), run
by qeff-kv's runtime with ``max_sequences=N``: the fused graph has no ``batch_index``, so the session runs its
sequences in lock step (a prefill runs on one sequence's row of the buffers, every decode step on all rows;
see docs/runtime.md). For reference the ``onnxruntime`` target with continuous batching (``batch_index``) is
run the same way. Each N prefills N different 128-token prompts, then decodes ``--new`` tokens for all of
them together; the figure is N x steps / decode time, median over rounds (min-max), interleaved. Greedy
tokens of every sequence are compared with the same prompt run alone. Target (issue 11): 4 sequences
>= 2.5x the single-sequence aggregate tokens/s on M. Figures: docs/performance.md.
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

COUNTS = (1, 2, 4)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=HERE / "work")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--model", default="M", choices=sorted(MODELS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    args = ap.parse_args(argv)

    from qeff_kv.export import export_model
    from qeff_kv.runtime import Session

    model_dir = build_model(args.model, args.work)
    work = args.work / f"{args.model}-batched"
    fused = export_model(model_dir, work / "fused", ctx_len=4096, prefill_seq_len=128, target="onnxruntime-fused")
    cb = export_model(model_dir, work / "ort-cb", ctx_len=4096, prefill_seq_len=128, target="onnxruntime",
                      continuous_batching=True, full_batch_size=max(COUNTS))
    engines = {"fused (lock step)": (fused.out_dir, {}), "onnxruntime + batch_index": (cb.out_dir, {})}
    sessions = {(e, n): Session(path, max_sequences=n, threads=args.threads, **kw)
                for e, (path, kw) in engines.items() for n in COUNTS}
    vocab = MODELS[args.model]["vocab_size"]
    prompts = [prompt_ids(args.prompt_len + i, vocab) for i in range(max(COUNTS))]

    def run(sess, n):
        for s in list(sess.sequences):
            sess.remove_sequence(s)
        seqs = []
        for p in prompts[:n]:
            seq = sess.add_sequence()
            tok = int(sess.prefill(seq, p).argmax())
            seqs.append([seq, tok, [tok]])
        t0 = time.perf_counter()
        for _ in range(args.new - 1):
            out = sess.decode([(s, t) for s, t, _ in seqs])
            for item in seqs:
                item[1] = int(out[item[0]].argmax())
                item[2].append(item[1])
        dt = time.perf_counter() - t0
        return n * (args.new - 1) / dt, [toks for _, _, toks in seqs]

    rates: dict = {k: [] for k in sessions}
    tokens: dict = {}
    for key, sess in sessions.items():   # warm-up
        run(sess, key[1])
    for e in engines:                    # the batched tokens, checked against each prompt alone below
        tokens[e] = run(sessions[(e, max(COUNTS))], max(COUNTS))[1]
    for r in range(args.rounds):
        for key, sess in sessions.items():
            rate, toks = run(sess, key[1])
            rates[key].append(rate)
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{k[0]} x{k[1]} {v[-1]:.1f} tok/s"
                                                          for k, v in rates.items()), flush=True)
    # each prompt alone on the single-sequence session, for the token check
    singles = {}
    for e in engines:
        sess = sessions[(e, 1)]
        got = []
        for p in prompts[:max(COUNTS)]:
            for s in list(sess.sequences):
                sess.remove_sequence(s)
            seq = sess.add_sequence()
            tok = int(sess.prefill(seq, p).argmax())
            toks = [tok]
            for _ in range(args.new - 1):
                tok = int(sess.decode({seq: tok})[seq].argmax())
                toks.append(tok)
            got.append(toks)
        singles[e] = got
    rows = []
    for e in engines:
        base = statistics.median(rates[(e, 1)])
        for n in COUNTS:
            v = rates[(e, n)]
            rows.append({"engine": e, "sequences": n, "aggregate_tok_s": round(statistics.median(v), 1),
                         "min": round(min(v), 1), "max": round(max(v), 1),
                         "vs_one": round(statistics.median(v) / base, 2)})
        print(f"{e}: " + ", ".join(f"x{r['sequences']} {r['aggregate_tok_s']} tok/s ({r['vs_one']}x)"
                                   for r in rows if r["engine"] == e)
              + f"; tokens equal to each prompt alone: {tokens[e] == singles[e]}")
    args.out.mkdir(parents=True, exist_ok=True)
    out = {"model": args.model, "threads": args.threads, "rounds": args.rounds, "new": args.new,
           "prompt_len": args.prompt_len, "rows": rows,
           "tokens_equal_alone": {e: tokens[e] == singles[e] for e in engines}}
    (args.out / "batched.json").write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out / 'batched.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
