"""The retained-state naming contract: the one module that spells buffer names.

Facts (see ``docs/naming.md``, the single reference):

* A KV buffer of layer ``i`` is an input ``<stem>.<i>`` paired with an output ``<stem>.<i>_RetainedState``.
  Pairing is by exact name: an output ``X_RetainedState`` is retained against the input ``X``.
* With a prefix ``P`` the names are ``<stem>.<i>_P`` and ``<stem>.<i>_P_RetainedState``.
* KV stems: ``past_key`` and ``past_value`` (what we export), plus ``compressed_kv``, ``k_pe`` (MLA), ``index_key``
  (DSA indexer keys) and ``conv_state``, ``recurrent_state`` (hybrid models) found in peer graphs. Stems match
  exactly, never by ``startswith("past_")``.
* Retained buffers that are not KV (``vision_embeds``...) are never prefixed.
* A prefix is 1-64 ASCII characters from ``[A-Za-z0-9]``; serving regexes select on it.

Other KV dialects (``docs/naming.md`` "Dialects"), spelled here too and read into the same :class:`KVName`:

* **past/present** (onnxruntime-genai, optimum, mobius-onnx's default build): ``past_key_values.<i>.key`` ->
  ``present.<i>.key`` (and ``.value``); with a prefix ``P``: ``past_key_values.<i>.key_P`` -> ``present.<i>.key_P``.
* **static cache** (mobius-onnx ``--static-cache``): ``key_cache.<i>`` -> ``updated_key_cache.<i>`` (and
  ``value_cache``); with a prefix: ``key_cache.<i>_P`` -> ``updated_key_cache.<i>_P``.

Nothing outside this module writes ``_RetainedState`` or parses a buffer name.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from typing import Iterable, Sequence

from qeff_kv.errors import PrefixError

#: Stems that qeff-kv exports (one key and one value buffer per layer).
EXPORT_STEMS: tuple[str, ...] = ("past_key", "past_value")
#: Every stem a prefix applies to: ours plus those of peer graphs (MLA, hybrid/linear attention).
KV_STEMS: tuple[str, ...] = ("past_key", "past_value", "compressed_kv", "k_pe", "conv_state", "recurrent_state",
                             "index_key")
#: DeepSeek sparse attention (contract section 11): an indexed layer's indexer keys ``index_key.{i}``
#: ``[batch, 1, ctx_len, index_head_dim]`` beside its pair, position ``p`` in slot ``p`` (:data:`INDEXED_STEMS`)
INDEX_STEM = "index_key"
INDEXED_STEMS: tuple[str, ...] = ("past_key", "past_value", INDEX_STEM)
#: MLA's compressed (latent) cache, contract section 11: ``compressed_kv [batch, 1, ctx_len, kv_lora_rank]`` and
#: ``k_pe [batch, 1, ctx_len, qk_rope_head_dim]`` per layer, exported with ``--mla-cache latent``.
LATENT_STEMS: tuple[str, ...] = ("compressed_kv", "k_pe")
#: Stems whose axis 2 is usually a position axis (``ctx_len`` or ``sliding_window``); recurrent states have none. Whether
#: a given buffer has one follows from its shapes, not its stem (the peer's Qwen3.5 dense keeps recurrent states as
#: ``past_key``/``past_value``): :func:`qeff_kv.contract.statespec.recurrent_buffers`.
POSITION_STEMS: tuple[str, ...] = ("past_key", "past_value", "compressed_kv", "k_pe", INDEX_STEM)
#: A recurrent (Mamba2 / gated-delta-net / short-conv) layer's state, contract section 12: ``conv_state.{i}``
#: ``[batch, conv_dim, conv_kernel]`` and ``recurrent_state.{i}`` ``[batch, heads, head_dim, state_dim]``; only axis 0
#: is dynamic, no position axis: every token overwrites it, so it cannot be cut by position.
RECURRENT_STEMS: tuple[str, ...] = ("conv_state", "recurrent_state")
#: The suffix that pairs an output with the input of the same base name.
RETAINED_SUFFIX = "_RetainedState"
#: Vision-language graphs (contract section 6): the dual layout's image rows (language-graph input, vision-graph
#: output), the single layout's image input, and the image-row counter chained across prefill chunks.
VISION_EMBEDS = "vision_embeds"
PIXEL_VALUES = "pixel_values"
IMAGE_IDX = "image_idx"
#: Retained buffers that are not KV caches: never prefixed, never selected as KV.
NON_KV_RETAINED: tuple[str, ...] = (
    VISION_EMBEDS,
    PIXEL_VALUES,
    "deepstack_features",
    IMAGE_IDX,
    "past_repetition_penalty_buffer",
    "past_presence_penalty_buffer",
)
#: Non-KV retained outputs that do not follow the ``_RetainedState`` rule (input -> output).
NON_KV_OUTPUT_ALIASES: dict[str, str] = {IMAGE_IDX: "image_idx_output"}
IMAGE_IDX_OUTPUT = NON_KV_OUTPUT_ALIASES[IMAGE_IDX]
#: graph metadata: the export target that wrote the graph (absent from another exporter's graphs)
TARGET_META = "qeff_kv.target"
#: graph metadata of a vision-language language graph: its vision geometry as JSON (``image_token_id``,
#: ``vision_size`` rows per image, ``hidden_size``, ``image_size``, ``channels``; patch-row models ``grid``,
#: ``patch_dim``, ``spatial_merge_size``; ``bidirectional_images`` when an image must stay in one prefill chunk)
VISION_META = "qeff_kv.vision"

#: The optional compute-context-length input (contract section 9): int64, 1-D, its length limits attention.
#: Not a buffer: never prefixed, never retained; its one dynamic axis has the same name.
CCL_INPUT = "comp_ctx_lengths"
#: a speculative-decoding ("target language model") graph's input: its length ``n`` (``[n, 1]``) is how many
#: logits the step returns, those of the ``n`` rows ending at the last valid one (QEfficient's TLM contract)
LOGITS_TO_KEEP_INPUT = "num_logits_to_keep"
#: the last output of an export with ``hidden_states``: the final (normed) hidden state at the rows the logits are
#: taken at, ``[batch, 1 or n, hidden]`` (what ``/v1/embeddings`` pools)
HIDDEN_STATES_OUTPUT = "hidden_states"
#: graph metadata: the ``K`` of a graph exported with ``--speculative-tokens K`` (decode steps of up to K+1 tokens)
SPECULATIVE_META = "qeff_kv.speculative_tokens"

#: Axis 2 of a KV buffer: ``ctx_len`` for a full-length cache, ``sliding_window`` for a sliding-window layer's
#: ring buffer (contract section 7; position ``p`` lives in slot ``p % capacity``). The peer uses both names.
CTX_DIM = "ctx_len"
SLIDING_DIM = "sliding_window"
#: Graph metadata keys of our exports for models with sliding layers: the window ``W`` and how the sliding
#: layers keep their cache (``ring``: ``[.., sliding_window, ..]`` buffers; ``full``: ``ctx_len`` buffers, the
#: window applied in attention).
SLIDING_WINDOW_META = "qeff_kv.sliding_window"
SLIDING_CACHE_META = "qeff_kv.sliding_cache"
#: Graph metadata key of an MLA export with a latent cache (JSON: ``heads``, ``qk_nope_head_dim``,
#: ``qk_rope_head_dim``, ``v_head_dim``, ``kv_lora_rank``): what the expanded per-head cache would hold.
MLA_META = "qeff_kv.mla"
#: Graph metadata key of the per-layer state spec (JSON, :mod:`qeff_kv.contract.statespec`): what each layer retains.
STATE_SPEC_META = "qeff_kv.state_spec"
#: graph metadata key of the checkpoint identity recorded at export (written by the exporter, read by the runtime)
CHECKPOINT_META = "qeff_kv.checkpoint"
#: graph metadata: the exporter version that wrote the graph (``qeff_kv.export.versions.EXPORTER_VERSION``)
EXPORTER_VERSION_META = "qeff_kv.exporter_version"
#: graph metadata: ``true``/``false``, the graph was exported with ``--continuous-batching``
CONTINUOUS_BATCHING_META = "qeff_kv.continuous_batching"
#: graph metadata of a single vision-language graph whose vision encoder runs only where ``image_idx >= 0``
#: (:class:`qeff_kv.graph.passes.GateVisionEncoderPass`): the value :data:`VISION_ENCODER_GATED`
VISION_ENCODER_META = "qeff_kv.vision_encoder"
VISION_ENCODER_GATED = "gated"
#: key of an in-memory model's ``ir.Model.meta`` (never written): the file it was loaded from
#: (:func:`qeff_kv.graph.graphio.load`), so that saving beside it can find its external data
SOURCE_PATH_META = "qeff_kv.source_path"

#: LoRA adapters mixed per row (docs/lora.md): the graph's per-row adapter slot (int64 ``[batch_size]``; slot 0 is
#: the zero adapter, the base) and scale (the graph's float type, ``[batch_size]``; 0 for a base row), and per
#: adapted module ``lora_A.{layer}.{module}`` ``[lora_slots, in_features, lora_rank]`` and ``lora_B.{layer}.{module}``
#: ``[lora_slots, lora_rank, out_features]`` (``module``: its path inside the decoder layer as PEFT names it,
#: ``self_attn.q_proj``). Inputs, never buffers: never prefixed, never retained.
LORA_IDS_INPUT = "lora_ids"
LORA_SCALES_INPUT = "lora_scales"
LORA_SLOTS_DIM = "lora_slots"
LORA_RANK_DIM = "lora_rank"
#: graph metadata of an export with adapters (JSON: ``max_rank``, ``modules``, ``adapters`` the export was proved
#: with): :mod:`qeff_kv.contract.lora`
LORA_META = "qeff_kv.lora"
_LORA_RE = re.compile(r"lora_(?P<part>[AB])\.(?P<layer>(?:0|[1-9][0-9]*))\.(?P<module>[A-Za-z_][A-Za-z0-9_.]*)")


def lora_input_name(part: str, layer: int, module: str) -> str:
    """``lora_A.{layer}.{module}`` (``part`` ``"A"`` or ``"B"``)."""
    if part not in ("A", "B"):
        raise ValueError(f"a LoRA input is part A or B, not {part!r}")
    return f"lora_{part}.{int(layer)}.{module}"


def parse_lora_name(name: str) -> tuple[str, int, str] | None:
    """``(part, layer, module)`` of a LoRA weight input name, else ``None``."""
    m = _LORA_RE.fullmatch(name)
    return None if m is None else (m.group("part"), int(m.group("layer")), m.group("module"))


def is_lora_input(name: str) -> bool:
    """Whether ``name`` is one of the adapter inputs (the per-row slots and scales, or an A/B weight)."""
    return name in (LORA_IDS_INPUT, LORA_SCALES_INPUT) or parse_lora_name(name) is not None


MAX_PREFIX_LEN = 64

_PREFIX_RE = re.compile(r"[A-Za-z0-9]{1,64}")
_LAYER = r"(?:0|[1-9][0-9]*)"
_BASE_RE = re.compile(r"(?P<stem>" + "|".join(map(re.escape, KV_STEMS)) + r")\.(?P<layer>" + _LAYER + r")"
                      r"(?:_(?P<prefix>[A-Za-z0-9]+))?")


# --------------------------------------------------------------------------------------------- prefixes
def _describe_char(ch: str) -> str:
    try:
        uname = unicodedata.name(ch)
    except ValueError:
        uname = f"U+{ord(ch):04X}"
    return f"{ch!r} ({uname})"


def validate_prefix(prefix: object) -> str:
    """Return ``prefix`` if it is a valid KV-cache prefix, else raise :class:`PrefixError`.

    Valid: a ``str`` of 1-64 ASCII letters or digits. ``str.isalnum()`` is not enough (it accepts ``é``,
    ``²``, full-width letters and Arabic-Indic digits, which serving regexes written in ASCII never match).
    A prefix containing ``RetainedState`` is refused too: it would make the input name of a prefixed buffer
    read as the retained output of an unprefixed one.
    """
    if not isinstance(prefix, str):
        raise PrefixError(f"KV-cache prefix must be a string, got {type(prefix).__name__} {prefix!r}")
    if prefix == "":
        raise PrefixError("KV-cache prefix is empty; it must be 1-64 ASCII letters or digits")
    if len(prefix) > MAX_PREFIX_LEN:
        raise PrefixError(
            f"KV-cache prefix is {len(prefix)} characters long; at most {MAX_PREFIX_LEN} are allowed")
    for ch in prefix:
        if not ("a" <= ch <= "z" or "A" <= ch <= "Z" or "0" <= ch <= "9"):
            if ch.isspace():
                why = "whitespace"
            elif not ch.isascii() and ch.isalnum():
                why = "a non-ASCII letter or digit"
            else:
                why = "not a letter or digit"
            raise PrefixError(
                f"KV-cache prefix {prefix!r} contains {_describe_char(ch)}: {why}; "
                "only ASCII letters and digits [A-Za-z0-9] are allowed")
    if "RetainedState" in prefix:
        raise PrefixError(
            f"KV-cache prefix {prefix!r} contains 'RetainedState', which would make input names read as "
            "retained outputs")
    assert _PREFIX_RE.fullmatch(prefix)
    return prefix


def is_valid_prefix(prefix: object) -> bool:
    try:
        validate_prefix(prefix)
    except PrefixError:
        return False
    return True


# --------------------------------------------------------------------------------------------- names
@dataclass(frozen=True, order=True)
class KVName:
    """A parsed KV buffer name: ``<stem>.<layer>[_<prefix>][_RetainedState]``."""

    stem: str
    layer: int
    prefix: str | None = None
    #: the output of the pair (``_RetainedState``, ``present.``, ``updated_``), not its input
    retained: bool = False
    #: the dialect that spells it (:data:`DIALECTS`)
    dialect: str = "retained-state"

    @property
    def base(self) -> str:
        """The input name of this buffer's pair."""
        return dialect_name(self.dialect, self.stem, self.layer, self.prefix)

    @property
    def name(self) -> str:
        return dialect_name(self.dialect, self.stem, self.layer, self.prefix, output=self.retained)

    @property
    def output(self) -> str:
        """The output name of this buffer's pair."""
        return dialect_name(self.dialect, self.stem, self.layer, self.prefix, output=True)

    def with_prefix(self, prefix: str | None) -> "KVName":
        if prefix is not None:
            validate_prefix(prefix)
        return KVName(self.stem, self.layer, prefix, self.retained, self.dialect)

    def in_dialect(self, dialect: str) -> "KVName":
        """The same buffer spelled in ``dialect`` (a stem the dialect has no name for raises ``ValueError``)."""
        dialect_name(dialect, self.stem, self.layer, self.prefix)
        return KVName(self.stem, self.layer, self.prefix, self.retained, dialect)

    def __str__(self) -> str:  # pragma: no cover - convenience
        return self.name


def kv_input_name(stem: str, layer: int, prefix: str | None = None) -> str:
    """``past_key.3`` or, with a prefix, ``past_key.3_VLLM``."""
    if stem not in KV_STEMS:
        raise ValueError(f"unknown KV stem {stem!r}; known stems: {', '.join(KV_STEMS)}")
    if not isinstance(layer, int) or layer < 0:
        raise ValueError(f"layer must be a non-negative int, got {layer!r}")
    base = f"{stem}.{layer}"
    if prefix is not None:
        base = f"{base}_{validate_prefix(prefix)}"
    return base


def kv_retained_name(stem: str, layer: int, prefix: str | None = None) -> str:
    """``past_key.3_RetainedState`` or ``past_key.3_VLLM_RetainedState``."""
    return retained_name(kv_input_name(stem, layer, prefix))


def kv_scale_name(stem: str, layer: int) -> str:
    """``--kv-cache-dtype int8``: the initializer holding layer ``layer``'s static per-channel scales of its ``stem``
    buffer (``kv_scale.past_key.0``, float32 ``[1, kv_heads, 1, head_dim]``); no prefix, not retained state."""
    return f"kv_scale.{stem}.{int(layer)}"


def retained_name(input_name: str) -> str:
    """The output name retained against ``input_name`` (the pairing rule)."""
    return input_name + RETAINED_SUFFIX


def retained_source(output_name: str) -> str | None:
    """The input an output is retained against, or ``None`` if the output is not retained."""
    if output_name.endswith(RETAINED_SUFFIX) and len(output_name) > len(RETAINED_SUFFIX):
        return output_name[: -len(RETAINED_SUFFIX)]
    for src, alias in NON_KV_OUTPUT_ALIASES.items():
        if output_name == alias:
            return src
    return None


def is_retained_output(name: str) -> bool:
    return retained_source(name) is not None


def parse_kv_name(name: str) -> KVName | None:
    """Parse a KV buffer name into (stem, layer, prefix, retained), or ``None`` if it is not one.

    ``past_key.0_RetainedState`` is the unprefixed retained output, never a buffer with prefix
    ``RetainedState``. Stems match exactly (``past_repetition_penalty_buffer`` is not KV).
    """
    retained = name.endswith(RETAINED_SUFFIX)
    base = name[: -len(RETAINED_SUFFIX)] if retained else name
    m = _BASE_RE.fullmatch(base)
    if m is None:
        return None
    prefix = m.group("prefix")
    if prefix is not None and not is_valid_prefix(prefix):
        return None
    return KVName(m.group("stem"), int(m.group("layer")), prefix, retained)


def is_kv_name(name: str) -> bool:
    return parse_kv_name(name) is not None


def non_kv_retained_base(name: str) -> str | None:
    """If ``name`` is a known non-KV retained buffer (input or output), its input name; else ``None``."""
    src = retained_source(name)
    base = src if src is not None else name
    return base if base in NON_KV_RETAINED else None


def rename_kv(name: str, prefix: str | None) -> str:
    """The same KV buffer name (any dialect) with ``prefix`` (``None`` strips it). Raises ``ValueError`` if not KV."""
    parsed = parse_any_kv_name(name)
    if parsed is None:
        raise ValueError(f"{name!r} is not a KV buffer name")
    return parsed.with_prefix(prefix).name


# --------------------------------------------------------------------------------------------- dialects
#: The KV dialects (``docs/naming.md`` "Dialects"): QEfficient's retained state (ours), past/present
#: (onnxruntime-genai, optimum, mobius-onnx's default) and the static cache (mobius-onnx ``--static-cache``).
RETAINED_STATE = "retained-state"
PAST_PRESENT = "past-present"
STATIC_CACHE = "static-cache"
DIALECTS: tuple[str, ...] = (RETAINED_STATE, PAST_PRESENT, STATIC_CACHE)
#: the stems each dialect has names for (past/present and the static cache: key and value only)
DIALECT_STEMS: dict[str, tuple[str, ...]] = {
    RETAINED_STATE: KV_STEMS, PAST_PRESENT: EXPORT_STEMS, STATIC_CACHE: EXPORT_STEMS}
#: a key or value stem's role word in the other dialects (``past_key_values.3.key``, ``key_cache.3``)
ROLE_OF_STEM: dict[str, str] = {"past_key": "key", "past_value": "value"}
STEM_OF_ROLE: dict[str, str] = {v: k for k, v in ROLE_OF_STEM.items()}
#: past/present: ``past_key_values.<i>.<role>`` -> ``present.<i>.<role>``
PAST_KEY_VALUES = "past_key_values"
PRESENT = "present"
#: static cache: ``<role>_cache.<i>`` -> ``updated_<role>_cache.<i>``, written by ``TensorScatter`` at ``write_indices``
#: (``[batch]``: the first slot a row's tokens go to), attention over ``nonpad_kv_seqlen`` (``[batch]``: positions a
#: row holds after the step)
STATIC_OUTPUT_PREFIX = "updated_"
WRITE_INDICES_INPUT = "write_indices"
NONPAD_KV_SEQLEN_INPUT = "nonpad_kv_seqlen"
#: the inputs past/present graphs take beside the KV (``attention_mask``: ``[batch, positions held after the step]``)
ATTENTION_MASK_INPUT = "attention_mask"
INPUT_IDS_INPUT = "input_ids"
POSITION_IDS_INPUT = "position_ids"
LOGITS_OUTPUT = "logits"

_ROLE = r"(?P<role>key|value)"
_PFX = r"(?:_(?P<prefix>[A-Za-z0-9]+))?"
_PP_RE = re.compile(r"(?P<side>" + PAST_KEY_VALUES + "|" + PRESENT + r")\.(?P<layer>" + _LAYER + r")\." + _ROLE + _PFX)
_STATIC_RE = re.compile(r"(?P<side>" + STATIC_OUTPUT_PREFIX + r")?" + _ROLE + r"_cache\.(?P<layer>" + _LAYER + r")"
                        + _PFX)


def dialect_name(dialect: str, stem: str, layer: int, prefix: str | None = None, *, output: bool = False) -> str:
    """The input (or, with ``output``, the output) name of buffer ``stem``/``layer`` in ``dialect``."""
    if dialect == RETAINED_STATE:
        base = kv_input_name(stem, layer, prefix)
        return retained_name(base) if output else base
    if dialect not in DIALECTS:
        raise ValueError(f"unknown KV dialect {dialect!r}; known: {', '.join(DIALECTS)}")
    if stem not in DIALECT_STEMS[dialect]:
        raise ValueError(f"the {dialect} dialect has no name for {stem!r} buffers (only key and value)")
    if not isinstance(layer, int) or layer < 0:
        raise ValueError(f"layer must be a non-negative int, got {layer!r}")
    tail = "" if prefix is None else "_" + validate_prefix(prefix)
    role = ROLE_OF_STEM[stem]
    if dialect == PAST_PRESENT:
        return f"{PRESENT if output else PAST_KEY_VALUES}.{layer}.{role}{tail}"
    return f"{STATIC_OUTPUT_PREFIX if output else ''}{role}_cache.{layer}{tail}"


def parse_any_kv_name(name: str) -> KVName | None:
    """Parse a KV buffer name of any dialect (:data:`DIALECTS`) into a :class:`KVName` (``retained``: the output
    of its pair), or ``None`` if it is not one."""
    parsed = parse_kv_name(name)
    if parsed is not None:
        return parsed
    for dialect, regex in ((PAST_PRESENT, _PP_RE), (STATIC_CACHE, _STATIC_RE)):
        m = regex.fullmatch(name)
        if m is None:
            continue
        prefix = m.group("prefix")
        if prefix is not None and not is_valid_prefix(prefix):
            return None
        output = m.group("side") in (PRESENT, STATIC_OUTPUT_PREFIX)
        return KVName(STEM_OF_ROLE[m.group("role")], int(m.group("layer")), prefix, output, dialect)
    return None


def dialect_of(name: str) -> str | None:
    """The dialect that spells KV buffer ``name``, or ``None`` if it is not one."""
    parsed = parse_any_kv_name(name)
    return None if parsed is None else parsed.dialect


# --------------------------------------------------------------------------------------------- regexes
def exact_regex(prefix: str | None, stems: Sequence[str] = EXPORT_STEMS, dialect: str = RETAINED_STATE) -> str:
    """The exact selection regex: ``^(past_key|past_value)\\.\\d+_P(_RetainedState)?$``.

    Without a prefix: ``^(past_key|past_value)\\.\\d+(_RetainedState)?$``. In the other dialects:
    ``^(past_key_values|present)\\.\\d+\\.(key|value)_P$`` and ``^(updated_)?(key|value)_cache\\.\\d+_P$``.
    """
    mid = "" if prefix is None else "_" + validate_prefix(prefix)
    if dialect == RETAINED_STATE:
        alt = "|".join(re.escape(s) for s in stems)
        return rf"^({alt})\.\d+{mid}({re.escape(RETAINED_SUFFIX)})?$"
    roles = "|".join(ROLE_OF_STEM[s] for s in stems if s in ROLE_OF_STEM) or "key|value"
    if dialect == PAST_PRESENT:
        return rf"^({PAST_KEY_VALUES}|{PRESENT})\.\d+\.({roles}){mid}$"
    if dialect == STATIC_CACHE:
        return rf"^({STATIC_OUTPUT_PREFIX})?({roles})_cache\.\d+{mid}$"
    raise ValueError(f"unknown KV dialect {dialect!r}")


def substring_regex(prefix: str) -> str:
    """The substring regex ``.*P.*`` that vLLM-QAIC uses to select the KV buffers of prefix ``P``."""
    return f".*{re.escape(validate_prefix(prefix))}.*"


def legacy_regexes(stems: Sequence[str] = EXPORT_STEMS, dialect: str = RETAINED_STATE) -> list[str]:
    """vLLM-QAIC's legacy (unprefixed) selection: ``past_key.*`` and ``past_value.*``; in the other dialects the
    same shape of regex on their names (``past_key_values.*``/``present.*``, ``key_cache.*``/``value_cache.*``/
    ``updated_.*``)."""
    if dialect == PAST_PRESENT:
        return [f"{PAST_KEY_VALUES}\\..*", f"{PRESENT}\\..*"]
    if dialect == STATIC_CACHE:
        roles = [ROLE_OF_STEM[s] for s in stems if s in ROLE_OF_STEM] or ["key", "value"]
        return [f"({STATIC_OUTPUT_PREFIX})?{r}_cache\\..*" for r in roles]
    return [f"{re.escape(s)}.*" for s in stems]


def canonical_regexes(prefix: str | None, stems: Sequence[str] = EXPORT_STEMS,
                      dialect: str = RETAINED_STATE) -> dict[str, str | list[str]]:
    """The canonical selection regexes for a graph with ``prefix`` (``None``: unprefixed) in ``dialect``."""
    if prefix is None:
        return {"exact": exact_regex(None, stems, dialect), "legacy": legacy_regexes(stems, dialect)}
    return {"exact": exact_regex(prefix, stems, dialect), "substring": substring_regex(prefix)}


def regex_selects(regex: str, name: str) -> bool:
    """Whether a serving framework's regex selects ``name`` (``re.fullmatch`` semantics, like ``^...$``)."""
    return re.fullmatch(regex, name) is not None


def select(regex: str, names: Iterable[str]) -> list[str]:
    """The names that ``regex`` selects, in the order given."""
    pat = re.compile(regex)
    return [n for n in names if pat.fullmatch(n) is not None]


# --------------------------------------------------------------------------------------------- checks
#: Stems that come together in one layer (key with value; MLA's latent with its rope part; a hybrid layer's
#: convolution state with its recurrent state). ``check`` requires what :data:`STEM_REQUIRES` says of each member.
STEM_GROUPS: tuple[tuple[str, ...], ...] = (
    ("past_key", "past_value"), ("compressed_kv", "k_pe"), ("conv_state", "recurrent_state"))

#: What each stem needs beside it in its layer (``check``'s ``layers`` rule): key and value need each other, so do
#: MLA's latent and rope parts; a recurrent state needs its convolution state, but a convolution state may stand
#: alone (a short-convolution layer, LFM2, keeps only ``conv_state``).
STEM_REQUIRES: dict[str, tuple[str, ...]] = {
    "past_key": ("past_value",), "past_value": ("past_key",), "compressed_kv": ("k_pe",), "k_pe": ("compressed_kv",),
    "conv_state": (), "recurrent_state": ("conv_state",)}

_KV_LIKE_RE = re.compile(r"(?:" + "|".join(map(re.escape, KV_STEMS + (PAST_KEY_VALUES, PRESENT))) + r"|"
                         + r"(?:" + STATIC_OUTPUT_PREFIX + r")?(?:key|value)_cache)\.[0-9]")


def looks_like_kv(name: str) -> bool:
    """Whether ``name`` starts like a KV buffer (``<stem>.<digit>``) whether or not it parses as one.

    ``check`` reports names for which this is true but :func:`parse_any_kv_name` is ``None`` (``past_key.0_a-b``,
    ``past_key.01``, ``present.01.key``): a serving regex or the pairing rule would treat them inconsistently.
    """
    return _KV_LIKE_RE.match(name) is not None


def prefixed_non_kv(name: str) -> tuple[str, str] | None:
    """If ``name`` is a known non-KV retained buffer that carries a prefix (``vision_embeds_P`` or
    ``vision_embeds_P_RetainedState``), return ``(base, P)``; else ``None``. Non-KV buffers are never prefixed."""
    if name in NON_KV_OUTPUT_ALIASES.values():
        return None
    base = name[: -len(RETAINED_SUFFIX)] if name.endswith(RETAINED_SUFFIX) else name
    for known in NON_KV_RETAINED:
        if base.startswith(known + "_"):
            rest = base[len(known) + 1:]
            if rest and all(c.isascii() and c.isalnum() for c in rest):
                return known, rest
    return None
