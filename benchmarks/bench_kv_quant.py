"""The int8 and int4 KV caches (``--kv-cache-dtype int8``, ``int4``) against the float32 cache: accuracy on real text
and decode speed at a long context, on the fused target.

    python benchmarks/bench_kv_quant.py [--model /work/ckpt/smollm2-360m] [--ctx-len 2048] [--context 1024]
                                        [--caches float32,int8,int4]

Exports MODEL (a local Hugging Face folder) once per cache of ``--caches`` with ``--target onnxruntime-fused``
(each verified at export; a quantized one against the reference with the cache quantization emulated). Then:

* **accuracy**: the mean per-token NLL of ``fixtures/text/gettysburg.txt`` (public domain), teacher forced through
  the runtime (the first token prefilled, every next one a decode step, NLL of token ``t+1`` in float64 from the
  logits after ``t``), and the top-1 agreement of the int8 cache's argmax with the float cache's;
* **speed**: decode tokens/s of one sequence at ``--context`` positions (a prompt of that many tokens of the text,
  repeated, prefilled; then ``--steps`` greedy decode steps), the caches interleaved for ``--rounds`` rounds;
* **bytes**: KV bytes per token and per sequence at ``ctx_len``.

``--json PATH`` writes the results.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

import bench_nll
from bench_nll import tokenize

HERE = Path(__file__).resolve().parent
TEXT = HERE.parent / "fixtures" / "text" / "gettysburg.txt"


def nll(export: Path, tokens: list[int]) -> dict:
    """Teacher-forced NLL through the runtime (``bench_nll.nll``), the fields this benchmark reports."""
    got = bench_nll.nll(export, tokens)
    return {k: got[k] for k in ("tokens", "mean_nll", "perplexity", "_argmax")}


def decode_speed(export: Path, prompt: list[int], steps: int) -> float:
    from qeff_kv.runtime import Session

    sess = Session(export)
    seq = sess.add_sequence()
    logits = sess.prefill(seq, prompt)
    tok = int(np.argmax(logits))
    t0 = time.perf_counter()
    for _ in range(steps):
        tok = int(np.argmax(sess.decode({seq: tok})[seq]))
    return steps / (time.perf_counter() - t0)


def kv_bytes(export: Path, ctx_len: int) -> dict:
    from qeff_kv.graph import graphio
    from qeff_kv.contract.layout import itemsize

    layout = graphio.layout_of(graphio.load(export / json.loads((export / "manifest.json").read_text())["onnx"]))
    per_token = sum(itemsize(p.input.dtype) * p.input.shape[1] * p.input.shape[3] for p in layout.pairs)
    return {"kv_bytes_per_token": int(per_token), "kv_bytes_per_sequence": int(per_token * ctx_len)}


def export(model: Path, out: Path, ctx_len: int, kv: str | None) -> Path:
    from qeff_kv.export import export_model

    if not (out / "manifest.json").is_file():
        t0 = time.perf_counter()
        export_model(model, out, ctx_len=ctx_len, target="onnxruntime-fused", kv_cache_dtype=kv,
                     progress=lambda m: print(f"  {m}", file=sys.stderr))
        print(f"  exported {out.name} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=Path("/work/ckpt/smollm2-360m"))
    ap.add_argument("--ctx-len", type=int, default=2048)
    ap.add_argument("--context", type=int, default=1024, help="positions held when decode speed is measured")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--work", type=Path, default=HERE / "work" / "kv_quant")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--caches", default="float32,int8,int4", help="the KV cache dtypes compared (float32 first)")
    args = ap.parse_args(argv)
    caches = ["float32"] + [c for c in args.caches.split(",") if c != "float32"]
    exports = {kv: export(args.model, args.work / f"{args.model.name}-{kv}-{args.ctx_len}", args.ctx_len,
                          None if kv == "float32" else kv) for kv in caches}
    text = TEXT.read_text()
    tokens = tokenize(exports["float32"], text)
    rows = {kv: {**kv_bytes(ex, args.ctx_len), **nll(ex, tokens),
                 "verification": json.loads((ex / "manifest.json").read_text())["verification"]}
            for kv, ex in exports.items()}
    base = rows["float32"]
    for q in (rows[kv] for kv in caches[1:]):
        q["top1_agreement_with_float"] = float(np.mean([a == b for a, b in zip(q["_argmax"], base["_argmax"])]))
        q["nll_vs_float"] = q["mean_nll"] / base["mean_nll"] - 1
    prompt = (tokens * (args.context // len(tokens) + 1))[:args.context]
    speeds: dict = {kv: [] for kv in exports}
    for _ in range(args.rounds):   # interleaved
        for kv, ex in exports.items():
            speeds[kv].append(decode_speed(ex, prompt, args.steps))
    print(f"model {args.model} ctx_len {args.ctx_len}; text {TEXT.name} ({base['tokens'] + 1} tokens); decode at "
          f"{args.context} positions, {args.steps} steps x {args.rounds} rounds (interleaved)")
    print(f"{'cache':<8} {'KV B/token':>10} {'MB/seq':>7} {'mean NLL':>9} {'ppl':>7} {'vs float':>9} {'top-1':>7} "
          f"{'tok/s (median)':>15}")
    for kv, r in rows.items():
        r["decode_tokens_per_s"] = [round(s, 2) for s in speeds[kv]]
        r["decode_tokens_per_s_median"] = round(float(np.median(speeds[kv])), 2)
        print(f"{kv:<8} {r['kv_bytes_per_token']:>10} {r['kv_bytes_per_sequence'] / 1e6:7.1f} {r['mean_nll']:9.4f} "
              f"{r['perplexity']:7.3f} {r.get('nll_vs_float', 0.0):+9.3%} "
              f"{r.get('top1_agreement_with_float', 1.0):7.1%} {r['decode_tokens_per_s_median']:15.2f}")
        r.pop("_argmax")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"model": str(args.model), "ctx_len": args.ctx_len, "context": args.context,
                                         "steps": args.steps, "rounds": args.rounds, "results": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
