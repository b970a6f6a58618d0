"""The request vocabulary of LoRA adapters (docs/lora.md#serving): llama-server's ``lora`` field and its
``/lora-adapters`` body, vLLM's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` bodies, each checked
field by field (a 400 naming the field; unknown keys refused).

* ``lora`` (a completion or chat request; ``POST /lora-adapters``): ``[{"id": N, "scale": S}, ...]``, ``id`` an
  adapter's llama-server id (``GET /lora-adapters``), ``scale`` a finite number (0: the adapter is not applied);
  each id at most once. What it selects is the engine's table's to say (one adapter per request).
* ``POST /v1/load_lora_adapter``: ``{"lora_name": NAME, "lora_path": PEFT_DIR}`` (vLLM's ``load_inplace`` accepted
  when false);
* ``POST /v1/unload_lora_adapter``: ``{"lora_name": NAME}`` (vLLM's ``lora_int_id`` accepted and, when given,
  checked by the route against the adapter's).
"""

from __future__ import annotations

import math

from qeff_kv.serve.wire.openai_io import bad, is_int, known_keys

#: ``lora`` entries a request may give (llama-server's adapters are few; a larger list is a mistake)
MAX_LORA_ENTRIES = 256


def lora_pairs(v, param: str = "lora") -> tuple[tuple[int, float], ...] | None:
    """llama-server's ``lora`` list as ``((id, scale), ...)`` (None when not given)."""
    if v is None:
        return None
    if not isinstance(v, list) or len(v) > MAX_LORA_ENTRIES:
        raise bad(f'{param} must be a list of {{"id": N, "scale": S}} (llama-server\'s), at most '
                  f"{MAX_LORA_ENTRIES}", param)
    pairs, seen = [], set()
    for i, item in enumerate(v):
        where = f"{param}[{i}]"
        if not isinstance(item, dict):
            raise bad(f'{where} must be an object {{"id": N, "scale": S}}, got {item!r}', param)
        known_keys(item, ("id", "scale"), where)
        if not is_int(item.get("id")) or item["id"] < 0:
            raise bad(f"{where}.id must be an adapter's id (an integer >= 0), got {item.get('id')!r}", param)
        scale = item.get("scale")
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
            raise bad(f"{where}.scale must be a finite number, got {scale!r}", param)
        if item["id"] in seen:
            raise bad(f"{where}: adapter {item['id']} is listed twice", param)
        seen.add(item["id"])
        pairs.append((item["id"], float(scale)))
    return tuple(pairs)


def _name(body: dict, key: str) -> str:
    v = body.get(key)
    if not isinstance(v, str) or not v:
        raise bad(f"{key} must be a non-empty string, got {v!r}", key)
    return v


def load_body(body) -> tuple[str, str]:
    """``(lora_name, lora_path)`` of a ``POST /v1/load_lora_adapter`` body."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object {\"lora_name\": NAME, \"lora_path\": PEFT_DIR}")
    known_keys(body, ("lora_name", "lora_path", "load_inplace"), "body")
    if body.get("load_inplace") not in (None, False):
        raise bad("load_inplace is not supported: unload the adapter, then load it", "load_inplace")
    return _name(body, "lora_name"), _name(body, "lora_path")


def unload_body(body) -> tuple[str, int | None]:
    """``(lora_name, lora_int_id or None)`` of a ``POST /v1/unload_lora_adapter`` body."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object {\"lora_name\": NAME}")
    known_keys(body, ("lora_name", "lora_int_id"), "body")
    int_id = body.get("lora_int_id")
    if int_id is not None and not is_int(int_id):
        raise bad(f"lora_int_id must be an integer, got {int_id!r}", "lora_int_id")
    return _name(body, "lora_name"), int_id
