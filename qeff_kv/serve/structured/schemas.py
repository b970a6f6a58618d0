"""JSON schemas as the forced grammars take them: closed objects, and a tool's parameters nested with their refs.

* :func:`close_objects`: an object schema that declares ``properties`` and says nothing about other keys
  (no ``additionalProperties``, ``patternProperties`` or ``unevaluatedProperties``) gets
  ``"additionalProperties": false``, as llama.cpp's schema converter reads such a schema: a small model then cannot
  pad tool arguments or a structured answer with keys the schema never declared until ``max_tokens`` cuts it. An
  object without ``properties`` stays any object, a schema that says ``additionalProperties`` keeps what it says,
  and members of ``allOf`` (and schemas beside ``allOf`` / ``anyOf`` / ``oneOf`` / ``$ref``, which add keys
  elsewhere) stay open. The request's own schema is not changed (the prompt shows it as given).
* :func:`nested_parameters`: a tool's ``parameters`` nested inside the call object (``{"name", "arguments"}``)
  moves the root its ``$ref`` pointers mean: Pydantic writes a model with a nested model as
  ``{"$defs": {"City": ...}, "properties": {"city": {"$ref": "#/$defs/City"}}}``, and under ``arguments`` that
  pointer would name the call object's ``$defs``. The parameters are placed whole in the new root's ``$defs`` (under
  :data:`ARGS_DEF` and the tool's index) and each local pointer ``#/...`` inside them is rewritten to
  ``#/$defs/<that name>/...`` (``#`` alone: the parameters themselves); parameters without ``$ref`` stay inline.
"""

from __future__ import annotations

#: the name under the root's ``$defs`` of tool ``i``'s parameters (when they hold ``$ref`` pointers)
ARGS_DEF = "qeff_kv_tool_{i}_parameters"
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_ONE = ("items", "additionalItems", "additionalProperties", "unevaluatedProperties", "unevaluatedItems",
               "not", "contains", "propertyNames", "if", "then", "else")
_SCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf", "items")
_OPENERS = ("additionalProperties", "patternProperties", "unevaluatedProperties", "allOf", "anyOf", "oneOf", "$ref")


def close_objects(schema, *, open_here: bool = False):
    """A copy of ``schema`` with every object that declares ``properties`` and nothing about other keys closed
    (see the module docstring); iterative over the schema's nesting is not needed: its depth is bounded by the
    request checks (:data:`~qeff_kv.serve.wire.json_values.MAX_INNER_DEPTH`)."""
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {k: close_objects(v) for k, v in value.items()}
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            out[key] = [close_objects(v, open_here=key == "allOf") for v in value]
        elif key in _SCHEMA_ONE and isinstance(value, dict):
            out[key] = close_objects(value)
        else:
            out[key] = value
    if not open_here and isinstance(schema.get("properties"), dict) and not any(k in schema for k in _OPENERS):
        out["additionalProperties"] = False
    return out


def has_ref(value) -> bool:
    """A ``$ref`` string anywhere in ``value``."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            if isinstance(v.get("$ref"), str):
                return True
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return False


def _rebased(value, base: str):
    """``value`` with each local ``$ref`` (``#...``) rewritten to start at ``#/$defs/<base>``."""
    if isinstance(value, list):
        return [_rebased(v, base) for v in value]
    if not isinstance(value, dict):
        return value
    out = {}
    for k, v in value.items():
        if k == "$ref" and isinstance(v, str) and v.startswith("#"):
            out[k] = f"#/$defs/{base}{v[1:]}" if v[1:].startswith("/") or v == "#" else v
        else:
            out[k] = _rebased(v, base)
    return out


def nested_parameters(params: dict, index: int) -> tuple[dict, dict]:
    """``(schema to nest, definitions for the root's $defs)`` for tool ``index``'s (closed) ``params``."""
    closed = close_objects(params)
    if not has_ref(closed):
        return closed, {}
    name = ARGS_DEF.format(i=index)
    return {"$ref": f"#/$defs/{name}"}, {name: _rebased(closed, name)}
