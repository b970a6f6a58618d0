"""Reading ``inference_metadata.yaml`` (the ONNX "Inference Metadata" proposal, onnx/onnx issue 8184) in both forms.

* The retired ``model.io`` form (what mobius-onnx 0.1.0 writes): ``kv_inputs`` / ``kv_outputs`` paired by position,
  ``kv_update: append | shared_buffer``; or ``static_cache`` with per-layer key/value input and output lists (the
  list position is the layer) and its ``write_indices`` / ``kv_sequence_length`` control inputs.
* The ``pipeline.workflow`` form (what onnx-genai 0.1.0.dev6 reads, and what :mod:`.workflow` writes): components
  whose ports carry roles, and ``serving.state_service.groups`` whose per-alias ``{input, output, role, layer}``
  name the KV pairs; ``update.kind`` (``indexed_scatter``...) and ``aliasing`` state how the graph writes them.

Both come back as one :class:`~qeff_kv.graph.sidecars.declared.Declared`, pairs ordered by the declared layer as a
number (never by the alias label's string order: ``key_cache.10`` sorts before ``key_cache.2``).
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from qeff_kv.errors import SidecarError
from qeff_kv.graph.sidecars.declared import Declared, DeclaredPair, ordered

_ROLE_KEYS = {"token_input": "token_ids", "position_ids_input": "position_ids", "attention_mask_input": "attention_mask",
              "logits_output": "logits"}
_INT_RE = re.compile(r"(?<![A-Za-z])(\d+)")


def load(path: Path) -> dict:
    try:
        doc = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError, yaml.YAMLError) as exc:
        raise SidecarError(f"{path}: not readable YAML ({' '.join(str(exc).split())})") from None
    if not isinstance(doc, dict):
        raise SidecarError(f"{path}: expected a YAML mapping")
    return doc


def read(doc: dict, source: str = "inference_metadata.yaml") -> Declared:
    """The declaration in either form; SidecarError when the file has neither or one is malformed."""
    workflow = (doc.get("pipeline") or {}).get("workflow") if isinstance(doc.get("pipeline"), dict) else None
    io = (doc.get("model") or {}).get("io") if isinstance(doc.get("model"), dict) else None
    version = None if doc.get("schema_version") is None else str(doc["schema_version"])
    if isinstance(workflow, dict):
        declared = _read_workflow(workflow, source)
    elif isinstance(io, dict):
        declared = _read_model_io(io, source)
    else:
        raise SidecarError(f"{source}: neither pipeline.workflow nor model.io is declared")
    declared.schema_version = version
    return declared


# ------------------------------------------------------------------------------------------------- model.io
def _str_list(io: dict, key: str, source: str) -> list[str]:
    v = io.get(key) or []
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise SidecarError(f"{source}: model.io.{key} must be a list of port names")
    return v


def _read_model_io(io: dict, source: str) -> Declared:
    control = {role: io[key] for key, role in _ROLE_KEYS.items() if isinstance(io.get(key), str)}
    static = io.get("static_cache")
    if isinstance(static, dict):
        pairs = []
        for role in ("key", "value"):
            ins = _str_list(static, f"{role}_cache_inputs", source)
            outs = _str_list(static, f"{role}_cache_outputs", source)
            if len(ins) != len(outs):
                raise SidecarError(f"{source}: static_cache lists {len(ins)} {role} inputs but {len(outs)} outputs")
            pairs += [DeclaredPair(i, o, role, layer) for layer, (i, o) in enumerate(zip(ins, outs))]
        for key, role in (("write_indices_input", "write_indices"), ("kv_sequence_length_input", "kv_length")):
            if isinstance(static.get(key), str):
                control[role] = static[key]
        return Declared("model.io", ordered(pairs), control, update="indexed_scatter", shared_buffer=False)
    ins, outs = _str_list(io, "kv_inputs", source), _str_list(io, "kv_outputs", source)
    if len(ins) != len(outs):
        raise SidecarError(f"{source}: model.io lists {len(ins)} kv_inputs but {len(outs)} kv_outputs")
    pairs = [DeclaredPair(i, o, *_role_layer(i, k)) for k, (i, o) in enumerate(zip(ins, outs))]
    update = io.get("kv_update")
    return Declared("model.io", ordered(pairs), control, update=update if isinstance(update, str) else "append",
                    shared_buffer=update == "shared_buffer")


def _role_layer(name: str, position: int) -> tuple[str | None, int]:
    """The model.io form names no role or layer: the half from a ``key``/``value`` word of the name, the layer from
    its one number; else by position in the list (layer-major, key before value, as the form's writers list them)."""
    halves = [w for w in re.split(r"[^a-z]+", name.lower()) if w in ("key", "value")]
    role = halves[-1] if halves else ("key", "value")[position % 2]  # the last: past_key_values.0.value
    numbers = _INT_RE.findall(name)
    return role, int(numbers[0]) if len(numbers) == 1 else position // 2


# ------------------------------------------------------------------------------------------------ workflow
def _layer(alias: dict, position: int, label: str, source: str) -> int:
    layer = alias.get("layer", position)
    if not isinstance(layer, int) or isinstance(layer, bool) or layer < 0:
        raise SidecarError(f"{source}: state alias {label!r} has layer {layer!r}, not a non-negative int")
    return layer


def _read_groups(groups: dict, source: str) -> tuple[list[DeclaredPair], dict, set, set]:
    pairs, control, updates, aliasing = [], {}, set(), set()
    for gname, group in groups.items():
        if not isinstance(group, dict):
            raise SidecarError(f"{source}: state group {gname!r} is not a mapping")
        update = group.get("update") if isinstance(group.get("update"), dict) else {}
        updates.add(update.get("kind"))
        aliasing.add(group.get("aliasing", "forbidden"))
        for key, role in (("write_indices_ports", "write_indices"), ("kv_length_ports", "kv_length")):
            for port in (update.get(key) or {}).values():
                control[role] = port
        for component, aliases in (group.get("ports") or {}).items():
            for position, (label, alias) in enumerate((aliases or {}).items()):
                if not isinstance(alias, dict) or not isinstance(alias.get("input"), str):
                    raise SidecarError(f"{source}: state alias {label!r} of {component!r} names no input")
                if not isinstance(alias.get("output"), str):
                    continue  # a read-only reader advances nothing
                pairs.append(DeclaredPair(alias["input"], alias["output"], alias.get("role"),
                                          _layer(alias, position, label, source), str(gname)))
    return pairs, control, updates, aliasing


def _read_workflow(workflow: dict, source: str) -> Declared:
    serving = workflow.get("serving") or {}
    groups = ((serving.get("state_service") or {}).get("groups") or {}) if isinstance(serving, dict) else {}
    if not isinstance(groups, dict) or not groups:
        raise SidecarError(f"{source}: pipeline.workflow declares no serving.state_service groups")
    pairs, control, updates, aliasing = _read_groups(groups, source)
    for component in (workflow.get("components") or {}).values():
        roles = ((component or {}).get("ports") or {}).get("roles") or {}
        for port, role in roles.items():
            control.setdefault(str(role), str(port))
    kinds = sorted(u for u in updates if u)
    update = kinds[0] if len(kinds) == 1 else ("mixed" if kinds else None)
    return Declared("pipeline.workflow", ordered(pairs), control, update=update,
                    shared_buffer=aliasing <= {"required", "permitted"} and bool(aliasing))
