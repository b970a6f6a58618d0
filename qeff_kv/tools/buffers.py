"""``qeff-kv buffers``: the KV buffer table of a graph, and what a serving regex would select.

* :func:`format_buffer_table` renders a :class:`~qeff_kv.contract.layout.KVLayout` (also printed after ``export``).
* :func:`buffers_report` reads a graph (external weights never loaded) and builds a :class:`BuffersReport`:
  the KV pairs (layer, kind, input name, retained name, dtype, shape, capacity, bytes per sequence at
  ``ctx_len`` and, for sliding-window ring buffers (axis 2 ``sliding_window``), at the window ``W`` taken from
  the graph metadata ``qeff_kv.sliding_window`` or given by the caller), the non-KV retained buffers, the
  canonical regexes for the graph's prefix and, with a regex, exactly which I/O
  names it selects and whether that equals the KV set. A graph with LoRA adapter inputs gets them apart from the KV
  (:mod:`qeff_kv.tools.lora_inputs`: modules, max rank, bytes per adapter slot at that rank).
* :func:`resolve_graph`: the graph an export folder's manifest names (``compile-config``'s from-graph half is
  :mod:`qeff_kv.tools.compile_from_graph`).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from qeff_kv.graph import graphio, sidecars
from qeff_kv.contract import multimodal, naming
from qeff_kv.support import validate
from qeff_kv.tools.compile_config import check_sliding_window, resolve_sliding_window
from qeff_kv.tools.lora_inputs import lora_lines, lora_summary
from qeff_kv.errors import ContractError, QeffKvError, RuntimeInputError
from qeff_kv.contract.layout import NO_KV, KVLayout, KVPair, itemsize

SCHEMA = "qeff-kv.buffers/1"


class RegexError(QeffKvError, ValueError):
    """A selection regex given by the user does not compile."""


# ------------------------------------------------------------------------------------------------ helpers
def human_bytes(n: int | None) -> str:
    if n is None:
        return "?"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            v = n / size
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{n} B"


def _sorted_pairs(layout: KVLayout) -> list[KVPair]:
    return sorted(layout.pairs, key=lambda p: (p.layer, naming.KV_STEMS.index(p.stem)))


def _fmt_shape(shape) -> str:
    if shape is None:
        return "?"
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    out = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip()]
    out.append("  ".join("-" * w for w in widths))
    for r in rows:
        out.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    return out


def total_bytes_per_sequence(layout: KVLayout, ctx_len: int | None,
                             sliding_window: int | None = None) -> int | None:
    """Bytes of one sequence over every KV pair, each at its own capacity (``sliding_window`` defaults to the
    graph metadata's window); ``None`` if one is unknown."""
    if sliding_window is None:
        sliding_window = layout.sliding_window
    total = 0
    for p in layout.pairs:
        b = p.bytes_per_sequence(ctx_len, sliding_window)
        if b is None:
            return None
        total += b
    return total


def bytes_per_token(layout: KVLayout) -> int | None:
    """Bytes one position of one sequence takes over every KV buffer with a position axis (all dims but the batch
    and position axes), ``None`` if a dim is unknown or no buffer has a position axis."""
    total, seen = 0, False
    for p in layout.pairs:
        shape = p.input.shape
        if p.recurrent or shape is None or len(shape) < 3:
            continue
        n = itemsize(p.input.dtype)
        for i, d in enumerate(shape):
            if i in (0, 2):
                continue
            if not isinstance(d, int) or isinstance(d, bool):
                return None
            n *= d
        total, seen = total + n, True
    return total if seen else None


def mla_full_equivalent(layout: KVLayout) -> int | None:
    """For a graph with MLA's latent cache and its ``qeff_kv.mla`` metadata: the bytes per token of the expanded
    per-head cache it replaces, ``heads * (qk_nope + qk_rope + v_head)`` values per layer (contract section 11)."""
    raw = layout.metadata.get(naming.MLA_META)
    latent = [p for p in layout.pairs if p.stem == naming.LATENT_STEMS[0]]
    if raw is None or not latent:
        return None
    try:
        g = json.loads(raw)
        per_layer = int(g["heads"]) * (int(g["qk_nope_head_dim"]) + int(g["qk_rope_head_dim"]) + int(g["v_head_dim"]))
    except (ValueError, KeyError, TypeError):
        return None
    return per_layer * itemsize(latent[0].input.dtype) * len(latent)


def _per_token_line(layout: KVLayout) -> str | None:
    per_token = bytes_per_token(layout)
    if per_token is None:
        return None
    line = f"KV bytes per token (one sequence, all layers): {per_token}"
    if layout.quantized_kv is not None:   # --kv-cache-dtype int8: read through its scales
        line += f", KV cache {layout.quantized_kv} (its scales are initializers, not per sequence)"
    full = mla_full_equivalent(layout)
    if full is not None:
        line += (f"; MLA latent cache (compressed_kv + k_pe), the expanded per-head cache would take {full} "
                 f"({full / per_token:.1f}x)")
    return line


def _fmt_capacity(n: int | None, recurrent: bool = False) -> str:
    return "state" if recurrent else "?" if n is None else str(n)


def recurrent_bytes_per_sequence(layout: KVLayout) -> int | None:
    """Bytes of one sequence's recurrent states (``conv_state``, ``recurrent_state``: no position axis, the same
    at any ``ctx_len`` and sequence length); ``None`` without them or when a dim is unknown."""
    pairs = layout.recurrent_pairs
    sizes = [p.bytes_per_sequence() for p in pairs]
    return None if not pairs or None in sizes else sum(sizes)


def format_buffer_table(layout: KVLayout, ctx_len: int | None = None, sliding_window: int | None = None) -> str:
    """The KV pairs of ``layout`` as a text table (capacity and bytes per sequence at each buffer's own
    capacity: ``ctx_len``, or the window ``W`` for ring buffers), with the non-KV retained buffers and totals.
    ``sliding_window`` defaults to the graph metadata's window."""
    if sliding_window is None:
        sliding_window = layout.sliding_window
    sliding = layout.has_sliding
    rows = []
    for p in _sorted_pairs(layout):
        rows.append([str(p.layer), p.stem, p.input_name, p.output_name, p.input.dtype, _fmt_shape(p.input.shape),
                     _fmt_capacity(p.capacity(ctx_len, sliding_window), p.recurrent),
                     human_bytes(p.bytes_per_sequence(ctx_len, sliding_window))])
    at = []
    if ctx_len is not None:
        at.append(f"ctx_len={ctx_len}")
    if sliding and sliding_window is not None:
        at.append(f"sliding_window={sliding_window}")
    bytes_col = "bytes/seq" + (f" @{','.join(at)}" if at else "")
    lines = _table(["layer", "kind", "input", "retained", "dtype", "shape", "capacity", bytes_col], rows)
    lines.append(_summary_line(layout, ctx_len, sliding_window))
    lines += _notes(layout, sliding_window)
    return "\n".join(lines) + "\n"


def _summary_line(layout: KVLayout, ctx_len: int | None, sliding_window: int | None) -> str:
    """Pairs, layers, prefix and the bytes per sequence (or which option would give them)."""
    total = total_bytes_per_sequence(layout, ctx_len, sliding_window)
    ps = layout.prefixes
    prefix = "mixed: " + ", ".join("(none)" if p is None else p for p in ps) if len(ps) > 1 else (
        "(none)" if not ps or ps[0] is None else ps[0])
    summary = f"{len(layout.pairs)} KV pairs, {layout.num_layers} layers, prefix {prefix}"
    if total is not None:
        summary += f", {human_bytes(total)} ({total} bytes) per sequence"
    elif layout.pairs:
        need = []
        if ctx_len is None and any(p.bytes_per_sequence(None, sliding_window or 1) is None for p in layout.pairs):
            need.append("--ctx-len N")
        if layout.has_sliding and sliding_window is None:
            need.append("--sliding-window N")
        if need:
            summary += f"; pass {' and '.join(need)} for bytes per sequence"
    return summary


def _notes(layout: KVLayout, sliding_window: int | None) -> list[str]:
    """The lines under the summary: per-token bytes, recurrent state, sliding layers, speculative decoding,
    unpaired and non-KV retained buffers, the vision-language kind."""
    lines = []
    per_token = _per_token_line(layout)
    if per_token is not None:
        lines.append(per_token)
    state = recurrent_bytes_per_sequence(layout)
    if state is not None:
        layers = sorted({p.layer for p in layout.recurrent_pairs})
        lines.append(f"recurrent state bytes per sequence (constant in ctx_len, layers "
                     f"{', '.join(map(str, layers))}): {human_bytes(state)} ({state} bytes)")
    if layout.has_sliding:
        w = f"window {sliding_window}" if sliding_window is not None else "window unknown"
        lines.append(f"sliding-window layers ({w}): " + ", ".join(str(i) for i in layout.sliding_layers))
    shared = layout.state_spec.shared
    if shared:
        lines.append("shared-KV layers (no buffers; each reads an earlier layer's keys/values): "
                     + ", ".join(f"{layer} reads {src}" for layer, src in shared))
    if layout.speculative:
        k = layout.speculative_tokens
        lines.append(f"speculative decoding: {naming.LOGITS_TO_KEEP_INPUT} input, decode steps of up to "
                     + (f"{k + 1} tokens (K={k})" if k is not None else "K+1 tokens (K not recorded)"))
    if layout.unpaired_inputs or layout.unpaired_outputs:
        lines.append("unpaired KV buffers: " + ", ".join(layout.unpaired_inputs + layout.unpaired_outputs))
    kind = multimodal.graph_kind(layout)
    non_kv = _non_kv_rows(layout)
    if non_kv:
        lines.append("non-KV retained buffers: " + ", ".join(
            f"{i or '(no input)'} -> {o or '(no output)'}" for i, o in non_kv))
    else:
        lines.append("non-KV retained buffers: none")
    if kind is not None:
        lines.append(f"{multimodal.describe_kind(kind)}")
    lines += lora_lines(layout, human_bytes)
    return lines


def _non_kv_rows(layout: KVLayout) -> list[tuple[str | None, str | None]]:
    """The non-KV retained buffers to list: none in a vision encoder graph (its ``pixel_values`` input and
    ``vision_embeds`` output are plain I/O there, nothing is retained)."""
    if multimodal.graph_kind(layout) == multimodal.VISION_ENCODER:
        return []
    return list(layout.non_kv_retained)


# ------------------------------------------------------------------------------------------------ selection
@dataclass
class RegexSelection:
    """What ``regex`` (full-match, as serving frameworks apply it) selects among a graph's I/O names."""

    regex: str
    selected: list[str]
    kv: list[str]
    extra: list[str] = field(default_factory=list)    # selected but not KV
    missed: list[str] = field(default_factory=list)   # KV but not selected

    @property
    def equals_kv(self) -> bool:
        return not self.extra and not self.missed

    def to_json(self) -> dict:
        return {"regex": self.regex, "selected": list(self.selected), "equals_kv_set": self.equals_kv,
                "selects_non_kv": list(self.extra), "misses_kv": list(self.missed)}

    def format_text(self) -> str:
        lines = [f"regex {self.regex!r} selects {len(self.selected)} of the graph's inputs/outputs:"]
        lines += [f"  {n}" for n in self.selected] or ["  (nothing)"]
        if self.equals_kv:
            lines.append(f"= exactly the {len(self.kv)} KV buffers")
        else:
            lines.append("!= the KV buffers:")
            if self.extra:
                lines.append("  selects non-KV: " + ", ".join(self.extra))
            if self.missed:
                lines.append("  misses KV: " + ", ".join(self.missed))
        return "\n".join(lines) + "\n"


def regex_selection(layout: KVLayout, regex: str) -> RegexSelection:
    try:
        re.compile(regex)
    except re.error as exc:
        raise RegexError(f"regex {regex!r} does not compile: {exc}") from None
    selected = naming.select(regex, layout.io_names)
    kv = layout.kv_names
    sel, kvs = set(selected), set(kv)
    return RegexSelection(regex, selected, kv, [n for n in selected if n not in kvs],
                          [n for n in kv if n not in sel])


# ------------------------------------------------------------------------------------------------ report
@dataclass
class BuffersReport:
    model: str
    layout: KVLayout
    ctx_len: int | None = None
    selection: RegexSelection | None = None
    #: the window ``W`` of the ring buffers: given by the caller, else the graph metadata's (``None``: unknown)
    sliding_window: int | None = None

    @property
    def prefix(self) -> str | None:
        ps = self.layout.prefixes
        return ps[0] if len(ps) == 1 else None

    @property
    def regexes(self) -> dict | None:
        """Canonical regexes for the graph's prefix (``None`` when prefixes are mixed or there is no KV)."""
        ps = self.layout.prefixes
        if len(ps) != 1:
            return None
        if self.layout.dialect is None:   # ports only a sidecar names: no regex selects them
            return None
        return naming.canonical_regexes(ps[0], self.layout.stems or naming.EXPORT_STEMS, self.layout.dialect)

    def to_json(self) -> dict:
        lay = self.layout
        kinds = lay.state_kinds
        return {
            "schema": SCHEMA,
            "model": self.model,
            "prefix": self.prefix,
            "prefixes": list(lay.prefixes),
            "dialect": lay.dialect,
            "source": lay.source,
            "update": lay.update,
            "num_layers": lay.num_layers,
            "ctx_len": self.ctx_len,
            "sliding_window": self.sliding_window,
            "sliding_layers": lay.sliding_layers,
            **({"shared_layers": [{"layer": a, "source": b} for a, b in sh]} if (sh := lay.state_spec.shared) else {}),
            "pairs": [{**p.to_json(self.ctx_len, self.sliding_window), "state": kinds.get((p.stem, p.layer))}
                      for p in _sorted_pairs(lay)],
            "bytes_per_sequence": total_bytes_per_sequence(lay, self.ctx_len, self.sliding_window),
            "bytes_per_token": bytes_per_token(lay),
            **({"recurrent_bytes_per_sequence": rec} if (rec := recurrent_bytes_per_sequence(lay)) is not None else {}),
            **({"mla_full_bytes_per_token": full} if (full := mla_full_equivalent(lay)) is not None else {}),
            # only on a quantized cache (--kv-cache-dtype int8): every float graph's key set stays as it was
            **({"kv_cache_dtype": q} if (q := lay.quantized_kv) is not None else {}),
            "unpaired": {"inputs": list(lay.unpaired_inputs), "outputs": list(lay.unpaired_outputs)},
            "non_kv_retained": [{"input": i, "retained": o} for i, o in _non_kv_rows(lay)],
            "regexes": self.regexes,
            "selection": None if self.selection is None else self.selection.to_json(),
            # only on speculative-decoding / vision-language graphs: other graphs' key set stays as it was
            **({"speculative_tokens": lay.speculative_tokens} if lay.speculative else {}),
            **({"vision_language": kind} if (kind := multimodal.graph_kind(lay)) else {}),
            # only on graphs with LoRA adapter inputs (not KV: listed apart from the pairs)
            **({"lora": lora} if (lora := lora_summary(lay)) is not None else {}),
        }

    def to_json_text(self) -> str:
        return json.dumps(self.to_json(), indent=2) + "\n"

    def format_text(self) -> str:
        out = [f"{self.model}", format_buffer_table(self.layout, self.ctx_len, self.sliding_window).rstrip("\n")]
        rx = self.regexes
        if rx is not None:
            out.append("canonical regexes:")
            for k, v in rx.items():
                out.append(f"  {k}: " + (" + ".join(v) if isinstance(v, list) else v))
        elif len(self.layout.prefixes) > 1:
            out.append("canonical regexes: none (mixed prefixes)")
        if self.selection is not None:
            out.append(self.selection.format_text().rstrip("\n"))
        return "\n".join(out) + "\n"


def buffers_report(path: str | os.PathLike, *, regex: str | None = None,
                   ctx_len: int | None = None, sliding_window: int | None = None) -> BuffersReport:
    """Read ``path`` (weights stay on disk) and describe its buffers.

    ``sliding_window``: the window ``W`` of the ring buffers (axis 2 ``sliding_window``) for their capacity and
    bytes per sequence; by default the graph metadata's ``qeff_kv.sliding_window`` (peer graphs carry none)."""
    if ctx_len is not None and (not isinstance(ctx_len, int) or isinstance(ctx_len, bool) or ctx_len < 1):
        raise RuntimeInputError(f"ctx_len must be a positive integer, got {ctx_len!r}")
    check_sliding_window(sliding_window)
    validate.path_like("path", path)
    validate.text("regex", regex)
    if regex is not None:
        try:
            re.compile(regex)
        except re.error as exc:
            raise RegexError(f"regex {regex!r} does not compile: {exc}") from None
    path = resolve_graph(path)
    layout = sidecars.layout_beside(graphio.load(path))
    if not layout.kv_names and multimodal.graph_kind(layout) != multimodal.VISION_ENCODER:
        raise ContractError(f"{path}: {NO_KV}")   # never "0 KV pairs" on a graph whose KV it cannot name
    if sliding_window is not None and not layout.has_sliding:   # a setting that would do nothing
        raise RuntimeInputError(f"{path} has no sliding-window KV buffers (axis {naming.SLIDING_DIM!r}); "
                                "--sliding-window does not apply")
    window = resolve_sliding_window(layout, sliding_window)
    sel = regex_selection(layout, regex) if regex is not None else None
    return BuffersReport(str(path), layout, ctx_len, sel, window)


def resolve_graph(path: str | os.PathLike) -> Path:
    """``path`` itself, or for an export folder the graph its ``manifest.json`` names as ``onnx`` (the graph
    holding the KV: the language graph of a vision-language export)."""
    path = Path(path)
    if not path.is_dir():
        return path
    man_path = path / multimodal.MANIFEST
    if not man_path.is_file():
        raise ContractError(f"{path} is a folder without {multimodal.MANIFEST}; give an .onnx file")
    try:
        man = json.loads(man_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ContractError(f"{man_path}: not valid JSON ({' '.join(str(exc).split())})") from None
    if not isinstance(man, dict) or not isinstance(man.get("onnx"), str) or not man["onnx"]:
        raise ContractError(f"{man_path} names no graph (no \"onnx\" entry)")
    return path / man["onnx"]
