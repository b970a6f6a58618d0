"""``qeff-kv check``: named rules a retained-state graph must pass, for CI.

Each rule has a stable id (the strings in :data:`RULES`) and reports every violation with the buffer it is
about. A rule that cannot apply (no KV buffers, mixed prefixes for the regex rules) is ``skip``, not ``fail``.

Rules, in order:

``kv-present``        the graph has KV buffers (inputs/outputs named like ``past_key.<i>``). A vision encoder
                      graph (``pixel_values`` -> ``vision_embeds``, nothing retained: the dual layout's vision
                      graph) is ``skip``, and so are the rules that need KV: it passes.
``pairing``           every ``X_RetainedState`` output has the input ``X``, and every KV input ``X`` has the
                      output ``X_RetainedState``; no input or output is listed twice. In a graph with KV buffers,
                      every non-KV retained input (``vision_embeds``, ``pixel_values``, ``image_idx``...) has its
                      output (``image_idx`` -> ``image_idx_output``), and a vision-language graph (a
                      ``vision_embeds`` or ``pixel_values`` input) chains ``image_idx``.
``pair-match``        a KV input and its retained output have the same dtype, rank, dims and dim names. Axis 2 of
                      a KV buffer may be ``ctx_len`` (a full-length cache) or ``sliding_window`` (a sliding-window
                      layer's ring buffer); layers may mix them (the report lists the sliding layers), but the key
                      and value of one layer may not. Graph metadata ``qeff_kv.sliding_window``, when present,
                      is a positive integer ``W``, and a static axis 2 on a sliding layer's buffer equals ``W``.
                      A non-KV retained pair keeps its dtype and dims; ``image_idx`` and ``image_idx_output`` are
                      int64 ``[1, 1]``. Output dims the exporter made up (``..._RetainedState_dim_<i>``) are matched
                      to the input (:mod:`qeff_kv.graph.madeup_dims`, the rule every rule sees): one the graph does not
                      tie takes the input's batch axis or fixed size (said in a note), and fails against any
                      other named axis. A quantized KV buffer (``--kv-cache-dtype int8``) has its float32 scale
                      initializer ``kv_scale.<stem>.<i>`` ``[1, kv_heads, 1, head_dim]``.
``layers``            layers are ``0..N-1`` with no gap (a layer the graph's state spec records as a shared-KV layer,
                      reading an earlier layer's keys/values, keeps none: not a gap), and each layer has both members
                      of its stem group
                      (``past_key`` with ``past_value``; ``compressed_kv`` with ``k_pe``; ``conv_state`` with
                      ``recurrent_state``).
``prefix``            one prefix (or none) on every KV buffer, valid (``[A-Za-z0-9]{1,64}``), equal to the
                      expected prefix when one is given; no name that starts like a KV buffer but is malformed.
``regex-exact``       the exact regex for the graph's prefix selects exactly the KV buffers.
``regex-substring``   the serving regex selects exactly the KV buffers: ``.*P.*`` for prefix ``P``, the legacy
                      ``past_key.*``/``past_value.*`` for an unprefixed graph.
``non-kv-unprefixed`` non-KV retained buffers (``vision_embeds``...) carry no prefix.
``inplace``           each KV input is updated by one in-place updater (ScatterND, GroupQueryAttention) writing
                      its retained output, and every other reader of it or of a view of it (Reshape, Squeeze,
                      Unsqueeze, Flatten, Identity) is a node the updater depends on, so it runs first
                      (:mod:`qeff_kv.graph.inplace`; shape-only readers allowed; function bodies followed). A recurrent
                      state no updater writes (replaced whole, the peer's) passes with a note.
``sidecar``           an ``inference_metadata.yaml`` (either form) or ``genai_config.json`` beside the graph names only
                      ports the graph has, pairs them as the graph's dialect does, with the layer each name says
                      (a list sorted as strings, ``key_cache.10`` before ``key_cache.2``, mis-pairs every layer past
                      9: refused), and names every KV pair of the graph (so its prefix is the graph's). ``skip``
                      without a sidecar (:mod:`qeff_kv.graph.sidecars`).
``lora``              the LoRA adapter inputs (docs/lora.md) form one well-formed set and are never prefixed, retained
                      or selected as KV (:mod:`qeff_kv.tools.check.lora_rule`); ``skip`` without adapter inputs.
``onnx-checker``      ``onnx.checker.check_model`` passes (graph proto only: external weights never loaded).

Reading the file can fail (missing, not ONNX, truncated, unsafe external data): that raises a typed error
(exit 2), it is not a rule failure (exit 1).

The verdicts and their renderings are in :mod:`qeff_kv.tools.check.report`.
"""

from __future__ import annotations

import os
from pathlib import Path

import onnx
import onnx_ir as ir

from qeff_kv.graph import graphio, sidecars
from qeff_kv.contract import multimodal, naming
from qeff_kv.support import validate
from qeff_kv.tools.check import state_rules as state_rules
from qeff_kv.tools.check.lora_rule import rule_lora
from qeff_kv.tools.check.report import ANY, FAIL, PASS, RULES, CheckReport, RuleResult, fmt_ints, fmt_prefix
from qeff_kv.errors import ContractError, GraphReadError
from qeff_kv.graph.inplace import inplace_issues
from qeff_kv.contract.layout import NO_KV, KVLayout, cache_dtype


# ------------------------------------------------------------------------------------------------ rules
def _rule_kv_present(layout: KVLayout, r: RuleResult) -> None:
    if not layout.kv_names:
        if multimodal.graph_kind(layout) == multimodal.VISION_ENCODER:
            r.skip(f"{multimodal.describe_kind(multimodal.VISION_ENCODER)}: the KV rules do not apply")
            return
        r.fail(None, NO_KV)


def _rule_pairing(layout: KVLayout, r: RuleResult) -> None:
    for kind, values in (("input", layout.inputs), ("output", layout.outputs)):
        seen: set[str] = set()
        for t in values:
            if t.name in seen:
                r.fail(t.name, f"{kind} {t.name} is listed twice in the graph's {kind}s")
            seen.add(t.name)
    if len(layout.dialects) > 1:
        r.fail(None, f"KV buffers mix dialects ({', '.join(layout.dialects)}); one graph speaks one")
    for n in layout.declared_missing:
        r.fail(n, f"{layout.source} names port {n}, which the graph does not have")
    for n in layout.unpaired_inputs:
        r.fail(n, f"KV input {n} has no output {layout.output_for(n) or '(none declared)'}")
    for n in layout.unpaired_outputs:
        r.fail(n, f"KV output {n} has no input {layout.input_for(n) or '(none declared)'}")
    in_names = {t.name for t in layout.inputs}
    for t in layout.outputs:
        src = naming.retained_source(t.name)
        if src is None or naming.parse_any_kv_name(t.name) is not None:
            continue  # KV outputs are covered above
        if src not in in_names:
            r.fail(t.name, f"retained output {t.name} has no input {src}")
    _non_kv(layout, r)


def _non_kv(layout: KVLayout, r: RuleResult) -> None:
    """The non-KV retained buffers' findings that belong to rule ``r`` (vision-language graphs, contract s. 6)."""
    for issue in multimodal.non_kv_issues(layout):
        if issue.rule == r.id:
            r.fail(issue.buffer, issue.message)


def _rule_pair_match(layout: KVLayout, r: RuleResult) -> None:
    taken: dict[str, list[int]] = {}   # made-up output dims the graph does not match, taken as the input's
    if layout.grows:
        p = next(p for p in layout.pairs if p.input.shape != p.output.shape)
        r.fail(p.output_name, f"{p.output_name} grows ({_fmt_shape(p.input.shape)} -> {_fmt_shape(p.output.shape)}): "
                              "not retained-state (past/present by concatenation; no buffer can be kept in place)")
        return
    for p in layout.pairs:
        a, b = p.input, p.output
        if a.dtype != b.dtype:
            r.fail(a.name, f"{a.name} is {a.dtype} but {b.name} is {b.dtype}")
        if a.shape is None or b.shape is None:
            if a.shape != b.shape:
                r.fail(a.name, f"{a.name} has shape {_fmt_shape(a.shape)} but {b.name} has {_fmt_shape(b.shape)}")
            continue
        if len(a.shape) != len(b.shape):
            r.fail(a.name, f"{a.name} has rank {len(a.shape)} but {b.name} has rank {len(b.shape)}")
            continue
        made_up = layout.made_up.get(b.name, ())
        for i, (da, db) in enumerate(zip(a.shape, b.shape)):
            if i in made_up and da == db:
                taken.setdefault(b.name, []).append(i)
            elif i in made_up:   # left made up against a named axis of the input (madeup_dims)
                r.fail(a.name, f"{a.name} dim {i} is {_fmt_dim(da)} but {b.name} dim {i} is {_fmt_dim(db)}, a dim "
                               "the exporter made up that neither the graph's scatter nor shape inference matches")
            elif da != db:
                r.fail(a.name, f"{a.name} dim {i} is {_fmt_dim(da)} but {b.name} dim {i} is {_fmt_dim(db)}")
    if taken and r.status != FAIL:
        r.note = _taken_note(taken)
    state_rules.sliding_dims(layout, r)
    state_rules.latent_dims(layout, r)
    state_rules.index_dims(layout, r)
    state_rules.recurrent_dims(layout, r)
    _non_kv(layout, r)


def _taken_note(taken: dict[str, list[int]]) -> str:
    if all(axes == [0] for axes in taken.values()):
        return f"batch axis of {', '.join(taken)} declared with a name the exporter made up; taken as the input's"
    dims = ", ".join(f"{n} (axes {fmt_ints(axes)})" for n, axes in taken.items())
    return f"dims of {dims} declared with names the exporter made up; taken as the input's"


def _fmt_dim(d) -> str:
    return "?" if d is None else (repr(d) if isinstance(d, str) else str(d))


def _fmt_shape(s) -> str:
    return "unknown" if s is None else "[" + ", ".join(_fmt_dim(d) for d in s) + "]"


def _parsed_kv(layout: KVLayout) -> list[naming.KVName]:
    """Every KV name as parsed (a sidecar's pairs: their declared stems and layers)."""
    if layout.source != "names":
        return [naming.KVName(p.stem, p.layer, None, out) for p in layout.pairs for out in (False, True)]
    out = []
    for name in layout.io_names:
        parsed = naming.parse_any_kv_name(name)
        if parsed is not None:
            out.append(parsed)
    return out


def _rule_layers(layout: KVLayout, r: RuleResult) -> None:
    parsed = _parsed_kv(layout)
    layers = sorted({k.layer for k in parsed})
    # a shared-KV layer the graph's state spec records keeps no buffer (it reads its source's): not a gap
    shared = {layer for layer, _ in layout.state_spec.shared}
    missing = sorted(set(range(layers[-1] + 1)) - set(layers) - shared) if layers else []
    for i in missing:
        r.fail(None, f"layer {i} has no KV buffers (layers present: {fmt_ints(layers)}; expected 0..{layers[-1]})")
    stems_at: dict[int, set[str]] = {}
    example: dict[tuple[int, str], str] = {}
    for k in parsed:
        if k.retained:
            continue
        stems_at.setdefault(k.layer, set()).add(k.stem)
        example.setdefault((k.layer, k.stem), k.name)
    # Layers that only have retained outputs (unpaired) still count for group completeness via outputs.
    for k in parsed:
        if k.retained and k.stem not in stems_at.get(k.layer, set()):
            stems_at.setdefault(k.layer, set()).add(k.stem)
            example.setdefault((k.layer, k.stem), k.name)
    for layer in sorted(stems_at):
        have = stems_at[layer]
        for group in naming.STEM_GROUPS:
            present = [s for s in group if s in have]
            if present and len(present) != len(group):
                for s in group:
                    if s not in have and any(s in naming.STEM_REQUIRES[p] for p in present):
                        r.fail(example[(layer, present[0])],
                               f"layer {layer} has {', '.join(present)} but no {s} "
                               f"({example[(layer, present[0])]} has no companion)")



def _rule_prefix(layout: KVLayout, r: RuleResult, expected: object) -> None:
    for name in layout.io_names:
        if naming.looks_like_kv(name) and naming.parse_any_kv_name(name) is None:
            r.fail(name, f"{name} starts like a KV buffer but is not a valid KV name ({_grammar(name)}, prefix "
                         "[A-Za-z0-9]{1,64})")
    parsed = [(n, naming.parse_any_kv_name(n)) for n in layout.io_names]
    parsed = [(n, k) for n, k in parsed if k is not None]
    prefixes = layout.prefixes
    if len(prefixes) > 1:
        counts = {p: sum(1 for _, k in parsed if k.prefix == p) for p in prefixes}
        if expected is not ANY and expected in counts:
            ref = expected
        else:
            ref = max(prefixes, key=lambda p: counts[p])  # first-seen wins ties
        for n, k in parsed:
            if k.prefix != ref:
                r.fail(n, f"{n} has prefix {fmt_prefix(k.prefix)} but other KV buffers have "
                          f"{fmt_prefix(ref)} (mixed prefixes: {', '.join(fmt_prefix(p) for p in prefixes)})")
        if expected is not ANY and expected not in counts:
            r.fail(None, f"expected prefix {fmt_prefix(expected)} (found {', '.join(fmt_prefix(p) for p in prefixes)})")
        return
    if expected is not ANY and prefixes and prefixes[0] != expected:
        first = parsed[0][0]
        r.fail(first, f"KV buffers carry prefix {fmt_prefix(prefixes[0])} but {fmt_prefix(expected)} is "
                      f"expected (e.g. {first})")


def _grammar(name: str) -> str:
    """The name grammar of the dialect ``name`` starts like."""
    if name.startswith((naming.PAST_KEY_VALUES + ".", naming.PRESENT + ".")):
        return "past_key_values|present.<layer>.key|value[_<prefix>]"
    if "_cache." in name:
        return "[updated_]key|value_cache.<layer>[_<prefix>]"
    return "<stem>.<layer>[_<prefix>][_RetainedState]"


def _selection_violations(r: RuleResult, layout: KVLayout, label: str, regexes: list[str]) -> None:
    kv = set(layout.kv_names)
    selected: set[str] = set()
    for rx in regexes:
        selected.update(naming.select(rx, layout.io_names))
    for n in layout.io_names:
        if n in selected and n not in kv:
            r.fail(n, f"{label} {' + '.join(regexes)} selects the non-KV buffer {n}")
        elif n in kv and n not in selected:
            r.fail(n, f"{label} {' + '.join(regexes)} does not select the KV buffer {n}")


def _uniform_prefix(layout: KVLayout, r: RuleResult) -> tuple[bool, str | None]:
    if not layout.kv_names:
        r.skip("no KV buffers")
        return False, None
    if len(layout.prefixes) > 1:
        r.skip("mixed prefixes (see rule prefix)")
        return False, None
    if len(layout.dialects) > 1:
        r.skip("mixed dialects (see rule pairing)")
        return False, None
    if layout.dialect is None:
        r.skip(f"ports named by {layout.source}, not by a dialect's names: no regex selects them")
        return False, None
    return True, layout.prefixes[0] if layout.prefixes else None


def _rule_regex_exact(layout: KVLayout, r: RuleResult) -> None:
    ok, prefix = _uniform_prefix(layout, r)
    if ok:
        stems = layout.stems or list(naming.EXPORT_STEMS)
        _selection_violations(r, layout, "exact regex", [naming.exact_regex(prefix, stems, layout.dialect)])


def _rule_regex_substring(layout: KVLayout, r: RuleResult) -> None:
    ok, prefix = _uniform_prefix(layout, r)
    if not ok:
        return
    if prefix is None:
        stems = layout.stems or list(naming.EXPORT_STEMS)
        r.note = "unprefixed graph: legacy regexes"
        _selection_violations(r, layout, "legacy regexes", naming.legacy_regexes(stems, layout.dialect))
    else:
        _selection_violations(r, layout, "substring regex", [naming.substring_regex(prefix)])


def _rule_non_kv(layout: KVLayout, r: RuleResult) -> None:
    for n in layout.io_names:
        hit = naming.prefixed_non_kv(n)
        if hit is not None:
            base, p = hit
            r.fail(n, f"non-KV retained buffer {n} carries prefix {p!r}; {base} buffers are never prefixed")


def _rule_inplace(model: ir.Model, layout: KVLayout, r: RuleResult) -> None:
    if not layout.pairs:
        r.skip("no KV pairs")
        return
    if layout.grows:
        r.skip("past/present that grows by concatenation: no buffer is kept in place (see rule pair-match)")
        return
    replaced = []
    for issue in inplace_issues(model, layout):
        if issue.replaced:
            replaced.append(issue.buffer)
        else:
            r.fail(issue.buffer, issue.message)
    if replaced:
        r.note = (f"recurrent state replaced whole, not updated in place: {', '.join(replaced)} (the runtime keeps a "
                  "second buffer for each)")


def _rule_sidecar(model: ir.Model, layout: KVLayout, r: RuleResult) -> None:
    found, problems = sidecars.sidecar_issues(model, layout)
    if found is None:
        r.skip("no inference_metadata.yaml or genai_config.json beside the graph")
        return
    for problem in problems:
        r.fail(None, problem)
    if not problems:
        r.note = f"checked: {found}"


def _rule_checker(path: Path, r: RuleResult) -> None:
    # Checked from the path so the checker resolves external-data files against the model's folder; it parses
    # the graph proto only (external tensors stay references: a > 2 GB model is never read into memory).
    try:
        onnx.checker.check_model(str(path), full_check=False)
    except onnx.checker.ValidationError as exc:
        msg = " ".join(str(exc).split())
        r.fail(None, f"onnx checker: {msg[:500]}")
    except Exception as exc:  # the checker's C++ side raises a few other types
        r.fail(None, f"onnx checker: {type(exc).__name__}: {' '.join(str(exc).split())[:500]}")


# ------------------------------------------------------------------------------------------------ entry
def check(path: str | os.PathLike, *, expected_prefix: object = ANY,
          skip_checker: bool = False) -> CheckReport:
    """Run every rule on the graph at ``path``.

    ``expected_prefix``: :data:`ANY` (default) accepts any single prefix; a string requires that prefix;
    ``None`` requires unprefixed KV buffers. Raises :class:`~qeff_kv.errors.QeffKvError` subclasses when the
    file cannot be read (or the expected prefix is invalid); rule failures are in the report.
    """
    if expected_prefix is not ANY and expected_prefix is not None:
        naming.validate_prefix(expected_prefix)
    validate.path_like("path", path, error=GraphReadError)
    validate.flag("skip_checker", skip_checker)
    path = Path(path)
    model = graphio.load(path)
    report = check_model(model, expected_prefix=expected_prefix, name=str(path))
    r = report.rule("onnx-checker")
    r.status, r.note = PASS, None
    if skip_checker:
        r.skip("skipped on request")
    else:
        _rule_checker(path, r)
    return report


def check_model(model: ir.Model, *, expected_prefix: object = ANY, name: str = "<model>") -> CheckReport:
    """Every rule but ``onnx-checker`` (which needs the file; marked skipped here) on an in-memory model."""
    layout = sidecars.layout_beside(model)
    results = {rid: RuleResult(rid) for rid in RULES}
    _rule_kv_present(layout, results["kv-present"])
    _rule_pairing(layout, results["pairing"])
    _rule_pair_match(layout, results["pair-match"])
    state_rules.kv_scales(model, layout, results["pair-match"])
    if layout.kv_names:
        _rule_layers(layout, results["layers"])
        _rule_prefix(layout, results["prefix"], expected_prefix)
    else:
        results["layers"].skip("no KV buffers")
        results["prefix"].skip("no KV buffers")
    _rule_regex_exact(layout, results["regex-exact"])
    _rule_regex_substring(layout, results["regex-substring"])
    _rule_non_kv(layout, results["non-kv-unprefixed"])
    _rule_inplace(model, layout, results["inplace"])
    _rule_sidecar(model, layout, results["sidecar"])
    rule_lora(layout, results["lora"])
    results["onnx-checker"].skip("in-memory model (no file to check)")
    prefixes = layout.prefixes
    return CheckReport(
        model=name, prefix=prefixes[0] if len(prefixes) == 1 else None, prefixes=prefixes,
        expected_prefix=expected_prefix, num_layers=layout.num_layers, rules=list(results.values()),
        ccl=layout.input(naming.CCL_INPUT) is not None, speculative=layout.speculative,
        speculative_tokens=layout.speculative_tokens, sliding_layers=layout.sliding_layers,
        sliding_window=layout.sliding_window, sliding_meta=layout.sliding_window_meta is not None,
        shared_layers=list(layout.state_spec.shared),
        vision_language=multimodal.graph_kind(layout), dialect=layout.dialect, update=layout.update,
        source=layout.source, lora=_lora_json(layout),
        kv_dtypes=_kv_dtypes(layout))


def _kv_dtypes(layout: KVLayout) -> list[str]:
    """The KV buffers' cache dtypes (:func:`~qeff_kv.contract.layout.cache_dtype`: a uint8 buffer is
    GroupQueryAttention's packed 4-bit cache, ``--kv-cache-dtype int4``, named ``int4``)."""
    return sorted({cache_dtype(str(p.input.dtype)) for p in layout.pairs if not p.recurrent})


def _lora_json(layout: KVLayout) -> dict | None:
    try:
        geo = layout.lora
    except ContractError:   # rule lora says why
        return None
    return None if geo is None else geo.to_json()
