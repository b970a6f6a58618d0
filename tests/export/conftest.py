"""Fixtures of the export tests alone (tests/conftest.py holds the ones other folders share too)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def family_refs(family_models):
    """transformers' greedy tokens for the matrix prompts."""
    from families import FAMILIES, NEW, PROMPTS
    from hf_models import hf_greedy, hf_greedy_whole

    cache: dict = {}

    def get(name: str) -> list[list[int]]:
        if name not in cache:
            greedy = hf_greedy_whole if FAMILIES[name].recurrent else hf_greedy
            cache[name] = [greedy(family_models(name), p, NEW) for p in PROMPTS]
        return cache[name]

    return get


@pytest.fixture(scope="session")
def mla_latent_dir(tmp_path_factory):
    """A tiny seeded DeepSeek-V3 (the ``deepseek_v3`` family with q_lora_rank 24; tests/export/test_mla.py)."""
    import torch
    import transformers

    from families import FAMILIES

    fam = FAMILIES["deepseek_v3"]
    cfg = transformers.DeepseekV3Config(**{**fam.config_kwargs(), "q_lora_rank": 24})
    cfg.architectures = [fam.model_class]
    torch.manual_seed(3)
    out = tmp_path_factory.mktemp("mla") / "tiny-deepseek-v3"
    transformers.DeepseekV3ForCausalLM(cfg).eval().save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="session")
def mla_latent_exports(mla_latent_dir, tmp_path_factory):
    """``--mla-cache latent`` exports of :func:`mla_latent_dir` (prefix ``VLLM``, ctx_len CTX, chunks of CHUNK):
    ``portable``, and ``cb`` (onnxruntime target, continuous batching, full_batch_size 2)."""
    from families import CHUNK, CTX
    from qeff_kv.export import export_model

    root = tmp_path_factory.mktemp("mla_exports")
    return {
        "portable": export_model(mla_latent_dir, root / "portable", ctx_len=CTX, prefill_seq_len=CHUNK,
                                 target="portable", mla_cache="latent", kv_cache_prefix="VLLM"),
        "cb": export_model(mla_latent_dir, root / "cb", ctx_len=CTX, prefill_seq_len=CHUNK, target="onnxruntime",
                           mla_cache="latent", kv_cache_prefix="VLLM", continuous_batching=True,
                           full_batch_size=2),
    }
