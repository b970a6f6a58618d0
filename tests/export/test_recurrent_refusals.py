"""Recurrent and linear-attention families qeff-kv does not export: refused from ``config.json`` alone (the config
transformers 5.23 writes for the family), before any weight is read, in one line that says why; nothing written.
The families it exports (Qwen3-Next, Qwen3.5's text model, LFM2, Kimi Linear, Bailing-Hybrid, the Mamba2-mixer
families) are not refused."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from qeff_kv.errors import ExportError
from qeff_kv.export.facts.family import ModelFacts
from qeff_kv.export.facts.recurrent_facts import RECURRENT_REFUSALS

transformers = pytest.importorskip("transformers")

_SCAN = "selective scan (transformers' torch path) is a Python loop over every token"
_POOLED_INDEXER = ("its sparse attention picks keys through an indexer whose cache pools keys in blocks of index_kpool "
                   "plus an incomplete tail pool (a retained state of its own, its top-k shared with the next layers), "
                   "which qeff-kv's graphs do not keep")
_PLE = ("its per-layer-embedding blocks keep two more convolution states per layer besides the gated delta net's, "
        "not the peer's conv_state/recurrent_state pair")
#: the config's top-level model_type -> the reason the refusal gives
WHY = {
    "mamba": f"its Mamba (v1) {_SCAN}",
    "falcon_mamba": f"its Mamba (v1) {_SCAN}",
    "jamba": f"its Mamba (v1) layers' {_SCAN}",
    "zamba": f"its Mamba (v1) layers' {_SCAN}",
    "zamba2": ("its hybrid layers run one shared attention block at several depths on the word embeddings "
               "concatenated to the hidden state, a layer layout of its own"),
    "recurrent_gemma": "its RG-LRU scan is a Python loop over every token of a prompt",
    "rwkv": ("its WKV attention is a Python loop over every token and keeps five states per layer, not the peer's "
             "conv_state/recurrent_state pair"),
    "xlstm": ("its mLSTM loops in Python over chunks and over tokens and keeps three states per layer (C, n, m), not "
              "the peer's conv_state/recurrent_state pair"),
    "minimax": ("its lightning attention loops in Python over blocks of a prompt and over every token after a cached "
                "one"),
    "glm5_next": _POOLED_INDEXER,   # its default config's head_dim is 0 (NoPE MLA): the refusal still names the reason
    "glm5_next_text": _POOLED_INDEXER,
    "qwen4_exp": _PLE,
    "qwen4_exp_text": _PLE,
    "inkling_mm_model": ("it convolves keys, values and each block's input with four short-conv states per layer, "
                         "not the peer's one conv_state"),
    "inkling2": ("it convolves keys, values and each block's input with several short-conv states per layer, not "
                 "the peer's one conv_state"),
    "zaya": ("its attention convolves queries and keys and keeps a recurrent value state beside its KV cache, a "
             "layout of its own"),
}
#: vision-language wrappers over recurrent text models: the text model is what qeff-kv exports
VLM_TEXT = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text", "lfm2_vl": "lfm2", "lfm3_vl": "lfm3"}


def _config(model_type: str) -> dict:
    cfg = transformers.AutoConfig.for_model(model_type).to_dict()
    cfg["architectures"] = [f"Tiny{model_type.title().replace('_', '')}ForCausalLM"]
    return cfg


def _folder(tmp_path, model_type: str):
    d = tmp_path / model_type
    d.mkdir()
    (d / "config.json").write_text(json.dumps(_config(model_type)))
    (d / "model.safetensors").write_bytes(b"never read: the refusal comes first")
    return d


@pytest.mark.parametrize("model_type", sorted(WHY))
def test_family_is_refused_from_its_config_before_loading(tmp_path, model_type):
    from qeff_kv.export import export_model

    arch = _config(model_type)["architectures"][0]
    out = tmp_path / "out"
    with pytest.raises(ExportError) as err:
        export_model(_folder(tmp_path, model_type), out, ctx_len=16, prefill_seq_len=4)
    assert str(err.value) == f"{arch}: {WHY[model_type]}; qeff-kv does not export it"
    assert "\n" not in str(err.value)
    assert not out.exists()


def test_every_refused_type_has_a_reason_and_transformers_knows_it():
    """The table names real model types of transformers 5.23 (no typo hides a family from its refusal)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    assert set(RECURRENT_REFUSALS) <= set(CONFIG_MAPPING_NAMES)
    assert {"mamba", "falcon_mamba", "jamba", "zamba", "zamba2", "recurrent_gemma", "rwkv", "xlstm", "minimax",
            "glm5_next"} <= set(RECURRENT_REFUSALS)


@pytest.mark.parametrize("model_type", sorted(VLM_TEXT))
def test_vision_language_wrapper_over_recurrent_layers_names_its_text_model(model_type):
    facts = ModelFacts.from_config(_config(model_type))
    assert facts.recurrent_refusal() == (
        f"{facts.architecture}: a vision-language model over recurrent layers is not exported yet; "
        f"export its text model ({VLM_TEXT[model_type]})")


@pytest.mark.parametrize("model_type", ["qwen3_next", "qwen3_5_text", "lfm2", "olmo_hybrid", "mamba2", "bamba",
                                        "granitemoehybrid", "falcon_h1", "nemotron_h", "kimi_linear",
                                        "bailing_hybrid"])
def test_exported_recurrent_families_are_not_refused(model_type):
    assert ModelFacts.from_config(_config(model_type)).recurrent_refusal() is None


def test_refusal_in_the_cli_is_one_line(tmp_path):
    from qeff_kv_cli.main import main

    res = CliRunner().invoke(main, ["export", str(_folder(tmp_path, "rwkv")), "-o", str(tmp_path / "o"), "-q"])
    assert res.exit_code == 2
    lines = res.output.strip().splitlines()
    assert lines == [f"error: TinyRwkvForCausalLM: {WHY['rwkv']}; qeff-kv does not export it"]
    assert not (tmp_path / "o").exists()
