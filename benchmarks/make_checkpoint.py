"""Seeded random-weight Llama checkpoints with the shapes of real releases, written shard by shard in bf16.

    python benchmarks/make_checkpoint.py llama-8b /tmp/ckpt/llama-8b              # one checkpoint folder
    python benchmarks/make_checkpoint.py smollm2-360m /tmp/ckpt/smollm2-360m --check  # ... then load it in transformers
    python benchmarks/make_checkpoint.py llama-70b /tmp/ckpt/llama-70b --sparse     # shards as holes (all-zero weights)

The scaling benchmark of export (bench_export_scale.py, issue 39) reads these folders. Each is what a downloaded
release looks like: ``model-0000i-of-0000n.safetensors`` shards in bfloat16 with ``model.safetensors.index.json``,
``config.json``, ``generation_config.json`` and a tokenizer (the bundled default model's files, from
``qeff_kv.export.sources.bundled_model_dir``). The model is never in memory: the shard layout is computed from the
shapes, each shard's safetensors header is written first (the format's published layout: little-endian u64 header
length, JSON header, raw little-endian data), then each tensor is generated and written in row chunks of at most
:data:`CHUNK_ELEMENTS` values, so the peak is one chunk whatever the size.

Weights: tensor ``name`` is drawn from a generator seeded with ``seed`` and the CRC32 of ``name`` (so a tensor's
values do not depend on the shard size), normal with std ``1/sqrt(fan_in)`` for projections and the output head
(``sqrt(3)/sqrt(hidden)`` for q and k: see :data:`QK_GAIN`) and ``1/sqrt(hidden)`` for the embedding, RMSNorm
weights 1. With that scale the greedy tokens vary (``--check`` prints them).
The bundled tokenizer knows 256 ids; the config keeps the real vocabulary size (the extra rows are padding, as real
checkpoints pad their vocabulary), so a random model may emit ids the tokenizer cannot print.

``--sparse`` writes every shard as a hole of the right size (all-zero weights, no disk used until read): for the
70B shape, whose 141 GB of bf16 do not fit this machine's disk, to measure export memory with ``--no-verify``.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
import zlib
from pathlib import Path

#: q and k projections' std is ``QK_GAIN/sqrt(hidden)``: at 1 attention is near uniform and one greedy token
#: repeats; at 2 the model is so sensitive that fp16 rounding alone (transformers in float16 against float32, no
#: export) moves the 360M shape's logits by 3.5% of their maximum, past the export verification's float16
#: tolerance (3%); at sqrt(3) it is 1.8% and the greedy tokens still vary.
QK_GAIN = math.sqrt(3.0)
#: Values generated at once (a chunk of rows): 32M float32 values is 128 MB, plus its bf16 copy.
CHUNK_ELEMENTS = 32 * 1024 * 1024

_LLAMA3_ROPE = dict(rope_type="llama3", low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192)

#: The published shapes (config.json of each release, vocabulary and RoPE included).
SHAPES = {
    "smollm2-360m": dict(hidden_size=960, num_hidden_layers=32, num_attention_heads=15, num_key_value_heads=5,
                         head_dim=64, intermediate_size=2560, vocab_size=49152, tie_word_embeddings=True,
                         rope_theta=100000.0, max_position_embeddings=8192, rms_norm_eps=1e-5),
    "llama-1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=64, intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True,
                     rope_theta=500000.0, max_position_embeddings=131072, rms_norm_eps=1e-5,
                     rope_scaling=dict(_LLAMA3_ROPE, factor=32.0)),
    "llama-3b": dict(hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
                     head_dim=128, intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True,
                     rope_theta=500000.0, max_position_embeddings=131072, rms_norm_eps=1e-5,
                     rope_scaling=dict(_LLAMA3_ROPE, factor=32.0)),
    "llama-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False,
                     rope_theta=500000.0, max_position_embeddings=131072, rms_norm_eps=1e-5,
                     rope_scaling=dict(_LLAMA3_ROPE, factor=8.0)),
    "llama-70b": dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                      head_dim=128, intermediate_size=28672, vocab_size=128256, tie_word_embeddings=False,
                      rope_theta=500000.0, max_position_embeddings=131072, rms_norm_eps=1e-5,
                      rope_scaling=dict(_LLAMA3_ROPE, factor=8.0)),
}
#: Which release each shape copies (for the benchmark's table).
RELEASES = {"smollm2-360m": "SmolLM2-360M", "llama-1b": "Llama-3.2-1B", "llama-3b": "Llama-3.2-3B",
            "llama-8b": "Llama-3.1-8B", "llama-70b": "Llama-3.1-70B"}
#: The bundled tokenizer's special ids.
BOS, EOS = 1, 2


def tensor_specs(shape: dict) -> list[tuple[str, tuple[int, ...], float]]:
    """``(name, shape, std)`` of every tensor of a Llama checkpoint, in the order transformers writes them;
    std 0 means RMSNorm weights (ones)."""
    h, inter, hd = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"]
    q, kv = shape["num_attention_heads"] * hd, shape["num_key_value_heads"] * hd
    specs = [("model.embed_tokens.weight", (shape["vocab_size"], h), 1 / math.sqrt(h))]
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}."
        specs += [(p + "input_layernorm.weight", (h,), 0.0),
                  (p + "self_attn.q_proj.weight", (q, h), QK_GAIN / math.sqrt(h)),
                  (p + "self_attn.k_proj.weight", (kv, h), QK_GAIN / math.sqrt(h)),
                  (p + "self_attn.v_proj.weight", (kv, h), 1 / math.sqrt(h)),
                  (p + "self_attn.o_proj.weight", (h, q), 1 / math.sqrt(q)),
                  (p + "post_attention_layernorm.weight", (h,), 0.0),
                  (p + "mlp.gate_proj.weight", (inter, h), 1 / math.sqrt(h)),
                  (p + "mlp.up_proj.weight", (inter, h), 1 / math.sqrt(h)),
                  (p + "mlp.down_proj.weight", (h, inter), 1 / math.sqrt(inter))]
    specs.append(("model.norm.weight", (h,), 0.0))
    if not shape["tie_word_embeddings"]:
        specs.append(("lm_head.weight", (shape["vocab_size"], h), 1 / math.sqrt(h)))
    return specs


def plan_shards(specs, max_shard_bytes: int) -> list[list[tuple[str, tuple[int, ...], float]]]:
    """Split the tensors, in order, into shards of at most ``max_shard_bytes`` of bf16 data (a larger tensor alone)."""
    shards, current, size = [], [], 0
    for spec in specs:
        nbytes = 2 * math.prod(spec[1])
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(spec)
        size += nbytes
    if current:
        shards.append(current)
    return shards


def _header(specs) -> bytes:
    """A safetensors header for ``specs`` in bf16, padded with spaces to a multiple of 8 bytes."""
    meta, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shp, _ in specs:
        n = 2 * math.prod(shp)
        meta[name] = {"dtype": "BF16", "shape": list(shp), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(meta, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


def _write_tensor(f, torch, name: str, shp: tuple[int, ...], std: float, seed: int) -> None:
    """Generate tensor ``name`` in row chunks and append its bf16 bytes to ``f``."""
    if std == 0.0:
        f.write(torch.ones(shp, dtype=torch.bfloat16).view(torch.int16).numpy().tobytes())
        return
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    rows, cols = shp
    step = max(1, CHUNK_ELEMENTS // cols)
    for r in range(0, rows, step):
        n = min(step, rows - r)
        chunk = torch.randn((n, cols), generator=gen).mul_(std).to(torch.bfloat16)
        f.write(chunk.view(torch.int16).numpy().data)
        del chunk


def config_dict(shape: dict) -> dict:
    """config.json of the checkpoint (as a release writes it, dtype bfloat16)."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0, "initializer_range": 0.02,
            "bos_token_id": BOS, "eos_token_id": EOS, "pretraining_tp": 1, "use_cache": True,
            "torch_dtype": "bfloat16", **shape}


def write_checkpoint(name: str, out: Path, seed: int = 0, shard_gb: float = 2.0, sparse: bool = False,
                     say=print) -> dict:
    """Write checkpoint ``name`` (a key of :data:`SHAPES`) to ``out`` (through ``out.partial``, renamed at the
    end); returns ``{"bytes", "shards", "seconds", "params"}``."""
    import torch

    from qeff_kv.export.sources import TOKENIZER_FILES, bundled_model_dir

    shape = SHAPES[name]
    specs = tensor_specs(shape)
    shards = plan_shards(specs, int(shard_gb * 1e9))
    tmp = out.with_name(out.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    t0, weight_map, total = time.perf_counter(), {}, 0
    for k, shard in enumerate(shards, 1):
        fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        header = _header(shard)
        nbytes = sum(2 * math.prod(s[1]) for s in shard)
        with open(tmp / fname, "wb") as f:
            f.write(header)
            if sparse:
                f.truncate(len(header) + nbytes)
            else:
                for tname, shp, std in shard:
                    _write_tensor(f, torch, tname, shp, std, seed)
        for tname, _, _ in shard:
            weight_map[tname] = fname
        total += nbytes
        say(f"  {fname}: {len(shard)} tensors, {nbytes / 1e9:.2f} GB, {time.perf_counter() - t0:.0f} s so far")
    (tmp / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (tmp / "config.json").write_text(json.dumps(config_dict(shape), indent=2))
    (tmp / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": BOS, "eos_token_id": EOS, "do_sample": False}, indent=2))
    bundled = bundled_model_dir()
    for fname in TOKENIZER_FILES:
        if (bundled / fname).is_file() and fname != "generation_config.json":
            shutil.copyfile(bundled / fname, tmp / fname)
    if out.exists():
        shutil.rmtree(out)
    tmp.replace(out)
    params = sum(math.prod(s[1]) for s in specs)
    return {"bytes": total, "shards": len(shards), "seconds": round(time.perf_counter() - t0, 1), "params": params,
            "sparse": sparse, "seed": seed}


def check(out: Path, steps: int = 8) -> list[int]:
    """Load ``out`` with transformers (float32), run a forward and ``steps`` greedy tokens; returns them."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.tensor([[BOS, 72, 101, 108, 108, 111, 32, 119]])
    with torch.no_grad():
        logits = model(ids).logits
        assert torch.isfinite(logits).all(), "non-finite logits"
        gen = model.generate(ids, max_new_tokens=steps, do_sample=False, eos_token_id=None, pad_token_id=0)
    return gen[0, ids.shape[1]:].tolist()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("out", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shard-gb", type=float, default=2.0, help="largest shard, GB of bf16 data (default 2)")
    ap.add_argument("--sparse", action="store_true", help="shards as holes: all-zero weights, no disk used")
    ap.add_argument("--check", action="store_true", help="then load it in transformers and print greedy tokens")
    args = ap.parse_args(argv)
    info = write_checkpoint(args.shape, args.out, seed=args.seed, shard_gb=args.shard_gb, sparse=args.sparse)
    print(json.dumps({"shape": args.shape, "release": RELEASES[args.shape], "path": str(args.out), **info}))
    if args.check:
        print("greedy tokens:", check(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
