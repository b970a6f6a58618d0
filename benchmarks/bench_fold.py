"""Decode step before and after FoldLayoutPairsPass on an onnxruntime-fused export (issue 21, part 2).

    python benchmarks/bench_fold.py --export PLAIN_DIR [--rounds 5] [--new-tokens 128]

``PLAIN_DIR``: an onnxruntime-fused export made before the pass existed (exporter version 6), e.g. SmolLM2-135M
from the GGUF (README "A real checkpoint"). The script copies it to ``--work`` and applies the pass to the copy's
graph (the same graph a version-7 export writes), then runs both interleaved (before, after, before, ...) with the
same threads on the same prompt: decode tokens/s (plain greedy decoding), medians with min-max, nodes in each
graph, and whether the tokens are identical. Writes ``benchmarks/results/fold.json``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from qeff_kv.graph import graphio
from qeff_kv.graph.passes import FoldLayoutPairsPass  # noqa: E402
from qeff_kv.runtime import Session  # noqa: E402

PROMPT = [1, 9690, 314, 253, 1345, 30, 2]   # a short fixed prompt; greedy decoding runs --new-tokens after it


def folded_copy(src: Path, work: Path) -> tuple[Path, dict]:
    dst = work / f"{src.name}-folded"
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    onnx_name = json.loads((dst / "manifest.json").read_text())["onnx"]
    model = graphio.load(dst / onnx_name)
    before = sum(1 for _ in model.graph)
    p = FoldLayoutPairsPass()
    p(model)
    graphio.save(model, dst / onnx_name, source_dir=dst)
    return dst, {"nodes_before": before, "nodes_after": sum(1 for _ in model.graph), "pairs_removed": p.removed,
                 "pairs_merged": p.merged}


def run(session: Session, new: int) -> tuple[list[int], float]:
    t = session.timings
    s0, n0 = t.decode_s, t.decode_tokens
    gen = session.generate([PROMPT], max_tokens=new, stop_tokens=[])[0]
    session.remove_sequence(gen.sequence)
    return gen.tokens, (t.decode_tokens - n0) / (t.decode_s - s0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--export", required=True, type=Path)
    ap.add_argument("--work", type=Path, default=HERE / "work")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "fold.json")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    after_dir, nodes = folded_copy(args.export, args.work)
    sessions = {"before": Session(args.export, threads=args.threads), "after": Session(after_dir, threads=args.threads)}
    rates: dict[str, list[float]] = {k: [] for k in sessions}
    tokens: dict[str, list[int]] = {}
    for _ in range(args.rounds):
        for name, sess in sessions.items():
            toks, rate = run(sess, args.new_tokens)
            tokens.setdefault(name, toks)
            rates[name].append(rate)
    med = {k: statistics.median(v) for k, v in rates.items()}
    result = {"export": str(args.export), "rounds": args.rounds, "new_tokens": args.new_tokens,
              "threads": args.threads, **nodes, "identical": tokens["before"] == tokens["after"],
              "decode_tokens_per_s": {k: {"median": round(med[k], 2), "min": round(min(v), 2),
                                          "max": round(max(v), 2)} for k, v in rates.items()},
              "step_ms": {k: round(1000 / med[k], 3) for k in med}, "speedup": round(med["after"] / med["before"], 4)}
    print(json.dumps(result, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
