"""A hybrid (Bamba-shaped) model against a dense one of the same width: KV + state bytes per sequence and decode
step time at ctx 1024 and 4096 (issue 20, recurrent export).

    python benchmarks/bench_hybrid.py                      # ctx 1024 and 4096
    python benchmarks/bench_hybrid.py --ctx 1024 --steps 3 # a smoke run

Two models of the same width (hidden 1024, 8 layers, MLP 2816, vocabulary 2048, random seeded weights, float32):

* **dense**: Llama, attention in every layer (16 heads, 8 KV heads of 64);
* **hybrid**: Bamba, attention (the same heads) in layers 3 and 7 only, the Mamba2 mixer in the other six (32 heads
  of 64, state 128, one group, conv kernel 4): the layers' ``conv_state [2304, 4]`` and ``recurrent_state
  [32, 64, 128]`` do not depend on the context.

Each is exported once on the ``onnxruntime`` target (``ctx_len`` is a symbolic axis, so one graph serves every ctx).
Bytes per sequence are read from the graph (``qeff_kv.tools.buffers``). The decode step is timed at the last position of
a cache of ``ctx`` slots (position ``ctx - 1``: every slot attended), every buffer (KV and state) random and bound
in place through IOBinding as the runtime binds them, median of ``--steps`` steps after one warm-up, 2 threads.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

COMMON = dict(vocab_size=2048, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
              num_key_value_heads=8, max_position_embeddings=4096, initializer_range=0.02, tie_word_embeddings=False)
MODELS = {
    "dense": ("LlamaConfig", "LlamaForCausalLM", dict(head_dim=64)),
    "hybrid": ("BambaConfig", "BambaForCausalLM", dict(attn_layer_indices=[3, 7], mamba_n_heads=32, mamba_d_head=64,
                                                       mamba_d_state=128, mamba_n_groups=1, mamba_d_conv=4,
                                                       mamba_expand=2)),
}


def build(work: Path, name: str) -> Path:
    import torch
    import transformers

    out = work / f"hybrid-bench-{name}"
    if (out / "config.json").is_file():
        return out
    cfg_cls, model_cls, extra = MODELS[name]
    cfg = getattr(transformers, cfg_cls)(**COMMON, **extra)
    cfg.architectures = [model_cls]
    torch.manual_seed(0)
    getattr(transformers, model_cls)(cfg).eval().save_pretrained(out, safe_serialization=True)
    return out


def export(src: Path, work: Path, name: str, ctx: int) -> Path:
    from qeff_kv.export import export_model

    out = work / f"hybrid-bench-export-{name}"
    if (out / "manifest.json").is_file():
        return out / json.loads((out / "manifest.json").read_text())["onnx"]
    return export_model(src, out, ctx_len=ctx, prefill_seq_len=32, target="onnxruntime", verify=False).onnx_path


def sizes(onnx_path: Path, ctx: int) -> dict:
    from qeff_kv.tools.buffers import buffers_report

    rep = buffers_report(onnx_path, ctx_len=ctx).to_json()
    return {"bytes_per_sequence": rep["bytes_per_sequence"], "kv_bytes_per_token": rep["bytes_per_token"],
            "state_bytes_per_sequence": rep.get("recurrent_bytes_per_sequence", 0)}


def step_times(onnx_path: Path, ctx: int, steps: int, threads: int) -> list[float]:
    """Decode steps at position ``ctx - 1`` over random buffers (KV at ``ctx`` slots), bound in place."""
    import numpy as np
    import onnxruntime as ort

    from qeff_kv.graph import graphio

    layout = graphio.layout_of(graphio.load(onnx_path))
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    sess = ort.InferenceSession(str(onnx_path), so, providers=["CPUExecutionProvider"])
    io = sess.io_binding()
    rng = np.random.default_rng(0)
    keep = []
    for p in layout.pairs:
        shape = [1] + [ctx if not isinstance(d, int) else int(d) for d in p.input.shape[1:]]
        v = ort.OrtValue.ortvalue_from_numpy(0.1 * rng.standard_normal(shape, dtype=np.float32))
        keep.append(v)
        io.bind_ortvalue_input(p.input_name, v)
        io.bind_ortvalue_output(p.output_name, v)          # in place, as the runtime binds them
    io.bind_cpu_input("input_ids", np.array([[7]], dtype=np.int64))
    io.bind_cpu_input("position_ids", np.array([[ctx - 1]], dtype=np.int64))
    io.bind_output("logits")
    times = []
    for i in range(steps + 1):
        t0 = time.perf_counter()
        sess.run_with_iobinding(io)
        if i:
            times.append(time.perf_counter() - t0)
    return times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=HERE / "work")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--ctx", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    graphs = {m: export(build(args.work, m), args.work, m, max(args.ctx)) for m in MODELS}
    result = {"models": {m: {"config": {**COMMON, **MODELS[m][2]}, "class": MODELS[m][1]} for m in MODELS},
              "threads": args.threads, "runs": []}
    args.out.mkdir(parents=True, exist_ok=True)
    for ctx in args.ctx:
        for m, g in graphs.items():
            t = step_times(g, ctx, args.steps, args.threads)
            run = {"ctx": ctx, "model": m, **sizes(g, ctx), "median_ms": 1000 * statistics.median(t),
                   "min_ms": 1000 * min(t), "steps": len(t)}
            result["runs"].append(run)
            print(f"ctx {ctx:5d} {m:6s}: {run['bytes_per_sequence'] / 2**20:8.2f} MiB per sequence "
                  f"(state {run['state_bytes_per_sequence'] / 2**20:.2f} MiB), decode step {run['median_ms']:.1f} ms "
                  f"(min {run['min_ms']:.1f}, {run['steps']} steps)", flush=True)
            (args.out / "bench_hybrid.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out / 'bench_hybrid.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
