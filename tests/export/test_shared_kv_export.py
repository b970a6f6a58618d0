"""Shared-KV layers in the exported graph (Gemma 4's ``num_kv_shared_layers``; the family matrix's
``gemma4_text_shared`` proves the tokens on every target): a shared layer has no buffer of its own, the state spec
records which layer it reads, and on the fused target it reads its source's GroupQueryAttention present without a
GroupQueryAttention node (no second append). gemma4_unified's text model runs the same code: one target."""

from __future__ import annotations

import pytest

from suite import requires_torch
from families import CHUNK, CTX, FAMILIES, NEW, PROMPTS, SW, Family

pytestmark = [requires_torch]

SHARED_SPEC = ((2, 0), (3, 1))


def _kv_inputs(model) -> list[str]:
    return [i.name for i in model.graph.input if i.name.startswith("past_")]


@pytest.mark.parametrize("target", ["portable", "onnxruntime-fused"])
def test_shared_layers_have_no_buffers_and_the_spec_names_their_source(target, family_exports):
    import onnx

    from qeff_kv.contract import naming, statespec

    result = family_exports("gemma4_text_shared", target)
    if isinstance(result, BaseException):
        raise result
    model = onnx.load(result.onnx_path, load_external_data=False)
    assert _kv_inputs(model) == ["past_key.0", "past_value.0", "past_key.1", "past_value.1"]
    meta = {p.key: p.value for p in model.metadata_props}
    spec = statespec.StateSpec.loads(meta[naming.STATE_SPEC_META])
    assert spec.shared == SHARED_SPEC
    gqa = [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]
    assert len(gqa) == (2 if target == "onnxruntime-fused" else 0)   # one per layer that keeps keys/values


def test_gemma4_unified_text_model_with_shared_layers_is_exact(monkeypatch, tmp_path):
    from families import make_family_dir
    from hf_models import PlainLoop, hf_greedy
    from qeff_kv.export import export_model

    monkeypatch.setitem(FAMILIES, "gemma4_unified_text_shared", Family(
        "Gemma4UnifiedTextConfig", "Gemma4UnifiedForCausalLM",
        dict(head_dim=16, global_head_dim=32, num_hidden_layers=4, sliding_window=SW, num_kv_shared_layers=2,
             layer_types=["sliding_attention", "full_attention"] * 2, final_logit_softcapping=30.0)))
    folder = make_family_dir("gemma4_unified_text_shared", tmp_path)
    r = export_model(folder, tmp_path / "o", ctx_len=CTX, prefill_seq_len=CHUNK, target="onnxruntime")
    assert r.manifest["verification"]["status"] == "passed"
    refs = [hf_greedy(folder, p, NEW) for p in PROMPTS]
    assert len({t for ref in refs for t in ref}) > 2
    assert [PlainLoop(r.onnx_path, CTX).greedy(p, NEW, CHUNK) for p in PROMPTS] == refs
