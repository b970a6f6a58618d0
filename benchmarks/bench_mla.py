"""MLA's compressed cache (issue 20, part 3): KV bytes per sequence and decode step time, latent vs full.

    python benchmarks/bench_mla.py                       # DeepSeek-V3 attention geometry, ctx 4096 and 32768
    python benchmarks/bench_mla.py --ctx 4096 --steps 3  # a smoke run

The model is DeepSeek-V3's attention exactly (128 heads, q_lora_rank 1536, kv_lora_rank 512, qk_rope_head_dim 64,
qk_nope_head_dim 128, v_head_dim 128, hidden 7168) with random seeded weights, scaled down where the cache does not
care: **one layer** (of 61), a dense MLP of intermediate 2048 (not 18432, no experts) and a vocabulary of 2048
(not 129280): about 1 GB of float32 weights. Bytes per token scale with the layer count exactly (every layer keeps
the same pair), so the figures per layer and for 61 layers are both given.

Two exports of the same checkpoint on the ``onnxruntime`` target (attention over the valid length):

* ``--mla-cache full`` (the default): the model's own attention; the graph retains the latent under
  ``past_key.{i}`` ``[.., 512]`` / ``past_value.{i}`` ``[.., 64]`` and expands every attended slot through
  ``kv_b_proj`` into 128 heads of keys (192) and values (128) at every step;
* ``--mla-cache latent``: ``compressed_kv.{i}`` / ``k_pe.{i}``, attention absorbed (never expanded).

Bytes per token are read from the graphs (``qeff_kv.tools.buffers``), with the expanded per-head cache that a
conventional KV export keeps (``heads * (qk_nope + qk_rope + v_head)`` values per layer, the peer's default for
this model: contract section 11) beside them. The decode step is timed at the last position of a cache of
``ctx`` slots (position ``ctx - 1``: every slot attended), with the buffers bound in place through onnxruntime's
IOBinding as the runtime binds them, median of ``--steps`` steps after one warm-up, 2 threads.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

V3 = dict(hidden_size=7168, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512,
          qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)
SCALED = dict(num_hidden_layers=1, first_k_dense_replace=1, intermediate_size=2048, vocab_size=2048,
              max_position_embeddings=32768, initializer_range=0.02, n_routed_experts=8, num_experts_per_tok=2,
              n_group=1, topk_group=1, moe_intermediate_size=256, tie_word_embeddings=False)
V3_LAYERS = 61


def build(work: Path) -> Path:
    import torch
    import transformers

    out = work / "mla-v3-geometry"
    if (out / "config.json").is_file():
        return out
    cfg = transformers.DeepseekV3Config(**V3, **SCALED)
    cfg.architectures = ["DeepseekV3ForCausalLM"]
    torch.manual_seed(0)
    transformers.DeepseekV3ForCausalLM(cfg).eval().save_pretrained(out, safe_serialization=True)
    return out


def export(src: Path, work: Path, mode: str, ctx: int) -> Path:
    from qeff_kv.export import export_model

    out = work / f"export-{mode}"
    if (out / "manifest.json").is_file():
        return out / json.loads((out / "manifest.json").read_text())["onnx"]
    return export_model(src, out, ctx_len=ctx, prefill_seq_len=32, target="onnxruntime", mla_cache=mode,
                        verify=False).onnx_path


def bytes_per_token(onnx_path: Path) -> dict:
    from qeff_kv.graph import graphio
    from qeff_kv.tools.buffers import bytes_per_token as per_token

    layout = graphio.layout_of(graphio.load(onnx_path))
    return {"graph": per_token(layout), "stems": layout.stems}


def step_times(onnx_path: Path, ctx: int, steps: int, threads: int) -> list[float]:
    """Decode steps at position ``ctx - 1`` over random buffers of ``ctx`` slots, bound in place."""
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
        shape = [1, 1, ctx, int(p.input.shape[3])]
        v = ort.OrtValue.ortvalue_from_numpy(rng.standard_normal(shape, dtype=np.float32))
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


def one_run(onnx_path: Path, ctx: int, steps: int, threads: int) -> dict:
    """:func:`step_times` in a child process (its own peak RSS; an out-of-memory kill is a result, not a crash)."""
    code = ("import json, resource, statistics, sys; sys.path.insert(0, %r); import bench_mla as b; "
            "t = b.step_times(%r, %d, %d, %d); "
            "print(json.dumps({'median_ms': 1000 * statistics.median(t), 'min_ms': 1000 * min(t), "
            "'max_ms': 1000 * max(t), 'steps': len(t), "
            "'peak_rss_gb': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}))"
            % (str(HERE), str(onnx_path), ctx, steps, threads))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if proc.returncode != 0:
        why = "killed (out of memory)" if proc.returncode == -9 else proc.stderr.strip().splitlines()[-1:]
        return {"error": f"exit {proc.returncode}: {why}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=HERE / "work")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--ctx", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--full-long-steps", type=int, default=1,
                    help="timed steps of the full cache above ctx 4096 (each takes minutes)")
    args = ap.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    src = build(args.work)
    graphs = {m: export(src, args.work, m, max(args.ctx)) for m in ("latent", "full")}
    heads, nope, rope, v, rank = (V3["num_attention_heads"], V3["qk_nope_head_dim"], V3["qk_rope_head_dim"],
                                  V3["v_head_dim"], V3["kv_lora_rank"])
    expanded = heads * (nope + rope + v) * 4
    result = {"model": "DeepSeek-V3 attention geometry, 1 layer, random weights, float32", "threads": args.threads,
              "bytes_per_token_per_layer": {m: bytes_per_token(g) for m, g in graphs.items()},
              "expanded_bytes_per_token_per_layer": expanded, "latent_values": rank + rope,
              "expanded_values": heads * (nope + rope + v), "runs": []}
    latent_bytes = result["bytes_per_token_per_layer"]["latent"]["graph"]
    result["ratio_expanded_to_latent"] = expanded / latent_bytes
    print(f"bytes/token/layer: latent {latent_bytes}, full (graph) "
          f"{result['bytes_per_token_per_layer']['full']['graph']}, expanded per-head cache {expanded} "
          f"({expanded / latent_bytes:.1f}x)")
    args.out.mkdir(parents=True, exist_ok=True)
    for ctx in args.ctx:
        for mode in ("latent", "full"):
            steps = args.steps if mode == "latent" or ctx <= 4096 else args.full_long_steps
            run = {"ctx": ctx, "mode": mode, "kv_bytes_per_sequence_1_layer": latent_bytes * ctx,
                   "kv_bytes_per_sequence_61_layers": latent_bytes * ctx * V3_LAYERS,
                   "expanded_bytes_per_sequence_61_layers": expanded * ctx * V3_LAYERS,
                   **one_run(graphs[mode], ctx, steps, args.threads)}
            result["runs"].append(run)
            if "median_ms" in run:
                print(f"ctx {ctx:6d} {mode:6s}: decode step {run['median_ms']:9.1f} ms (min {run['min_ms']:.1f}, "
                      f"max {run['max_ms']:.1f}, {run['steps']} steps), peak RSS {run['peak_rss_gb']:.1f} GB",
                      flush=True)
            else:
                print(f"ctx {ctx:6d} {mode:6s}: {run['error']}", flush=True)
            (args.out / "bench_mla.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "bench_mla.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out / 'bench_mla.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
