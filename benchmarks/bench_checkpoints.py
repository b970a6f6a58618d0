"""The cost of checkpoints of the recurrent state (issue 20, Measure): bytes per checkpoint and per sequence, and the
time of taking one.

    python benchmarks/bench_checkpoints.py                 # geometries + the synthetic hybrid test graph
    python benchmarks/bench_checkpoints.py --model G.onnx --ctx-len 1024 --prefill-seq-len 32   # a real export

A checkpoint (:mod:`qeff_kv.runtime.memory.recurrent`) is a copy of one sequence's rows of every recurrent buffer
(``conv_state.{i}`` ``[conv_dim, conv_kernel]`` and ``recurrent_state.{i}`` ``[heads, head_dim, d_state]``), so its
bytes are those of the sequence's recurrent state, and a sequence keeps at most ``max_checkpoints`` of them (default
8). Taking one is :meth:`RecurrentMemory.snapshot`, timed here on buffers of each geometry (float32, one sequence,
median of ``--repeat``, the first one, into fresh memory, apart; where the state is larger than ``--max-mib``, on as many layers as fit,
scaled linearly to every layer: a copy's time is linear in its bytes).

Geometries (the recurrent layers only; attention layers keep their KV cache as before):

* ``mamba2-130m``: 24 layers, 24 heads x 64, d_state 128, n_groups 1, expand 2 (hidden 768), conv kernel 4;
* ``mamba2-default``: transformers' ``Mamba2Config()`` (Mamba-Codestral-7B's shape: 64 layers, 128 heads x 64,
  d_state 128, n_groups 8, hidden 4096);
* ``bamba-default`` / ``granitemoehybrid-default``: transformers' ``BambaConfig()`` / ``GraniteMoeHybridConfig()``
  (32 layers, 128 heads x 64, d_state 256, n_groups 1, hidden 4096; all layers recurrent in the default configs);
* ``falcon-h1-default``: transformers' ``FalconH1Config()`` (32 layers, mamba_d_ssm 1024 in 128 heads x 8, d_state
  256).

``--model`` (or, by default, the synthetic hybrid graph of ``tests/helpers/_recurrent_graph.py``) also times a whole
``Session``: prefilling a prompt and decoding with checkpoints every ``--every`` positions against none
(``checkpoint_every=0, max_checkpoints=0``): the chunks cut at checkpoint positions plus the copies.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

from qeff_kv.contract.layout import KVPair, TensorInfo  # noqa: E402
from qeff_kv.runtime.memory.recurrent import DEFAULT_KEEP, CheckpointPolicy, RecurrentMemory  # noqa: E402


def geometry(layers, heads, head_dim, d_state, n_groups, intermediate):
    """conv_state [intermediate + 2 * n_groups * d_state, 4], recurrent_state [heads, head_dim, d_state]."""
    return {"layers": layers, "conv": (intermediate + 2 * n_groups * d_state, 4), "rec": (heads, head_dim, d_state)}


GEOMETRIES = {
    "mamba2-130m": geometry(24, 24, 64, 128, 1, 1536),
    "mamba2-default": geometry(64, 128, 64, 128, 8, 8192),
    "bamba-default": geometry(32, 128, 64, 256, 1, 8192),
    "granitemoehybrid-default": geometry(32, 128, 64, 256, 1, 8192),
    "falcon-h1-default": geometry(32, 128, 8, 256, 1, 1024),
}


def _pairs(g, layers):
    out = []
    for i in range(layers):
        for stem, shape in (("conv_state", g["conv"]), ("recurrent_state", g["rec"])):
            name = f"{stem}.{i}"
            t = TensorInfo(name, "float32", ("batch_size",) + tuple(shape))
            out.append(KVPair(stem, i, None, t, TensorInfo(name + "_RetainedState", "float32", t.shape)))
    return out


class _Seq:
    id, slot, length = 0, 0, 0


def time_snapshot(g, repeat: int, max_mib: float) -> dict:
    per_layer = 4 * (int(np.prod(g["conv"])) + int(np.prod(g["rec"])))
    layers = max(1, min(g["layers"], int(max_mib * 2**20 // (2 * per_layer))))   # the state and one checkpoint
    mem = RecurrentMemory(_pairs(g, layers), max_sequences=1, policy=CheckpointPolicy(every=0, keep=1))
    for a in mem.arrays.values():
        a[...] = np.random.default_rng(0).standard_normal(a.shape, dtype=np.float32)
    seq = _Seq()
    t0 = time.perf_counter()
    mem.snapshot(seq, 1)                 # the first: fresh memory
    first = time.perf_counter() - t0
    times = []
    for r in range(repeat):              # then the oldest checkpoint's arrays are reused (keep=1)
        t0 = time.perf_counter()
        mem.snapshot(seq, 2 + r)
        times.append(time.perf_counter() - t0)
    scale = 1e3 * g["layers"] / layers
    return {"bytes_per_checkpoint": per_layer * g["layers"], "bytes_per_layer": per_layer,
            "bytes_per_sequence_at_max": per_layer * g["layers"] * DEFAULT_KEEP,
            "snapshot_ms": round(statistics.median(times) * scale, 3), "first_snapshot_ms": round(first * scale, 3),
            "timed_layers": layers, "layers": g["layers"]}


def time_session(model, ctx_len, prefill, prompt_len, decode, every, repeat) -> dict:
    from qeff_kv.runtime import Session

    out = {}
    rng = np.random.default_rng(1)
    for label, kw in (("off", dict(checkpoint_every=0, max_checkpoints=0)),
                      ("on", dict(checkpoint_every=every, max_checkpoints=DEFAULT_KEEP))):
        s = Session(model, ctx_len=ctx_len, prefill_seq_len=prefill, max_sequences=1, threads=2, **kw)
        vocab = s.vocab_size or 32
        pre, dec = [], []
        for _ in range(repeat + 1):
            seq = s.add_sequence()
            toks = rng.integers(0, vocab, prompt_len).tolist()
            t0 = time.perf_counter()
            s.prefill(seq, toks)
            t1 = time.perf_counter()
            for t in rng.integers(0, vocab, decode).tolist():
                s.decode({seq: t})
            t2 = time.perf_counter()
            pre.append(t1 - t0)
            dec.append(t2 - t1)
            mem = s.memory()
            s.remove_sequence(seq)
        out[label] = {"prefill_ms": round(statistics.median(pre[1:]) * 1e3, 3),
                      "decode_ms_per_step": round(statistics.median(dec[1:]) * 1e3 / decode, 4),
                      "checkpoints": mem["checkpoints"], "checkpoints_bytes": mem["checkpoints_bytes"],
                      "checkpoint_bytes": mem["checkpoint_bytes"]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a recurrent/hybrid .onnx or export folder (default: the synthetic "
                                                  "hybrid test graph)")
    ap.add_argument("--ctx-len", type=int, default=1024)
    ap.add_argument("--prefill-seq-len", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    ap.add_argument("--decode", type=int, default=256, help="decode steps")
    ap.add_argument("--every", type=int, default=64, help="checkpoint_every of the timed session")
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--max-mib", type=float, default=512.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    results = {"geometries": {k: time_snapshot(g, args.repeat, args.max_mib) for k, g in GEOMETRIES.items()}}
    model = args.model
    if model is None:
        sys.path.insert(0, str(REPO / "tests" / "helpers"))
        import tempfile

        import _recurrent_graph as rg
        model = str(rg.save(Path(tempfile.mkdtemp()) / "hybrid.onnx"))
        results["session_graph"] = "tests/helpers/_recurrent_graph.py (synthetic hybrid, 1 attention + 1 recurrent layer)"
    else:
        results["session_graph"] = model
    results["session"] = time_session(model, args.ctx_len, args.prefill_seq_len, args.prompt, args.decode,
                                      args.every, args.repeat)
    results["settings"] = vars(args)
    if args.json:
        print(json.dumps(results, indent=1))
        return
    print("| geometry | recurrent layers | bytes / checkpoint | bytes / sequence (8 checkpoints) | take one (ms) | "
          "the first (ms) |")
    print("|---|---|---|---|---|---|")
    for k, r in results["geometries"].items():
        scaled = "" if r["timed_layers"] == r["layers"] else f" (timed on {r['timed_layers']} layers, scaled)"
        print(f"| {k} | {r['layers']} | {r['bytes_per_checkpoint'] / 2**20:.2f} MiB | "
              f"{r['bytes_per_sequence_at_max'] / 2**20:.1f} MiB | {r['snapshot_ms']:.3f}{scaled} | "
              f"{r['first_snapshot_ms']:.3f} |")
    s = results["session"]
    print(f"\nsession ({results['session_graph']}): prompt {args.prompt} tokens in chunks of {args.prefill_seq_len}, "
          f"{args.decode} decode steps, checkpoint_every {args.every}")
    print("| checkpoints | prefill (ms) | decode step (ms) | checkpoints held | their bytes |")
    print("|---|---|---|---|---|")
    for label in ("off", "on"):
        r = s[label]
        print(f"| {label} | {r['prefill_ms']} | {r['decode_ms_per_step']} | {r['checkpoints']} | "
              f"{r['checkpoints_bytes']} ({r['checkpoint_bytes']} each) |")


if __name__ == "__main__":
    main()
