"""Family quirks as facts read from a model's ``config.json``, in one place. No torch here.

The exporter never asks ``model_type == ...``: it asks these facts. Each fact names the config fields it
reads and is proved by a test in ``tests/export/test_family_facts.py`` (and, end to end, by the family matrix in
``tests/export/test_families.py``). Where a target cannot express a model, :meth:`ModelFacts.refusal` says so from
the config alone, before anything is loaded or traced. The facts never import the targets: what a target can do
(ring buffers, GroupQueryAttention) comes with the options (``ExportOptions.target_info``, from the registry).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

from qeff_kv.errors import ExportError
from qeff_kv.export.facts.config_values import first_of, float_or_none, int_or_none
from qeff_kv.export.facts.layer_facts import (  # noqa: F401 (the constants: tests read them here)
    ALWAYS_ALIBI, ATTENTION_CODE, ATTENTION_SINK_MODEL_TYPES, FUSED_ATTENTION_LIMITS, FUSED_HEAD_SIZE_MULTIPLE,
    attention_head_dims, chunked_attention, compressed_attention_refusal, has_mrope, indexed_layers, kv_sharing,
    kv_sharing_problem, latent_attention, logits_scaling, longrope_threshold, rope_layers, rope_types, sliding_layers,
    unknown_indexer_refusal)
from qeff_kv.export.facts.recurrent_facts import (RECURRENT_REFUSALS, RECURRENT_TEXT_MODEL_TYPES, RecurrentFacts,
                                                  mixer_layer_types, recurrent_facts)


#: language models that a vision-language ``config.json`` names by a type of its own, which transformers reads as
#: another family's (Exaone4.5's ``exaone4_5_text`` is exaone4: ``Exaone4_5_Config.__post_init__``, 5.24)
TEXT_MODEL_TYPE_ALIASES = {"exaone4_5_text": "exaone4"}


def text_config(config: dict) -> dict:
    """The language model's section of a config: ``text_config`` for multimodal configs (its ``model_type`` read as
    transformers reads it, :data:`TEXT_MODEL_TYPE_ALIASES`), else the config."""
    sub = config.get("text_config")
    if not isinstance(sub, dict):
        return config
    alias = TEXT_MODEL_TYPE_ALIASES.get(str(sub.get("model_type")))
    return sub if alias is None else {**sub, "model_type": alias}


@dataclass(frozen=True)
class ModelFacts:
    """What the exporter needs to know about a model family, read from its config."""

    architecture: str
    #: the config describes a vision-language model (``vision_config`` present)
    vision_language: bool
    num_layers: int
    #: sliding-window size, and which layers use it (empty: none)
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    #: logits multiplied by this (Cohere's ``logit_scale``)
    logit_scale: float | None = None
    #: logits divided by this (Granite's ``logits_scaling``; MiniCPM3's ``hidden_size / dim_model_base``)
    logits_scaling: float | None = None
    #: final logits soft-capped: ``tanh(x / c) * c`` (Gemma2's ``final_logit_softcapping``)
    final_logit_softcapping: float | None = None
    #: attention scores soft-capped (Gemma2's ``attn_logit_softcapping``)
    attn_logit_softcapping: float | None = None
    #: ``model_type`` of the language model's config
    model_type: str = ""
    #: the layers that apply rotary position embeddings, for a model that uses RoPE (see :func:`_rope_layers`)
    rope_layers: tuple[int, ...] = ()
    #: how the model's attention is computed (see :data:`ATTENTION_CODE`): ``"interface"`` (transformers'
    #: AttentionInterface), ``"sdpa"`` (its own code calling torch's scaled_dot_product_attention) or
    #: ``"eager"`` (its own code only)
    attention_code: str = "interface"
    #: ALiBi position biases instead of position embeddings (Falcon's ``alibi``)
    alibi: bool = False
    #: multi-head latent attention: keys and values of different head sizes (``kv_lora_rank``, ``v_head_dim``)
    latent_attention: bool = False
    #: MLA's compressed cache width (``kv_lora_rank``, DeepSeek-V2/V3), ``None`` without MLA: what
    #: ``--mla-cache latent`` needs
    kv_lora_rank: int | None = None
    #: DeepSeek sparse attention: each query attends to the ``index_topk`` positions its layer's indexer selects
    #: (``None`` without); ``indexed_layers`` run their own indexer and keep its keys (``index_key.{i}``)
    index_topk: int | None = None
    #: the head sizes the config gives its attention layers (:func:`.layer_facts.attention_head_dims`)
    head_dims: tuple[int, ...] = ()
    indexed_layers: tuple[int, ...] = ()
    #: why the model's compressed or sparse attention cannot be exported (DeepSeek-V4's ``compress_rates``, an
    #: indexer of a layout qeff-kv does not trace), ``None``
    compressed_attention: str | None = None
    #: attention adds learned per-head sink logits to the softmax (GPT-OSS; see :data:`ATTENTION_SINK_MODEL_TYPES`)
    attention_sinks: bool = False
    #: RoPE variants the config selects (``rope_parameters``, or the older ``rope_scaling``; one per layer type
    #: where they differ): ``"default"``, ``"linear"``, ``"llama3"``, ``"yarn"``, ``"longrope"``, ``"dynamic"``...
    rope_types: tuple[str, ...] = ()
    #: ``max_position_embeddings``: where transformers' dynamic-NTK RoPE starts rescaling (see :meth:`refusal`)
    max_position_embeddings: int | None = None
    #: longrope: the sequence length beyond which the long factors replace the short ones (the effective
    #: ``original_max_position_embeddings``, see :func:`_longrope_threshold`); ``None`` without longrope
    longrope_threshold: int | None = None
    #: vision-language: the token id whose positions take image rows (``image_token_id``/``image_token_index``)
    image_token_id: int | None = None
    #: vision-language: multimodal RoPE (``mrope_section`` in the RoPE parameters: Qwen2-VL, Qwen2.5-VL)
    mrope: bool = False
    #: vision-language: the language model has cross-attention layers fed by the image (Mllama)
    cross_attention: bool = False
    #: vision-language: image tokens attend to each other bidirectionally (Gemma3, PaliGemma: the model's
    #: forward builds its mask from ``token_type_ids``; see :data:`BIDIRECTIONAL_IMAGE_MODEL_TYPES`)
    bidirectional_images: bool = False
    #: chunked attention (Llama4's ``attention_chunk_size``): these layers (``layer_types`` ``"chunked_attention"``)
    #: attend only within their query's chunk of ``attention_chunk`` positions
    attention_chunk: int | None = None
    chunked_layers: tuple[int, ...] = ()
    #: attention temperature tuning on NoPE layers (Llama4's ``attn_temperature_tuning``): queries scaled from
    #: position ``floor_scale - 1`` on, counted by transformers from its cache's length (see :meth:`refusal`)
    temperature_floor: int | None = None
    #: ``model_type`` of the whole config (a vision-language wrapper's own; ``model_type`` is its language model's)
    top_model_type: str = ""
    #: recurrent / hybrid models: the mixer, its layers and its state geometry (:mod:`.recurrent_facts`);
    #: ``None`` for attention-only models
    recurrent: RecurrentFacts | None = None
    #: shared-KV layers (Gemma 4's ``num_kv_shared_layers``): ``(layer, source)`` pairs; a shared layer keeps no
    #: buffer and attends over the keys/values its source layer wrote in the same step (:func:`kv_sharing`)
    kv_shared: tuple[tuple[int, int], ...] = ()
    #: ``layer_types`` names of recurrent mixer layers (LFM3's ``"conv"``): keys of a per-layer-type mask dict
    #: that get no mask (:func:`.recurrent_facts.mixer_layer_types`)
    mixer_layer_types: tuple[str, ...] = ()
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_config(cls, config: dict) -> "ModelFacts":
        text = text_config(config)
        num_layers = int(first_of(text, "num_hidden_layers", "n_layer", "num_layers", default=0))
        window, sliding = sliding_layers(text, num_layers)
        model_type = str(text.get("model_type") or config.get("model_type") or "")
        return cls(
            architecture=str((config.get("architectures") or ["?"])[0]),
            vision_language=isinstance(config.get("vision_config"), dict),
            num_layers=num_layers,
            sliding_window=window,
            sliding_layers=sliding,
            # Falcon-H1 multiplies its logits by lm_head_multiplier (as Cohere by logit_scale)
            logit_scale=float_or_none(first_of(text, "logit_scale", "lm_head_multiplier")),
            logits_scaling=logits_scaling(text),
            final_logit_softcapping=float_or_none(text.get("final_logit_softcapping")),
            attn_logit_softcapping=float_or_none(text.get("attn_logit_softcapping")),
            model_type=model_type,
            rope_layers=rope_layers(text, num_layers, window, sliding),
            attention_code=ATTENTION_CODE.get(model_type, "interface"),
            alibi=bool(text.get("alibi")) or model_type in ALWAYS_ALIBI,
            latent_attention=latent_attention(text),
            kv_lora_rank=int_or_none(text.get("kv_lora_rank")) or None,
            index_topk=int_or_none(text.get("index_topk")) or None,
            head_dims=attention_head_dims(text),
            indexed_layers=indexed_layers(text, num_layers),
            compressed_attention=(compressed_attention_refusal(text)
                                  or unknown_indexer_refusal(text, model_type)),
            attention_sinks=model_type in ATTENTION_SINK_MODEL_TYPES,
            rope_types=rope_types(text),
            max_position_embeddings=int_or_none(first_of(text, "max_position_embeddings", "n_positions")),
            longrope_threshold=longrope_threshold(text, model_type),
            image_token_id=int_or_none(first_of(config, "image_token_id", "image_token_index")),
            mrope=has_mrope(text),
            cross_attention=bool(text.get("cross_attention_layers")),
            bidirectional_images=str(config.get("model_type")) in BIDIRECTIONAL_IMAGE_MODEL_TYPES,
            **chunked_attention(text, num_layers),
            top_model_type=str(config.get("model_type") or ""),
            recurrent=recurrent_facts(text, str((config.get("architectures") or ["?"])[0]), model_type),
            kv_shared=kv_sharing(text, num_layers),
            mixer_layer_types=mixer_layer_types(text),
        )

    # ---------------------------------------------------------------------------------------- refusals
    def refusal(self, options) -> str | None:
        """Why this model cannot be exported with ``options`` (one line), or ``None``."""
        for check in (self._kind_refusal, self._cache_refusal, self._rope_refusal):   # in order, first one wins
            reason = check(options)
            if reason is not None:
                return reason
        if (self.chunked_layers and options.ctx_len > self.attention_chunk
                and options.target_info.group_query_attention):
            return (f"--target onnxruntime-fused cannot express {self.architecture}'s chunked attention (layers "
                    f"attend within chunks of {self.attention_chunk} positions; GroupQueryAttention only has a "
                    f"sliding window); use --target onnxruntime, or --ctx-len {self.attention_chunk} or less")
        # Attention sinks need no refusal: the portable target runs the model's own attention, the onnxruntime
        # target adds them to its grouped attention and the fused one passes them as GQA's ``head_sink``.
        if options.target_info.group_query_attention:
            return self.fused_refusal() or self.kv_quant_refusal(options)
        return self.kv_quant_refusal(options)

    def kv_quant_refusal(self, options) -> str | None:
        """``--kv-cache-dtype int8`` (``int4``): only layers whose own GroupQueryAttention node reads their quantized
        cache."""
        kv = getattr(options, "kv_cache_dtype", None)
        if kv not in ("int8", "int4"):
            return None
        kinds = (("shared-KV layers", bool(self.kv_shared)), ("recurrent layers", self.recurrent is not None),
                 ("vision-language graph", self.vision_language), ("latent attention", self.latent_attention),
                 ("sparse-attention indexer", self.index_topk is not None),
                 ("sliding-window ring buffers", bool(self.ring_layers(options))))
        kind = next((k for k, present in kinds if present), None)
        if kind is not None:
            return (f"--kv-cache-dtype {kv} cannot be used with {self.architecture}'s {kind} (only layers that "
                    f"keep a plain key/value cache of their own hold it in {kv} here); export without it")
        return None

    def _kind_refusal(self, options) -> str | None:
        """A recurrent family, or options that do not fit a vision-language model, a text decoder or this
        recurrent model."""
        reason = self.recurrent_refusal()
        if reason is not None:
            return reason
        if self.compressed_attention is not None:
            return f"{self.architecture}: {self.compressed_attention}; qeff-kv does not export it"
        if self.vision_language:
            reason = self.vision_refusal()
            if reason is not None:
                return reason
            for flag, value in (("--weights", options.weights), ("--ccl", options.ccl),
                                ("--speculative-tokens", getattr(options, "speculative_tokens", None))):
                if value is not None:
                    return f"{flag} is not supported for vision-language exports yet"
        elif getattr(options, "single_graph", False):
            return "--single-graph is for vision-language models; this is a text decoder"
        elif getattr(options, "image_size", None) is not None:   # settings that would do nothing are refused
            return "--image-size is for vision-language models; this is a text decoder"
        if self.recurrent is not None:
            reason = self.recurrent.refusal(options)
            if reason is not None:
                return reason
        return None

    def _cache_refusal(self, options) -> str | None:
        """Cache options this model's attention cannot take (sliding cache, latent MLA cache, ring buffers), or a
        shared-KV layout with a layer that has nothing to share."""
        reason = kv_sharing_problem(self.kv_shared, self.architecture)
        if reason is not None:
            return reason
        if getattr(options, "sliding_cache", None) is not None and not self.sliding_layers:
            return f"--sliding-cache {options.sliding_cache} is for models with sliding-window layers; this one has none"
        if getattr(options, "mla_cache", None) == "latent" and self.kv_lora_rank is None:
            return (f"--mla-cache latent is for models with multi-head latent attention (kv_lora_rank); "
                    f"{self.architecture} has none")
        if getattr(options, "mla_cache", None) == "latent" and self.index_topk is not None:
            return (f"--mla-cache latent does not support {self.architecture}'s DeepSeek sparse attention (its "
                    f"absorbed attention has no indexer selection); export with --mla-cache full")
        if self.ring_layers(options) and options.prefill_seq_len > int(self.sliding_window):
            # A chunk longer than the ring would write two of its positions into one slot in one ScatterND.
            return (f"prefill_seq_len {options.prefill_seq_len} is longer than the sliding window "
                    f"{self.sliding_window}: a prefill chunk must fit in the sliding layers' ring buffers; "
                    f"export with --prefill-seq-len {self.sliding_window} or less")
        if self.ring_layers(options) and getattr(options, "speculative_tokens", None) is not None:
            return ("--speculative-tokens with ring buffers: rewinding rejected drafts needs slots a ring has "
                    "overwritten; export with --sliding-cache full")
        return None

    def _rope_refusal(self, options) -> str | None:
        """A context length past where this model's position scaling switches in Python (a graph cannot)."""
        if ("dynamic" in self.rope_types and self.max_position_embeddings
                and options.ctx_len > self.max_position_embeddings):
            # transformers recomputes dynamic-NTK frequencies in a Python branch once a forward pass reaches
            # beyond max_position_embeddings: a traced graph would keep the unscaled ones (silently wrong).
            return (f"this model uses dynamic RoPE scaling, which rescales beyond max_position_embeddings "
                    f"{self.max_position_embeddings} in Python (a traced graph cannot follow); export with "
                    f"--ctx-len {self.max_position_embeddings} or less")
        if self.longrope_threshold is not None and options.ctx_len > self.longrope_threshold:
            # The graph picks short/long factors per forward pass as transformers' rotary module does, but
            # keys already in the cache keep theirs; transformers' generate recomputes the whole cache with the
            # long factors when the sequence first grows past the threshold (Phi-3), which a retained cache cannot.
            return (f"this model uses longrope RoPE scaling, whose factors switch once a sequence is longer than "
                    f"original_max_position_embeddings {self.longrope_threshold} (transformers then recomputes "
                    f"the whole cache); export with --ctx-len {self.longrope_threshold} or less")
        if self.temperature_floor is not None and options.ctx_len >= self.temperature_floor:
            # Llama4 scales NoPE layers' queries by log1p(floor((p + 1) / floor_scale)): transformers counts p from
            # its cache's length, which a retained cache's graph does not have (it would stay at scale 1).
            return (f"{self.architecture} scales the queries of its NoPE layers from position "
                    f"{self.temperature_floor - 1} on (attn_temperature_tuning, floor_scale "
                    f"{self.temperature_floor}), counting positions from the cache length, which a retained-state "
                    f"graph does not have; export with --ctx-len {self.temperature_floor - 1} or less")
        return None

    def recurrent_refusal(self) -> str | None:
        """Why qeff-kv does not export this recurrent or linear-attention family (one line, from
        :data:`RECURRENT_REFUSALS`), or ``None``."""
        for model_type in (self.model_type, self.top_model_type):
            reason = RECURRENT_REFUSALS.get(str(model_type))
            if reason is not None:
                return f"{self.architecture}: {reason}; qeff-kv does not export it"
        if self.vision_language and self.model_type in RECURRENT_TEXT_MODEL_TYPES:
            return (f"{self.architecture}: a vision-language model over recurrent layers is not exported yet; "
                    f"export its text model ({self.model_type})")
        return None

    def vision_refusal(self) -> str | None:
        """Why qeff-kv cannot export this vision-language model yet (one line), or ``None``.

        Supported: an image encoder whose projected features replace the image-token embeddings one row per
        token (``get_image_features`` plus an ``image_token_id``: Llava, Gemma3, Qwen2.5-VL), over a language
        model with 1-D or multimodal (``[4, batch, seq_len]``) positions."""
        name = self.architecture
        if self.image_token_id is None:
            return f"{name}: the config has no image_token_id (or image_token_index); cannot merge image rows"
        if self.cross_attention:
            return (f"{name} attends to the image through cross-attention layers; qeff-kv does not export it "
                    f"yet")
        return None

    def fused_refusal(self) -> str | None:
        """Why onnxruntime's GroupQueryAttention cannot compute this model's attention, or ``None``."""
        cannot = f"--target onnxruntime-fused cannot express {self.architecture}'s"
        if self.attention_code == "eager":
            return (f"{cannot} attention (computed by its own code, not through transformers' attention "
                    f"interface or SDPA); use --target onnxruntime")
        if self.alibi:
            return f"{cannot} ALiBi position biases (GroupQueryAttention has no ALiBi); use --target onnxruntime"
        limit = FUSED_ATTENTION_LIMITS.get(self.model_type)
        if limit is not None:
            return f"{cannot} {limit}; use --target onnxruntime"
        if self.index_topk is not None:
            return (f"{cannot} DeepSeek sparse attention (each query attends only to the index_topk "
                    f"{self.index_topk} positions its indexer selects; GroupQueryAttention attends to every cached "
                    f"position); use --target onnxruntime")
        if self.latent_attention:
            return (f"{cannot} multi-head latent attention (keys and values of different head sizes); "
                    f"use --target onnxruntime")
        if self.vision_language and self.bidirectional_images:
            return (f"{cannot} attention within an image both ways (GroupQueryAttention masks causally); "
                    f"use --target onnxruntime")
        odd = [d for d in self.head_dims if d % FUSED_HEAD_SIZE_MULTIPLE]
        if odd and (self.recurrent is None or self.recurrent.attention_layers):
            return (f"{cannot} attention head size {odd[0]}: onnxruntime's CPU GroupQueryAttention runs head sizes "
                    f"that are a multiple of {FUSED_HEAD_SIZE_MULTIPLE} only; use --target onnxruntime")
        return None

    @property
    def kv_shared_layers(self) -> tuple[int, ...]:
        """The layers that keep no keys/values of their own (they read their source's, :attr:`kv_shared`)."""
        return tuple(layer for layer, _ in self.kv_shared)

    def cache_writers(self) -> tuple[int, ...] | None:
        """The layers that write keys/values through the cache (the probe's check), ``None``: every layer. A
        recurrent model's attention layers; a shared-KV layer never writes."""
        if self.recurrent is None and not self.kv_shared:
            return None
        every = self.recurrent.attention_layers if self.recurrent is not None else range(self.num_layers)
        return tuple(i for i in every if i not in self.kv_shared_layers)

    def ring_layers(self, options) -> tuple[int, ...]:
        """The layers whose KV cache is a ring buffer of ``sliding_window`` slots (contract section 7): the
        sliding layers, when ``ctx_len`` exceeds the window (below it the window never binds), the target
        writes its cache with ScatterND and ``--sliding-cache full`` was not asked for. The fused target keeps
        full-length buffers and windows attention in GroupQueryAttention (``local_window_size``)."""
        if not self.sliding_layers or options.ctx_len <= int(self.sliding_window):
            return ()
        if not options.target_info.ring_buffers or getattr(options, "sliding_cache", None) == "full":
            return ()
        return self.sliding_layers

    def windowed_layers(self, options) -> tuple[int, ...]:
        """Sliding layers with full-length buffers whose window binds (``ctx_len`` above it): their attention
        mask (or GroupQueryAttention's ``local_window_size``) applies the window."""
        if not self.sliding_layers or options.ctx_len <= int(self.sliding_window) or self.ring_layers(options):
            return ()
        return self.sliding_layers

    def sliding_cache(self, options) -> str | None:
        """How the sliding layers keep their cache with ``options``: ``"ring"`` (``sliding_window`` slots),
        ``"full"`` (``ctx_len`` slots, the window applied by attention), ``None`` without sliding layers."""
        if not self.sliding_layers:
            return None
        return "ring" if self.ring_layers(options) else "full"

    def require_exportable(self, options) -> None:
        reason = self.refusal(options)
        if reason is not None:
            raise ExportError(reason)


#: vision-language families whose forward makes each image's tokens attend to each other both ways (from
#: ``token_type_ids``; transformers 5.23 ``create_masks_for_vision_model``), by the top-level ``model_type``
BIDIRECTIONAL_IMAGE_MODEL_TYPES = frozenset({"gemma3", "paligemma", "gemma3n"})


def needs_image_sizes(model) -> bool:
    """The model's image encoder requires each image's size (``image_sizes`` without a default: Pixtral-style
    encoders, Mistral3); Llava's optional one stays unused."""
    param = inspect.signature(model.get_image_features).parameters.get("image_sizes")
    return param is not None and param.default is inspect.Parameter.empty
