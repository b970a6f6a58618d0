"""Writing ``inference_metadata.yaml`` in the ``pipeline.workflow`` form for our retained-state graphs (and their
shared-buffer past/present twins, `rewrite --to shared-past-present`: the same buffers under other names), and for
static-cache graphs (`rewrite --to static-cache`, mobius-onnx ``--static-cache``).

What onnx-genai 0.1.0.dev6 loads (tried against it, benchmarks/peer_onnx_genai.py): ``schema_version: v1.2`` (the
first version with ``package.tokenizer.special_tokens``, where the EOS ids go), one ONNX component ``decoder`` whose
ports carry the roles ``token_ids``, ``position_ids`` and ``logits``, a ``token_policy`` binding, one
``serving.state_service`` group per state kind with one alias ``{input, output, role, layer}`` per buffer,
``aliasing: required`` (the retained output is the input's buffer), ``layout: head_major_bnsh``, ``sequence_axis:
2`` and state cells seeded with zeros, each cell's shape giving its capacity (``ctx_len``, or the window ``W`` of a
ring). Kinds: ``full`` -> ``full_attention``, ``ring`` -> ``sliding_attention``, ``latent`` ->
``multi_latent_attention``, ``indexed`` -> ``indexed_attention``, ``recurrent`` -> ``recurrent`` (``update: replace``,
no sequence axis).

The schema refuses unknown fields, so what it has no field for is in the header comment: the KV prefix, and that
the proposal has no update kind for a graph that writes its own slots from ``position_ids`` (position ``p`` at slot
``p``, or ``p % W`` in a ring): no ``update`` is written for those groups. ``position_ids`` is bound to a literal
placeholder of its own length symbol: the runtime feeds the port by its role.

A static cache (``key_cache.{i}`` ``[batch, capacity, kv_heads*head_dim]`` -> ``updated_key_cache.{i}``, written by
TensorScatter at ``write_indices``, attention over ``nonpad_kv_seqlen``) is one ``full_attention`` group with
``update: {kind: indexed_scatter, write_indices: cache_lengths, capacity: package.sequence_capacity,
write_indices_ports, kv_length_ports}``, ``logical_lengths: cache_lengths``, ``layout: bsh``, ``sequence_axis: 1``,
``aliasing: required`` (TensorScatter writes the input's buffer); the capacity (and ``max_sequence_length``) is the
buffers' axis 1. The decoder binds ``write_indices`` to the ``cache_lengths`` cell (the length before the step) and
``nonpad_kv_seqlen`` to a literal placeholder (the length after it, which the runtime feeds by the group's port).
"""

from __future__ import annotations

import dataclasses

from qeff_kv.contract import naming
from qeff_kv.contract.layout import KVLayout, KVPair, TensorInfo
from qeff_kv.errors import SidecarError
from qeff_kv.graph.sidecars.declared import SidecarFacts, STEM_ROLES

#: the proposal version written (onnx-genai 0.1.0.dev6 reads v1.0 through v1.8)
SCHEMA_VERSION = "v1.2"
#: our state kind -> the proposal's state group kind
GROUP_KINDS = {"full": "full_attention", "ring": "sliding_attention", "latent": "multi_latent_attention",
               "indexed": "indexed_attention", "recurrent": "recurrent"}
_TEXT_INPUTS = (naming.INPUT_IDS_INPUT, naming.POSITION_IDS_INPUT)
_STATIC_INPUTS = (naming.WRITE_INDICES_INPUT, naming.NONPAD_KV_SEQLEN_INPUT)
#: a static cache's packed ``[batch, capacity, kv_heads*head_dim]`` buffer as the schema spells it (positions: axis 1)
STATIC_LAYOUT, STATIC_SEQUENCE_AXIS = "bsh", 1
#: the state cell that is both a static cache's write cursor and its valid length before a step
_LENGTHS_CELL = "cache_lengths"
_DIMS = {"batch_size": "batch", "batch": "batch", "seq_len": "sequence", "sequence_len": "sequence"}
_POLICY_OUT = {"accepted_len": ("int64", ["batch"]), "active": ("bool", ["batch"]),
               "cache_lengths": ("int64", ["batch"]), "done": ("bool", ["batch"]),
               "token": ("int64", ["batch", "sequence"])}


def is_static(layout: KVLayout) -> bool:
    """A static-cache graph (``key_cache.{i}`` -> ``updated_key_cache.{i}`` by TensorScatter at ``write_indices``)."""
    return layout.dialect == naming.STATIC_CACHE


def unsupported_reason(layout: KVLayout) -> str | None:
    if layout.dialect not in (naming.RETAINED_STATE, naming.PAST_PRESENT, naming.STATIC_CACHE) or layout.grows:
        return (f"the workflow form written here binds buffers the graph updates in place or by indexed scatter; a "
                f"{layout.dialect or 'sidecar-declared'} graph ({layout.update}) is not one")
    allowed = _TEXT_INPUTS + (_STATIC_INPUTS if is_static(layout) else ())
    extra = [t.name for t in layout.inputs if t.name not in allowed and naming.parse_any_kv_name(t.name) is None]
    if extra:
        return f"the workflow form written here binds {', '.join(allowed)} and KV buffers; the graph also takes {extra[0]!r}"
    if layout.input(naming.INPUT_IDS_INPUT) is None or layout.output(naming.LOGITS_OUTPUT) is None:
        return "the graph has no input_ids input or no logits output"
    return _static_reason(layout) if is_static(layout) else None


def _static_reason(layout: KVLayout) -> str | None:
    missing = [n for n in _STATIC_INPUTS if layout.input(n) is None]
    if missing:
        return f"a static cache is declared with its {missing[0]!r} input, which the graph lacks"
    kinds = set(layout.state_kinds.values()) - {"full"}
    if kinds:
        return f"the static cache declared here is one full-attention group; this graph keeps {', '.join(sorted(kinds))}"
    for p in layout.pairs:
        if not p.packed or not (isinstance(p.axis2, int) or p.axis2 == naming.CTX_DIM):
            return (f"{p.input_name!r} is not a packed [batch, capacity, kv_heads*head_dim] buffer with a known "
                    f"capacity (shape {list(p.input.shape or ())})")
    return None


def static_capacity(layout: KVLayout, ctx_len: int) -> int:
    """The positions a static cache holds: its buffers' axis 1 (``ctx_len`` where the axis is named so)."""
    caps = {p.capacity(ctx_len) for p in layout.pairs}
    if len(caps) != 1 or None in caps:
        raise SidecarError(f"the static cache's buffers do not share one known capacity ({sorted(map(str, caps))})")
    return caps.pop()


def _contract(dtype: str, shape, batch: bool = True) -> dict:
    d = {"dtype": dtype, "shape": list(shape), "optional": False}
    if batch:
        d["batch_layout"] = {"kind": "request_aligned", "axis": 0}
    return d


def _shape(t: TensorInfo, ctx_len: int, window: int | None, rename: dict | None = None) -> list:
    dims = {**_DIMS, naming.CTX_DIM: ctx_len, naming.SLIDING_DIM: window, **(rename or {})}
    out = []
    for i, d in enumerate(t.shape or ()):
        v = dims.get(d, d) if isinstance(d, str) else d
        out.append("batch" if i == 0 else (v if v is not None else f"d{i}"))
    return out


def _own_length(t: TensorInfo) -> dict | None:
    """``position_ids``' length gets a symbol of its own (the runtime binds it to a literal placeholder, which must
    not tie the prompt's length), whatever the graph calls it."""
    shape = t.shape or ()
    if t.name != naming.POSITION_IDS_INPUT or len(shape) < 2 or not isinstance(shape[1], str):
        return None
    return {shape[1]: "position_len"}


def _literal(dtype: str, shape: list, default, batch: bool = True) -> dict:
    return {"contract": _contract(dtype, shape, batch), "role": {"kind": "opaque"}, "source": {"kind": "literal"},
            "required": False, "default": default}


def _cell(dtype: str, shape: list, initializer: str, **extra) -> dict:
    cell = {"contract": _contract(dtype, shape), "class": "semantic", "scope": "invocation",
            "initializer": initializer, "recurrence": {"kind": "invariant"}, "management": "workflow"}
    cell.update(extra)
    return cell


def alias_label(p: KVPair) -> str:
    """The state cell of one buffer: ``past_key.0003`` (zero-padded, so the label's string order is the layer's)."""
    return f"{p.stem}.{p.layer:04d}"


def _groups(layout: KVLayout) -> dict[str, list[KVPair]]:
    kinds = layout.state_kinds
    groups: dict[str, list[KVPair]] = {}
    for p in sorted(layout.pairs, key=lambda p: (p.layer, naming.KV_STEMS.index(p.stem))):
        groups.setdefault(f"kv_{kinds.get((p.stem, p.layer), 'full')}", []).append(p)
    return groups


def _group(kind: str, pairs: list[KVPair], static: bool = False) -> dict:
    group: dict = {"kind": GROUP_KINDS[kind]}
    if kind == "recurrent":
        group.update({"layout": "batch_major", "aliasing": "required", "update": {"kind": "replace"}})
    elif static:   # TensorScatter writes the input's buffer at write_indices: aliased, capacity fixed
        group.update({"sequence_axis": STATIC_SEQUENCE_AXIS, "layout": STATIC_LAYOUT,
                      "logical_lengths": _LENGTHS_CELL, "aliasing": "required",
                      "update": {"kind": "indexed_scatter", "write_indices": _LENGTHS_CELL,
                                 "capacity": "package.sequence_capacity",
                                 "write_indices_ports": {"decoder": naming.WRITE_INDICES_INPUT},
                                 "kv_length_ports": {"decoder": naming.NONPAD_KV_SEQLEN_INPUT}}})
    else:
        group.update({"sequence_axis": 2, "layout": "head_major_bnsh", "aliasing": "required"})
    group["reuse"] = {"prefix_reusable": kind != "recurrent", "evictable_prefix": False}
    group["ports"] = {"decoder": {alias_label(p): {"input": p.input_name, "output": p.output_name,
                                                   **({"role": STEM_ROLES[p.stem]} if p.stem in STEM_ROLES else {}),
                                                   "layer": p.layer} for p in pairs}}
    return group


def _ports(layout: KVLayout, facts: SidecarFacts) -> tuple[dict, dict]:
    window = facts.sliding_window
    ins = {t.name: _contract(t.dtype, _shape(t, facts.ctx_len, window, _own_length(t))) for t in layout.inputs}
    outs = {t.name: _contract(t.dtype, _shape(t, facts.ctx_len, window)) for t in layout.outputs}
    return ins, outs


def _inputs(layout: KVLayout, facts: SidecarFacts, seeds: dict[str, tuple]) -> dict:
    ctx = facts.ctx_len
    inputs = {"package.accepted_len": _literal("int64", ["batch"], 0),
              "package.active": _literal("bool", ["batch"], True),
              "package.cache_lengths": _literal("int64", ["batch"], 0),
              "package.done": _literal("bool", ["batch"], False),
              "package.sequence_capacity": _literal("int64", [1], ctx, batch=False)}
    if layout.input(naming.POSITION_IDS_INPUT) is not None:
        inputs["package.position_ids"] = _literal("int64", ["batch", "position_len"], 0)
    if is_static(layout):
        inputs["package.kv_lengths"] = _literal("int64", ["batch"], 0)
    for name, (shape, dtype) in seeds.items():   # zeros of the cell's dtype (an int8 cache: int8 zeros)
        inputs[name] = _literal(dtype, shape, 0.0 if dtype.startswith(("float", "bfloat")) else 0)
    inputs["request.input_ids"] = {"contract": _contract("int64", ["batch", "sequence"]),
                                   "role": {"kind": "runtime", "version": "1.0", "role": "prompt_tokens"},
                                   "source": {"kind": "request"}, "required": True}
    inputs["request.max_iterations"] = {"contract": _contract("int64", [1], batch=False),
                                        "role": {"kind": "runtime", "version": "1.0", "role": "max_iterations"},
                                        "source": {"kind": "request"}, "required": False, "default": ctx}
    return inputs


def _state(groups: dict[str, list[KVPair]], shapes: dict[str, list]) -> tuple[dict, dict]:
    state = {name: _cell(dtype, shape, f"package.{name}") for name, (dtype, shape) in _POLICY_OUT.items()
             if name != "token"}
    state["sequence"] = _cell("int64", ["batch", "sequence"], "request.input_ids",
                              recurrence={"kind": "bounded", "axis": 1, "max": "package.sequence_capacity"})
    seeds: dict[str, tuple] = {}   # seed name -> (shape, dtype): one seed per shape and dtype
    for gname, pairs in groups.items():
        for p in pairs:
            shape = shapes[p.input_name]
            kind = (shape, p.input.dtype)
            seed = f"package.{gname}_seed_{len(seeds)}" if kind not in seeds.values() else \
                next(k for k, v in seeds.items() if v == kind)
            seeds.setdefault(seed, kind)
            state[alias_label(p)] = _cell(p.input.dtype, shape, seed, management="runtime",
                                          release_boundary="invocation", service_group=gname)
    return state, seeds


def _steps(layout: KVLayout, groups: dict[str, list[KVPair]]) -> list[dict]:
    pairs = [p for ps in groups.values() for p in ps]
    invoke_in = {naming.INPUT_IDS_INPUT: "request.input_ids"}
    if layout.input(naming.POSITION_IDS_INPUT) is not None:
        invoke_in[naming.POSITION_IDS_INPUT] = "package.position_ids"
    if is_static(layout):   # the cursor is the cache length before the step; the valid length the runtime feeds
        invoke_in.update({naming.WRITE_INDICES_INPUT: _LENGTHS_CELL, naming.NONPAD_KV_SEQLEN_INPUT: "package.kv_lengths"})
    invoke_in.update({p.input_name: alias_label(p) for p in pairs})
    invoke_out = {"logits": "step.logits", **{p.output_name: "body." + alias_label(p) for p in pairs}}
    cells = [alias_label(p) for p in pairs] + ["cache_lengths", "active", "done", "accepted_len"]
    body = [{"kind": "invoke", "component": "decoder", "inputs": invoke_in, "outputs": invoke_out},
            {"kind": "invoke", "component": "token_policy", "inputs": {"logits": "step.logits"},
             "outputs": {k: "step.token" if k == "token" else "body." + k for k in _POLICY_OUT}},
            {"kind": "emit", "value": "step.token", "when": "active", "output": "tokens", "mode": "append"}]
    return [{"kind": "loop", "setup": [], "steps": body, "continue_when": "active",
             "max_iterations": "request.max_iterations", "termination": "generation_eos",
             "iteration": {"value": "loop.iteration", "contract": _contract("int64", [1], batch=False)},
             "carried": [{"cell": c, "next": "body." + c} for c in cells] + [{"cell": "sequence", "next": "step.token"}]}]


def _components(facts: SidecarFacts, ins: dict, outs: dict) -> dict:
    roles = {"input_ids": "token_ids", "logits": "logits"}
    if "position_ids" in ins:
        roles["position_ids"] = "position_ids"
    contract = {"version": "1.0", "equivalence": "semantic", "bindings": {}, "parameters": {}}
    return {
        "decoder": {"implementation": {"kind": "onnx", "artifact": facts.onnx_name},
                    "ports": {"inputs": ins, "outputs": outs, "roles": dict(sorted(roles.items()))},
                    "contract": {"id": "onnx-genai.autoregressive-decode", **contract},
                    "application_overridable": False, "effects": []},
        "token_policy": {"implementation": {"kind": "binding"},
                         "ports": {"inputs": {"logits": outs["logits"]},
                                   "outputs": {k: _contract(d, s) for k, (d, s) in _POLICY_OUT.items()}},
                         "contract": {"id": "onnx-genai.token-policy", **contract},
                         "application_overridable": False, "effects": []}}


def build(layout: KVLayout, facts: SidecarFacts) -> dict:
    """The workflow-form document for the graph ``layout`` describes."""
    reason = unsupported_reason(layout)
    if reason is not None:
        raise SidecarError(reason)
    if is_static(layout):   # the buffer holds what it holds: its capacity bounds the sequence
        facts = dataclasses.replace(facts, ctx_len=static_capacity(layout, facts.ctx_len))
    groups = _groups(layout)
    ins, outs = _ports(layout, facts)
    state, seeds = _state(groups, {n: c["shape"] for n, c in ins.items()})
    workflow = {"manifest": {"adapter_abis": {}}, "inputs": _inputs(layout, facts, seeds),
                "outputs": {"tokens": {"contract": _contract("int64", ["batch", "sequence"]), "role": "tokens",
                                       "stage": "pre_adapter"}},
                "components": _components(facts, ins, outs), "state": state, "effects": {},
                "serving": {"active": "active", "done": "done", "accepted_len": "accepted_len",
                            "state_service": {"groups": {g: _group(g.removeprefix("kv_"), ps, is_static(layout))
                                                         for g, ps in groups.items()}}},
                "steps": _steps(layout, groups)}
    doc: dict = {"schema_version": SCHEMA_VERSION, "model": {"max_sequence_length": facts.ctx_len}}
    if facts.eos_token_ids:
        special: dict = {"eos_token_id": list(facts.eos_token_ids)}
        if facts.bos_token_id is not None:
            special["bos_token_id"] = facts.bos_token_id
        doc["package"] = {"tokenizer": {"special_tokens": special}}
    doc["pipeline"] = {"workflow": workflow}
    return doc


def header(layout: KVLayout, facts: SidecarFacts) -> str:
    """The comment lines above the document: what the schema has no field for."""
    kinds = sorted({k for k in layout.state_kinds.values()})
    prefix = layout.prefix
    if is_static(layout):
        capacity = f"capacity: {static_capacity(layout, facts.ctx_len)} positions (the buffers' axis 1)"
        update = (f"# update indexed_scatter: TensorScatter writes the new positions into the input's buffer at "
                  f"{naming.WRITE_INDICES_INPUT} (the cache length before the step); {naming.NONPAD_KV_SEQLEN_INPUT} "
                  "is the valid length after it (the runtime feeds both ports; package.kv_lengths is a placeholder)")
    else:
        capacity = f"capacity: ctx_len {facts.ctx_len}" + (
            f", ring window {facts.sliding_window}" if "ring" in kinds else "")
        update = ("# no update kind: the proposal has none yet for a graph that writes its own slots from position_ids "
                  "(position p at slot p, p % W in a ring); the retained output aliases the input (aliasing: required)")
    return "\n".join([
        f"# inference_metadata.yaml written by qeff-kv: ONNX Inference Metadata proposal (onnx/onnx#8184), "
        f"pipeline.workflow form, schema_version {SCHEMA_VERSION}",
        f"# qeff-kv KV prefix: {prefix if prefix is not None else '(none)'}; state kinds: {', '.join(kinds)}; "
        + capacity, update, ""])
