"""Family facts (qeff_kv/export/facts/family.py) proved from config dicts alone: no torch, no weights.

Each fact the exporter asks instead of ``model_type == ...`` is read here from a config shaped like the
family's own ``config.json``, and each onnxruntime-fused refusal is checked word for word.
"""

from __future__ import annotations

import pytest

from qeff_kv.export.facts.family import ModelFacts
from qeff_kv.export.options import ExportOptions


def facts(**cfg) -> ModelFacts:
    cfg.setdefault("architectures", ["XForCausalLM"])
    cfg.setdefault("num_hidden_layers", 4)
    return ModelFacts.from_config(cfg)


def opts(target: str, ctx_len: int = 32) -> ExportOptions:
    return ExportOptions(ctx_len=ctx_len, prefill_seq_len=4, target=target).validate()


# --- rope_layers: the layers whose GroupQueryAttention applies RoPE ----------------------------------------

def test_rope_layers_default_to_every_layer():
    assert facts(model_type="llama").rope_layers == (0, 1, 2, 3)
    assert facts(model_type="gemma3_text", sliding_window=4096,
                 layer_types=["sliding_attention", "full_attention"] * 2).rope_layers == (0, 1, 2, 3)


def test_rope_layers_from_no_rope_layers_one_means_rope():
    # SmolLM3 (and Llama4): no_rope_layers[i] == 1 means layer i USES RoPE
    f = facts(model_type="smollm3", no_rope_layers=[1, 0, 1, 0], no_rope_layer_interval=2)
    assert f.rope_layers == (0, 2)


def test_rope_layers_from_layer_rope_theta_zero_means_nope():
    f = facts(model_type="granite_swa", num_hidden_layers=2, layer_rope_theta=[10000.0, 0])
    assert f.rope_layers == (0,)


def test_exaone4_rotates_only_sliding_layers_when_a_window_is_set():
    cfg = dict(model_type="exaone4", sliding_window=4096, sliding_window_pattern=2,
               layer_types=["sliding_attention", "full_attention"] * 2)
    assert facts(**cfg).rope_layers == (0, 2)
    assert facts(**{**cfg, "sliding_window": None}).rope_layers == (0, 1, 2, 3)


def test_cohere2_rotates_only_sliding_layers():
    cfg = dict(model_type="cohere2", sliding_window=4096,
               layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"])
    assert facts(**cfg).rope_layers == (0, 1, 2)
    assert facts(**{**cfg, "sliding_window": None}).rope_layers == ()


def test_logits_scaling_from_logits_scaling_or_dim_model_base():
    assert facts(model_type="granite", logits_scaling=4.0).logits_scaling == 4.0
    # MiniCPM3: a config-class property (hidden states divided before the head), not in config.json
    assert facts(model_type="minicpm3", hidden_size=2560, dim_model_base=256).logits_scaling == 10.0
    assert facts(model_type="llama", hidden_size=64).logits_scaling is None


# --- how attention is computed, and what GroupQueryAttention cannot express --------------------------------

@pytest.mark.parametrize("model_type, code", [
    ("llama", "interface"), ("gpt2", "interface"), ("gemma2", "interface"), ("gpt_oss", "interface"),
    ("falcon", "sdpa"), ("gptj", "eager"), ("codegen", "eager"), ("bloom", "eager"),
])
def test_attention_code(model_type, code):
    assert facts(model_type=model_type).attention_code == code


def test_alibi():
    assert facts(model_type="falcon", alibi=True).alibi
    assert not facts(model_type="falcon", alibi=False).alibi
    assert facts(model_type="mpt").alibi and facts(model_type="bloom").alibi
    assert not facts(model_type="llama").alibi


def test_latent_attention():
    assert facts(model_type="deepseek_v3", kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                 v_head_dim=16).latent_attention
    assert facts(model_type="x", qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16).latent_attention
    assert not facts(model_type="x", qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24).latent_attention
    assert facts(model_type="x", head_dim=16, v_head_dim=8).latent_attention
    assert not facts(model_type="llama", head_dim=16).latent_attention


def test_soft_capping_and_sinks_are_facts():
    f = facts(model_type="gemma2", attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
    assert (f.attn_logit_softcapping, f.final_logit_softcapping) == (50.0, 30.0)
    assert facts(model_type="gpt_oss").attention_sinks
    assert not facts(model_type="llama").attention_sinks


# --- refusals ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cfg, message", [
    (dict(architectures=["GPTJForCausalLM"], model_type="gptj"),
     "--target onnxruntime-fused cannot express GPTJForCausalLM's attention (computed by its own code, not "
     "through transformers' attention interface or SDPA); use --target onnxruntime"),
    (dict(architectures=["FalconForCausalLM"], model_type="falcon", alibi=True),
     "--target onnxruntime-fused cannot express FalconForCausalLM's ALiBi position biases (GroupQueryAttention "
     "has no ALiBi); use --target onnxruntime"),
    (dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", kv_lora_rank=32),
     "--target onnxruntime-fused cannot express DeepseekV3ForCausalLM's multi-head latent attention (keys and "
     "values of different head sizes); use --target onnxruntime"),
])
def test_fused_refusals_are_one_line_and_fused_only(cfg, message):
    f = facts(**cfg)
    assert f.refusal(opts("onnxruntime-fused")) == message
    assert "\n" not in message
    assert f.refusal(opts("portable")) is None and f.refusal(opts("onnxruntime")) is None


@pytest.mark.parametrize("cfg", [
    dict(model_type="falcon", alibi=False),                                          # SDPA route
    dict(model_type="gpt2"),                                                         # no RoPE
    dict(model_type="gemma2", attn_logit_softcapping=50.0, sliding_window=4096,
         layer_types=["sliding_attention", "full_attention"] * 2),                  # GQA softcap
    dict(model_type="gpt_oss", sliding_window=4096,
         layer_types=["sliding_attention", "full_attention"] * 2),                  # GQA head_sink
    dict(model_type="smollm3", no_rope_layers=[1, 1, 1, 0]),                         # per-layer do_rotary
])
@pytest.mark.parametrize("target", ["portable", "onnxruntime", "onnxruntime-fused"])
def test_expressible_families_are_not_refused(cfg, target):
    assert facts(**cfg).refusal(opts(target)) is None


def test_a_window_smaller_than_ctx_len_is_no_longer_refused():
    """Sliding windows are ring buffers now: only the target's own refusal remains."""
    f = facts(architectures=["GPTJForCausalLM"], model_type="gptj", sliding_window=16)
    assert f.refusal(opts("onnxruntime-fused", ctx_len=32)).startswith("--target onnxruntime-fused cannot express")
    assert facts(model_type="mistral", sliding_window=16).refusal(opts("portable", ctx_len=32)) is None


# --- logits: what the model's own forward does to its head's output (RetainedStateLM applies these) ---------

def test_logit_facts():
    assert facts(model_type="cohere", logit_scale=0.0625).logit_scale == 0.0625
    assert facts(model_type="granite", logits_scaling=4.0).logits_scaling == 4.0
    f = facts(model_type="llama")
    assert (f.logit_scale, f.logits_scaling, f.final_logit_softcapping) == (None, None, None)


# --- RoPE variants and the positions where transformers changes them at run time ---------------------------

def test_rope_types_from_rope_parameters_rope_scaling_and_per_layer_type_sets():
    assert facts(model_type="llama", rope_parameters={"rope_type": "llama3", "factor": 8.0}).rope_types == ("llama3",)
    assert facts(model_type="llama", rope_scaling={"type": "dynamic", "factor": 2.0}).rope_types == ("dynamic",)
    assert facts(model_type="llama", rope_parameters={"rope_theta": 10000.0}).rope_types == ("default",)
    assert facts(model_type="llama").rope_types == ()
    nested = {"sliding_attention": {"rope_type": "default"}, "full_attention": {"rope_type": "linear", "factor": 8}}
    assert facts(model_type="gemma3_text", rope_parameters=nested).rope_types == ("default", "linear")


def _longrope(**top):
    rope = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    rope.update(top.pop("rope", {}))
    return dict(model_type=top.pop("model_type", "phi3"), max_position_embeddings=128, rope_parameters=rope, **top)


def test_longrope_threshold_is_the_effective_original_max_position_embeddings():
    # Phi-3's top-level field has priority over rope_parameters' (transformers' standardize_rope_params) ...
    assert facts(**_longrope(original_max_position_embeddings=16,
                             rope={"original_max_position_embeddings": 64})).longrope_threshold == 16
    # ... and Phi3Config has one even when config.json does not (default 4096)
    assert facts(**_longrope(rope={"original_max_position_embeddings": 64})).longrope_threshold == 4096
    # other classes: rope_parameters' own value, else max_position_embeddings
    assert facts(**_longrope(model_type="x", rope={"original_max_position_embeddings": 64})).longrope_threshold == 64
    assert facts(**_longrope(model_type="x")).longrope_threshold == 128
    assert facts(model_type="phi3", rope_parameters={"rope_type": "yarn", "factor": 4.0}).longrope_threshold is None


@pytest.mark.parametrize("target", ["portable", "onnxruntime", "onnxruntime-fused"])
def test_longrope_beyond_the_threshold_is_refused_in_one_line(target):
    f = facts(architectures=["Phi3ForCausalLM"], **_longrope(original_max_position_embeddings=16))
    assert f.refusal(opts(target, ctx_len=16)) is None
    msg = f.refusal(opts(target, ctx_len=17))
    assert msg == ("this model uses longrope RoPE scaling, whose factors switch once a sequence is longer than "
                   "original_max_position_embeddings 16 (transformers then recomputes the whole cache); export "
                   "with --ctx-len 16 or less")


@pytest.mark.parametrize("target", ["portable", "onnxruntime", "onnxruntime-fused"])
def test_dynamic_rope_beyond_max_position_embeddings_is_refused_in_one_line(target):
    f = facts(model_type="llama", max_position_embeddings=64, rope_scaling={"type": "dynamic", "factor": 2.0})
    assert f.max_position_embeddings == 64
    assert f.refusal(opts(target, ctx_len=64)) is None
    assert f.refusal(opts(target, ctx_len=65)) == (
        "this model uses dynamic RoPE scaling, which rescales beyond max_position_embeddings 64 in Python (a "
        "traced graph cannot follow); export with --ctx-len 64 or less")
    # other RoPE variants are exact at any ctx_len
    for rope in ({"rope_type": "llama3", "factor": 8.0}, {"rope_type": "yarn", "factor": 4.0}):
        assert facts(model_type="llama", max_position_embeddings=64, rope_parameters=rope).refusal(
            opts(target, ctx_len=128)) is None


# --- sliding windows: which layers are ring buffers (contract section 7) ---------------------------------------

GEMMA3 = dict(model_type="gemma3_text", sliding_window=8, num_hidden_layers=6,
              layer_types=["sliding_attention"] * 5 + ["full_attention"])


def test_ring_layers_are_the_sliding_layers_when_ctx_len_exceeds_the_window():
    f = facts(**GEMMA3)
    assert f.sliding_layers == (0, 1, 2, 3, 4)
    for target in ("portable", "onnxruntime"):
        assert f.ring_layers(opts(target, ctx_len=64)) == (0, 1, 2, 3, 4)
        assert f.sliding_cache(opts(target, ctx_len=64)) == "ring"
        # at or below the window the window never binds: full-length buffers
        assert f.ring_layers(opts(target, ctx_len=8)) == ()
        assert f.sliding_cache(opts(target, ctx_len=8)) == "full"
    # GroupQueryAttention appends linearly: full-length buffers, the window in local_window_size
    assert f.ring_layers(opts("onnxruntime-fused", ctx_len=64)) == ()
    assert f.sliding_cache(opts("onnxruntime-fused", ctx_len=64)) == "full"
    assert facts(model_type="llama").sliding_cache(opts("portable")) is None


def test_sliding_layers_from_each_config_style():
    assert facts(model_type="mistral", sliding_window=8).sliding_layers == (0, 1, 2, 3)
    assert facts(model_type="mistral", sliding_window=None).sliding_layers == ()
    assert facts(model_type="qwen2", sliding_window=8, use_sliding_window=False).sliding_layers == ()
    assert facts(model_type="gemma3_text", sliding_window=8, sliding_window_pattern=3).sliding_layers == (0, 1, 3)


def test_a_chunk_longer_than_the_window_is_refused_only_with_rings():
    f = facts(**GEMMA3)
    msg = ("prefill_seq_len 16 is longer than the sliding window 8: a prefill chunk must fit in the sliding "
           "layers' ring buffers; export with --prefill-seq-len 8 or less")
    for target in ("portable", "onnxruntime"):
        o = ExportOptions(ctx_len=64, prefill_seq_len=16, target=target).validate()
        assert f.refusal(o) == msg
    assert f.refusal(ExportOptions(ctx_len=64, prefill_seq_len=16, target="onnxruntime-fused").validate()) is None
    assert f.refusal(ExportOptions(ctx_len=64, prefill_seq_len=8, target="portable").validate()) is None


# --- vision-language models: what is exported and what is refused, from the config ---------------------------

def _vlm(**over):
    cfg = {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava", "image_token_id": 120,
           "text_config": {"model_type": "llama", "num_hidden_layers": 2},
           "vision_config": {"model_type": "clip_vision_model"}}
    cfg.update(over)
    return ModelFacts.from_config(cfg)


def test_llava_style_models_are_exported():
    f = _vlm()
    assert (f.vision_language, f.image_token_id, f.vision_refusal()) == (True, 120, None)
    assert _vlm(image_token_id=None, image_token_index=32000).image_token_id == 32000


def test_vision_language_refusals_name_the_reason():
    assert _vlm(image_token_id=None).vision_refusal() == (
        "LlavaForConditionalGeneration: the config has no image_token_id (or image_token_index); cannot merge "
        "image rows")
    qwen = _vlm(architectures=["Qwen2_5_VLForConditionalGeneration"], model_type="qwen2_5_vl",
                text_config={"model_type": "qwen2_5_vl_text", "num_hidden_layers": 2,
                             "rope_parameters": {"rope_type": "default", "mrope_section": [2, 2, 4]}})
    assert qwen.mrope and qwen.vision_refusal() is None and qwen.fused_refusal() is None
    mllama = _vlm(architectures=["MllamaForConditionalGeneration"], model_type="mllama",
                  text_config={"model_type": "mllama_text_model", "num_hidden_layers": 4,
                               "cross_attention_layers": [1, 3]})
    assert mllama.vision_refusal().startswith("MllamaForConditionalGeneration attends to the image through "
                                              "cross-attention layers")
    gemma3 = _vlm(architectures=["Gemma3ForConditionalGeneration"], model_type="gemma3")
    assert gemma3.bidirectional_images and gemma3.vision_refusal() is None
    assert gemma3.fused_refusal() == ("--target onnxruntime-fused cannot express Gemma3ForConditionalGeneration's "
                                      "attention within an image both ways (GroupQueryAttention masks causally); "
                                      "use --target onnxruntime")
    assert not _vlm().bidirectional_images


def test_single_graph_is_refused_for_text_decoders():
    o = ExportOptions(ctx_len=32, prefill_seq_len=4, single_graph=True).validate()
    assert facts(model_type="llama").refusal(o) == "--single-graph is for vision-language models; this is a text decoder"


def test_recurrent_layers_never_apply_rope():
    """Only attention layers rotate: ``linear_attention`` (gated delta net), ``conv`` (LFM2), ``mamba``, ``mlp``
    layers are left out of the RoPE layers, which the fused target checks its rotated layers against."""
    def rope(**text):
        return ModelFacts.from_config({"architectures": ["X"], "num_hidden_layers": 4, **text}).rope_layers

    assert rope(layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"]) == (3,)
    assert rope(layer_types=["conv", "full_attention", "conv", "sliding_attention"]) == (1, 3)
    assert rope(layers_block_type=["mamba", "attention", "mlp", "moe"]) == (1,)
    assert rope(layer_types=["full_attention", "sliding_attention"] * 2) == (0, 1, 2, 3)
    assert rope() == (0, 1, 2, 3)


# --- shared-KV layers (Gemma 4's num_kv_shared_layers) ------------------------------------------------------
GEMMA4_SHARED = dict(model_type="gemma4_text", num_hidden_layers=5, num_kv_shared_layers=2, sliding_window=512,
                     layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
                                  "full_attention"])


def test_shared_kv_layers_read_the_last_earlier_layer_of_their_type():
    """transformers 5.24 ``kv_sharing_modes``: the last ``num_kv_shared_layers`` layers reuse the keys/values of
    the last layer before them of the same attention type; they write nothing through the cache."""
    f = facts(**GEMMA4_SHARED)
    assert f.kv_shared == ((3, 2), (4, 1))
    assert f.kv_shared_layers == (3, 4)
    assert f.cache_writers() == (0, 1, 2)
    assert f.refusal(opts("portable")) is None and f.refusal(opts("onnxruntime-fused")) is None
    # the shared layers stay sliding/RoPE layers: they attend with their type's window and rotate their queries
    assert f.sliding_layers == (0, 2, 3) and f.rope_layers == (0, 1, 2, 3, 4)
    assert facts(**{**GEMMA4_SHARED, "num_kv_shared_layers": 0}).kv_shared == ()
    assert facts(**{**GEMMA4_SHARED, "num_kv_shared_layers": 0}).cache_writers() is None
    assert facts(model_type="llama").kv_shared == ()
    # no layer_types: every layer is one type, the shared layers read the last unshared one
    assert facts(num_hidden_layers=4, num_kv_shared_layers=1).kv_shared == ((3, 2),)


def test_shared_kv_layers_of_a_hybrid_model_leave_the_recurrent_layers_out_of_the_writers():
    f = facts(model_type="qwen3_next", num_hidden_layers=4, num_kv_shared_layers=1,
              layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
              linear_conv_kernel_dim=4, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
              linear_value_head_dim=8)
    assert f.kv_shared == ((3, 1),)
    assert f.cache_writers() == (1,)


@pytest.mark.parametrize("target", ["portable", "onnxruntime", "onnxruntime-fused"])
def test_a_shared_layer_with_nothing_to_read_is_refused_in_one_line(target):
    """Every layer shared, or a shared layer whose type no earlier layer has: transformers has no source for it."""
    every = facts(**{**GEMMA4_SHARED, "num_kv_shared_layers": 5})
    assert every.refusal(opts(target)) == (
        "XForCausalLM: shared-KV layers [0, 1, 2, 3, 4] (num_kv_shared_layers) have no earlier layer of their "
        "attention type to read keys and values from; fix the config's layer_types or num_kv_shared_layers")
    orphan = facts(**{**GEMMA4_SHARED, "num_kv_shared_layers": 3,
                      "layer_types": ["full_attention"] * 2 + ["sliding_attention", "full_attention"] * 1
                      + ["full_attention"]})
    assert orphan.kv_shared == ((2, -1), (3, 1), (4, 1))
    assert orphan.refusal(opts(target)).startswith("XForCausalLM: shared-KV layers [2] (num_kv_shared_layers)")


# --- DeepSeek sparse attention and DeepSeek-V4 (issue 53) ---------------------------------------------------------

def test_indexed_layers_from_index_topk_and_indexer_types():
    """The layers that run their own indexer (and keep ``index_key``): every attention layer with ``index_topk``;
    GLM-5's ``indexer_types`` (given, or derived as transformers does from ``index_topk_pattern`` or
    ``index_topk_freq``/``index_skip_topk_offset``) keeps only the ``"full"`` ones."""
    v32 = dict(model_type="deepseek_v32", kv_lora_rank=32, index_topk=6, index_head_dim=16)
    assert (facts(**v32).indexed_layers, facts(**v32).index_topk) == ((0, 1, 2, 3), 6)
    glm = dict(model_type="glm_moe_dsa", kv_lora_rank=32, index_topk=6)
    assert facts(**glm, indexer_types=["full", "shared", "full", "shared"]).indexed_layers == (0, 2)
    assert facts(**glm, index_topk_pattern="FSSF").indexed_layers == (0, 3)
    assert facts(**glm, index_topk_freq=2, index_skip_topk_offset=1).indexed_layers == (0, 2)
    assert (facts(model_type="deepseek_v3", kv_lora_rank=32).indexed_layers,
            facts(model_type="deepseek_v3", kv_lora_rank=32).index_topk) == ((), None)


def test_sparse_attention_refusals_come_first_and_name_the_limit():
    """onnxruntime-fused: the sparse selection is named before MLA (both hold; the selection is what no option of
    GroupQueryAttention expresses); ``--mla-cache latent``: its absorbed attention has no selection."""
    f = facts(architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32", kv_lora_rank=32, index_topk=6)
    assert f.refusal(opts("onnxruntime-fused")) == (
        "--target onnxruntime-fused cannot express DeepseekV32ForCausalLM's DeepSeek sparse attention (each query "
        "attends only to the index_topk 6 positions its indexer selects; GroupQueryAttention attends to every "
        "cached position); use --target onnxruntime")
    assert f.refusal(opts("portable")) is None and f.refusal(opts("onnxruntime")) is None
    latent = ExportOptions(ctx_len=32, prefill_seq_len=4, target="portable", mla_cache="latent").validate()
    assert f.refusal(latent).startswith("--mla-cache latent does not support DeepseekV32ForCausalLM's DeepSeek "
                                        "sparse attention")


@pytest.mark.parametrize("fields", [dict(compress_rates={"compressed_sparse_attention": 4,
                                                         "heavily_compressed_attention": 128}),
                                    dict(compress_ratios=[0, 4, 128, 4])])   # an older checkpoint's config
@pytest.mark.parametrize("target", ["portable", "onnxruntime", "onnxruntime-fused"])
def test_deepseek_v4_compressed_attention_is_refused_from_the_config(fields, target):
    f = facts(architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4", index_topk=512, hc_mult=4, **fields)
    reason = f.refusal(opts(target))
    assert reason.startswith("DeepseekV4ForCausalLM: its compressed attention layers (compress_rates) keep running "
                             "compressor buffers")
    assert reason.endswith("; qeff-kv does not export it") and "\n" not in reason


def test_kimi_delta_facts_from_the_saved_config_and_the_checkpoint_layout():
    """Kimi delta attention's state geometry: ``conv_state [3 * heads * head_dim, kernel]`` (q, k, v convolved as
    one), ``recurrent_state [heads, head_dim, head_dim]``; the layers from ``layer_types`` or a checkpoint's 1-based
    ``linear_attn_config`` lists; Bailing-Hybrid's from ``num_attention_heads``/``head_dim``."""
    saved = facts(model_type="kimi_linear", num_hidden_layers=3, linear_num_heads=2, linear_head_dim=16,
                  linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention", "linear_attention"])
    ckpt = facts(model_type="kimi_linear", num_hidden_layers=3, linear_attn_config=dict(
        num_heads=2, head_dim=16, short_conv_kernel_size=4, kda_layers=[1, 3], full_attn_layers=[2]))
    bailing = facts(model_type="bailing_hybrid", num_hidden_layers=3, num_attention_heads=2, head_dim=16,
                    short_conv_kernel_size=4, layer_types=["linear_attention", "full_attention", "linear_attention"])
    for f in (saved, ckpt, bailing):
        r = f.recurrent
        assert (r.mixer, r.mixer_layers, r.attention_layers) == ("kda", (0, 2), (1,))
        assert r.state_shapes == ((96, 4), (2, 16, 16))
    # without layer_types: transformers' defaults (Kimi: every 4th from layer 4; Bailing: every layer_group_size-th)
    kimi = facts(model_type="kimi_linear", num_hidden_layers=6, linear_num_heads=2, linear_head_dim=16).recurrent
    assert (kimi.mixer_layers, kimi.attention_layers) == ((0, 1, 2, 3, 5), (4,))
    bailing = facts(model_type="bailing_hybrid", num_hidden_layers=6, num_attention_heads=2, head_dim=16,
                    layer_group_size=3).recurrent
    assert (bailing.mixer_layers, bailing.attention_layers) == ((0, 1, 3, 4), (2, 5))


def test_mla_latent_cache_is_refused_for_recurrent_models_before_loading():
    o = ExportOptions(ctx_len=32, prefill_seq_len=4, mla_cache="latent").validate()
    f = facts(model_type="kimi_linear", architectures=["KimiLinearForCausalLM"], num_hidden_layers=3,
              kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, linear_num_heads=2,
              linear_head_dim=16, layer_types=["linear_attention", "full_attention", "linear_attention"])
    assert f.refusal(o) == ("--mla-cache latent with KimiLinearForCausalLM's recurrent layers: the compressed cache "
                            "is absorbed only in models whose every layer is MLA attention; export with "
                            "--mla-cache full")


def test_mixer_layer_types_are_the_recurrent_layer_type_names():
    """A decoder that takes one mask per layer type (LFM3) also looks up its mixer layers' type (``"conv"``): the
    fact names those types, once each, and none for attention-only or list-less configs."""
    assert facts(model_type="lfm3", conv_L_cache=3, hidden_size=64,
                 layer_types=["conv", "sliding_attention", "conv", "full_attention"]).mixer_layer_types == ("conv",)
    assert facts(layer_types=["linear_attention", "full_attention"] * 2).mixer_layer_types == ("linear_attention",)
    assert facts(layer_types=["sliding_attention", "full_attention"] * 2).mixer_layer_types == ()
    assert facts().mixer_layer_types == ()


def test_a_per_type_mask_dict_names_the_mixer_types_without_a_mask():
    """SlidingPlan.masks: with ring layers and full layers the decoder gets ``{type: mask}``; a mixer layer type
    maps to ``None`` (transformers looks every type of ``layer_types`` up: without it, ``KeyError: 'conv'``)."""
    torch = pytest.importorskip("torch")
    from qeff_kv.export.modeling.caches import SlidingPlan

    plan = SlidingPlan(4, 6, ring_layers=(1,), unmasked_types=("conv",))
    pos = torch.arange(4).reshape(1, 4)
    ring = plan.ring_step(pos, torch.zeros(1, 4, dtype=torch.bool), torch.float32)
    full = torch.zeros(1, 1, 4, 32)
    masks = plan.masks(full, ring)
    assert set(masks) == {"full_attention", "sliding_attention", "conv"}
    assert masks["conv"] is None and masks["full_attention"] is full and masks["sliding_attention"] is ring.mask
    assert SlidingPlan(4, None, unmasked_types=("conv",)).masks(full, None) is full   # one mask: left as it is


def test_exaone45_text_model_is_read_as_exaone4():
    """Exaone4.5's ``config.json`` may name its text model ``exaone4_5_text``, which transformers reads as exaone4:
    the facts too (its global layers without RoPE when a window is set), whichever name the file uses."""
    text = dict(num_hidden_layers=4, sliding_window=6, head_dim=16,
                layer_types=["sliding_attention", "full_attention"] * 2)
    for name in ("exaone4", "exaone4_5_text"):
        f = ModelFacts.from_config({"architectures": ["Exaone4_5_ForConditionalGeneration"], "model_type": "exaone4_5",
                                    "image_token_id": 67, "vision_config": {"depth": 2},
                                    "text_config": {**text, "model_type": name}})
        assert f.model_type == "exaone4" and f.rope_layers == (0, 2) and f.vision_language and not f.mrope
        assert f.vision_refusal() is None


# --- head sizes onnxruntime's CPU GroupQueryAttention runs (issue 53, item 6) -------------------------------------

def test_attention_head_dims_from_the_config():
    assert facts(head_dim=24).head_dims == (24,)
    assert facts(hidden_size=64, num_attention_heads=4).head_dims == (16,)
    assert facts(n_embd=96, n_head=4).head_dims == (24,)
    assert facts(head_dim=256, global_head_dim=512).head_dims == (256, 512)   # Gemma 4: its full layers' size
    assert facts(hidden_size=64, num_attention_heads=5).head_dims == ()        # the config does not say


def test_a_head_size_groupqueryattention_cannot_run_is_refused_on_fused_only():
    odd = facts(head_dim=24)
    assert odd.refusal(opts("onnxruntime-fused")) == (
        "--target onnxruntime-fused cannot express XForCausalLM's attention head size 24: onnxruntime's CPU "
        "GroupQueryAttention runs head sizes that are a multiple of 16 only; use --target onnxruntime")
    assert odd.refusal(opts("portable")) is None and odd.refusal(opts("onnxruntime")) is None
    assert facts(head_dim=16, global_head_dim=40).refusal(opts("onnxruntime-fused")).startswith(
        "--target onnxruntime-fused cannot express XForCausalLM's attention head size 40")
    assert facts(head_dim=128).refusal(opts("onnxruntime-fused")) is None
    # a pure recurrent model's head_dim is its mixer's, not an attention head's
    mamba = facts(model_type="mamba2", num_heads=4, head_dim=24, state_size=8, n_groups=2, hidden_size=48)
    assert mamba.recurrent is not None and not mamba.recurrent.attention_layers
    assert mamba.fused_refusal() is None


@pytest.mark.parametrize("model_type", ["axk2", "hy_v4", "mistral_large4_text"])
def test_an_indexer_of_another_layout_is_refused_from_the_config(model_type):
    """Configs with ``index_topk`` whose indexer is not DeepSeek-V3.2's (transformers 5.24: AXK2, HY-V4,
    Mistral-Large-4) used to load and fail in the shape probe (``RecordingCache`` has no ``update_indexer``)."""
    f = facts(model_type=model_type, kv_lora_rank=32, index_topk=2048)
    for target in ("portable", "onnxruntime", "onnxruntime-fused"):
        assert f.refusal(opts(target)) == (
            f"XForCausalLM: its sparse attention's indexer ({model_type}'s own, index_topk 2048) is not the "
            f"DeepSeek-V3.2 / GLM-5 indexer qeff-kv traces; qeff-kv does not export it")
    assert facts(model_type="deepseek_v32", kv_lora_rank=32, index_topk=6).compressed_attention is None
