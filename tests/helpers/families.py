"""The family matrix: one tiny seeded transformers model per decoder family users bring.

Each entry is ``name -> Family(config class, model class, config kwargs)``. Models are small (2-4 layers,
hidden 64, vocab 128) and built with a seed and an init scale whose greedy tokens vary. Importing this module
needs neither torch nor transformers; :func:`make_family_dir` imports them.

The matrix's expected outcome per target lives in ``EXPECT`` (``"exact"`` or the start of the refusal
message); ``docs/supported-models.md`` is generated from it by ``tests/helpers/gen_supported_models.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

TARGETS = ("portable", "onnxruntime", "onnxruntime-fused")
#: The matrix's probe: two prompts unlike the all-zero tracing input, chunks of CHUNK (the first prompt's
#: last chunk padded), capacity CTX, NEW greedy tokens.
PROMPTS = [[5, 17, 42, 99, 13, 7, 101, 64, 3, 77, 21], [100, 3, 3, 60, 9]]
CTX, CHUNK, NEW = 32, 4, 8
#: the sliding window of the ``*_sw`` families: smaller than CTX, so sliding layers are ring buffers; a prompt
#: plus its new tokens spans three windows, and chunks of CHUNK straddle the wrap (positions 4..7)
SW = 6

_LLAMA_LIKE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                   initializer_range=0.15, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                   tie_word_embeddings=False)
_GPT_LIKE = dict(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=128, initializer_range=0.15,
                 bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)


@dataclass(frozen=True)
class Family:
    config_class: str
    model_class: str
    kwargs: dict = field(default_factory=dict)
    base: dict = field(default_factory=lambda: dict(_LLAMA_LIKE))
    #: what the family exercises (shown in docs/supported-models.md)
    note: str = ""
    #: a recurrent or hybrid family (conv_state/recurrent_state): its reference is transformers' forward over the
    #: whole sequence without a cache (tests/helpers/hf_models.py ``hf_greedy_whole``)
    recurrent: bool = False

    def config_kwargs(self) -> dict:
        return {**self.base, **self.kwargs}


def _moe(**kw) -> dict:
    return dict(num_hidden_layers=2, **kw)


#: Gemma 4's text model: 4 query heads of 16 (sliding layers) and 2 KV heads of 32 on its global layers
#: (``global_head_dim``, ``num_global_key_value_heads`` with ``attention_k_eq_v``), per-layer embeddings of 8
_GEMMA4 = dict(head_dim=16, global_head_dim=32, num_global_key_value_heads=2, attention_k_eq_v=True,
               hidden_size_per_layer_input=8, vocab_size_per_layer_input=128, enable_moe_block=True, num_experts=4,
               top_k_experts=2, moe_intermediate_size=32, final_logit_softcapping=30.0,
               layer_types=["sliding_attention", "full_attention"])
_GEMMA4_SHARED_TYPES = ["sliding_attention", "full_attention"] * 2


FAMILIES: dict[str, Family] = {
    # --- dense, already exact ---------------------------------------------------------------------------
    "llama": Family("LlamaConfig", "LlamaForCausalLM", dict(head_dim=16)),
    "mistral": Family("MistralConfig", "MistralForCausalLM", dict(head_dim=16, sliding_window=4096)),
    "qwen2": Family("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": Family("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16)),
    "phi3": Family("Phi3Config", "Phi3ForCausalLM", dict(sliding_window=None)),
    "granite": Family("GraniteConfig", "GraniteForCausalLM",
                      dict(embedding_multiplier=2.0, attention_multiplier=0.3, residual_multiplier=0.5,
                           logits_scaling=4.0), note="embedding/attention/residual multipliers, logits scaling"),
    # --- dense, this round ------------------------------------------------------------------------------
    "gemma": Family("GemmaConfig", "GemmaForCausalLM", dict(head_dim=16), note="(1+w) RMSNorm, scaled embedding"),
    "phi": Family("PhiConfig", "PhiForCausalLM", dict(partial_rotary_factor=0.5), note="partial rotary, parallel block"),
    "gpt2": Family("GPT2Config", "GPT2LMHeadModel", dict(), base=dict(_GPT_LIKE), note="learned positions, no RoPE"),
    "gptj": Family("GPTJConfig", "GPTJForCausalLM", dict(rotary_dim=8), base=dict(_GPT_LIKE),
                   note="interleaved partial rotary"),
    "gpt_neox": Family("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(rotary_pct=0.5)),
    "gpt_bigcode": Family("GPTBigCodeConfig", "GPTBigCodeForCausalLM", dict(multi_query=True), base=dict(_GPT_LIKE),
                          note="multi-query attention, learned positions"),
    "falcon_mqa": Family("FalconConfig", "FalconForCausalLM",
                         dict(multi_query=True, new_decoder_architecture=False, parallel_attn=True, num_kv_heads=4,
                              alibi=False), note="multi_query=True: 1 KV head whatever num_kv_heads says"),
    "falcon_mha": Family("FalconConfig", "FalconForCausalLM",
                         dict(multi_query=False, new_decoder_architecture=False, parallel_attn=True, alibi=False)),
    "falcon_new": Family("FalconConfig", "FalconForCausalLM",
                         dict(multi_query=False, new_decoder_architecture=True, num_kv_heads=2, alibi=False)),
    "stablelm": Family("StableLmConfig", "StableLmForCausalLM", dict(partial_rotary_factor=0.25)),
    "starcoder2": Family("Starcoder2Config", "Starcoder2ForCausalLM", dict(sliding_window=None)),
    "olmo2": Family("Olmo2Config", "Olmo2ForCausalLM"),
    "cohere": Family("CohereConfig", "CohereForCausalLM", dict(logit_scale=0.0625),
                     note="interleaved RoPE, logit_scale multiplies the logits"),
    "glm": Family("GlmConfig", "GlmForCausalLM", dict(head_dim=16, partial_rotary_factor=0.5),
                  note="interleaved partial RoPE"),
    "smollm3": Family("SmolLM3Config", "SmolLM3ForCausalLM", dict(num_hidden_layers=4, no_rope_layer_interval=2),
                      note="NoPE layers (no_rope_layers)"),
    "exaone4": Family("Exaone4Config", "Exaone4ForCausalLM",
                      dict(num_hidden_layers=4, sliding_window=4096, sliding_window_pattern=2),
                      note="global layers without RoPE"),
    "gemma2": Family("Gemma2Config", "Gemma2ForCausalLM",
                     dict(head_dim=16, query_pre_attn_scalar=8, attn_logit_softcapping=2.0,
                          final_logit_softcapping=3.0, sliding_window=4096,
                          layer_types=["sliding_attention", "full_attention"]),
                     note="attention and final logit soft-capping, query_pre_attn_scalar, sliding layers"),
    "gemma3_text": Family("Gemma3TextConfig", "Gemma3ForCausalLM",
                          dict(head_dim=16, query_pre_attn_scalar=8, sliding_window=4096,
                               layer_types=["sliding_attention", "full_attention"],
                               rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=10000.0),
                                                "full_attention": dict(rope_type="linear", factor=8.0,
                                                                       rope_theta=1000000.0)}),
                          note="two RoPE bases (local/global layers), q/k norms, sliding layers"),
    "granite_swa": Family("GraniteSWAConfig", "GraniteSWAForCausalLM",
                          dict(layer_rope_theta=[10000.0, 0], layer_types=["full_attention", "sliding_attention"],
                               sliding_window=4096),
                          note="learned attention sinks, a NoPE layer (layer_rope_theta 0)"),
    "llama_rope_llama3": Family("LlamaConfig", "LlamaForCausalLM",
                                dict(head_dim=16, rope_parameters=dict(rope_type="llama3", rope_theta=10000.0,
                                     factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                     original_max_position_embeddings=32)), note="rope scaling llama3"),
    "llama_rope_yarn": Family("LlamaConfig", "LlamaForCausalLM",
                              dict(head_dim=16, rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                   original_max_position_embeddings=32)), note="rope scaling yarn"),
    "phi3_longrope": Family("Phi3Config", "Phi3ForCausalLM",
                            dict(sliding_window=None, max_position_embeddings=128,
                                 original_max_position_embeddings=32,  # Phi3Config's own field decides
                                 rope_parameters=dict(rope_type="longrope", rope_theta=10000.0,
                                                      short_factor=[1.0 + 0.1 * i for i in range(8)],
                                                      long_factor=[2.0 + 0.5 * i for i in range(8)],
                                                      original_max_position_embeddings=32)),
                            note="rope scaling longrope (ctx_len up to original_max_position_embeddings, where "
                                 "the factors switch)"),
    # --- sliding windows smaller than CTX: ring buffers of SW slots, chunks straddling the wrap ------------
    "gemma2_sw": Family("Gemma2Config", "Gemma2ForCausalLM",
                        dict(head_dim=16, query_pre_attn_scalar=8, attn_logit_softcapping=2.0,
                             final_logit_softcapping=3.0, sliding_window=SW,
                             layer_types=["sliding_attention", "full_attention"]),
                        note=f"window {SW}: ring buffers on alternating layers, soft-capping"),
    "gemma3_sw": Family("Gemma3TextConfig", "Gemma3ForCausalLM",
                        dict(head_dim=16, query_pre_attn_scalar=8, sliding_window=SW, num_hidden_layers=6,
                             layer_types=["sliding_attention"] * 5 + ["full_attention"],
                             rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=10000.0),
                                              "full_attention": dict(rope_type="linear", factor=8.0,
                                                                     rope_theta=1000000.0)}),
                        note=f"window {SW}: 5 ring layers to 1 global, two RoPE bases"),
    "mistral_sw": Family("MistralConfig", "MistralForCausalLM", dict(head_dim=16, sliding_window=SW),
                         note=f"window {SW} on every layer (one mask)"),
    "phi3_sw": Family("Phi3Config", "Phi3ForCausalLM", dict(sliding_window=SW),
                      note=f"window {SW} on every layer"),
    "qwen2_sw": Family("Qwen2Config", "Qwen2ForCausalLM",
                       dict(use_sliding_window=True, sliding_window=SW, max_window_layers=1),
                       note=f"use_sliding_window, window {SW} from max_window_layers on"),
    "gpt_oss_sw": Family("GptOssConfig", "GptOssForCausalLM",
                         _moe(head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=SW,
                              layer_types=["sliding_attention", "full_attention"],
                              rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0,
                                                   beta_fast=32.0, beta_slow=1.0, truncate=False,
                                                   original_max_position_embeddings=32)),
                         note=f"window {SW}: ring buffers with attention sinks, MoE"),
    # --- Gemma 4: per-layer embeddings (PLE), wider global heads, MoE beside the MLP; shared-KV layers -------
    "gemma4_text_shared": Family("Gemma4TextConfig", "Gemma4ForCausalLM",
                                 dict(_GEMMA4, num_hidden_layers=4, sliding_window=SW, num_kv_shared_layers=2,
                                      use_double_wide_mlp=True, layer_types=_GEMMA4_SHARED_TYPES),
                                 note=f"Gemma 4: unshared layers 0 (sliding) and 1 (global), shared-KV layers 2 and "
                                      f"3 reading them (num_kv_shared_layers, no buffers of their own), window {SW}: "
                                      "ring buffers, per-layer embeddings, global layers with wider heads whose keys "
                                      "are the values (attention_k_eq_v), MoE beside the MLP"),
    # --- mixture of experts -----------------------------------------------------------------------------
    "mixtral": Family("MixtralConfig", "MixtralForCausalLM",
                      _moe(head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
                      note="routed experts (softmax, top-k, renormalised)"),
    "qwen2_moe": Family("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                        _moe(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                             shared_expert_intermediate_size=64),
                        note="routed experts plus a shared expert behind a sigmoid gate"),
    "qwen3_moe": Family("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                        _moe(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                             norm_topk_prob=True),
                        note="routed experts, norm_topk_prob, q/k norms"),
    "granitemoe": Family("GraniteMoeConfig", "GraniteMoeForCausalLM",
                         _moe(num_local_experts=4, num_experts_per_tok=2, logits_scaling=2.0),
                         note="routed experts (softmax after top-k), logits scaling"),
    "gpt_oss": Family("GptOssConfig", "GptOssForCausalLM",
                      _moe(head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4096,
                           layer_types=["sliding_attention", "full_attention"],
                           rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0, beta_fast=32.0,
                                                beta_slow=1.0, truncate=False, original_max_position_embeddings=32)),
                      note="experts with biases and clamped SwiGLU, attention sinks, sliding layers, yarn RoPE"),
    # --- families users bring (issue 20): exported exactly or refused from the config ---------------------
    "apertus": Family("ApertusConfig", "ApertusForCausalLM", dict(), note="xIELU activation (expm1)"),
    "diffllama": Family("DiffLlamaConfig", "DiffLlamaForCausalLM", dict(head_dim=16),
                        note="differential attention (two maps subtracted), RMSNorm of the heads (aten::rms_norm)"),
    "llama4_text": Family("Llama4TextConfig", "Llama4ForCausalLM",
                          dict(num_hidden_layers=4, head_dim=16, intermediate_size_mlp=128, num_local_experts=4,
                               num_experts_per_tok=1, interleave_moe_layer_step=2, attention_chunk_size=SW,
                               no_rope_layer_interval=4, use_qk_norm=True),
                          note=f"chunked attention (chunks of {SW}: 3 chunked layers, 1 global NoPE layer), "
                               "complex RoPE as cos/sin pairs, L2 q/k norm, dense MoE with a shared expert"),
    "jetmoe": Family("JetMoeConfig", "JetMoeForCausalLM",
                     dict(kv_channels=16, num_local_experts=4, num_experts_per_tok=2, num_key_value_heads=2),
                     note="mixture of attention heads (routed query/output projections) and routed experts, "
                          "both grouped by Python counts in transformers: gathered by expert id"),
    "ministral3": Family("Ministral3Config", "Ministral3ForCausalLM",
                         dict(head_dim=16, sliding_window=None,
                              rope_parameters=dict(rope_type="yarn", rope_theta=1000000.0, factor=16.0,
                                                   original_max_position_embeddings=8, beta_fast=32.0,
                                                   beta_slow=1.0, mscale_all_dim=1.0, mscale=1.0,
                                                   llama_4_scaling_beta=0.1)),
                         note="query scaled by 1 + beta log(1 + floor(p / 8)) (grows within the prompt), yarn RoPE"),
    # --- multi-head latent attention --------------------------------------------------------------------
    "deepseek_v3": Family("DeepseekV3Config", "DeepseekV3ForCausalLM",
                          dict(num_hidden_layers=2, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None,
                               qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4,
                               num_experts_per_tok=2, n_group=1, topk_group=1, moe_intermediate_size=64,
                               first_k_dense_replace=1, n_shared_experts=1),
                          note="MLA (compressed KV), MoE"),
    "deepseek_v2": Family("DeepseekV2Config", "DeepseekV2ForCausalLM",
                          dict(num_hidden_layers=2, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None,
                               qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4,
                               num_experts_per_tok=2, moe_intermediate_size=64, first_k_dense_replace=1,
                               n_shared_experts=1),
                          note="MLA, RoPE through complex numbers (torch.polar) as cos/sin pairs, MoE"),
    # --- DeepSeek sparse attention: MLA plus a lightning indexer with its own key cache (index_key.{i}) --------
    "deepseek_v32": Family("DeepseekV32Config", "DeepseekV32ForCausalLM",
                           dict(num_hidden_layers=2, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=24,
                                qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4,
                                num_experts_per_tok=2, n_group=1, topk_group=1, moe_intermediate_size=64,
                                first_k_dense_replace=1, n_shared_experts=1, index_topk=6, index_head_dim=16,
                                index_n_heads=16),
                           note="DeepSeek sparse attention: MLA over the index_topk positions an indexer selects "
                                "(its own key cache index_key), dense and MoE layers"),
    "glm_moe_dsa": Family("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM",
                          dict(num_hidden_layers=2, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=24,
                               qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4,
                               num_experts_per_tok=2, n_group=1, topk_group=1, moe_intermediate_size=64,
                               first_k_dense_replace=1, n_shared_experts=1, index_topk=6, index_head_dim=16,
                               index_n_heads=16, indexer_types=["full", "shared"]),
                          note="DeepSeek sparse attention; a shared-indexer layer reuses the previous layer's "
                               "selection (no index_key of its own), dense and MoE layers"),
    "deepseek_v4": Family("DeepseekV4Config", "DeepseekV4ForCausalLM",
                          dict(num_hidden_layers=3, num_key_value_heads=1, head_dim=16, q_lora_rank=24,
                               n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, o_groups=2,
                               o_lora_rank=16, index_n_heads=4, index_head_dim=16, index_topk=6, sliding_window=4,
                               hc_mult=2, compress_rates={"compressed_sparse_attention": 2,
                                                          "heavily_compressed_attention": 4},
                               layer_types=["sliding_attention", "compressed_sparse_attention",
                                            "heavily_compressed_attention"]),
                          note="compressed sparse / heavily compressed attention, hyper-connections: refused"),
    "minicpm3": Family("MiniCPM3Config", "MiniCPM3ForCausalLM",
                       dict(num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=24, qk_rope_head_dim=8,
                            qk_nope_head_dim=16, v_head_dim=16, scale_emb=12.0, scale_depth=1.4, dim_model_base=16,
                            rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                                 original_max_position_embeddings=32, mscale=1.0,
                                                 mscale_all_dim=1.0)),
                       note="MLA; scale_emb, scale_depth residuals, logits divided by hidden_size / dim_model_base, "
                            "yarn softmax scale"),
    "mistral4": Family("Mistral4Config", "Mistral4ForCausalLM",
                       dict(num_hidden_layers=2, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=24,
                            qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4,
                            num_experts_per_tok=2, moe_intermediate_size=64, first_k_dense_replace=1,
                            n_shared_experts=1),
                       note="MLA, MoE; transformers maps it to no AutoModelForCausalLM: loaded by its config's "
                            "`architectures` class"),
    "longcat_flash": Family("LongcatFlashConfig", "LongcatFlashForCausalLM",
                            dict(num_layers=2, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=24,
                                 qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, head_dim=8,
                                 n_routed_experts=4, zero_expert_num=2, moe_topk=2, ffn_hidden_size=128,
                                 expert_ffn_hidden_size=64),
                            note="MLA, two attention sublayers per layer, zero-compute (identity) experts routed "
                                 "by data, shortcut MoE"),
}

#: Recurrent and hybrid families (contract section 12): their recurrent mixers run qeff-kv's own traced step
#: (``qeff_kv/export/modeling/recurrent.py``: ``gated_delta``, ``short_conv``); a linear/conv layer before and after an
#: attention layer.
_GATED_DELTA = dict(head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                    linear_value_head_dim=8, linear_conv_kernel_dim=4, num_hidden_layers=3,
                    layer_types=["linear_attention", "full_attention", "linear_attention"])
_SHORT_CONV = dict(conv_L_cache=3, num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"])
RECURRENT_FAMILIES: dict[str, Family] = {
    "qwen3_next": Family("Qwen3NextConfig", "Qwen3NextForCausalLM",
                         dict(_GATED_DELTA, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                              shared_expert_intermediate_size=32),
                         note="gated delta net (conv_state, recurrent_state), gated attention with partial RoPE, "
                              "MoE with a shared expert"),
    "qwen3_5_text": Family("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(_GATED_DELTA),
                           note="gated delta net, gated attention with partial RoPE (Qwen3.5's text model)"),
    "qwen3_5_moe_text": Family("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM",
                               dict(_GATED_DELTA, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=32),
                               note="gated delta net, MoE with a shared expert (Qwen3.5-MoE's text model)"),
    "olmo_hybrid": Family("OlmoHybridConfig", "OlmoHybridForCausalLM", dict(_GATED_DELTA),
                          note="gated delta net with q/k/v/gate projections, beta in [0, 2] (linear_allow_neg_eigval)"),
    "lfm2": Family("Lfm2Config", "Lfm2ForCausalLM", dict(_SHORT_CONV), note="short-conv layers (conv_state only)"),
    "lfm2_moe": Family("Lfm2MoeConfig", "Lfm2MoeForCausalLM",
                       dict(_SHORT_CONV, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                            num_dense_layers=1), note="short-conv layers, MoE"),
    "lfm3": Family("Lfm3Config", "Lfm3ForCausalLM",
                   dict(conv_L_cache=3, num_hidden_layers=4, head_dim=16, sliding_window=SW,
                        layer_types=["conv", "sliding_attention", "conv", "full_attention"]),
                   note=f"short-conv layers, gated attention, a sliding layer (window {SW}: a ring buffer on the "
                        "ScatterND targets) and a full one with proportional partial RoPE"),
    "kimi_linear": Family("KimiLinearConfig", "KimiLinearForCausalLM",
                          dict(num_hidden_layers=3,
                               layer_types=["linear_attention", "full_attention", "linear_attention"],
                               mlp_layer_types=["dense", "sparse", "sparse"], linear_num_heads=2, linear_head_dim=16,
                               linear_conv_kernel_dim=4, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
                               q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                               num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_group=1,
                               topk_group=1),
                          note="Kimi delta attention (per-channel decay; conv_state, recurrent_state), MLA attention "
                               "without RoPE, MoE and dense MLPs"),
    "bailing_hybrid": Family("BailingHybridConfig", "BailingHybridForCausalLM",
                             dict(num_hidden_layers=3, layer_types=["linear_attention", "full_attention",
                                                                    "linear_attention"],
                                  mlp_layer_types=["dense", "sparse", "sparse"], head_dim=16, short_conv_kernel_size=4,
                                  num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8,
                                  qk_nope_head_dim=16, v_head_dim=16, num_experts=4, num_experts_per_tok=2,
                                  moe_intermediate_size=32, n_group=1, topk_group=1),
                             note="KDA with a bounded gate (kda_safe_gate), MLA with interleaved RoPE and a head-wise "
                                  "output gate, MoE and dense MLPs"),
}


# --- recurrent and hybrid (contract section 12): the Mamba2 mixer ----------------------------------------------
_MAMBA = dict(mamba_n_heads=4, mamba_d_head=32, mamba_d_state=8, mamba_n_groups=2, mamba_d_conv=4, mamba_expand=2,
              mamba_chunk_size=8)
FAMILIES.update({
    "mamba2": Family("Mamba2Config", "Mamba2ForCausalLM",
                     dict(num_heads=4, head_dim=32, state_size=8, n_groups=2, conv_kernel=4, expand=2, chunk_size=8),
                     base=dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, initializer_range=0.15,
                               bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False),
                     note="pure Mamba2: conv_state/recurrent_state only", recurrent=True),
    "bamba": Family("BambaConfig", "BambaForCausalLM", dict(_MAMBA, num_hidden_layers=3, attn_layer_indices=[1]),
                    note="hybrid: Mamba2 layers 0, 2, attention layer 1", recurrent=True),
    "granitemoehybrid": Family("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM",
                               dict(_MAMBA, num_hidden_layers=3,
                                    layer_types=["linear_attention", "full_attention", "linear_attention"],
                                    num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=64,
                                    embedding_multiplier=2.0, logits_scaling=4.0, residual_multiplier=0.5,
                                    attention_multiplier=0.3),
                               note="hybrid Mamba2/attention, MoE, Granite multipliers", recurrent=True),
    "falcon_h1": Family("FalconH1Config", "FalconH1ForCausalLM",
                        dict(_MAMBA, mamba_d_ssm=None, head_dim=16, lm_head_multiplier=0.5, embedding_multiplier=2.0,
                             ssm_multipliers=[1.5, 0.5, 1.0, 2.0, 1.0], ssm_in_multiplier=0.7,
                             ssm_out_multiplier=1.2, attention_in_multiplier=0.8, attention_out_multiplier=0.9,
                             key_multiplier=1.1, mlp_multipliers=[1.2, 0.8]),
                        note="parallel hybrid: attention and Mamba2 in every layer, its multipliers", recurrent=True),
    "nemotron_h": Family("NemotronHConfig", "NemotronHForCausalLM",
                         dict(num_hidden_layers=4, head_dim=16, mamba_num_heads=4, mamba_head_dim=32,
                              ssm_state_size=8, n_groups=2, conv_kernel=4, expand=2, chunk_size=8,
                              layers_block_type=["linear_attention", "mlp", "full_attention", "moe"],
                              n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                              moe_shared_expert_intermediate_size=32),
                         note="MLP/MoE blocks as stateless layers of their own", recurrent=True),
})


def make_family_dir(name: str, root: Path, seed: int = 0) -> Path:
    """Save the tiny seeded model of family ``name`` with safetensors weights; return its folder."""
    import torch
    import transformers

    fam = FAMILIES[name] if name in FAMILIES else RECURRENT_FAMILIES[name]
    cfg = getattr(transformers, fam.config_class)(**fam.config_kwargs())
    cfg.architectures = [fam.model_class]
    torch.manual_seed(seed)
    model = getattr(transformers, fam.model_class)(cfg).eval()
    out = root / f"tiny-{name}"
    model.save_pretrained(out, safe_serialization=True)
    return out


#: Expected outcome per family and target: ``"exact"``, or ``"refused: <start of the one-line message>"``.
#: ``docs/supported-models.md`` is generated from this table and FAMILIES (tests/helpers/gen_supported_models.py);
#: tests/export/test_families.py proves every cell.
EXACT_EVERYWHERE = {t: "exact" for t in TARGETS}
EXPECT: dict[str, dict[str, str]] = {name: dict(EXACT_EVERYWHERE) for name in FAMILIES}
#: the same per recurrent family (tests/export/test_recurrent_families.py proves every cell): the KDA families'
#: attention layers are MLA, which GroupQueryAttention cannot express
RECURRENT_EXPECT: dict[str, dict[str, str]] = {name: dict(EXACT_EVERYWHERE) for name in RECURRENT_FAMILIES}
for _name, _cls in (("kimi_linear", "KimiLinearForCausalLM"), ("bailing_hybrid", "BailingHybridForCausalLM")):
    RECURRENT_EXPECT[_name]["onnxruntime-fused"] = (f"refused: --target onnxruntime-fused cannot express {_cls}'s "
                                                    f"multi-head latent attention")
#: onnxruntime-fused refusals, from the config (qeff_kv/export/facts/family.py, ModelFacts.fused_refusal)
EXPECT["gptj"]["onnxruntime-fused"] = "refused: --target onnxruntime-fused cannot express GPTJForCausalLM's attention"
EXPECT["nemotron_h"] = {t: "refused: NemotronHForCausalLM has layers without any state" for t in TARGETS}
EXPECT["deepseek_v3"]["onnxruntime-fused"] = ("refused: --target onnxruntime-fused cannot express "
                                              "DeepseekV3ForCausalLM's multi-head latent attention")
EXPECT["diffllama"]["onnxruntime-fused"] = ("refused: --target onnxruntime-fused cannot express "
                                            "DiffLlamaForCausalLM's differential attention")
EXPECT["deepseek_v2"]["onnxruntime-fused"] = ("refused: --target onnxruntime-fused cannot express "
                                              "DeepseekV2ForCausalLM's multi-head latent attention")
EXPECT["deepseek_v32"]["onnxruntime-fused"] = ("refused: --target onnxruntime-fused cannot express "
                                               "DeepseekV32ForCausalLM's DeepSeek sparse attention")
EXPECT["glm_moe_dsa"]["onnxruntime-fused"] = ("refused: --target onnxruntime-fused cannot express "
                                              "GlmMoeDsaForCausalLM's DeepSeek sparse attention")
EXPECT["deepseek_v4"] = {t: "refused: DeepseekV4ForCausalLM: its compressed attention layers" for t in TARGETS}
EXPECT["minicpm3"]["onnxruntime-fused"] = ("refused: --target onnxruntime-fused cannot express "
                                           "MiniCPM3ForCausalLM's multi-head latent attention")
EXPECT["longcat_flash"]["onnxruntime-fused"] = ("refused: --target onnxruntime-fused cannot express "
                                                "LongcatFlashForCausalLM's multi-head latent attention")
EXPECT["mistral4"]["onnxruntime-fused"] = ("refused: --target onnxruntime-fused cannot express "
                                           "Mistral4ForCausalLM's multi-head latent attention")
EXPECT["llama4_text"]["onnxruntime-fused"] = ("refused: --target onnxruntime-fused cannot express "
                                              "Llama4ForCausalLM's chunked attention")
EXPECT["jetmoe"]["onnxruntime-fused"] = ("refused: --target onnxruntime-fused cannot express JetMoeForCausalLM's "
                                         "mixture of attention heads")
