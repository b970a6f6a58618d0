"""Sliding-window layers: ring buffers vs a full-length cache on a Gemma3-style layout (issue 9, item 5).

    python benchmarks/bench_sliding.py                 # ctx 4096 and 32768, 5 rounds, 2 threads
    python benchmarks/bench_sliding.py --rounds 2 --ctx 4096     # a smoke run

The model is a Gemma3 text decoder with random seeded weights, sized like Gemma3-1B's attention (hidden 1152,
4 query heads, 1 KV head, head_dim 256, window 512) with 6 layers in Gemma3's 5:1 pattern (5 sliding, 1
global) and a small vocabulary. For each ``ctx_len`` it is exported twice to the ``onnxruntime`` target:
``--sliding-cache ring`` (sliding layers hold 512 slots) and ``--sliding-cache full`` (every layer holds
``ctx_len`` slots, the window in the mask). Both exports are verified against PyTorch at export.

Reported per (ctx_len, cache): KV bytes per sequence (from the graph's buffers at their capacities) and the
decode step time with the sequence at position ``ctx_len - 1`` (the cache contents do not change the work, so
the step is timed directly at that position in qeff-kv's runtime with its in-place buffers, after one short
prefill). Each configuration runs once per round, interleaved; the figure is the median over rounds of each
round's median step time, with the min-max over rounds. Figures: docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
WINDOW = 512
CONFIG = dict(vocab_size=8192, hidden_size=1152, intermediate_size=6912, num_hidden_layers=6,
              num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
              sliding_window=WINDOW, layer_types=["sliding_attention"] * 5 + ["full_attention"],
              max_position_embeddings=32768, initializer_range=0.02, bos_token_id=1, eos_token_id=2,
              pad_token_id=0, tie_word_embeddings=True,
              rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=10000.0),
                               "full_attention": dict(rope_type="default", rope_theta=1000000.0)})


def build_model(work: Path) -> Path:
    out = work / "gemma3-style"
    if (out / "config.json").exists():
        return out
    import torch
    import transformers

    cfg = transformers.Gemma3TextConfig(**CONFIG)
    cfg.architectures = ["Gemma3ForCausalLM"]
    torch.manual_seed(0)
    transformers.Gemma3ForCausalLM(cfg).eval().save_pretrained(out, safe_serialization=True)
    return out


def at_position(seq, pos: int) -> None:
    """Timing only: put ``seq`` at position ``pos`` without filling the cache (a step's work depends on the
    position, not on the cache contents)."""
    seq.length = pos
    seq.tokens = [0] * pos
    if hasattr(seq, "written"):
        seq.written = pos


def kv_bytes_per_sequence(manifest: dict) -> int:
    return sum(int(b["bytes_per_sequence"]) for b in manifest["buffers"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=HERE / "work", help="model and exports (reused across runs)")
    ap.add_argument("--out", type=Path, default=HERE / "results", help="where sliding.json goes")
    ap.add_argument("--ctx", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=16)
    args = ap.parse_args(argv)

    from qeff_kv.export import export_model
    from qeff_kv.runtime import Session

    model_dir = build_model(args.work)
    configs = {}
    for ctx in args.ctx:
        for cache in ("ring", "full"):
            res = export_model(model_dir, args.work / f"gemma3-style-{ctx}-{cache}", ctx_len=ctx, prefill_seq_len=32,
                               target="onnxruntime", sliding_cache=cache)
            sess = Session(res.out_dir, threads=args.threads)
            configs[(ctx, cache)] = (sess, res.manifest)
            print(f"exported ctx {ctx} {cache}: {kv_bytes_per_sequence(res.manifest) / 2**20:.1f} MiB/sequence, "
                  f"verification {res.manifest['verification']['status']}", flush=True)

    def time_steps(sess, ctx: int) -> float:
        for s in list(sess.sequences):
            sess.remove_sequence(s)
        seq = sess.add_sequence()
        sess.prefill(seq, [5, 6, 7, 8])
        times = []
        for _ in range(args.steps):
            at_position(seq, ctx - 1)
            t0 = time.perf_counter()
            sess.decode({seq: 9})
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    rounds: dict = {k: [] for k in configs}
    for r in range(args.rounds):
        for key, (sess, _) in configs.items():
            rounds[key].append(time_steps(sess, key[0]))
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(
            f"{k[0]}/{k[1]} {v[-1] * 1e3:.2f} ms" for k, v in rounds.items()), flush=True)

    rows = []
    for (ctx, cache), (sess, man) in configs.items():
        t = rounds[(ctx, cache)]
        rows.append({"ctx_len": ctx, "sliding_cache": cache, "window": WINDOW,
                     "kv_bytes_per_sequence": kv_bytes_per_sequence(man),
                     "decode_step_ms": round(statistics.median(t) * 1e3, 3),
                     "decode_step_ms_min": round(min(t) * 1e3, 3), "decode_step_ms_max": round(max(t) * 1e3, 3)})
    for ctx in args.ctx:
        ring = next(r for r in rows if r["ctx_len"] == ctx and r["sliding_cache"] == "ring")
        full = next(r for r in rows if r["ctx_len"] == ctx and r["sliding_cache"] == "full")
        print(f"ctx {ctx}: KV {full['kv_bytes_per_sequence'] / 2**20:.1f} -> {ring['kv_bytes_per_sequence'] / 2**20:.1f}"
              f" MiB/sequence ({full['kv_bytes_per_sequence'] / ring['kv_bytes_per_sequence']:.2f}x less); "
              f"decode step at position {ctx - 1}: full {full['decode_step_ms']:.2f} ms, ring "
              f"{ring['decode_step_ms']:.2f} ms ({full['decode_step_ms'] / ring['decode_step_ms']:.2f}x)")
    args.out.mkdir(parents=True, exist_ok=True)
    out = {"model": {k: v for k, v in CONFIG.items() if k != "rope_parameters"}, "threads": args.threads,
           "rounds": args.rounds, "steps": args.steps, "rows": rows}
    (args.out / "sliding.json").write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out / 'sliding.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
