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
