"""The CPU decode loop of :class:`qeff_kv.runtime.Session` (the device-agnostic binding path, ``device="cpu"``),
timed so that two trees of qeff-kv can be compared on the same export (issue 40: the CPU keeps its speed).

    python benchmarks/bench_device.py EXPORT_DIR [--sequences N] [--steps 64] [--rounds 7]

Prints one JSON line: the median and min of microseconds per decode step over ``--rounds`` rounds of ``--steps``
greedy steps (after a prefill of 16 tokens), and the tokens of the first sequence (equal between trees, or the
comparison means nothing). Run it with ``PYTHONPATH`` set to each tree in turn, interleaved; see docs/runtime.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("export")
    ap.add_argument("--sequences", type=int, default=1)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    from qeff_kv.runtime import Session

    sess = Session(args.export, max_sequences=args.sequences, threads=args.threads)
    rounds, first = [], None
    for _ in range(args.rounds):
        for s in list(sess.sequences):
            sess.remove_sequence(s)
        seqs = [sess.add_sequence() for _ in range(args.sequences)]
        toks = {s: int(np.argmax(sess.prefill(s, [(7 * i + j) % 97 + 3 for j in range(16)])))
                for i, s in enumerate(seqs)}
        out = [toks[seqs[0]]]
        t0 = time.perf_counter()
        for _ in range(args.steps):
            logits = sess.decode(toks)
            toks = {s: int(np.argmax(row)) for s, row in logits.items()}
            out.append(toks[seqs[0]])
        rounds.append((time.perf_counter() - t0) / args.steps * 1e6)
        first = out
    print(json.dumps({"us_per_step_median": round(statistics.median(rounds), 1),
                      "us_per_step_min": round(min(rounds), 1), "sequences": args.sequences,
                      "steps": args.steps, "rounds": args.rounds, "tokens": first[:12]}))


if __name__ == "__main__":
    main()
