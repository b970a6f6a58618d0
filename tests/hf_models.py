"""Tiny seeded Hugging Face models of each supported architecture, HF reference generation, and a plain
onnxruntime loop (feed each ``_RetainedState`` output back into its input) to run exported graphs.

torch/transformers are imported inside the functions: importing this module needs neither.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from qeff_kv.layout import KVLayout, TensorInfo, dtype_from_ort

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.15, bos_token_id=1,
              eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)

ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(head_dim=16)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(head_dim=16, sliding_window=4096)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict()),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(sliding_window=None)),
    "granite": ("GraniteConfig", "GraniteForCausalLM",
                dict(embedding_multiplier=2.0, attention_multiplier=0.3, residual_multiplier=0.5,
                     logits_scaling=4.0)),
}


def make_model_dir(arch: str, root: Path, seed: int = 0, **overrides) -> Path:
    """Save a tiny random model of ``arch`` (seeded) with safetensors weights; return its folder.

    ``overrides`` replace entries of the config (e.g. ``vocab_size=256``)."""
    import torch
    import transformers

    cfg_cls, model_cls, extra = ARCHS[arch]
    cfg = getattr(transformers, cfg_cls)(**{**COMMON, **extra, **overrides})
    cfg.architectures = [model_cls]
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(cfg).eval()
    out = root / f"tiny-{arch}"
    model.save_pretrained(out, safe_serialization=True)
    return out


def hf_greedy(model_dir: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens from transformers ``generate`` (eager attention, fp32)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    ids = torch.tensor([prompt], dtype=torch.int64)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


class PlainLoop:
    """The simplest correct runner: numpy KV buffers fed back each step (no IOBinding)."""

    def __init__(self, onnx_path: Path | str, ctx_len: int, batch: int = 1):
        import onnxruntime as ort

        self.sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
        ins = [TensorInfo(i.name, dtype_from_ort(i.type), tuple(i.shape)) for i in self.sess.get_inputs()]
        outs = [TensorInfo(o.name, dtype_from_ort(o.type), tuple(o.shape)) for o in self.sess.get_outputs()]
        self.layout = KVLayout.from_io(ins, outs).require_valid()
        self.out_names = [o.name for o in outs]
        self.kv = {}
        for p in self.layout.pairs:
            shape = [batch if i == 0 else (ctx_len if not isinstance(d, int) else d)
                     for i, d in enumerate(p.input.shape)]
            self.kv[p.input_name] = np.zeros(shape, dtype=np.dtype(p.input.dtype))
        self.has_batch_index = any(t.name == "batch_index" for t in ins)

    def step(self, ids: np.ndarray, pos: np.ndarray, batch_index: np.ndarray | None = None) -> np.ndarray:
        feeds = {"input_ids": ids.astype(np.int64), "position_ids": pos.astype(np.int64), **self.kv}
        if self.has_batch_index:
            feeds["batch_index"] = batch_index.astype(np.int64)
        out = dict(zip(self.out_names, self.sess.run(None, feeds)))
        for p in self.layout.pairs:
            self.kv[p.input_name] = out[p.output_name]
        return out["logits"]

    def prefill(self, prompt: list[int], chunk: int, slot: int | None = None) -> np.ndarray:
        """Right-padded chunks with position -1 for padding; returns the last chunk's logits."""
        pos = 0
        logits = None
        while pos < len(prompt):
            part = prompt[pos:pos + chunk]
            n = len(part)
            ids = np.array([part + [0] * (chunk - n)])
            pids = np.array([list(range(pos, pos + n)) + [-1] * (chunk - n)])
            bi = None if slot is None else np.array([[slot]])
            logits = self.step(ids, pids, bi)
            pos += n
        return logits

    def greedy(self, prompt: list[int], max_new_tokens: int, chunk: int) -> list[int]:
        logits = self.prefill(prompt, chunk, slot=0 if self.has_batch_index else None)
        assert np.isfinite(logits).all()
        toks = [int(logits[0, -1].argmax())]
        pos = len(prompt)
        while len(toks) < max_new_tokens:
            bi = np.array([[0]]) if self.has_batch_index else None
            logits = self.step(np.array([[toks[-1]]]), np.array([[pos]]), bi)
            toks.append(int(logits[0, -1].argmax()))
            pos += 1
        return toks
