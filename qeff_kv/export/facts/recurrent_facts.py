"""Recurrent and hybrid families as facts read from ``config.json`` (contract section 12). No torch here.

A model whose layers keep a recurrent state (instead of, or beside, an attention KV cache) is described by one
:class:`RecurrentFacts`: which *mixer* computes that state (``"mamba2"``: the Mamba2 selective-state-space mixer of
Mamba2, Bamba, GraniteMoeHybrid, Falcon-H1, NemotronH), which layers have it, which layers attend, and the state's
geometry (``conv_state [conv_dim, conv_kernel]``, ``recurrent_state [heads, head_dim, d_state]``), plus the few
quirks a family adds to the mixer (Falcon-H1's multipliers, its ungated-norm variant).

:func:`recurrent_facts` reads them from the language config; :meth:`RecurrentFacts.refusal` says, from the config
alone, why a recurrent family cannot be exported (one line), before anything is loaded. A new mixer kind (a short
convolution, a gated delta net, Kimi delta attention) is one more reader in :data:`MIXERS` and one more module in
:mod:`qeff_kv.export.modeling.recurrent` that traces it.
"""

from __future__ import annotations

from dataclasses import dataclass

from qeff_kv.export.facts.config_values import first_of, int_or_none

#: layer-type names that mean "this layer attends" / "this layer runs the recurrent mixer"
_ATTENTION_TYPES = frozenset({"full_attention", "sliding_attention", "attention", "attn", "*"})
_MIXER_TYPES = frozenset({"linear_attention", "mamba", "mamba2", "M", "conv"})
#: families whose every layer runs attention and the Mamba2 mixer side by side (their configs carry no field that
#: says so, so the type is the fact): Falcon-H1 (transformers 5.23 ``FalconH1DecoderLayer``)
PARALLEL_HYBRID_MODEL_TYPES = frozenset({"falcon_h1"})


@dataclass(frozen=True)
class RecurrentFacts:
    """A recurrent or hybrid model's mixer, its layers and its state geometry."""

    #: the mixer that writes the recurrent state (``"mamba2"``)
    mixer: str
    architecture: str
    num_layers: int
    #: layers whose mixer keeps ``conv_state``/``recurrent_state``
    mixer_layers: tuple[int, ...]
    #: layers that attend (keep ``past_key``/``past_value``); a parallel-hybrid layer is in both
    attention_layers: tuple[int, ...]
    conv_kernel: int
    #: channels of the depthwise convolution: ``intermediate + 2 * n_groups * d_state``
    conv_dim: int
    heads: int
    head_dim: int
    d_state: int
    n_groups: int
    #: the SSM's inner width (``heads * head_dim``)
    intermediate: int
    #: ``dt`` is clamped to this range after the softplus
    time_step_limit: tuple[float, float] = (0.0, float("inf"))
    #: the mixer's input is multiplied by this first (Falcon-H1's ``ssm_in_multiplier``)
    in_multiplier: float | None = None
    #: the input projection's output is multiplied by the mixer's ``mup_vector`` (Falcon-H1's ``ssm_multipliers``)
    projection_multipliers: bool = False
    #: the output goes through the mixer's gated RMSNorm ``norm(y, gate)``; else ``y * silu(gate)`` (Falcon-H1
    #: with ``mamba_rms_norm`` false)
    gated_norm: bool = True
    #: layers that keep no state at all (NemotronH's MLP/MoE blocks)
    stateless_layers: tuple[int, ...] = ()
    #: the mixer keeps a ``recurrent_state`` beside its ``conv_state`` (a short-convolution mixer keeps only the
    #: convolution state)
    keeps_recurrent_state: bool = True

    @property
    def conv_shape(self) -> tuple[int, int]:
        """``conv_state.{i}`` after the batch axis: ``(conv_dim, conv_kernel)``."""
        return self.conv_dim, self.conv_kernel

    @property
    def recurrent_shape(self) -> tuple[int, int, int] | None:
        """``recurrent_state.{i}`` after the batch axis: ``(heads, head_dim, d_state)``; ``None`` for a mixer that
        keeps only its convolution state."""
        return (self.heads, self.head_dim, self.d_state) if self.keeps_recurrent_state else None

    @property
    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """The shapes after the batch axis of a mixer layer's states, in stem order (``conv_state`` first)."""
        return tuple(s for s in (self.conv_shape, self.recurrent_shape) if s is not None)

    def refusal(self, options) -> str | None:
        """Why this recurrent model cannot be exported with ``options`` (one line), or ``None``."""
        name = self.architecture
        if self.stateless_layers:
            return (f"{name} has layers without any state (MLP/MoE blocks as layers of their own: "
                    f"{list(self.stateless_layers)}); qeff-kv's graphs need every layer to retain state, so it is "
                    f"not exported yet")
        if self.heads and self.heads % self.n_groups:
            return f"{name}: {self.heads} mamba heads do not split into {self.n_groups} groups"
        if getattr(options, "speculative_tokens", None) is not None:
            return (f"--speculative-tokens with {name}'s recurrent state: rejected drafts cannot be rewound out "
                    f"of a state every token overwrites")
        if getattr(options, "mla_cache", None) == "latent":
            return (f"--mla-cache latent with {name}'s recurrent layers: the compressed cache is absorbed only in "
                    f"models whose every layer is MLA attention; export with --mla-cache full")
        if getattr(options, "ccl", None) is not None and not self.attention_layers:
            return f"--ccl limits attention; {name} has no attention layers"
        return None


def _float(v, default: float) -> float:
    """A float of the config, including transformers' ``{"__float__": "Infinity"}`` for non-finite values."""
    if isinstance(v, dict) and "__float__" in v:
        v = v["__float__"]
    try:
        return float(v)
    except (TypeError, ValueError):
        return default


def _layer_kinds(text: dict, num_layers: int, model_type: str) -> tuple[tuple[int, ...], tuple[int, ...], tuple]:
    """``(mixer layers, attention layers, stateless layers)`` from ``layer_types`` / ``layers_block_type`` /
    ``hybrid_override_pattern`` / ``attn_layer_indices``; a parallel hybrid has both in every layer; a config with
    none of these is a pure recurrent model."""
    every = tuple(range(num_layers))
    if model_type in PARALLEL_HYBRID_MODEL_TYPES:
        return every, every, ()
    types = first_of(text, "layers_block_type", "layer_types")
    if isinstance(types, list) and len(types) >= num_layers:
        types = [str(t) for t in types[:num_layers]]
    elif isinstance(text.get("hybrid_override_pattern"), str):
        types = list(text["hybrid_override_pattern"][:num_layers])
    elif isinstance(text.get("attn_layer_indices"), list):
        attn = {int(i) for i in text["attn_layer_indices"]}
        types = ["full_attention" if i in attn else "linear_attention" for i in every]
    else:
        return every, (), ()
    mixer = tuple(i for i, t in enumerate(types) if t in _MIXER_TYPES)
    attention = tuple(i for i, t in enumerate(types) if t in _ATTENTION_TYPES)
    stateless = tuple(i for i in every if i not in mixer and i not in attention)
    return mixer, attention, stateless


def _mamba2(text: dict, architecture: str, model_type: str) -> RecurrentFacts | None:
    """The Mamba2 mixer's facts: Mamba2 (``state_size``, ``num_heads``...), Bamba / GraniteMoeHybrid / Falcon-H1
    (``mamba_*``), NemotronH (``ssm_state_size``, ``mamba_num_heads``...)."""
    d_state = int_or_none(first_of(text, "mamba_d_state", "ssm_state_size", "state_size"))
    if d_state is None:
        return None
    types = first_of(text, "layers_block_type", "layer_types")
    num_layers = int(first_of(text, "num_hidden_layers", "n_layer", "num_layers") or 0) or \
        (len(types) if isinstance(types, list) else 0)   # NemotronH: one entry per layer, no count
    hidden = int(text.get("hidden_size") or 0)
    heads = int_or_none(first_of(text, "mamba_n_heads", "mamba_num_heads", "num_heads")) or 0
    head_dim = int_or_none(first_of(text, "mamba_d_head", "mamba_head_dim", "head_dim")) or 0
    expand = first_of(text, "mamba_expand", "expand") or 2
    inner = int_or_none(text.get("mamba_d_ssm")) or int(expand * hidden)
    if text.get("mamba_d_head") == "auto" or not head_dim:
        head_dim = inner // max(heads, 1)
    n_groups = int_or_none(first_of(text, "mamba_n_groups", "n_groups")) or 1
    limit = text.get("time_step_limit") or (0.0, float("inf"))
    mixer, attention, stateless = _layer_kinds(text, num_layers, model_type)
    in_mult = text.get("ssm_in_multiplier")
    return RecurrentFacts(
        mixer="mamba2", architecture=architecture, num_layers=num_layers, mixer_layers=mixer,
        attention_layers=attention, stateless_layers=stateless,
        conv_kernel=int(first_of(text, "mamba_d_conv", "conv_kernel") or 4),
        conv_dim=inner + 2 * n_groups * d_state, heads=heads, head_dim=head_dim, d_state=d_state,
        n_groups=n_groups, intermediate=inner, time_step_limit=(_float(limit[0], 0.0), _float(limit[1], float("inf"))),
        in_multiplier=None if in_mult is None else float(in_mult),
        projection_multipliers=text.get("ssm_multipliers") is not None,
        gated_norm=bool(text.get("mamba_rms_norm", True)))


def _gated_delta(text: dict, architecture: str, model_type: str) -> RecurrentFacts | None:
    """The gated delta net's facts (Qwen3-Next, Qwen3.5, Qwen3.5-MoE: ``linear_*``): ``conv_state [2 * key_dim +
    value_dim, linear_conv_kernel_dim]``, ``recurrent_state [v_heads, k_head_dim, v_head_dim]``."""
    k_heads, v_heads = int_or_none(text.get("linear_num_key_heads")), int_or_none(text.get("linear_num_value_heads"))
    k_dim, v_dim = int_or_none(text.get("linear_key_head_dim")), int_or_none(text.get("linear_value_head_dim"))
    if None in (k_heads, v_heads, k_dim, v_dim):
        return None
    num_layers = int(first_of(text, "num_hidden_layers", "n_layer", "num_layers") or 0)
    mixer, attention, stateless = _layer_kinds(text, num_layers, model_type)
    return RecurrentFacts(
        mixer="gated_delta", architecture=architecture, num_layers=num_layers, mixer_layers=mixer,
        attention_layers=attention, stateless_layers=stateless,
        conv_kernel=int(text.get("linear_conv_kernel_dim") or 4), conv_dim=2 * k_heads * k_dim + v_heads * v_dim,
        heads=v_heads, head_dim=k_dim, d_state=v_dim, n_groups=k_heads, intermediate=v_heads * v_dim)


def _short_conv(text: dict, architecture: str, model_type: str) -> RecurrentFacts | None:
    """LFM2's short convolution (LFM2, LFM2-MoE, LFM3): ``conv_state [hidden_size, conv_L_cache]`` only."""
    kernel, hidden = int_or_none(text.get("conv_L_cache")), int_or_none(text.get("hidden_size"))
    if kernel is None or hidden is None:
        return None
    num_layers = int(first_of(text, "num_hidden_layers", "n_layer", "num_layers") or 0)
    mixer, attention, stateless = _layer_kinds(text, num_layers, model_type)
    return RecurrentFacts(
        mixer="short_conv", architecture=architecture, num_layers=num_layers, mixer_layers=mixer,
        attention_layers=attention, stateless_layers=stateless, conv_kernel=kernel, conv_dim=hidden, heads=0,
        head_dim=0, d_state=0, n_groups=1, intermediate=hidden, keeps_recurrent_state=False)


#: KDA families whose config sizes the linear heads by ``num_attention_heads``/``head_dim`` (transformers copies
#: them into ``linear_*`` in the config's ``__post_init__``, then overwrites ``head_dim`` with the RoPE width, so a
#: saved config carries ``linear_*``, a checkpoint's only the originals)
_KDA_HEADS_FROM_ATTENTION = frozenset({"bailing_hybrid"})


def _kda_default_layer_types(text: dict, sub: dict, num_layers: int, model_type: str) -> list[str]:
    """The layer types transformers derives when the config has no ``layer_types``: a Kimi checkpoint's 1-based
    ``kda_layers`` (else every 4th layer from layer 4 attends), Bailing-Hybrid's every ``layer_group_size``-th."""
    if isinstance(sub.get("kda_layers"), list):
        linear = {int(i) - 1 for i in sub["kda_layers"]}
        return ["linear_attention" if i in linear else "full_attention" for i in range(num_layers)]
    if model_type in _KDA_HEADS_FROM_ATTENTION:
        group = int(text.get("layer_group_size") or 6)
        return ["full_attention" if (i + 1) % group == 0 else "linear_attention" for i in range(num_layers)]
    return ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(num_layers)]


def _kda(text: dict, architecture: str, model_type: str) -> RecurrentFacts | None:
    """Kimi delta attention's facts (Kimi Linear, Bailing-Hybrid: ``linear_num_heads``/``linear_head_dim``/
    ``linear_conv_kernel_dim``, or a Kimi checkpoint's ``linear_attn_config`` with 1-based ``kda_layers``/
    ``full_attn_layers``, or a Bailing checkpoint's attention sizes): ``conv_state
    [3 * heads * head_dim, kernel]`` (q, k and v convolved as one), ``recurrent_state [heads, head_dim, head_dim]``."""
    sub = text.get("linear_attn_config") if isinstance(text.get("linear_attn_config"), dict) else {}
    if model_type in _KDA_HEADS_FROM_ATTENTION and not sub:   # Bailing-Hybrid: its linear heads are the attention's
        sub = {"num_heads": text.get("num_attention_heads"), "head_dim": text.get("head_dim"),
               "short_conv_kernel_size": text.get("short_conv_kernel_size")}
    heads = int_or_none(text.get("linear_num_heads") or sub.get("num_heads"))
    dim = int_or_none(text.get("linear_head_dim") or sub.get("head_dim"))
    if heads is None or dim is None:
        return None
    kernel = int(text.get("linear_conv_kernel_dim") or sub.get("short_conv_kernel_size") or 4)
    num_layers = int(first_of(text, "num_hidden_layers", "n_layer", "num_layers") or 0)
    if not isinstance(text.get("layer_types"), list):
        text = dict(text, layer_types=_kda_default_layer_types(text, sub, num_layers, model_type))
    mixer, attention, stateless = _layer_kinds(text, num_layers, model_type)
    return RecurrentFacts(
        mixer="kda", architecture=architecture, num_layers=num_layers, mixer_layers=mixer,
        attention_layers=attention, stateless_layers=stateless, conv_kernel=kernel, conv_dim=3 * heads * dim,
        heads=heads, head_dim=dim, d_state=dim, n_groups=1, intermediate=heads * dim)


#: mixer readers, by the ``model_type`` values whose layers run them (transformers 5.23)
MIXERS = {
    "mamba2": _mamba2, "bamba": _mamba2, "granitemoehybrid": _mamba2, "falcon_h1": _mamba2, "nemotron_h": _mamba2,
    "qwen3_next": _gated_delta, "qwen3_5_text": _gated_delta, "qwen3_5_moe_text": _gated_delta,
    "olmo_hybrid": _gated_delta,
    "lfm2": _short_conv, "lfm2_moe": _short_conv, "lfm3": _short_conv,
    "kimi_linear": _kda, "bailing_hybrid": _kda,
}


def mixer_layer_types(text: dict) -> tuple[str, ...]:
    """The ``layer_types`` names of a hybrid config whose layers run a recurrent mixer (LFM3's ``"conv"``), in
    order of first use: a decoder that takes one attention mask per layer type (``{layer_type: mask}``) looks these
    up too, and they get none (the mixer reads its padding from the graph's own inputs)."""
    types = text.get("layer_types")
    if not isinstance(types, list):
        return ()
    return tuple(dict.fromkeys(str(t) for t in types if str(t) in _MIXER_TYPES))


def recurrent_facts(text: dict, architecture: str, model_type: str) -> RecurrentFacts | None:
    """The recurrent facts of a language config, ``None`` for a model without recurrent layers."""
    reader = MIXERS.get(model_type)
    return None if reader is None else reader(text, architecture, model_type)


# ------------------------------------------------------------------------------------------- refusals
_SCAN = "selective scan (transformers' torch path) is a Python loop over every token"
_POOLED_INDEXER = ("its sparse attention picks keys through an indexer whose cache pools keys in blocks of "
                   "index_kpool plus an incomplete tail pool (a retained state of its own, its top-k shared with the "
                   "next layers), which qeff-kv's graphs do not keep")
#: Recurrent and linear-attention families of transformers 5.23 that qeff-kv does not export, by ``model_type``
#: (the language model's, or the top-level one), and why, read from their modeling code. Exported: Qwen3-Next,
#: Qwen3.5, OLMo-Hybrid (gated delta net, ``export/gated_delta.py``), Kimi Linear and Bailing-Hybrid (Kimi delta
#: attention, ``export/gated_delta.py``), LFM2 (short conv, ``export/short_conv.py``) and the Mamba2-mixer families.
RECURRENT_REFUSALS: dict[str, str] = {
    "mamba": f"its Mamba (v1) {_SCAN}",
    "falcon_mamba": f"its Mamba (v1) {_SCAN}",
    "jamba": f"its Mamba (v1) layers' {_SCAN}",
    "zamba": f"its Mamba (v1) layers' {_SCAN}",
    "zamba2": ("its hybrid layers run one shared attention block at several depths on the word embeddings "
               "concatenated to the hidden state, a layer layout of its own"),
    "recurrent_gemma": "its RG-LRU scan is a Python loop over every token of a prompt",
    "rwkv": ("its WKV attention is a Python loop over every token and keeps five states per layer, not the peer's "
             "conv_state/recurrent_state pair"),
    "xlstm": ("its mLSTM loops in Python over chunks and over tokens and keeps three states per layer (C, n, m), "
              "not the peer's conv_state/recurrent_state pair"),
    "minimax": ("its lightning attention loops in Python over blocks of a prompt and over every token after a "
                "cached one"),
    "glm5_next_text": _POOLED_INDEXER,
    "glm5_next": _POOLED_INDEXER,
    "qwen4_exp_text": ("its per-layer-embedding blocks keep two more convolution states per layer besides the gated "
                       "delta net's, not the peer's conv_state/recurrent_state pair"),
    "qwen4_exp": ("its per-layer-embedding blocks keep two more convolution states per layer besides the gated "
                  "delta net's, not the peer's conv_state/recurrent_state pair"),
    "inkling_text": ("it convolves keys, values and each block's input with four short-conv states per layer, not "
                     "the peer's one conv_state"),
    "inkling_mm_model": ("it convolves keys, values and each block's input with four short-conv states per layer, "
                         "not the peer's one conv_state"),
    "inkling2_text": ("it convolves keys, values and each block's input with several short-conv states per layer, "
                      "not the peer's one conv_state"),
    "inkling2": ("it convolves keys, values and each block's input with several short-conv states per layer, not "
                 "the peer's one conv_state"),
    "zaya": ("its attention convolves queries and keys and keeps a recurrent value state beside its KV cache, a "
             "layout of its own"),
}
#: language models with recurrent layers that qeff-kv exports as text models (their vision-language wrappers are
#: refused by :meth:`ModelFacts.recurrent_refusal`)
RECURRENT_TEXT_MODEL_TYPES = frozenset({"qwen3_5_text", "qwen3_5_moe_text", "lfm2", "lfm2_moe", "lfm3"})
