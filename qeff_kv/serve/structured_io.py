"""The structured-output fields of a request, checked and turned into one :class:`~.constrained.GrammarSpec`.

OpenAI's field:

* ``response_format``: ``{"type": "text"}`` (nothing), ``{"type": "json_object"}`` (any JSON object),
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}`` (JSON valid against
  ``schema``; always enforced, whatever ``strict`` says).

Extensions, named as the servers people come from name them:

* vLLM: ``structured_outputs`` ``{"json": schema, "regex": str, "choice": [str], "grammar": str,
  "json_object": true}`` (exactly one key), and its older top-level ``guided_json``, ``guided_regex``,
  ``guided_choice``, ``guided_grammar``;
* llama-server: ``json_schema`` (a schema) and ``grammar`` (GBNF).

A grammar (``grammar``, ``guided_grammar``, ``structured_outputs.grammar``) is llguidance's Lark dialect or GBNF
(converted by llguidance's own converter). At most one of these fields per request; anything malformed is a 400
naming the field.
"""

from __future__ import annotations

import asyncio
import json
import threading

from ..errors import QeffKvError
from .constrained import GrammarSpec, lark_string
from .openai_io import bad

#: vLLM's ``structured_outputs`` keys and the older top-level fields that mean the same
_VLLM_KEYS = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice", "grammar": "guided_grammar"}
_LLAMA_FIELDS = ("json_schema", "grammar")


def parse_structured(body: dict) -> tuple[GrammarSpec | None, str | None]:
    """The request's grammar (or None) and the name of the field it came from."""
    found = []
    rf = _response_format(body.get("response_format"))
    if rf is not None:
        found.append((rf, "response_format"))
    so = body.get("structured_outputs")
    if so is not None:
        found.append((_structured_outputs(so), "structured_outputs"))
    for key, old in _VLLM_KEYS.items():
        if body.get(old) is not None:
            found.append((_vllm_value(key, body[old], old), old))
    if body.get("json_schema") is not None:
        found.append((GrammarSpec("json_schema", _schema(body["json_schema"], "json_schema")), "json_schema"))
    if body.get("grammar") is not None:
        found.append((_grammar(body["grammar"], "grammar"), "grammar"))
    if len(found) > 1:
        raise bad(f"give one structured-output field, not {len(found)} ({', '.join(f for _, f in found)})",
                  found[1][1])
    if not found:
        return None, None
    if body.get("ignore_eos"):
        raise bad("ignore_eos does not go with structured output (the grammar decides where the output ends)",
                  "ignore_eos")
    return found[0]


def _response_format(rf) -> GrammarSpec | None:
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise bad(f"response_format must be an object, got {rf!r}", "response_format")
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise bad("response_format.json_schema must be an object with name and schema",
                      "response_format.json_schema")
        name = js.get("name")
        if not isinstance(name, str) or not name:
            raise bad("response_format.json_schema.name must be a non-empty string", "response_format.json_schema")
        if js.get("strict") is not None and not isinstance(js.get("strict"), bool):
            raise bad("response_format.json_schema.strict must be true or false", "response_format.json_schema")
        schema = js.get("schema", {})
        return GrammarSpec("json_schema", _schema(schema, "response_format.json_schema.schema"))
    raise bad(f"response_format.type must be text, json_object or json_schema, got {kind!r}", "response_format")


def _schema(schema, where: str) -> dict:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise bad(f"{where} is not valid JSON ({exc})", where) from None
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise bad(f"{where} must be a JSON schema object, got {type(schema).__name__}", where)
    return schema


def _grammar(text, where: str) -> GrammarSpec:
    if not isinstance(text, str) or not text.strip():
        raise bad(f"{where} must be a non-empty grammar (Lark or GBNF)", where)
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        return GrammarSpec("lark", any_to_lark(text))
    except Exception as exc:   # noqa: BLE001 - the converter's own errors name the line
        raise bad(f"{where}: the grammar does not parse: {str(exc).splitlines()[0] if str(exc) else exc}",
                  where) from None


def _vllm_value(key: str, value, where: str) -> GrammarSpec:
    if key == "json":
        return GrammarSpec("json_schema", _schema(value, where))
    if key == "regex":
        if not isinstance(value, str) or not value:
            raise bad(f"{where} must be a non-empty regular expression", where)
        return GrammarSpec("regex", value)
    if key == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise bad(f"{where} must be a non-empty list of non-empty strings", where)
        return GrammarSpec("lark", "start: " + " | ".join(lark_string(c) for c in value))
    return _grammar(value, where)


def _structured_outputs(so) -> GrammarSpec:
    where = "structured_outputs"
    if not isinstance(so, dict):
        raise bad(f"{where} must be an object, got {so!r}", where)
    given = {k: v for k, v in so.items() if v not in (None, False)}
    keys = [k for k in given if k in _VLLM_KEYS or k == "json_object"]
    unknown = [k for k in given if k not in _VLLM_KEYS and k not in ("json_object", "disable_any_whitespace",
                                                                     "disable_fallback", "whitespace_pattern")]
    if unknown:
        raise bad(f"{where}.{unknown[0]} is not supported (json, regex, choice, grammar, json_object)", where)
    if len(keys) != 1:
        raise bad(f"{where} takes exactly one of json, regex, choice, grammar, json_object; got {len(keys)}", where)
    if keys[0] == "json_object":
        return GrammarSpec("json_object")
    return _vllm_value(keys[0], given[keys[0]], f"{where}.{keys[0]}")


class Constraints:
    """One app's compiler of grammar specs into per-request constraints: llguidance's tokenizer is built from the
    export's tokenizer on the first constrained request (in a worker thread, once), each spec is compiled in a
    worker thread, and a spec the library cannot compile is a 400 naming the field and why."""

    def __init__(self, tokenizer, eos_token_ids):
        self.tokenizer, self.eos_token_ids = tokenizer, tuple(eos_token_ids)
        self._grammars = None
        self._lock = threading.Lock()

    def grammars(self):
        from .constrained import Grammars

        with self._lock:
            if self._grammars is None:
                self._grammars = Grammars(self.tokenizer, self.eos_token_ids)
            return self._grammars

    def _compile(self, spec: GrammarSpec):
        return self.grammars().compile(spec)

    async def compile(self, spec: GrammarSpec, field: str):
        from .constrained import ConstraintError

        try:
            return await asyncio.to_thread(self._compile, spec)
        except ConstraintError as exc:
            raise bad(f"{field}: the grammar cannot be compiled: {exc}", field, "invalid_grammar") from None
        except QeffKvError as exc:
            raise bad(f"{field}: {exc}", field) from None
