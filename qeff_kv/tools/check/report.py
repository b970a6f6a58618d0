"""``qeff-kv check``'s report: the rule ids (:data:`RULES`), each rule's verdict (:class:`RuleResult` and its
:class:`Violation` list), the whole graph's :class:`CheckReport` and its two renderings (JSON schema
``qeff-kv.check/1``, the text table).

A graph with sliding-window ring buffers (or the metadata ``qeff_kv.sliding_window``) adds
``"sliding_window"`` (``W`` from the metadata, ``null`` if absent or invalid) and ``"sliding_layers"`` (layer
indices whose buffers have axis 2 ``sliding_window``) at the end of the JSON; other graphs' JSON is unchanged.

A vision-language graph (contract section 6) adds ``"vision_language"``: ``"dual"`` (the language graph of the
dual layout), ``"single"`` or ``"vision-encoder"`` at the end of the JSON; other graphs' JSON is unchanged.

The optional input ``comp_ctx_lengths`` (compute context length, contract section 9) is known: it is not a
KV buffer, no rule is about it, and the report says the graph has it (``"comp_ctx_lengths": true`` at the end
of the JSON, present only then).
A rule that attention is really limited by its length may come later.

A graph with LoRA adapter inputs (docs/lora.md) adds ``"lora"`` (the adapted modules, ``max_rank``, dtype, the adapters
the export was proved with) at the end of the JSON when rule ``lora`` reads the set; other graphs' JSON is unchanged.

So is ``num_logits_to_keep`` (a speculative-decoding graph, QEfficient's "target language model"): the report
says so (``"num_logits_to_keep": {"speculative_tokens": K}`` at the end of the JSON, ``K`` from the graph
metadata or ``null``; present only then).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from qeff_kv.contract import multimodal, naming
from qeff_kv.contract.layout import QUANTIZED_KV_DTYPES

SCHEMA = "qeff-kv.check/1"

#: Rule id -> one-line description. Ids are stable: CI configurations and JSON consumers key on them.
RULES: dict[str, str] = {
    "kv-present": "the graph has KV buffers",
    "pairing": "every X_RetainedState output has input X and every KV input X has output X_RetainedState "
               "(non-KV retained inputs too; image_idx -> image_idx_output chained in a vision-language graph)",
    "pair-match": "a KV input and its retained output have the same dtype, rank, dims and dim names "
                  "(axis 2 ctx_len or sliding_window; sliding sizes equal the graph's window; MLA's compressed_kv "
                  "and k_pe share batch, head and ctx axes); non-KV retained pairs too (image_idx: int64 [1, 1])",
    "layers": "layers 0..N-1 are contiguous and every layer has key and value (each stem group complete)",
    "prefix": "one valid prefix on every KV buffer, equal to the expected prefix when given",
    "regex-exact": "the exact selection regex selects exactly the KV buffers",
    "regex-substring": "the serving regex (.*P.*, or legacy past_key.*/past_value.*) selects exactly the KV buffers",
    "non-kv-unprefixed": "non-KV retained buffers carry no prefix",
    "inplace": "each KV input is updated in place into its retained output; every other reader runs before the update",
    "sidecar": "an inference_metadata.yaml or genai_config.json beside the graph names only its ports, pairs them as "
               "the graph does (layers in numeric order) and names every KV pair",
    "lora": "the LoRA adapter inputs form one set (lora_ids, lora_scales, lora_A/lora_B pairs, one slots and one rank "
            "axis, one float type), never prefixed, retained or selected as KV",
    "onnx-checker": "onnx.checker.check_model passes",
}

PASS, FAIL, SKIP = "pass", "fail", "skip"


class _Any:
    def __repr__(self) -> str:  # pragma: no cover - cosmetic
        return "ANY"


#: ``expected_prefix`` default: accept whatever single prefix the graph has.
ANY = _Any()


@dataclass(frozen=True)
class Violation:
    rule: str
    buffer: str | None
    message: str

    def to_json(self) -> dict:
        return {"rule": self.rule, "buffer": self.buffer, "message": self.message}


@dataclass
class RuleResult:
    id: str
    status: str = PASS
    violations: list[Violation] = field(default_factory=list)
    note: str | None = None

    @property
    def description(self) -> str:
        return RULES[self.id]

    def fail(self, buffer: str | None, message: str) -> None:
        self.status = FAIL
        self.violations.append(Violation(self.id, buffer, message))

    def skip(self, note: str) -> None:
        self.status = SKIP
        self.note = note

    def to_json(self) -> dict:
        return {"id": self.id, "description": self.description, "status": self.status, "note": self.note,
                "violations": [v.to_json() for v in self.violations]}


@dataclass
class CheckReport:
    model: str
    prefix: str | None
    prefixes: list[str | None]
    expected_prefix: object
    num_layers: int
    rules: list[RuleResult]
    #: the graph takes ``comp_ctx_lengths`` (CCL, contract section 9)
    ccl: bool = False
    #: a speculative-decoding graph (a ``num_logits_to_keep`` input) and its ``K`` (metadata, else ``None``)
    speculative: bool = False
    speculative_tokens: int | None = None
    #: layers with sliding-window ring buffers (axis 2 ``sliding_window``)
    sliding_layers: list[int] = field(default_factory=list)
    #: ``W`` from graph metadata ``qeff_kv.sliding_window`` (``None``: absent or not a positive integer)
    sliding_window: int | None = None
    #: the graph carries the metadata ``qeff_kv.sliding_window`` (valid or not)
    sliding_meta: bool = False
    #: ``"dual"``, ``"single"`` or ``"vision-encoder"`` for a vision-language graph (contract section 6), else None
    vision_language: str | None = None
    #: the KV dialect (``retained-state``, ``past-present``, ``static-cache``; ``None``: a sidecar's names or no KV),
    #: how the graph updates the cache (:attr:`qeff_kv.contract.layout.KVLayout.update`) and where the pairs came from
    dialect: str | None = None
    update: str | None = None
    source: str = "names"
    #: the graph's LoRA adapter inputs (:meth:`qeff_kv.contract.lora.LoraGeometry.to_json`; ``None``: none, or a
    #: malformed set, which rule ``lora`` fails)
    lora: dict | None = None
    #: shared-KV layers the graph's state spec records, ``(layer, source)``: no buffers of their own
    shared_layers: list = field(default_factory=list)
    #: the KV buffers' dtypes (``["int8"]``: a quantized cache, ``--kv-cache-dtype int8``)
    kv_dtypes: list = field(default_factory=list)

    @property
    def quantized_kv(self) -> bool:
        """The KV buffers hold a quantized cache (:data:`~qeff_kv.contract.layout.QUANTIZED_KV_DTYPES`)."""
        return any(d in QUANTIZED_KV_DTYPES for d in self.kv_dtypes)

    @property
    def sliding(self) -> bool:
        return bool(self.sliding_layers) or self.sliding_meta

    @property
    def ok(self) -> bool:
        return all(r.status != FAIL for r in self.rules)

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1

    @property
    def failed(self) -> list[str]:
        return [r.id for r in self.rules if r.status == FAIL]

    @property
    def violations(self) -> list[Violation]:
        return [v for r in self.rules for v in r.violations]

    def rule(self, rule_id: str) -> RuleResult:
        for r in self.rules:
            if r.id == rule_id:
                return r
        raise KeyError(rule_id)

    def to_json(self) -> dict:
        exp = self.expected_prefix
        return {
            "schema": SCHEMA,
            "model": self.model,
            "ok": self.ok,
            "prefix": self.prefix,
            "prefixes": list(self.prefixes),
            "expected_prefix": None if exp is ANY else {"prefix": exp},
            "num_layers": self.num_layers,
            "summary": {s: sum(1 for r in self.rules if r.status == s) for s in (PASS, FAIL, SKIP)},
            "failed": self.failed,
            "rules": [r.to_json() for r in self.rules],
            # only on graphs that have the input: the key set of schema /1 stays as it was for the others
            **({naming.CCL_INPUT: True} if self.ccl else {}),
            **({naming.LOGITS_TO_KEEP_INPUT: {"speculative_tokens": self.speculative_tokens}}
               if self.speculative else {}),
            **({"sliding_window": self.sliding_window, "sliding_layers": list(self.sliding_layers)}
               if self.sliding else {}),
            **({"vision_language": self.vision_language} if self.vision_language else {}),
            **({"lora": self.lora} if self.lora is not None else {}),
            **({"shared_layers": [{"layer": a, "source": b} for a, b in self.shared_layers]}
               if self.shared_layers else {}),
            # only on quantized caches (int8): every float graph's key set stays as it was
            **({"kv_cache_dtype": "/".join(self.kv_dtypes)} if self.quantized_kv else {}),
            # only on graphs of another dialect (or pairs a sidecar names): our own graphs' key set stays as it was
            **({"dialect": self.dialect, "update": self.update, "source": self.source}
               if self.dialect not in (None, naming.RETAINED_STATE) or self.source != "names" else {}),
        }

    def to_json_text(self) -> str:
        return json.dumps(self.to_json(), indent=2) + "\n"

    def format_text(self) -> str:
        width = max(len(r) for r in RULES)
        lines = [f"{self.model}: prefix {fmt_prefix(self.prefix) if len(self.prefixes) <= 1 else 'mixed'}, "
                 f"{self.num_layers} layers" + (f", KV cache {'/'.join(self.kv_dtypes)}" if self.quantized_kv else "")
                 + (", comp_ctx_lengths input (CCL)" if self.ccl else "")
                 + (f", {naming.LOGITS_TO_KEEP_INPUT} input (speculative decoding, "
                    f"K={self.speculative_tokens if self.speculative_tokens is not None else 'unknown'})"
                    if self.speculative else "")
                 + (f", sliding-window layers {fmt_ints(self.sliding_layers) or 'none'} "
                    f"(window {self.sliding_window if self.sliding_window is not None else 'unknown'})"
                    if self.sliding else "")
                 + (f", shared-KV layers {fmt_ints([a for a, _ in self.shared_layers])} (no buffers)"
                    if self.shared_layers else "")
                 + (f", {multimodal.describe_kind(self.vision_language)}" if self.vision_language else "")
                 + (f", LoRA adapter inputs ({self.lora['adapted']} modules, max rank "
                    f"{'unknown' if self.lora['max_rank'] is None else self.lora['max_rank']})" if self.lora else "")
                 + (f", {self.dialect or 'declared'} dialect ({self.update}; pairs from {self.source})"
                    if self.dialect not in (None, naming.RETAINED_STATE) or self.source != "names" else "")]
        for r in self.rules:
            lines.append(f"  {r.status.upper():4}  {r.id:<{width}}  {r.description}")
            if r.note:
                lines.append(f"        {'':<{width}}  ({r.note})")
            for v in r.violations:
                where = f" {v.buffer}" if v.buffer else ""
                lines.append(f"        {'':<{width}}  - [{v.rule}{where}] {v.message}")
        s = self.to_json()["summary"]
        verdict = "OK" if self.ok else f"FAILED ({', '.join(self.failed)})"
        lines.append(f"{verdict}: {s['pass']} passed, {s['fail']} failed, {s['skip']} skipped")
        return "\n".join(lines) + "\n"


def fmt_prefix(p: str | None) -> str:
    return "(none)" if p is None else repr(p)



def fmt_ints(xs: list[int]) -> str:
    return ", ".join(str(x) for x in xs)
