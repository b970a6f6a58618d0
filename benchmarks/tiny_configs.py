"""A tiny config of any transformers model type, shrunk generically from its config class's defaults.

Used by ``benchmarks/family_matrix.py``. The rules are generic (by field name); :data:`OVERRIDES` holds the few
per-type corrections a generic rule cannot make, each with its reason. Importing this module needs neither torch
nor transformers; :func:`tiny_config` and :func:`build_tiny` import them.

Layers: every layer kind the defaults have is kept. A layer's kind is its entries in the per-layer fields
(``layer_types``, ``mlp_layer_types``, ``no_rope_layers``, a hybrid pattern string...), its membership in the
index-list fields (``mlp_only_layers``, ``full_attn_idxs``...) and its side of the counted-from-the-start or -end
fields (``first_k_dense_replace``, ``num_kv_shared_layers``...). The first layer of each kind is kept (at least
two layers), and every one of those fields is rewritten for the kept layers.
"""

from __future__ import annotations

HIDDEN, VOCAB, HEAD_DIM, HEADS, FFN, MOE_FFN, EXPERTS, SLIDING = 64, 128, 16, 4, 128, 32, 4, 6
INIT = 0.15
BOS, EOS, PAD = 1, 2, 0

_WIDTH = {"hidden_size", "d_model", "n_embd", "embedding_dim", "emb_dim", "dim", "hidden_dim", "word_embed_proj_dim",
          "embedding_size", "hidden_size_global", "input_embedding_size", "output_embedding_size", "lru_width",
          "attention_hidden_size", "projector_input_dim", "projector_output_dim", "router_hidden_size",
          "backbone_hidden_size", "ple_embed_dim"}
_HEADS = {"num_attention_heads", "n_head", "n_heads", "num_heads", "attention_heads", "decoder_attention_heads",
          "encoder_attention_heads", "swa_num_attention_heads", "linear_num_heads", "index_n_heads",
          "num_decoder_attention_heads", "num_encoder_attention_heads", "conf_num_attention_heads"}
_KV_HEADS = {"num_key_value_heads", "num_kv_heads", "n_kv_heads", "kv_n_heads", "swa_num_key_value_heads",
             "num_query_groups"}
_HEAD_DIMS = {"head_dim", "attention_head_dim", "d_head", "dim_head", "kv_channels", "swa_head_dim",
              "linear_head_dim", "linear_key_head_dim", "linear_value_head_dim", "index_head_dim", "mamba_d_head",
              "mamba_head_dim", "mamba_headdim", "attention_head_size", "qk_nope_head_dim", "v_head_dim", "d_kv",
              "d_rel"}
_FIXED = {"qk_rope_head_dim": 8, "qk_head_dim": 24, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
          "mamba_n_heads": 8, "mamba_num_heads": 8, "n_mamba_heads": 2, "mamba_d_ssm": 128,
          "mamba_d_state": 16, "ssm_state_size": 16, "state_size": 16, "mamba_dt_rank": 8, "time_step_rank": 8,
          "chunk_size": 16, "mamba_chunk_size": 16, "q_lora_rank": 32, "kv_lora_rank": 32, "index_topk": 8,
          "index_block_size": 4, "index_topk_blocks": 2, "laurel_rank": 16, "adapter_rank": 16, "hc_lowrank": 16,
          "loop_gate_rank": 8, "gated_norm_rank": 8, "hidden_size_per_layer_input": 16, "altup_num_inputs": 2,
          "rotary_dim": 8, "attention_chunk_size": 8}
_FFN = {"intermediate_size", "ffn_dim", "d_ff", "dim_ff", "dff", "d_inner", "ffn_hidden_size", "decoder_ffn_dim",
        "encoder_ffn_dim", "feed_forward_size", "intermediate_size_mlp", "dense_intermediate_size", "mlp_dim"}
_MOE_FFN = {"moe_intermediate_size", "expert_ffn_hidden_size", "shared_expert_intermediate_size",
            "shared_experts_intermediate_size", "moe_shared_expert_intermediate_size", "shared_intermediate_size"}
_EXPERTS = {"num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts"}
_TOP_K = {"num_experts_per_tok", "num_experts_per_token", "moe_k", "moe_top_k", "moe_topk"}
_ONE = {"n_shared_experts", "num_shared_experts", "moe_num_shared_experts", "n_group", "num_expert_group",
        "topk_group", "n_groups", "mamba_n_groups", "mamba_ngroups", "num_nextn_predict_layers"}
_POSITIONS = {"max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "context_length",
              "max_target_positions", "model_max_length"}
_WINDOWS = {"sliding_window", "sliding_window_size", "attention_window_size", "local_attention_window_len"}
#: periodic layer patterns (every p-th layer): shrunk to a period of 2 so two layers show both kinds
_PERIODS = {"sliding_window_pattern", "_sliding_window_pattern", "global_attn_every_n_layers",
            "no_rope_layer_interval", "interleave_moe_layer_step", "attn_layer_period", "expert_layer_period",
            "moe_layer_interval", "decoder_sparse_step", "layer_group_size", "full_attention_interval",
            "moe_layer_freq"}
_OFFSETS = {"attn_layer_offset", "expert_layer_offset"}
#: layers counted from the start (the first k are of one kind) or from the end (the last k)
_FROM_START = {"first_k_dense_replace", "num_dense_layers", "moe_layer_start_index", "max_window_layers"}
_FROM_END = {"num_kv_shared_layers"}
_LAYERS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers")
_OTHER_LAYERS = {"encoder_layers", "decoder_layers", "num_decoder_layers", "num_encoder_layers",
                 "conf_num_hidden_layers", "num_layers_per_stack", "n_input_layers", "n_output_layers",
                 "n_recurrent_layers", "num_global_layers"}
_INITS = {"initializer_range", "init_std", "embedding_initializer_range"}
_GENERIC_SUFFIXES = ("_size", "_dim", "rank", "_channels")
_NOT_GENERIC = ("vocab", "patch", "image", "kernel", "chunk_size_feed_forward", "conv", "window", "merge", "block")

#: Per-type corrections a generic rule cannot make (each with its reason); applied after the generic rules.
OVERRIDES: dict[str, dict] = {
    # its attention is multi-head with num_kv_heads only read under new_decoder_architecture; 71 kv heads of the
    # defaults shrink to 2, which the default (multi_query) layout ignores: keep the defaults' meaning
    "falcon": dict(num_kv_heads=HEADS),
    # the gated delta net's value heads are a multiple of its key heads and its conv spans both: 2 and 4 keep it
    "qwen3_next": dict(linear_num_key_heads=2, linear_num_value_heads=4),
    # the default hidden 4096 / 64 Mamba2 heads: heads x head_dim must equal expand x hidden (2 x 64 = 128)
    "nemotron_h": dict(mamba_num_heads=8, mamba_head_dim=16, n_groups=1),
    "zamba2": dict(mamba_headdim=16, mamba_ngroups=1),
    # Mamba2: num_heads x head_dim must equal expand x hidden (128)
    "mamba2": dict(num_heads=8, head_dim=16),
    "falcon_h1": dict(mamba_d_ssm=128, mamba_n_heads=8, mamba_d_head=16),
    # the defaults leave the routed experts' top-k unset (None): they do not build at full size either
    "deepseek_v2": dict(num_experts_per_tok=2),
    # the defaults leave the sparse indexer's geometry unset (None)
    "qwen4_exp_text": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=16,
                           indexer_compress_ratio=4),
    # its defaults have no layer_types (None; the checkpoints name them): one short-conv and one attention layer
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_hidden_layers=2, num_dense_layers=1),
}


def _kv_heads(orig_kv, orig_heads):
    if orig_kv is None or orig_heads is None:
        return 2
    return HEADS if orig_kv >= orig_heads else 1 if orig_kv == 1 else 2


def _token_ids(d: dict) -> None:
    """Special token ids inside the tiny vocabulary: bos 1, eos 2, pad 0, the others high and distinct."""
    spare = iter(range(VOCAB - 1, 3, -1))
    for k in sorted(d):
        v = d[k]
        if k == "bos_token_id" and v is not None:
            d[k] = BOS
        elif k == "eos_token_id" and v is not None:
            d[k] = [EOS] if isinstance(v, list) else EOS
        elif k == "pad_token_id" and v is not None:
            d[k] = PAD
        elif (k.endswith("_token_id") or k.endswith("_token_index") or k.endswith("_token_ids")) and v is not None:
            if isinstance(v, int) and not isinstance(v, bool) and v >= VOCAB:
                d[k] = next(spare)
            elif isinstance(v, list) and any(isinstance(x, int) and x >= VOCAB for x in v):
                d[k] = [next(spare) for _ in v]


def _scale(k: str, v, d: dict, orig: dict):
    """The tiny value of one scalar field (``v`` unchanged where no rule applies)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return v
    if k in _INITS:
        return INIT
    if not isinstance(v, int):
        return v
    if "vocab_size" in k and k != "type_vocab_size":
        return min(v, VOCAB)
    if k in _WIDTH:
        return min(v, HIDDEN)
    if k in _HEADS:
        return min(v, HEADS)
    if k in _KV_HEADS:
        return min(v, _kv_heads(v, orig.get("num_attention_heads", orig.get("n_head"))))
    if k in _HEAD_DIMS:
        return min(v, HEAD_DIM)
    if k in _FIXED:
        return min(v, _FIXED[k]) if v > 0 else v
    if k in _FFN:
        return min(v, FFN)
    if k in _MOE_FFN:
        return min(v, MOE_FFN)
    if k in _EXPERTS:
        return min(v, EXPERTS)
    if k in _TOP_K:
        return min(v, 2)
    if k in _ONE:
        return min(v, 1)
    if k in _POSITIONS:
        return min(v, 128)
    if k in _WINDOWS:
        return min(v, SLIDING) if v > 0 else v
    if k in _PERIODS:
        return min(v, 2)
    if k in _OFFSETS:
        return min(v, 1)
    if k == "zero_expert_num":
        return min(v, 2)
    if k.endswith(_GENERIC_SUFFIXES) and not any(w in k for w in _NOT_GENERIC) and v > 128:
        return 64
    return v


def _increasing(v, n: int) -> bool:
    return all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < n for x in v) \
        and all(a < b for a, b in zip(v, v[1:]))


def _per_layer(d: dict, n: int) -> tuple[dict, dict]:
    """The per-layer fields (a value per layer) and the index-list fields (layer numbers, increasing; or a dict
    keyed by layer number, kept as a list of its keys) of config dict ``d``."""
    per, idx = {}, {}
    for k, v in d.items():
        if isinstance(v, dict) and v and "layer" in k and all(str(x).isdigit() and int(x) < n for x in v):
            idx[k] = sorted(int(x) for x in v)
            continue
        named = k in _FFN or any(w in k for w in ("layer", "type", "pattern", "block", "idxs", "indices", "indexes", "ids"))
        if not named or not isinstance(v, (list, str)) or isinstance(v, str) and k.endswith("_type"):
            continue
        if isinstance(v, list) and v and _increasing(v, n):
            idx[k] = v
        elif len(v) == n and n > 1 and not (isinstance(v, list) and v and all(isinstance(x, dict) for x in v)):
            per[k] = v
    return per, idx


def select_layers(d: dict, n: int) -> list[int]:
    """The layers kept: the first of each kind, at least two (see the module docstring)."""
    per, idx = _per_layer(d, n)
    starts = {k: d[k] for k in _FROM_START if isinstance(d.get(k), int) and not isinstance(d.get(k), bool)}
    ends = {k: d[k] for k in _FROM_END if isinstance(d.get(k), int) and d[k] > 0}

    def kind(i):
        return (tuple(str(v[i]) for v in per.values()) + tuple(i in v for v in idx.values())
                + tuple(i < s for s in starts.values()) + tuple(i >= n - e for e in ends.values()))

    seen, keep = set(), []
    for i in range(n):
        if kind(i) not in seen:
            seen.add(kind(i))
            keep.append(i)
    for i in range(n):
        if len(keep) >= min(2, n):
            break
        if i not in keep:
            keep.append(i)
    return sorted(keep)


def shrink_layers(d: dict) -> None:
    """Keep :func:`select_layers`' layers and rewrite every per-layer field of ``d`` for them."""
    key = next((k for k in _LAYERS if isinstance(d.get(k), int) and not isinstance(d.get(k), bool)), None)
    if key is None:
        return
    n = d[key]
    keep = select_layers(d, n)
    per, idx = _per_layer(d, n)
    for k, v in per.items():
        picked = [v[i] for i in keep]
        d[k] = "".join(picked) if isinstance(v, str) else picked
    for k, v in idx.items():
        if isinstance(d[k], dict):
            by_int = {int(x): y for x, y in d[k].items()}
            d[k] = {j: by_int[i] for j, i in enumerate(keep) if i in v}
        else:
            d[k] = [j for j, i in enumerate(keep) if i in v]
    for k in _FROM_START:
        if isinstance(d.get(k), int) and not isinstance(d.get(k), bool):
            d[k] = sum(1 for i in keep if i < d[k])
    for k in _FROM_END:
        if isinstance(d.get(k), int) and d[k] > 0:
            d[k] = sum(1 for i in keep if i >= n - d[k])
    if isinstance(d.get("moe_layer_end_index"), int):
        d["moe_layer_end_index"] = len(keep) - 1
    for k in _LAYERS:
        if isinstance(d.get(k), int) and not isinstance(d.get(k), bool) and d[k] == n:
            d[k] = len(keep)
    for k in _OTHER_LAYERS:   # an encoder's or another stack's layer count: two
        if isinstance(d.get(k), int) and not isinstance(d.get(k), bool):
            d[k] = min(d[k], 2)


def shrink_dict(d: dict, model_type: str | None = None) -> dict:
    """The tiny version of config dict ``d`` (a copy; sub-configs, dicts with a ``model_type``, shrunk too)."""
    orig = dict(d)
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and "model_type" in v:
            out[k] = shrink_dict(v, v.get("model_type"))
        elif isinstance(v, list) and v and all(isinstance(x, int) and not isinstance(x, bool) for x in v) \
                and k in _FFN:
            out[k] = [min(x, FFN) for x in v]
        else:
            out[k] = _scale(k, v, out, orig)
    _token_ids(out)
    if "head_dim" in out and out["head_dim"] is None and out.get("num_attention_heads"):
        out["head_dim"] = HEAD_DIM
    if "num_key_value_heads" in out and out["num_key_value_heads"] is None and out.get("num_attention_heads"):
        out["num_key_value_heads"] = 2
    if isinstance(out.get("head_dim"), int) and isinstance(out.get("hidden_size"), int):
        heads = out.get("num_attention_heads")
        if heads and out["head_dim"] * heads != out["hidden_size"] and orig.get("head_dim") is None:
            out["head_dim"] = out["hidden_size"] // heads
    if isinstance(out.get("qk_rope_head_dim"), int) and isinstance(out.get("head_dim"), int):
        out["head_dim"] = out["qk_rope_head_dim"]   # MLA: the rotary embedding's size is the rope part's
    if out.get("is_decoder") is False:   # an encoder family's LM head is a causal decoder only with is_decoder
        out["is_decoder"] = True
    shrink_layers(out)
    if isinstance(out.get("patch_size"), int) and isinstance(out.get("image_size"), int):
        merge = out.get("spatial_merge_size") if isinstance(out.get("spatial_merge_size"), int) else 1
        out["image_size"] = out["patch_size"] * 4 * max(merge, 1)   # a vision encoder: 4x4 (merged) patches
    if isinstance(out.get("mm_tokens_per_image"), int):
        out["mm_tokens_per_image"] = 16
    rope = out.get("rope_parameters")
    if isinstance(rope, dict) and "original_max_position_embeddings" in rope:
        rope["original_max_position_embeddings"] = min(rope["original_max_position_embeddings"], 64)
    out.update(OVERRIDES.get(model_type or out.get("model_type"), {}))
    return out


def _set_everywhere(d: dict, key: str, value) -> None:
    """Set ``key`` in config dict ``d`` and in each sub-config that has it."""
    if key in d:
        d[key] = value
    for v in d.values():
        if isinstance(v, dict) and "model_type" in v:
            _set_everywhere(v, key, value)


def tiny_config(model_type: str, init: float = INIT, untie: bool = False):
    """The tiny config object of ``model_type`` (its config class's defaults, shrunk); ``init`` the initializer
    range, ``untie`` separate input and output embeddings (tied tiny models often echo their last token)."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    d = shrink_dict(cls().to_dict(), model_type)
    for k in _INITS:
        _set_everywhere(d, k, init)
    if untie:
        _set_everywhere(d, "tie_word_embeddings", False)
    for k in ("transformers_version", "architectures", "_name_or_path"):
        d.pop(k, None)
    return cls.from_dict(d)


def vision_image_size(cfg) -> int | None:
    """The image size to export a tiny vision-language ``cfg`` at where its vision config names none (models that
    take patch rows): 4x4 merged patches; ``None`` where the config has its own."""
    vision = getattr(cfg, "vision_config", None)
    if vision is None or getattr(vision, "image_size", None) or not isinstance(getattr(vision, "patch_size", 0), int):
        return None
    merge = getattr(vision, "spatial_merge_size", 1) or 1
    return vision.patch_size * 4 * merge


def layer_kinds(cfg) -> list[str]:
    """A short description of the kept layers' kinds (for the matrix's table)."""
    d = cfg.to_dict()
    key = next((k for k in _LAYERS if isinstance(d.get(k), int) and not isinstance(d.get(k), bool)), None)
    if key is None:
        return []
    per, _ = _per_layer(d, d[key])
    return sorted({str(v) for vals in per.values() for v in vals})


#: the (init scale, untie) tried in turn until transformers' greedy tokens vary (benchmarks/family_matrix.py)
ATTEMPTS = ((INIT, False), (INIT, True), (0.05, True), (0.4, True))


def build_tiny(model_type: str, class_name: str, out, seed: int = 0, init: float = INIT,
               untie: bool = False) -> dict:
    """Save a tiny seeded random-weight ``class_name`` of ``model_type`` into folder ``out``; returns a summary."""
    import torch
    import transformers

    cfg = tiny_config(model_type, init, untie)
    model_cls = getattr(transformers, class_name)
    want = getattr(model_cls, "config_class", None)
    if want is not None and not isinstance(cfg, want):   # a composite config whose CausalLM takes its text part
        cfg = cfg.get_text_config()
    cfg.architectures = [class_name]
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    model.save_pretrained(out, safe_serialization=True)
    params = sum(p.numel() for p in model.parameters())
    text = cfg.get_text_config()
    n = next((getattr(text, k) for k in _LAYERS if isinstance(getattr(text, k, None), int)), None)
    return dict(params=params, layers=n, kinds=layer_kinds(text), init=init,
                tied=bool(getattr(cfg, "tie_word_embeddings", False)))
