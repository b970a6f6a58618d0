"""Cost of one row's token selection (qeff_kv.runtime.decoding.sampling) on a vocabulary the size of SmolLM2's.

    python benchmarks/bench_sampling.py [--vocab 49152] [--tokens 300] [--rounds 5]

Per case, the median over rounds of the time per token of ``TokenPicker.pick`` + ``accept`` on one row of random
logits (a 200-token prompt in the history): plain greedy and sampled rows (the fast path), then logprobs,
``logit_bias`` and penalties (the adjusting path). Also ``probabilities`` with top-p against the same with a full
``argsort`` of the vocabulary (what it did before the candidate sort). ``uptime``'s load average is printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from qeff_kv.runtime.decoding.sampling import SamplingParams, TokenPicker, probabilities

CASES = {
    "greedy (fast path)": (SamplingParams(), None),
    "T=0.7 top_p=0.9 (fast path)": (SamplingParams(temperature=0.7, top_p=0.9, seed=1), None),
    "T=0.7 top_k=40 (fast path)": (SamplingParams(temperature=0.7, top_k=40, seed=1), None),
    "greedy + top_logprobs 5": (SamplingParams(), 5),
    "greedy + logit_bias + 3 penalties": (SamplingParams(repetition_penalty=1.1, presence_penalty=0.5,
                                                         frequency_penalty=0.5, logit_bias=((5, -100.0),)), None),
    "T=0.7 top_p=0.9 + penalties + top_logprobs 5": (SamplingParams(temperature=0.7, top_p=0.9, seed=1,
                                                                    repetition_penalty=1.1, frequency_penalty=0.5), 5),
}


def per_token(params: SamplingParams, top: int | None, x: np.ndarray, tokens: int) -> float:
    picker = TokenPicker(params, prompt=list(range(200)), vocab_size=x.size)
    t0 = time.perf_counter()
    for i in range(tokens):
        picker.accept(picker.pick(x, i, top_logprobs=top).token)
    return (time.perf_counter() - t0) / tokens


def full_sort_top_p(x: np.ndarray, top_p: float) -> np.ndarray:
    p = np.exp(x - x.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = order[:int(np.searchsorted(np.cumsum(p[order]), top_p, side="left")) + 1]
    out = np.zeros_like(p)
    out[keep] = p[keep]
    return out / out.sum()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    x = (np.random.default_rng(0).normal(size=args.vocab) * 3).astype(np.float32)
    print(f"load average {os.getloadavg()}; vocab {args.vocab}; median of {args.rounds} rounds")
    for name, (params, top) in CASES.items():
        ms = statistics.median(per_token(params, top, x, args.tokens) for _ in range(args.rounds)) * 1e3
        print(f"{name:48s} {ms:7.3f} ms/token")
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=0)
    for name, fn in (("probabilities top_p=0.9 (candidate sort)", lambda: probabilities(x, params)),
                     ("same with a full argsort (before)", lambda: full_sort_top_p(x.astype(np.float64), 0.9))):
        runs = []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            for _ in range(30):
                fn()
            runs.append((time.perf_counter() - t0) / 30)
        print(f"{name:48s} {statistics.median(runs) * 1e3:7.3f} ms")


if __name__ == "__main__":
    main()
