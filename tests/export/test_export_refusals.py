"""Refusals that come from the config alone: before loading weights or tracing, one line, nothing written."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from qeff_kv.errors import ExportError


def _vlm_folder(tmp_path):
    """An Mllama folder (the image reaches the text through cross-attention layers: not exported yet)."""
    d = tmp_path / "mllama"
    d.mkdir()
    cfg = {"architectures": ["MllamaForConditionalGeneration"], "model_type": "mllama", "image_token_index": 99,
           "text_config": {"model_type": "mllama_text_model", "num_hidden_layers": 4, "vocab_size": 128,
                           "cross_attention_layers": [1, 3]},
           "vision_config": {"model_type": "mllama_vision_model", "image_size": 32}}
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "model.safetensors").write_bytes(b"not read: the refusal comes first")
    return d


def test_vision_language_folder_is_refused_before_loading(tmp_path):
    from qeff_kv.export import export_model

    out = tmp_path / "out"
    with pytest.raises(ExportError, match=r"^MllamaForConditionalGeneration attends to the image through "
                                          r"cross-attention layers; qeff-kv does not export it yet$"):
        export_model(_vlm_folder(tmp_path), out, ctx_len=16, prefill_seq_len=4)
    assert not out.exists()


def test_vision_language_refusal_in_the_cli_is_one_line(tmp_path):
    from qeff_kv_cli.main import main

    res = CliRunner().invoke(main, ["export", str(_vlm_folder(tmp_path)), "-o", str(tmp_path / "o"), "-q"])
    assert res.exit_code == 2
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: MllamaForConditionalGeneration attends to the image")
    assert not (tmp_path / "o").exists()


def test_sliding_window_in_text_config_is_read():
    from qeff_kv.export.facts.family import ModelFacts

    facts = ModelFacts.from_config({"architectures": ["X"], "text_config": {
        "num_hidden_layers": 4, "sliding_window": 8, "sliding_window_pattern": 2}})
    assert facts.sliding_window == 8 and facts.sliding_layers == (0, 2)


def test_numpy_integers_are_accepted_as_plain_ints(tmp_path):
    """``export_model(ctx_len=np.int64(32))`` works and writes plain ints (the manifest is JSON)."""
    import numpy as np

    from qeff_kv.export import export_model

    r = export_model(None, tmp_path / "o", ctx_len=np.int64(24), prefill_seq_len=np.int32(4), verify=False)
    assert type(r.manifest["ctx_len"]) is int and r.manifest["ctx_len"] == 24
    assert type(r.manifest["prefill_seq_len"]) is int and r.manifest["prefill_seq_len"] == 4
    with pytest.raises(ExportError, match=r"^ctx_len must be a positive integer, got np.float64\(2.5\)$|"
                                          r"^ctx_len must be a positive integer, got 2.5$"):
        export_model(None, tmp_path / "p", ctx_len=np.float64(2.5), prefill_seq_len=4, verify=False)
