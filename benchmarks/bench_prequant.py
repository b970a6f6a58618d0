"""Pre-quantized int4 checkpoints at a real model's shape: export time, peak memory, graph bytes, and greedy tokens
of the MatMulNBits graph against transformers on the dequantized weights.

    python benchmarks/bench_prequant.py --work /tmp/bench-prequant [--formats gptq-actorder,awq,ct]

For each format, a seeded random-weight Llama of the shape is quantized and packed as the format stores it
(tests/helpers/prequant_checkpoints.py: min-max int4, groups of 64 (32 for act-order; 576 features are 9 groups of 64), the Linears only; the vocabulary
table float16), beside its float reference (the exact dequantization). ``qeff-kv export CKPT --target
onnxruntime-fused`` runs in a child process (wall time, its peak RSS from ``getrusage``); then greedy tokens of
the export (``qeff_kv.runtime.Session``) on seeded random prompts against ``transformers.generate`` on the
reference. Writes ``benchmarks/results/prequant.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "helpers"))

SHAPES = {
    "smollm2-135m": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         head_dim=64, intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True,
                         rope_theta=100000.0, max_position_embeddings=8192, rms_norm_eps=1e-5, initializer_range=0.02),
}
FORMATS = {
    "gptq-actorder": ("gptq", dict(group=32, sym=False, v1=False, act_order=True)),
    "gptq": ("gptq", dict(group=64, sym=True, v1=True)),
    "awq": ("awq", dict(group=64)),
    "ct": ("compressed-tensors", dict(group=64, sym=False)),
}


def run_export(ckpt: Path, out: Path, threads: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(threads)}
    cmd = [sys.executable, "-m", "qeff_kv_cli.main", "export", str(ckpt), "-o", str(out), "--target",
           "onnxruntime-fused", "--ctx-len", "256", "--prefill-seq-len", "32"]
    # a fresh parent per export, so that its children's peak RSS is this export's alone
    probe = ("import resource, subprocess, sys, json; p = subprocess.run(sys.argv[1:], capture_output=True, "
             "text=True); print(json.dumps([p.returncode, p.stdout, p.stderr, "
             "resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss]))")
    t0 = time.perf_counter()
    rc, stdout, stderr, peak_kb = json.loads(subprocess.run([sys.executable, "-c", probe, *cmd], env=env,
                                                            capture_output=True, text=True, check=True).stdout)
    wall = time.perf_counter() - t0
    if rc:
        raise SystemExit(stderr)
    proc = argparse.Namespace(stdout=stdout, stderr=stderr)
    return {"wall_s": round(wall, 1), "peak_rss_gb": round(peak_kb * 1024 / 1e9, 2),
            "log": [ln for ln in proc.stdout.splitlines() + proc.stderr.splitlines() if "]" in ln][:20]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--formats", default="gptq-actorder,awq,ct")
    ap.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=16)
    args = ap.parse_args()
    from hf_models import hf_greedy
    from prequant_checkpoints import make_checkpoint

    from qeff_kv.runtime import Session

    rows = []
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 49000, 12).tolist() for _ in range(3)]
    for key in args.formats.split(","):
        kind, kw = FORMATS[key]
        root = args.work / key
        t0 = time.perf_counter()
        ck = make_checkpoint(kind, root, seed=0, **kw, **{k: v for k, v in SHAPES[args.shape].items()})
        built = time.perf_counter() - t0
        ck_bytes = sum(f.stat().st_size for f in ck.folder.glob("*.safetensors"))
        ex = run_export(ck.folder, root / "export", args.threads)
        manifest = json.loads((root / "export" / "manifest.json").read_text())
        onnx_path = root / "export" / manifest["onnx"]
        same = []
        for p in prompts:
            got = Session(onnx_path).generate(p, max_tokens=args.new_tokens)[0].tokens
            same.append(got == hf_greedy(ck.reference, p, args.new_tokens))
        w = manifest["weights"]
        rows.append({"format": key, "shape": args.shape, "checkpoint_bytes": ck_bytes, "build_s": round(built, 1),
                     **{k: v for k, v in ex.items() if k != "log"}, "graph_bytes": w["graph_bytes"],
                     "float_graph_bytes": w["float_graph_bytes"], "prequantized": w["prequantized"],
                     "check": w["check"], "greedy_equal_to_transformers": same})
        print(json.dumps(rows[-1], indent=1, default=str), flush=True)
    out = HERE / "results" / "prequant.json"
    old = [r for r in (json.loads(out.read_text()) if out.is_file() else []) if r["format"] not in
           {r["format"] for r in rows}]
    out.write_text(json.dumps(old + rows, indent=1, default=str))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
