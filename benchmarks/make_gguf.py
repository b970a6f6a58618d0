"""A GGUF file of a Llama checkpoint folder (``make_checkpoint.py``'s), written as llama.cpp's converter lays it out:
its tensor names, its row permutation of the q/k projections, its metadata keys, Q4_0 or Q8_0 matrices (the
``gguf`` package's own quantizers: the library llama.cpp's converter writes with) and F32 norms.

    python benchmarks/make_gguf.py /work/ckpt/llama-8b /work/ckpt/llama-8b-q4_0.gguf --type Q4_0

The export-at-scale benchmark (bench_export_scale.py ``--gguf``) exports it. llama.cpp's ``convert_hf_to_gguf.py``
itself lives in llama.cpp's repository (bench extra, ~15 min to build the rest); the facts it applies are restated
here: ``token_embd``/``blk.{i}.attn_q``.../``output_norm``/``output`` names, q rows permuted per head as
``reshape(n_head, 2, head_dim / 2, K).swapaxes(1, 2)`` (k with the KV head count), a tied head written once (no
``output``), the tokenizer as ``tokenizer.ggml.*`` (here the bundled byte-level BPE of the checkpoint folder).
Tensors are read, quantized and written one at a time (the ``gguf`` writer's temporary-file mode keeps them on
disk until the header is written): the peak is one tensor in float32 and its quantized copy.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def gguf_name(key: str) -> str:
    if key == "model.embed_tokens.weight":
        return "token_embd.weight"
    if key == "model.norm.weight":
        return "output_norm.weight"
    if key == "lm_head.weight":
        return "output.weight"
    parts = key.split(".")   # model.layers.{i}.{module...}.weight
    return f"blk.{parts[2]}.{NAMES['.'.join(parts[3:-1])]}.weight"


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(folder: Path, out: Path, qtype: str) -> dict:
    import gguf

    from qeff_kv.export.weights.checkpoint_store import CheckpointStore

    import torch

    cfg = json.loads((folder / "config.json").read_text())
    tok = json.loads((folder / "tokenizer.json").read_text())
    store = CheckpointStore(folder)
    kind = getattr(gguf.GGMLQuantizationType, qtype)
    tmp = out.with_name(out.name + ".partial")
    w = gguf.GGUFWriter(str(tmp), "llama", use_temp_file=True)
    w.add_name(folder.name)
    w.add_vocab_size(cfg["vocab_size"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_rope_dimension_count(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_file_type({"Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[qtype])
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([gguf.TokenType.NORMAL] * len(vocab))
    w.add_token_scores([0.0] * len(vocab))
    w.add_token_merges(list(tok["model"].get("merges") or []))
    t0, n = time.time(), 0
    for key in sorted(store.keys()):
        arr = store.array(key, torch.float32)
        name = gguf_name(key)
        if name.endswith("attn_q.weight"):
            arr = permute(arr, cfg["num_attention_heads"])
        elif name.endswith("attn_k.weight"):
            arr = permute(arr, cfg["num_key_value_heads"])
        if arr.ndim == 2:
            w.add_tensor(name, gguf.quants.quantize(arr, kind), raw_dtype=kind)
        else:
            w.add_tensor(name, arr.astype(np.float32))
        n += arr.size
        del arr
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    tmp.replace(out)
    return {"gguf": str(out), "type": qtype, "parameters": n, "bytes": out.stat().st_size,
            "seconds": round(time.time() - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--type", default="Q4_0", choices=["Q4_0", "Q8_0"])
    args = ap.parse_args()
    print(json.dumps(write_gguf(args.folder, args.out, args.type)))


if __name__ == "__main__":
    main()
