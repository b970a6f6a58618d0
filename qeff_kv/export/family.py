"""Family quirks as facts read from a model's ``config.json``, in one place. No torch here.

The exporter never asks ``model_type == ...``: it asks these facts. Each fact names the config fields it
reads and is proved by a test in ``tests/test_family_facts.py`` (and, end to end, by the family matrix in
``tests/test_families.py``). Where a target cannot express a model, :meth:`ModelFacts.refusal` says so from
the config alone, before anything is loaded or traced.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import ExportError


def text_config(config: dict) -> dict:
    """The language model's section of a config: ``text_config`` for multimodal configs, else the config."""
    sub = config.get("text_config")
    return sub if isinstance(sub, dict) else config


def _first(cfg: dict, *keys, default=None):
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    return default


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
    #: logits divided by this (Granite's ``logits_scaling``)
    logits_scaling: float | None = None
    #: final logits soft-capped: ``tanh(x / c) * c`` (Gemma2's ``final_logit_softcapping``)
    final_logit_softcapping: float | None = None
    #: attention scores soft-capped (Gemma2's ``attn_logit_softcapping``)
    attn_logit_softcapping: float | None = None
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_config(cls, config: dict) -> "ModelFacts":
        text = text_config(config)
        num_layers = int(_first(text, "num_hidden_layers", "n_layer", "num_layers", default=0))
        window, sliding = _sliding(text, num_layers)
        return cls(
            architecture=str((config.get("architectures") or ["?"])[0]),
            vision_language=isinstance(config.get("vision_config"), dict),
            num_layers=num_layers,
            sliding_window=window,
            sliding_layers=sliding,
            logit_scale=_float_or_none(text.get("logit_scale")),
            logits_scaling=_float_or_none(text.get("logits_scaling")),
            final_logit_softcapping=_float_or_none(text.get("final_logit_softcapping")),
            attn_logit_softcapping=_float_or_none(text.get("attn_logit_softcapping")),
        )

    # ---------------------------------------------------------------------------------------- refusals
    def refusal(self, options) -> str | None:
        """Why this model cannot be exported with ``options`` (one line), or ``None``."""
        if self.vision_language:
            return (f"{self.architecture} is a vision-language model; qeff-kv exports text decoders only "
                    f"(vision-language export is not supported yet)")
        if self.sliding_layers and options.ctx_len > int(self.sliding_window):
            return (f"this model uses sliding-window attention (window {self.sliding_window}) and ctx_len "
                    f"{options.ctx_len} is larger; export with --ctx-len {self.sliding_window} or less")
        return None

    def require_exportable(self, options) -> None:
        reason = self.refusal(options)
        if reason is not None:
            raise ExportError(reason)


def _float_or_none(v) -> float | None:
    if v is None or isinstance(v, bool):
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def _sliding(text: dict, num_layers: int) -> tuple[int | None, tuple[int, ...]]:
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
