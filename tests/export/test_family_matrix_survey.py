"""benchmarks/family_matrix.py and its generic shrinker (benchmarks/tiny_configs.py) cannot rot silently: the shrinker
keeps every layer kind and rewrites every per-layer field, builds real tiny models of a handful of config classes,
and the compare mode and the generated page read the results file. No export here (the script's own run is the
survey; docs/family-matrix.md is its output)."""

import importlib.util
import json

import pytest

from suite import REPO, requires_torch


def _load(name):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


tiny = _load("tiny_configs")
matrix = _load("family_matrix")


def test_shrinker_keeps_the_first_layer_of_every_kind_and_rewrites_each_per_layer_field():
    d = dict(num_hidden_layers=12, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
             vocab_size=150000, intermediate_size=11008, moe_intermediate_size=1408, num_experts=64,
             num_experts_per_tok=8, sliding_window=4096, first_k_dense_replace=3, num_kv_shared_layers=4,
             layer_types=["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"] * 5
             + ["full_attention"], mlp_only_layers=[1, 7], per_layer_config={5: {"a": 1}, 11: {"a": 2}},
             eos_token_id=[150001, 150002], bos_token_id=149999, initializer_range=0.02)
    out = tiny.shrink_dict(d)
    # a kind is (type, MLP-only, per-layer config, dense, shared): the first of each is layer 0 1 3 5 7 8 11
    assert out["layer_types"] == ["sliding_attention"] * 3 + ["full_attention"] + ["sliding_attention"] * 2 \
        + ["full_attention"]
    assert out["num_hidden_layers"] == 7
    assert out["mlp_only_layers"] == [1, 4]
    assert out["per_layer_config"] == {3: {"a": 1}, 6: {"a": 2}}
    assert out["first_k_dense_replace"] == 2 and out["num_kv_shared_layers"] == 2
    assert (out["hidden_size"], out["num_attention_heads"], out["num_key_value_heads"], out["head_dim"]) == \
        (64, 4, 2, 16)
    assert (out["vocab_size"], out["intermediate_size"], out["moe_intermediate_size"]) == (128, 128, 32)
    assert (out["num_experts"], out["num_experts_per_tok"], out["sliding_window"]) == (4, 2, 6)
    assert out["eos_token_id"] == [2] and out["bos_token_id"] == 1 and out["initializer_range"] == tiny.INIT
    assert d["num_hidden_layers"] == 12, "the input dict is not modified"


def test_shrinker_keeps_two_layers_of_a_uniform_stack_and_a_hybrid_pattern_string():
    assert tiny.select_layers(dict(layer_types=["full_attention"] * 30), 30) == [0, 1]
    out = tiny.shrink_dict(dict(num_hidden_layers=8, hybrid_override_pattern="M-M*M-M*"))
    assert out["hybrid_override_pattern"] == "M-*" and out["num_hidden_layers"] == 3


@requires_torch
@pytest.mark.parametrize("model_type,kinds", [
    ("gemma3_text", {"sliding_attention", "full_attention"}),
    ("qwen3_next", {"linear_attention", "full_attention"}),
    ("olmo_hybrid", {"linear_attention", "full_attention"}),
    ("glm4_moe_lite", {"dense", "sparse"}),
])
def test_generic_shrinker_builds_a_tiny_model_with_every_layer_kind(tmp_path, model_type, kinds):
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    summary = tiny.build_tiny(model_type, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type], tmp_path / "m")
    assert kinds <= set(summary["kinds"]), summary
    assert 2 <= summary["layers"] <= 4 and summary["params"] < 1_000_000
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    assert text["vocab_size"] == 128 and text["hidden_size"] == 64


def _results(records):
    return dict(transformers="5.24.0", targets=["portable"], ctx_len=32, prefill_seq_len=4, new_tokens=8,
                summary=matrix.summarize(records), records=records)


OLD = [dict(type="llama", stage="build", status="built", layers=2, kinds=[], **{"class": "LlamaForCausalLM"}),
       dict(type="llama", target="portable", status="exact"),
       dict(type="kimi", stage="build", status="built", layers=2, kinds=["a", "b"], **{"class": "KimiForCausalLM"}),
       dict(type="kimi", target="portable", status="refused", loaded=True, detail="kimi: per-channel decay"),
       dict(type="gone", stage="build", status="build-failed", detail="KeyError: 'x'", **{"class": "GoneLM"})]
NEW = [dict(OLD[0]), dict(type="llama", target="portable", status="MISMATCH"), OLD[2],
       dict(type="kimi", target="portable", status="refused", loaded=False, detail="kimi: per-channel decay")]


def test_compare_names_each_changed_cell_and_flags_a_mismatch():
    lines = matrix.compare(_results(OLD), _results(NEW))
    assert lines[1:] == ["gone [build]: build-failed -> absent",
                         "kimi [portable]: refused after load -> refused before load (kimi: per-channel decay)",
                         "llama [portable]: exact -> MISMATCH  <-- MISMATCH"]
    assert matrix.compare(_results(OLD), _results(OLD))[1:] == ["no change"]


def test_counts_and_generated_page_separate_refusals_before_and_after_loading(tmp_path):
    data = _results(OLD)
    assert data["summary"]["portable"] == {"exact": 1, "refused-after-load": 1}
    page = matrix.render_doc(data)
    assert page.startswith("# Every CausalLM type of transformers 5.24.0")
    assert "| kimi | `KimiForCausalLM` | 2 (a, b) | refused (after load): kimi: per-channel decay |" in page
    assert "| gone | `GoneLM` |  | build-failed: KeyError: 'x' |" in page
    assert "| llama | `LlamaForCausalLM` | 2 | exact |" in page


def test_subset_run_replaces_only_its_own_cells():
    merged = matrix.merge(_results(OLD), [OLD[2], dict(type="kimi", target="portable", status="exact")], {"kimi"})
    assert [(r["type"], r.get("target", "build"), r["status"]) for r in merged] == [
        ("gone", "build", "build-failed"), ("kimi", "build", "built"), ("kimi", "portable", "exact"),
        ("llama", "build", "built"), ("llama", "portable", "exact")]


def test_generated_page_matches_the_committed_results():
    assert matrix.OUT.is_file(), "run: python benchmarks/family_matrix.py --targets portable,onnxruntime,onnxruntime-fused --vlm"
    assert matrix.DOC.read_text() == matrix.render_doc(json.loads(matrix.OUT.read_text())), \
        "docs/family-matrix.md is generated: python benchmarks/family_matrix.py --docs-only"


def test_bugs_lists_mismatches_first_then_refusals_after_loading():
    assert matrix.bugs(_results(NEW + OLD[3:4])) == [
        "MISMATCH: llama [portable]", "refused after load: kimi [portable] kimi: per-channel decay"]
