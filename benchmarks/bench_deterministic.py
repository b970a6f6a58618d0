"""Batch invariance of ``qeff-kv serve`` (issue 54): do a request's tokens depend on what else runs?

For each mode (the default, and ``--deterministic``), against fresh server processes on 127.0.0.1:

* **alone**: ``--requests`` mixed chat requests (questions under the chat template's shared system prompt, some
  asked twice, some continuing an earlier answer, so prompt reuse meets shared and non-aligned prefixes; greedy,
  and every fourth one sampled with a fixed seed), sent one at a time (1 client);
* **together**: a fresh server, the same requests from ``--clients`` clients at once (shuffled).

Reported per mode: requests whose tokens differ between the two runs, differing tokens (for each such request, the
tokens from the first difference on), and aggregate generated tokens/s of each run (the speed cost of the mode at
1 and at N clients). The tokens are compared as the ``logprobs`` token lists of the answers.

    python benchmarks/bench_deterministic.py --export smollm2-int4/ --requests 100 --clients 8 \\
        --out benchmarks/results/deterministic.json
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import random
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import Server, free_port, say  # noqa: E402

HERE = Path(__file__).resolve().parent

QUESTIONS = ["Why does the Moon have phases?", "What is the capital of France?", "Write a haiku about rain.",
             "Explain photosynthesis in two sentences.", "Name three prime numbers and say why they are prime.",
             "How do airplanes stay in the air?", "What is a black hole?", "Give me a tip for learning to cook.",
             "What causes the seasons on Earth?", "Summarise the plot of Romeo and Juliet.",
             "How does a vaccine work?", "What is the difference between weather and climate?",
             "Why is the sky blue?", "Describe a cat to someone who has never seen one.",
             "What is machine learning?", "How do I make a cup of tea?", "What is the tallest mountain?",
             "Explain gravity to a child.", "List four uses of copper.", "Why do leaves change colour in autumn?"]


def workload(n: int, seed: int = 54) -> list[dict]:
    """``n`` mixed chat requests: single questions, repeated ones, and two-turn conversations."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        q = rng.choice(QUESTIONS)
        messages = [{"role": "user", "content": q}]
        if i % 5 == 3:   # a second turn: a prefix of an earlier conversation and more
            messages += [{"role": "assistant", "content": "Let me think about that."},
                         {"role": "user", "content": rng.choice(QUESTIONS)}]
        sampled = i % 4 == 1
        out.append({"messages": messages, "max_tokens": rng.randrange(16, 33),
                    "temperature": 0.8 if sampled else 0, **({"seed": 1000 + i} if sampled else {})})
    return out


def ask(url: str, body: dict) -> list[str]:
    r = httpx.post(url + "/v1/chat/completions", timeout=1200,
                   json={"model": "m", "logprobs": True, "ignore_eos": True, **body})
    r.raise_for_status()
    return [t["token"] for t in r.json()["choices"][0]["logprobs"]["content"]]


def run(argv: list[str], reqs: list[dict], clients: int, log: Path) -> tuple[list[list[str]], float]:
    server = Server(argv + ["--port", str(port := free_port())], port, log)
    try:
        order = list(range(len(reqs)))
        random.Random(clients).shuffle(order)
        t0 = time.perf_counter()
        with cf.ThreadPoolExecutor(clients) as ex:
            got = dict(zip(order, ex.map(lambda i: ask(server.url, reqs[i]), order)))
        wall = time.perf_counter() - t0
    finally:
        server.stop()
    toks = [got[i] for i in range(len(reqs))]
    return toks, sum(map(len, toks)) / wall


def differing(a: list[list[str]], b: list[list[str]]) -> tuple[int, int]:
    """(requests that differ, tokens from each one's first difference on)."""
    reqs = toks = 0
    for x, y in zip(a, b):
        if x != y:
            first = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
            reqs += 1
            toks += max(len(x), len(y)) - first
    return reqs, toks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--export", required=True)
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--modes", default="default,deterministic")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "deterministic.json")
    args = ap.parse_args()
    reqs = workload(args.requests)
    logs = HERE / "work" / "deterministic"
    logs.mkdir(parents=True, exist_ok=True)
    base = [sys.executable, "-m", "qeff_kv_cli.main", "serve", args.export, "--accept-any-model-name",
            "--max-sequences", str(args.clients)] + (["--threads", str(args.threads)] if args.threads else [])
    results = {"export": args.export, "requests": args.requests, "clients": args.clients, "modes": {}}
    for mode in args.modes.split(","):
        argv = base + (["--deterministic"] if mode == "deterministic" else [])
        alone, tps1 = run(argv, reqs, 1, logs / f"{mode}-1.log")
        together, tpsn = run(argv, reqs, args.clients, logs / f"{mode}-{args.clients}.log")
        n_req, n_tok = differing(alone, together)
        results["modes"][mode] = {"differing_requests": n_req, "differing_tokens": n_tok,
                                  "tokens": sum(map(len, together)), "tok_s_1_client": round(tps1, 1),
                                  f"tok_s_{args.clients}_clients": round(tpsn, 1)}
        say(f"{mode}: {n_req}/{args.requests} requests differ ({n_tok} tokens); {tps1:.1f} tok/s at 1 client, "
            f"{tpsn:.1f} at {args.clients}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
