"""The dense/MoE families users bring beyond the first matrix (issue 20): what makes each exact, and what is refused.

Their tokens on every target are proved by the family matrix (tests/helpers/families.py, tests/export/test_families.py: Llama4
text, DeepSeek-V2, MiniCPM3, Apertus, DiffLlama, JetMoe, LongcatFlash, Ministral3). Here:

* every refusal comes from the config alone, in one exact line, before the weights are read (the folders hold a
  file that is not safetensors) and before anything is written;
* Llama4 is exact on the fused target while its chunked attention cannot bind (``ctx_len`` up to the chunk);
* complex RoPE (``torch.polar``) is recognised by measuring the model's own code, per heads axis.
"""

from __future__ import annotations

import pytest

from suite import requires_torch
from families import CHUNK, CTX, FAMILIES, NEW, PROMPTS, Family

pytestmark = [requires_torch]

FUSED = "onnxruntime-fused"

#: (family, config overrides, target) -> the exact one-line refusal
REFUSALS = {
    ("diffllama", (), FUSED):
        "--target onnxruntime-fused cannot express DiffLlamaForCausalLM's differential attention (two attention "
        "maps over the two halves of the values, subtracted; GroupQueryAttention attends over the cached values "
        "once); use --target onnxruntime",
    ("jetmoe", (), FUSED):
        "--target onnxruntime-fused cannot express JetMoeForCausalLM's mixture of attention heads (routed query "
        "experts over key/value heads repeated in tiled order after the cache update); use --target onnxruntime",
    ("llama4_text", (), FUSED):
        "--target onnxruntime-fused cannot express Llama4ForCausalLM's chunked attention (layers attend within "
        "chunks of 6 positions; GroupQueryAttention only has a sliding window); use --target onnxruntime, or "
        "--ctx-len 6 or less",
    ("llama4_text", (("floor_scale", 16),), "portable"):
        "Llama4ForCausalLM scales the queries of its NoPE layers from position 15 on (attn_temperature_tuning, "
        "floor_scale 16), counting positions from the cache length, which a retained-state graph does not have; "
        "export with --ctx-len 15 or less",
    ("deepseek_v2", (), FUSED):
        "--target onnxruntime-fused cannot express DeepseekV2ForCausalLM's multi-head latent attention (keys and "
        "values of different head sizes); use --target onnxruntime",
    ("minicpm3", (), FUSED):
        "--target onnxruntime-fused cannot express MiniCPM3ForCausalLM's multi-head latent attention (keys and "
        "values of different head sizes); use --target onnxruntime",
    ("longcat_flash", (), FUSED):
        "--target onnxruntime-fused cannot express LongcatFlashForCausalLM's multi-head latent attention (keys and "
        "values of different head sizes); use --target onnxruntime",
}


def _config_only(name: str, overrides: dict, root):
    """The family's ``config.json`` (as transformers writes it) beside a weights file that cannot be loaded."""
    import transformers

    fam = FAMILIES[name]
    cfg = getattr(transformers, fam.config_class)(**{**fam.config_kwargs(), **overrides})
    cfg.architectures = [fam.model_class]
    folder = root / f"cfg-{name}"
    cfg.save_pretrained(folder)
    (folder / "model.safetensors").write_bytes(b"not read: the refusal comes first")
    return folder


@pytest.mark.parametrize("name,overrides,target", list(REFUSALS), ids=[f"{n}-{t}" + ("-" + o[0][0] if o else "")
                                                                       for n, o, t in REFUSALS])
def test_refused_from_the_config_before_loading(name, overrides, target, tmp_path):
    from qeff_kv.errors import ExportError
    from qeff_kv.export import export_model

    folder = _config_only(name, dict(overrides), tmp_path)
    out = tmp_path / "out"
    with pytest.raises(ExportError) as err:
        export_model(folder, out, ctx_len=CTX, prefill_seq_len=CHUNK, target=target)
    assert str(err.value) == REFUSALS[(name, overrides, target)]
    assert not out.exists()


def test_refusals_are_one_line_in_the_cli(tmp_path):
    from click.testing import CliRunner

    from qeff_kv_cli.main import main

    folder = _config_only("jetmoe", {}, tmp_path)
    res = CliRunner().invoke(main, ["export", str(folder), "-o", str(tmp_path / "o"), "--ctx-len", str(CTX),
                                    "--target", FUSED, "-q"])
    assert res.exit_code == 2
    assert res.stderr == f"error: {REFUSALS[('jetmoe', (), FUSED)]}\n"
    assert not (tmp_path / "o").exists()


def test_llama4_is_exact_on_the_fused_target_within_one_chunk(monkeypatch, tmp_path):
    """With ``ctx_len`` up to ``attention_chunk_size`` no query crosses a chunk: the fused graph (the model's own
    complex RoPE as cos/sin pairs before GQA, NoPE layers, dense MoE) gives transformers' tokens."""
    from families import make_family_dir
    from hf_models import PlainLoop, hf_greedy
    from qeff_kv.export import export_model

    base = FAMILIES["llama4_text"]
    monkeypatch.setitem(FAMILIES, "llama4_chunk32", Family(base.config_class, base.model_class,
                                                           dict(base.kwargs, attention_chunk_size=CTX)))
    folder = make_family_dir("llama4_chunk32", tmp_path)
    r = export_model(folder, tmp_path / "o", ctx_len=CTX, prefill_seq_len=CHUNK, target=FUSED)
    assert r.manifest["verification"]["status"] == "passed"
    refs = [hf_greedy(folder, p, NEW) for p in PROMPTS]
    assert len({t for ref in refs for t in ref}) > 2
    assert [PlainLoop(r.onnx_path, CTX).greedy(p, NEW, CHUNK) for p in PROMPTS] == refs


def test_complex_rope_is_measured_per_heads_axis():
    """DeepSeek-V2 rotates ``[B, H, S, D]`` and Llama4 ``[B, S, H, D]`` through complex numbers: each is recognised
    with its own heads axis; a rotary module returning (cos, sin) is not complex RoPE."""
    import sys

    import torch
    import transformers

    from qeff_kv.export.modeling import rope

    def rotary_and_apply(name):
        fam = FAMILIES[name]
        cfg = getattr(transformers, fam.config_class)(**fam.config_kwargs())
        model = getattr(transformers, fam.model_class)(cfg)
        module = model.model.rotary_emb
        return module, getattr(sys.modules[type(module).__module__], "apply_rotary_emb", None)

    assert rope.complex_rope_kind(*rotary_and_apply("deepseek_v2")) == 1
    assert rope.complex_rope_kind(*rotary_and_apply("llama4_text")) == 2
    llama_rotary, _ = rotary_and_apply("llama")
    ds_rotary, ds_apply = rotary_and_apply("deepseek_v2")
    assert rope.complex_rope_kind(llama_rotary, ds_apply) is None
    with torch.no_grad():
        pos = torch.arange(5).unsqueeze(0)
        assert torch.allclose(torch.view_as_real(ds_rotary(torch.zeros(1), pos)),
                              rope._real_rotary_forward(ds_rotary)(torch.zeros(1), pos))
