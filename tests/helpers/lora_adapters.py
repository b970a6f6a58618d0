"""PEFT LoRA adapters for the suite: made on a tiny model with every A and B weight seeded and non-zero (PEFT starts B
at zero, and an adapter whose B is zero proves nothing), and the transformers + PEFT logits that are their reference.

torch, transformers and peft are imported inside the functions: importing this module needs none of them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def make_adapter(model_dir: Path, out_dir: Path, *, r: int, alpha: float, targets, seed: int, rslora: bool = False,
                 dora: bool = False, dtype: str | None = None, rank_pattern: dict | None = None,
                 alpha_pattern: dict | None = None, scale: float = 0.2, **config) -> Path:
    """Save a PEFT LoRA adapter of the model in ``model_dir`` to ``out_dir`` and return ``out_dir``.

    ``targets`` is LoraConfig's ``target_modules`` (a list of names or a regex string); every ``lora_A``/``lora_B``
    weight is set to seeded normal values times ``scale`` (``seed``), so the adapter changes the outputs noticeably;
    ``dtype`` (``"bfloat16"``, ``"float16"``) saves the adapter's tensors in that type; ``config`` holds further
    LoraConfig fields (``bias="all"``, ``modules_to_save=[...]``...)."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lora = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, use_dora=dora,
                      rank_pattern=dict(rank_pattern or {}), alpha_pattern=dict(alpha_pattern or {}),
                      lora_dropout=0.0, task_type="CAUSAL_LM", **config)
    peft_model = get_peft_model(model, lora)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(peft_model.named_parameters()):
            if ".lora_A." in name or ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=gen) * scale)
        if dtype is not None:
            peft_model.to(getattr(torch, dtype))
    peft_model.save_pretrained(out_dir)
    return Path(out_dir)


def peft_model(model_dir: Path, adapter_dir: Path, merged: bool = False):
    """The transformers model of ``model_dir`` (fp32, eager attention) with the adapter of ``adapter_dir`` applied
    by PEFT (``merged``: folded into the base weights by ``merge_and_unload``), in eval mode."""
    import torch
    import transformers
    from peft import PeftModel

    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                             attn_implementation="eager")
    model = PeftModel.from_pretrained(base, adapter_dir).float().eval()
    return model.merge_and_unload().eval() if merged else model


def peft_logits(model_dir: Path, adapter_dir: Path, input_ids, merged: bool = False) -> np.ndarray:
    """transformers + PEFT logits ``[batch, seq, vocab]`` (float32) of ``input_ids`` (``[batch, seq]`` or one list
    of ids) with the adapter of ``adapter_dir`` (``merged``: folded into the base weights first)."""
    import torch

    ids = np.asarray(input_ids, dtype=np.int64)
    ids = ids[None] if ids.ndim == 1 else ids
    model = peft_model(model_dir, adapter_dir, merged=merged)
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(ids), attention_mask=torch.ones(ids.shape, dtype=torch.int64),
                    use_cache=False)
    return out.logits.float().numpy()


def peft_greedy(model_dir: Path, adapter_dir: Path | None, prompts, max_new_tokens: int,
                merged: bool = False) -> list[list[int]]:
    """transformers ``generate`` greedy tokens (``max_new_tokens`` each, no stop token) of every prompt of
    ``prompts``, with the adapter of ``adapter_dir`` applied by PEFT (``merged``: folded into the base weights by
    ``merge_and_unload``; ``None``: the base model alone), fp32, eager attention."""
    import torch
    import transformers

    if adapter_dir is None:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                                  attn_implementation="eager").eval()
    else:
        model = peft_model(model_dir, adapter_dir, merged=merged)
    out = []
    for prompt in prompts:
        ids = torch.tensor([list(prompt)], dtype=torch.int64)
        with torch.no_grad():
            gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 min_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
        out.append(gen[0, ids.shape[1]:].tolist())
    return out


def dequantized_model_dir(model_dir: Path, out_dir: Path, weights: str, block_size: int) -> Path:
    """The model of ``model_dir`` with the weights ``--weights int4|int8 --block-size B`` quantizes replaced by
    their quantized-then-dequantized values (onnxruntime's own kernel: qeff_kv's ``quantize_stream.dequantized``,
    proved equal to MatMulNBits' reading in tests/export/test_export_stream.py), saved to ``out_dir``: a Linear
    weight with at least one block of input features, and the vocabulary tables (symmetric) where their width is a
    whole number of blocks."""
    import torch
    import transformers

    from qeff_kv.export.schemes import WeightScheme, min_k
    from qeff_kv.export.weights.quantize_stream import dequantized

    scheme = WeightScheme(weights, block_size, 1)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tables = {id(m.weight) for m in (model.get_input_embeddings(), model.get_output_embeddings())}
    with torch.no_grad():
        for module in model.modules():
            if not isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
                continue
            w = module.weight
            k = int(w.shape[1])
            if id(w) in tables:
                if k >= min_k(block_size) and k % block_size == 0:
                    w.copy_(torch.from_numpy(dequantized(w.numpy().copy(), scheme, True)))
            elif isinstance(module, torch.nn.Linear) and k >= min_k(block_size):
                w.copy_(torch.from_numpy(dequantized(w.numpy().copy(), scheme)))
    model.save_pretrained(out_dir, safe_serialization=True)
    return Path(out_dir)
