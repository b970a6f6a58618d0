"""``genai_config.json``: the sidecar onnxruntime-genai and onnx-genai read.

It names the KV buffers as ``%d`` patterns, one pair of patterns for keys and one for values; we write the graph's own
names (``past_key.%d`` -> ``past_key.%d_RetainedState``, with a prefix ``past_key.%d_VLLM`` ->
``past_key.%d_VLLM_RetainedState``; a shared-buffer past/present graph's ``past_key_values.%d.key`` ->
``present.%d.key``) and ``search.past_present_share_buffer: true``: the retained output is the
input's buffer, written in place at ``position_ids``, ``context_length`` = ``ctx_len`` positions.

The format has one KV geometry for every layer, so only a graph whose layers are all ``full`` with ``past_key`` /
``past_value`` buffers gets one (:func:`unsupported_reason` says why another does not).
"""

from __future__ import annotations

import json
from pathlib import Path

from qeff_kv.contract import naming
from qeff_kv.contract.layout import KVLayout
from qeff_kv.errors import SidecarError
from qeff_kv.graph.sidecars.declared import Declared, DeclaredPair, SidecarFacts, STEM_ROLES

#: the graph inputs genai_config.json feeds beside the KV (its keys under ``model.decoder.inputs`` are the same words)
_CONTROL_INPUTS = (naming.INPUT_IDS_INPUT, naming.POSITION_IDS_INPUT, naming.ATTENTION_MASK_INPUT)
_PATTERN_KEYS = (("past_key_names", "present_key_names", "key"), ("past_value_names", "present_value_names", "value"))


def unsupported_reason(layout: KVLayout) -> str | None:
    """Why ``genai_config.json`` cannot describe the graph, or ``None`` when it can."""
    if layout.dialect not in (naming.RETAINED_STATE, naming.PAST_PRESENT):
        return (f"genai_config.json names past/present buffers; a {layout.dialect or 'sidecar-declared'} graph "
                f"({layout.update}) has no such form")
    if layout.grows:
        return "genai_config.json is written for fixed buffers (past_present_share_buffer); this graph grows"
    extra = [t.name for t in layout.inputs
             if t.name not in _CONTROL_INPUTS and naming.parse_any_kv_name(t.name) is None]
    if extra:
        return f"genai_config.json feeds {', '.join(_CONTROL_INPUTS)} and KV buffers; the graph also takes {extra[0]!r}"
    kinds = set(layout.state_kinds.values())
    if kinds - {"full"}:
        return f"genai_config.json has one KV geometry for all layers; this graph keeps {', '.join(sorted(kinds))}"
    if set(layout.stems) != set(STEM_ROLES):
        return f"genai_config.json names key and value buffers only; this graph keeps {', '.join(layout.stems)}"
    if sorted({p.layer for p in layout.pairs}) != list(range(layout.num_layers)):
        return "genai_config.json expands %d over layers 0..N-1; this graph's layers are not contiguous"
    return None


def pattern(stem: str, prefix: str | None, dialect: str = naming.RETAINED_STATE, output: bool = False) -> str:
    """``past_key.%d`` (``past_key.%d_VLLM`` with a prefix; ``present.%d.key`` in past/present): the name of layer 0
    in ``dialect`` with its number as ``%d`` (the first ``.0``: no stem holds one)."""
    return naming.dialect_name(dialect, stem, 0, prefix, output=output).replace(".0", ".%d", 1)


def build(layout: KVLayout, facts: SidecarFacts) -> dict:
    """The ``genai_config.json`` object for the graph ``layout`` describes."""
    reason = unsupported_reason(layout)
    if reason is not None:
        raise SidecarError(reason)
    prefix = layout.prefix
    inputs = {"input_ids": naming.INPUT_IDS_INPUT}
    for name in _CONTROL_INPUTS[1:]:
        if layout.input(name) is not None:
            inputs[name] = name
    outputs = {"logits": naming.LOGITS_OUTPUT}
    for past, present, role in _PATTERN_KEYS:
        stem = next(s for s, r in STEM_ROLES.items() if r == role)
        inputs[past] = pattern(stem, prefix, layout.dialect)
        outputs[present] = pattern(stem, prefix, layout.dialect, output=True)
    decoder = {"filename": facts.onnx_name, "head_size": facts.head_dim, "hidden_size": facts.hidden_size,
               "num_attention_heads": facts.num_attention_heads, "num_key_value_heads": facts.n_kv_heads,
               "num_hidden_layers": layout.num_layers, "inputs": inputs, "outputs": outputs}
    model = {"type": facts.model_type, "context_length": facts.ctx_len, "vocab_size": facts.vocab_size,
             "eos_token_id": list(facts.eos_token_ids), "bos_token_id": facts.bos_token_id,
             "pad_token_id": facts.pad_token_id if facts.pad_token_id is not None else
             (facts.eos_token_ids[0] if facts.eos_token_ids else None),
             "decoder": {k: v for k, v in decoder.items() if v is not None}}
    return {"model": {k: v for k, v in model.items() if v is not None},
            "search": {"max_length": facts.ctx_len, "past_present_share_buffer": True}}


def _expand(pat: object, layer: int, source: str, key: str) -> str:
    if not isinstance(pat, str) or pat.count("%d") != 1 or "%" in pat.replace("%d", ""):
        raise SidecarError(f"{source}: {key} must be a name with one %d, got {pat!r}")
    return pat.replace("%d", str(layer))


def read(doc: dict, source: str = "genai_config.json") -> Declared:
    """The KV pairs a ``genai_config.json`` object declares (its ``%d`` patterns expanded over
    ``num_hidden_layers``), its control ports and whether the buffer is shared."""
    try:
        decoder = doc["model"]["decoder"]
        ins, outs = decoder.get("inputs", {}), decoder.get("outputs", {})
        layers = decoder["num_hidden_layers"]
    except (KeyError, TypeError):
        raise SidecarError(f"{source}: no model.decoder with num_hidden_layers, inputs and outputs") from None
    if not isinstance(layers, int) or isinstance(layers, bool) or layers < 0:
        raise SidecarError(f"{source}: model.decoder.num_hidden_layers must be a non-negative int, got {layers!r}")
    pairs = []
    for past, present, role in _PATTERN_KEYS:
        if past not in ins or present not in outs:
            raise SidecarError(f"{source}: model.decoder needs inputs.{past} and outputs.{present}")
        pairs += [DeclaredPair(_expand(ins[past], i, source, past), _expand(outs[present], i, source, present),
                               role, i) for i in range(layers)]
    control = {role: ins[key] for key, role in (("input_ids", "token_ids"), ("position_ids", "position_ids"),
                                                ("attention_mask", "attention_mask")) if isinstance(ins.get(key), str)}
    if isinstance(outs.get("logits"), str):
        control["logits"] = outs["logits"]
    shared = bool((doc.get("search") or {}).get("past_present_share_buffer", False))
    return Declared("genai_config", pairs, control, update="shared_buffer" if shared else "append",
                    shared_buffer=shared)


def load(path: Path) -> dict:
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise SidecarError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise SidecarError(f"{path}: expected a JSON object")
    return doc


def renamed(doc: dict, prefix: str | None, onnx_name: str | None = None, dialect: str | None = None) -> dict:
    """``doc`` with its KV patterns carrying ``prefix`` (``None``: none), spelled in ``dialect`` when given (a graph
    converted by ``rewrite --to``) and, when given, the decoder file name."""
    doc = json.loads(json.dumps(doc))
    decoder = doc["model"]["decoder"]
    for side in ("inputs", "outputs"):
        for key, pat in list(decoder.get(side, {}).items()):
            if not isinstance(pat, str) or pat.count("%d") != 1:
                continue
            parsed = naming.parse_any_kv_name(pat.replace("%d", "0"))
            if parsed is not None:
                decoder[side][key] = pattern(parsed.stem, prefix, dialect or parsed.dialect, parsed.retained)
    if onnx_name is not None:
        decoder["filename"] = onnx_name
    return doc
