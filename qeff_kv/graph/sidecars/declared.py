"""What a runtime sidecar declares about a graph, in one neutral form, and the facts a writer needs.

* :class:`DeclaredPair`: one KV buffer as a sidecar declares it: graph input, graph output, ``role`` (``key``,
  ``value``, or ``None`` for latent and recurrent state, which the sidecars do not split in halves) and ``layer``.
* :class:`Declared`: the pairs in layer order (numeric, never a string sort: ``key_cache.10`` after
  ``key_cache.2``), the control ports by role, the form read and the update discipline declared.
* :func:`check_against`: a declaration against the graph's real inputs and outputs; a port the graph lacks, a
  pair the graph pairs otherwise (our naming contract pairs ``X`` with its retained output) or a layer declared
  twice is a :class:`~qeff_kv.errors.SidecarError` with a one-line message.
* :class:`SidecarFacts`: what the graph alone does not say (context length, vocabulary, EOS ids, head counts).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from qeff_kv.contract import naming
from qeff_kv.errors import SidecarError

#: file names the runtimes look for beside the graph
GENAI_CONFIG_FILE = "genai_config.json"
INFERENCE_METADATA_FILE = "inference_metadata.yaml"
SIDECAR_FILES = (GENAI_CONFIG_FILE, INFERENCE_METADATA_FILE)
_ROLE_ORDER = {"key": 0, "value": 1, None: 2}
#: the half of an attention cache each of our stems carries (latent and recurrent stems carry no half)
STEM_ROLES = {"past_key": "key", "past_value": "value"}


@dataclass(frozen=True)
class DeclaredPair:
    """One KV buffer as a sidecar declares it."""

    input: str
    output: str
    role: str | None
    layer: int
    #: the state group (workflow form) or ``kv`` (other forms)
    group: str = "kv"

    def to_json(self) -> dict:
        return {"input": self.input, "output": self.output, "role": self.role, "layer": self.layer,
                "group": self.group}


@dataclass
class Declared:
    """A sidecar's declaration: KV pairs, control ports, form and update discipline."""

    #: ``genai_config``, ``model.io`` or ``pipeline.workflow``
    form: str
    pairs: list[DeclaredPair]
    #: role -> graph port: ``token_ids``, ``position_ids``, ``attention_mask``, ``logits``, ``write_indices``,
    #: ``kv_length``
    control: dict[str, str] = field(default_factory=dict)
    #: ``append``, ``shared_buffer``, ``indexed_scatter``, ``replace``, or ``None`` when the sidecar names none
    update: str | None = None
    #: whether the past buffer is the present one (genai ``past_present_share_buffer``, workflow ``aliasing``)
    shared_buffer: bool = False
    #: the schema version the file declares, when it declares one
    schema_version: str | None = None

    def to_json(self) -> dict:
        return {"form": self.form, "pairs": [p.to_json() for p in self.pairs], "control": dict(self.control),
                "update": self.update, "shared_buffer": self.shared_buffer, "schema_version": self.schema_version}


def ordered(pairs: Iterable[DeclaredPair]) -> list[DeclaredPair]:
    """Pairs by layer as a number, then key before value."""
    return sorted(pairs, key=lambda p: (p.layer, _ROLE_ORDER.get(p.role, 2), p.input))


@dataclass
class SidecarFacts:
    """What a sidecar states that the graph does not: from the export manifest and the checkpoint's config."""

    onnx_name: str
    ctx_len: int
    vocab_size: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    model_type: str | None = None
    num_attention_heads: int | None = None
    n_kv_heads: int | None = None
    head_dim: int | None = None
    hidden_size: int | None = None
    num_layers: int | None = None
    sliding_window: int | None = None

    @classmethod
    def from_manifest(cls, manifest: dict, config: dict | None = None) -> "SidecarFacts":
        """Facts from an export manifest (``ctx_len``, ``eos_token_id``, geometry) and the model's config."""
        config = config or {}
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
        eos = manifest.get("eos_token_id")
        eos = [eos] if isinstance(eos, int) else [int(e) for e in (eos or [])]
        return cls(onnx_name=str(manifest["onnx"]), ctx_len=int(manifest["ctx_len"]),
                   vocab_size=manifest.get("vocab_size"), eos_token_ids=eos,
                   bos_token_id=_int_or_none(text.get("bos_token_id", config.get("bos_token_id"))),
                   pad_token_id=_int_or_none(text.get("pad_token_id", config.get("pad_token_id"))),
                   model_type=manifest.get("model_type") or config.get("model_type"),
                   num_attention_heads=_int_or_none(text.get("num_attention_heads")),
                   n_kv_heads=manifest.get("n_kv_heads"), head_dim=manifest.get("head_dim"),
                   hidden_size=_int_or_none(text.get("hidden_size")), num_layers=manifest.get("num_layers"),
                   sliding_window=manifest.get("sliding_window"))


def _int_or_none(v: object) -> int | None:
    if isinstance(v, list):
        v = v[0] if v else None
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _names(items: Iterable) -> set[str]:
    return {getattr(t, "name", t) for t in items}


def check_against(declared: Declared, inputs: Iterable, outputs: Iterable, *, source: str) -> Declared:
    """``declared`` if it names only ports the graph has and pairs them as the graph does; else SidecarError.
    ``inputs``/``outputs``: the graph's names (or :class:`~qeff_kv.contract.layout.TensorInfo`)."""
    ins, outs = _names(inputs), _names(outputs)
    seen: dict[tuple[str, str, int], str] = {}
    for p in declared.pairs:
        if p.input not in ins:
            raise SidecarError(f"{source}: declares KV input {p.input!r} (layer {p.layer}), which the graph lacks")
        if p.output not in outs:
            raise SidecarError(f"{source}: declares KV output {p.output!r} (layer {p.layer}), which the graph lacks")
        key = (p.group, p.role or p.input, p.layer)   # a state cell (no key/value role): one per buffer
        if key in seen:
            raise SidecarError(f"{source}: layer {p.layer} {p.role or 'state'} declared twice "
                               f"({seen[key]!r} and {p.input!r})")
        seen[key] = p.input
        _check_contract_pair(p, source)
    for role, port in declared.control.items():
        if port not in ins and port not in outs:
            raise SidecarError(f"{source}: declares {role} port {port!r}, which the graph lacks")
    declared.pairs = ordered(declared.pairs)
    return declared


def _check_contract_pair(p: DeclaredPair, source: str) -> None:
    """A pair in a dialect's names (:mod:`qeff_kv.contract.naming`): the output is the one the input's dialect pairs it
    with, the layer and half are the name's."""
    parsed = naming.parse_any_kv_name(p.input)
    if parsed is None or parsed.retained:
        return
    if p.output != parsed.output:
        raise SidecarError(f"{source}: pairs {p.input!r} with {p.output!r}, but the graph pairs "
                           f"{p.input!r} with {parsed.output!r}")
    if parsed.layer != p.layer:
        raise SidecarError(f"{source}: declares {p.input!r} as layer {p.layer}, but it is layer {parsed.layer} "
                           "of the graph")
    role = STEM_ROLES.get(parsed.stem)
    if p.role is not None and role is not None and p.role != role:
        raise SidecarError(f"{source}: declares {p.input!r} as a {p.role}, but it is the graph's {role}")
