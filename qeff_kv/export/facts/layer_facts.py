"""The attention layout of a decoder read from its config (no torch): sliding-window and chunked layers, the
layers that apply RoPE and its kinds, latent (MLA) attention, logit scaling, and the model types whose attention
code is special. Pure functions of the text config dict, each proved in ``tests/export/test_family_facts.py``; the facts of
:class:`.family.ModelFacts` are built from them.
"""

from __future__ import annotations

from qeff_kv.export.facts.config_values import float_or_none, int_or_none


def has_mrope(text: dict) -> bool:
    for key in ("rope_parameters", "rope_scaling"):
        rope = text.get(key)
        if isinstance(rope, dict) and ("mrope_section" in rope or rope.get("type") == "mrope"
                                       or rope.get("rope_type") == "mrope"):
            return True
    return False


def chunked_attention(text: dict, num_layers: int) -> dict:
    """Chunked attention layers (``layer_types`` ``"chunked_attention"`` with ``attention_chunk_size``) and the
    NoPE attention temperature threshold (``attn_temperature_tuning`` with ``floor_scale``, where a layer has no
    RoPE: ``no_rope_layers`` 0), as :class:`ModelFacts` fields."""
    out: dict = {}
    chunk = int_or_none(text.get("attention_chunk_size"))
    layer_types = text.get("layer_types")
    if chunk and isinstance(layer_types, list):
        layers = tuple(i for i, t in enumerate(layer_types[:num_layers]) if t == "chunked_attention")
        if layers:
            out.update(attention_chunk=chunk, chunked_layers=layers)
    flags = text.get("no_rope_layers")
    floor = int_or_none(text.get("floor_scale"))
    if text.get("attn_temperature_tuning") and floor and isinstance(flags, list) and not all(flags[:num_layers]):
        out["temperature_floor"] = floor
    return out


def rope_types(text: dict) -> tuple[str, ...]:
    """The RoPE variants of ``rope_parameters`` (transformers 5) or ``rope_scaling`` (older configs), either one
    set of parameters or one per layer type (Gemma3: ``{"sliding_attention": {...}, "full_attention": {...}}``);
    ``rope_type`` (or the older ``type``) names the variant, ``"default"`` when absent. Sorted, unique."""
    rope = text.get("rope_parameters") or text.get("rope_scaling")
    if not isinstance(rope, dict):
        return ()
    per_type = [v for v in rope.values() if isinstance(v, dict)]
    sets = per_type if per_type and not ({"rope_type", "type"} & set(rope)) else [rope]
    return tuple(sorted({str(p.get("rope_type") or p.get("type") or "default") for p in sets}))


#: config classes with a top-level ``original_max_position_embeddings`` field of their own, and its default:
#: transformers gives that field priority over ``rope_parameters`` (``standardize_rope_params``), default included
_OWN_ORIGINAL_MAX_POSITIONS: dict[str, int] = {"phi3": 4096, "phi4_multimodal": 4096}


def longrope_threshold(text: dict, model_type: str) -> int | None:
    """The effective ``original_max_position_embeddings`` of a longrope config, as transformers 5.23 settles it:
    one global set of RoPE parameters takes the config's top-level field when present (or when the config class
    has one: Phi-3's defaults to 4096), else its own value, else ``max_position_embeddings``; per-layer-type sets
    take their own value, else ``max_position_embeddings``. The smallest over longrope sets; ``None`` without."""
    rope = text.get("rope_parameters") or text.get("rope_scaling")
    if not isinstance(rope, dict):
        return None
    per_type = [v for v in rope.values() if isinstance(v, dict)]
    nested = bool(per_type) and not ({"rope_type", "type"} & set(rope))
    sets = [p for p in (per_type if nested else [rope]) if (p.get("rope_type") or p.get("type")) == "longrope"]
    if not sets:
        return None
    max_pos = int_or_none(text.get("max_position_embeddings"))
    if not nested:
        top = int_or_none(text.get("original_max_position_embeddings"))
        if top is None:
            top = _OWN_ORIGINAL_MAX_POSITIONS.get(model_type)
        if top is not None:
            return top
    values = [int_or_none(p.get("original_max_position_embeddings")) for p in sets]
    values = [v if v is not None else max_pos for v in values]
    values = [v for v in values if v is not None]
    return min(values) if values else None


def logits_scaling(text: dict) -> float | None:
    """What the logits are divided by: ``logits_scaling`` (Granite), else ``hidden_size / dim_model_base``
    (MiniCPM3 divides the hidden states by it before its bias-free output head, a property of its config class
    that ``config.json`` does not carry)."""
    value = float_or_none(text.get("logits_scaling"))
    base = float_or_none(text.get("dim_model_base"))
    hidden = float_or_none(text.get("hidden_size"))
    if value is None and base and hidden:
        value = hidden / base
    return value


def sliding_layers(text: dict, num_layers: int) -> tuple[int | None, tuple[int, ...]]:
    """Sliding window and the layers that use it, from ``sliding_window``, ``layer_types``,
    ``use_sliding_window``, ``sliding_window_pattern`` and ``max_window_layers``."""
    window = text.get("sliding_window")
    if not window or text.get("use_sliding_window") is False:
        return None, ()
    window = int(window)
    layer_types = text.get("layer_types")
    if isinstance(layer_types, list) and layer_types:
        return window, tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
    pattern = text.get("sliding_window_pattern")
    if isinstance(pattern, int) and pattern > 0:
        return window, tuple(i for i in range(num_layers) if (i + 1) % pattern != 0)
    return window, tuple(range(num_layers))


#: Decoder families whose attention does not go through transformers' AttentionInterface, by ``model_type``
#: (read from transformers 5.23's modeling code): ``"sdpa"`` calls ``torch.nn.functional.
#: scaled_dot_product_attention`` itself when the attention implementation is "sdpa" (Falcon); ``"eager"``
#: computes attention in its own code whatever the implementation (causal LMs with neither
#: ``_supports_attention_backend`` nor ``_supports_sdpa``). Every other family: ``"interface"``.
ATTENTION_CODE: dict[str, str] = {
    "falcon": "sdpa",
    **{t: "eager" for t in ("gptj", "codegen", "gpt_neo", "bloom", "mpt", "gpt_neox_japanese", "xglm",
                            "openai-gpt")},
}
#: ``model_type`` values whose attention adds learned per-head sink logits to the softmax (a ``sinks``
#: parameter in transformers 5.23); their configs carry no field that says so, so the type is the fact
ATTENTION_SINK_MODEL_TYPES = frozenset({"gpt_oss", "granite_swa", "granitemoe_swa", "mimo_v2_flash", "hy_v4",
                                        "flint", "deepseek_v4", "openai_privacy_filter"})
#: attention GroupQueryAttention cannot compute, by ``model_type`` (transformers 5.23's modeling code): what
#: the layer does instead, for the fused target's refusal
FUSED_ATTENTION_LIMITS: dict[str, str] = {
    # DiffLlamaAttention calls attention twice per layer, each time over one half of the values repeated, and
    # subtracts the two (lambda-weighted): GQA appends the values it is given to the cache, so cannot do either
    "diffllama": ("differential attention (two attention maps over the two halves of the values, subtracted; "
                  "GroupQueryAttention attends over the cached values once)"),
    # JetMoeAttention repeats its key/value heads in tiled order (head h reads kv head h % Hkv) for the query heads
    # of its top-k routed attention experts, after the cache update: GQA groups heads the other way and appends
    # the keys it is given
    "jetmoe": ("mixture of attention heads (routed query experts over key/value heads repeated in tiled order "
               "after the cache update)"),
}
#: families that always use ALiBi (no config switch)
ALWAYS_ALIBI = frozenset({"bloom", "mpt"})
#: families that rotate only their sliding-window layers when a window is configured, by ``model_type``, and
#: what they rotate without a window (transformers 5.23): ``"all"`` where the code reads ``sliding_window is
#: None or is_sliding`` (Exaone4, ExaoneMoe, Kolibri1), ``"none"`` where only a layer with a window rotates
#: (Cohere2, Flint, AFMoE)
_ROPE_ON_SLIDING_LAYERS_ONLY: dict[str, str] = {"exaone4": "all", "exaone_moe": "all", "kolibri1": "all",
                                                "cohere2": "none", "flint": "none", "afmoe": "none"}


def rope_layers(text: dict, num_layers: int, window: int | None, sliding: tuple[int, ...]) -> tuple[int, ...]:
    """The layers that apply RoPE, of the attention layers (:func:`_attention_layers`: a recurrent layer never
    does): ``no_rope_layers`` (SmolLM3, Llama4: ``1`` means the layer uses RoPE), ``layer_rope_theta``
    (GraniteSWA: a base of 0 means no RoPE), the sliding layers of the families in
    :data:`_ROPE_ON_SLIDING_LAYERS_ONLY`, else every layer."""
    attention = set(attention_layers(text, num_layers))
    return tuple(i for i in rope_layers_of_config(text, num_layers, window, sliding) if i in attention)


def attention_layers(text: dict, num_layers: int) -> tuple[int, ...]:
    """The layers that attend: where ``layer_types`` (or a ``layers_block_type`` list) names each layer, those
    whose type is an attention type (``full_attention``, ``sliding_attention``, ``attention``...) and not
    ``linear_attention`` (a gated delta net: Qwen3-Next, Qwen3.5) nor ``conv``/``mamba``/``mlp``/``moe``
    (LFM2's short conv, the Mamba2 hybrids, NemotronH's MLP layers); else every layer."""
    types = text.get("layer_types")
    if not (isinstance(types, list) and len(types) >= num_layers):
        types = text.get("layers_block_type")
    if not (isinstance(types, list) and len(types) >= num_layers):
        return tuple(range(num_layers))
    return tuple(i for i in range(num_layers)
                 if "attention" in str(types[i]) and str(types[i]) != "linear_attention")


def rope_layers_of_config(text: dict, num_layers: int, window: int | None,
                           sliding: tuple[int, ...]) -> tuple[int, ...]:
    flags = text.get("no_rope_layers")
    if isinstance(flags, list) and len(flags) >= num_layers:
        return tuple(i for i in range(num_layers) if flags[i])
    thetas = text.get("layer_rope_theta")
    if isinstance(thetas, list) and len(thetas) >= num_layers:
        return tuple(i for i in range(num_layers) if thetas[i])
    without_window = _ROPE_ON_SLIDING_LAYERS_ONLY.get(str(text.get("model_type")))
    if without_window is not None:
        if window:
            return sliding
        return tuple(range(num_layers)) if without_window == "all" else ()
    return tuple(range(num_layers))


#: onnxruntime's CPU GroupQueryAttention (the pinned 1.32) runs head sizes that are a multiple of this only ("head_size
#: shall be a multiple of 16" at run time)
FUSED_HEAD_SIZE_MULTIPLE = 16


def attention_head_dims(text: dict) -> tuple[int, ...]:
    """The head sizes the config gives its attention layers: ``head_dim`` (else ``hidden_size`` over
    ``num_attention_heads``, or GPT-2's ``n_embd`` over ``n_head``) and Gemma 4's ``global_head_dim`` for its full
    layers; sorted, unique, empty when the config does not say."""
    dims = set()
    head_dim = int_or_none(text.get("head_dim"))
    if head_dim:
        dims.add(head_dim)
    else:
        hidden = int_or_none(text.get("hidden_size") or text.get("n_embd"))
        heads = int_or_none(text.get("num_attention_heads") or text.get("n_head"))
        if hidden and heads and hidden % heads == 0:
            dims.add(hidden // heads)
    global_dim = int_or_none(text.get("global_head_dim"))
    if global_dim:
        dims.add(global_dim)
    return tuple(sorted(dims))


def latent_attention(text: dict) -> bool:
    """Keys and values of different head sizes: MLA (``kv_lora_rank``), or ``v_head_dim`` other than the key's
    ``qk_nope_head_dim + qk_rope_head_dim`` / ``head_dim``."""
    if text.get("kv_lora_rank"):
        return True
    v = text.get("v_head_dim")
    if v is None:
        return False
    if text.get("qk_nope_head_dim") is not None or text.get("qk_rope_head_dim") is not None:
        return int(v) != int(text.get("qk_nope_head_dim") or 0) + int(text.get("qk_rope_head_dim") or 0)
    return text.get("head_dim") is not None and int(v) != int(text["head_dim"])


def kv_sharing(text: dict, num_layers: int) -> tuple[tuple[int, int], ...]:
    """Layers that attend over an earlier layer's keys and values and keep none of their own (Gemma 4, Gemma 3n:
    ``num_kv_shared_layers``), as ``(layer, source)`` pairs: the last ``num_kv_shared_layers`` layers each read the
    last layer before them of the same ``layer_types`` entry (transformers 5.24 ``kv_sharing_modes``: that layer
    "stores", the shared layers "reuse"). A shared layer whose type no earlier layer has gets source ``-1`` (see
    :func:`kv_sharing_problem`). Empty without sharing."""
    shared = int_or_none(text.get("num_kv_shared_layers")) or 0
    if shared <= 0 or num_layers <= 0:
        return ()
    types = text.get("layer_types")
    if not (isinstance(types, list) and len(types) >= num_layers):
        types = ["full_attention"] * num_layers
    first = max(num_layers - shared, 0)
    pairs = []
    for i in range(first, num_layers):
        source = next((j for j in range(first - 1, -1, -1) if types[j] == types[i]), -1)
        pairs.append((i, source))
    return tuple(pairs)


def kv_sharing_problem(pairs: tuple[tuple[int, int], ...], architecture: str) -> str | None:
    """Why the shared-KV layout of :func:`kv_sharing` cannot be exported (a shared layer with no earlier
    layer of its type to read), or ``None``."""
    orphans = [layer for layer, source in pairs if source < 0]
    if not orphans:
        return None
    return (f"{architecture}: shared-KV layers {orphans} (num_kv_shared_layers) have no earlier layer of their "
            f"attention type to read keys and values from; fix the config's layer_types or num_kv_shared_layers")


def indexed_layers(text: dict, num_layers: int) -> tuple[int, ...]:
    """DeepSeek sparse attention (``index_topk``: DeepSeek-V3.2, GLM-5's ``glm_moe_dsa``): the layers that run their
    own lightning indexer, so keep its keys (``index_key.{i}``): those whose ``indexer_types`` entry is ``"full"``
    (a ``"shared"`` layer reuses the previous layer's selection and keeps none; transformers derives the list from
    ``index_topk_pattern`` or ``index_topk_freq``/``index_skip_topk_offset`` when the config has none), else every
    attention layer. Empty without ``index_topk``."""
    if not text.get("index_topk"):
        return ()
    types = text.get("indexer_types")
    pattern = text.get("index_topk_pattern")
    if not isinstance(types, list) and pattern is not None:
        types = [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
    if not isinstance(types, list) and text.get("index_topk_freq") is not None:
        freq, offset = max(int(text["index_topk_freq"]), 1), int(text.get("index_skip_topk_offset", 2))
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers)]
    if isinstance(types, list) and len(types) >= num_layers:
        return tuple(i for i in range(num_layers) if types[i] == "full")
    return attention_layers(text, num_layers)


#: the sparse-attention families whose indexer qeff-kv traces (``export/modeling/sparse.py``: an MLA module with a
#: lightning indexer, DeepSeek-V3.2's layout), by ``model_type``; other configs with ``index_topk`` (AXK2, HY-V4,
#: Mistral-Large-4: indexers of their own layout, transformers 5.24) are refused from the config
SPARSE_ATTENTION_MODEL_TYPES = frozenset({"deepseek_v32", "glm_moe_dsa"})


def unknown_indexer_refusal(text: dict, model_type: str) -> str | None:
    """Why a sparse-attention model (``index_topk``) whose indexer is not one qeff-kv traces cannot be exported
    (:data:`SPARSE_ATTENTION_MODEL_TYPES`), or ``None``."""
    if not text.get("index_topk") or model_type in SPARSE_ATTENTION_MODEL_TYPES:
        return None
    return (f"its sparse attention's indexer ({model_type}'s own, index_topk {text['index_topk']}) is not the "
            f"DeepSeek-V3.2 / GLM-5 indexer qeff-kv traces")


def compressed_attention_refusal(text: dict) -> str | None:
    """Why the model's compressed attention cannot be a retained-state graph (``compress_rates``, or the older
    checkpoints' ``compress_ratios`` / ``compress_rate_csa``: DeepSeek-V4's compressed sparse and heavily compressed
    attention layers), or ``None``."""
    if not any(text.get(k) for k in ("compress_rates", "compress_ratios", "compress_rate_csa", "compress_rate_hca")):
        return None
    return ("its compressed attention layers (compress_rates) keep running compressor buffers that emit one cache "
            "entry per window of compress_rate tokens, a cache that grows by windows rather than one slot per "
            "position, and its hyper-connections (hc_mult) carry several residual streams between layers")
