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

Bounds, checked before anything is compiled (a 400 naming the field and the bound): a schema nests at most
:data:`~qeff_kv.serve.wire.json_values.MAX_INNER_DEPTH` levels and holds at most :data:`MAX_SCHEMA_NODES` objects and lists; a regex or
grammar text (a ``choice`` list as the grammar it becomes) at most :data:`MAX_GRAMMAR_CHARS` characters; a
``choice`` at most :data:`MAX_CHOICES` strings. :class:`Constraints` compiles on its own worker threads (with
large stacks: llguidance recurses over a grammar's rules) within :data:`COMPILE_TIMEOUT_S` (the compile alone:
llguidance's tokenizer is built once, before the server takes requests); whatever goes wrong there is the request's
``invalid_grammar``.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

from qeff_kv.errors import QeffKvError, RuntimeInputError
from qeff_kv.serve.wire.json_values import MAX_INNER_DEPTH, check_encodable, json_depth, json_in_string
from qeff_kv.serve.structured.constrained import GrammarSpec, lark_string
from qeff_kv.serve.wire.openai_io import APIError, bad, known_keys
from qeff_kv.serve.structured.schemas import close_objects

#: the most objects and lists in one schema (10,000 optional properties cost llguidance minutes of CPU)
MAX_SCHEMA_NODES = 2000
#: the longest regex or grammar text, in characters (a ``choice`` list counted as the grammar it becomes)
MAX_GRAMMAR_CHARS = 32 * 1024
#: the most strings in a ``choice`` list
MAX_CHOICES = 1024
#: seconds a grammar may take to compile (with its first mask) before the request is refused
COMPILE_TIMEOUT_S = 10.0
#: the compiling threads, and each one's stack (llguidance recurses over rules: 3,000 chained Lark rules overflow
#: the default 8 MiB stack and kill the process; only the pages used are committed)
COMPILE_THREADS = 2
COMPILE_STACK_BYTES = 256 << 20

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
    where = "response_format"
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise bad(f"response_format must be an object, got {rf!r}", where)
    kind = rf.get("type")
    if kind == "text":
        known_keys(rf, ("type",), where)
        return None
    if kind == "json_object":   # llama-server's ``schema`` beside it: JSON valid against that schema
        known_keys(rf, ("type", "schema"), where)
        if rf.get("schema") is not None:
            return GrammarSpec("json_schema", _schema(rf["schema"], "response_format.schema"))
        return GrammarSpec("json_object")
    if kind == "json_schema":
        known_keys(rf, ("type", "json_schema"), where)
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise bad("response_format.json_schema must be an object with name and schema",
                      "response_format.json_schema")
        known_keys(js, ("name", "schema", "strict", "description"), "response_format.json_schema")
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
        schema = json_in_string(schema, where)
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise bad(f"{where} must be a JSON schema object, got {type(schema).__name__}", where)
    check_schema_size(schema, where)
    return close_objects(schema)


def check_schema_size(schema, where: str) -> None:
    """A 400 naming ``where`` for a schema over the bounds of the module docstring (or holding a lone surrogate)."""
    if json_depth(schema) > MAX_INNER_DEPTH:
        raise bad(f"{where}: the schema is nested deeper than {MAX_INNER_DEPTH} levels", where, "invalid_grammar")
    nodes, stack = 0, [schema]
    while stack:
        v = stack.pop()
        if isinstance(v, (dict, list)):
            nodes += 1
            stack.extend(v.values() if isinstance(v, dict) else v)
    if nodes > MAX_SCHEMA_NODES:
        raise bad(f"{where}: the schema holds {nodes} objects and lists; the limit is {MAX_SCHEMA_NODES}", where,
                  "invalid_grammar")
    check_encodable(schema, where)
    if _only_refers_to_itself(schema):
        raise bad(f"{where}: the schema only refers to itself ($ref cycle without a type); no value matches it",
                  where, "invalid_grammar")


_ANNOTATIONS = {"$defs", "definitions", "$schema", "$id", "title", "description", "$comment"}


def _only_refers_to_itself(root) -> bool:
    """``root`` is a ``$ref`` (with annotations only) whose chain of such references comes back to one already
    followed (``{"$ref": "#"}``, a -> b -> a): a schema no value can match."""
    node, seen = root, set()
    while isinstance(node, dict) and isinstance(node.get("$ref"), str) and set(node) - _ANNOTATIONS == {"$ref"}:
        ref = node["$ref"]
        if ref in seen:
            return True
        if not ref.startswith("#"):
            return False
        seen.add(ref)
        node = root
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(node, dict) or part not in node:
                return False
            node = node[part]
    return False


def _text_size(text: str, where: str) -> str:
    if len(text) > MAX_GRAMMAR_CHARS:
        raise bad(f"{where}: the grammar is {len(text)} characters; the limit is {MAX_GRAMMAR_CHARS}", where,
                  "invalid_grammar")
    return text


def _grammar(text, where: str) -> GrammarSpec:
    if not isinstance(text, str) or not text.strip():
        raise bad(f"{where} must be a non-empty grammar (Lark or GBNF)", where)
    from llguidance.gbnf_to_lark import any_to_lark

    _text_size(text, where)
    try:
        return GrammarSpec("lark", _text_size(any_to_lark(text), where))
    except APIError:
        raise
    except Exception as exc:   # noqa: BLE001 - the converter's own errors name the line
        raise bad(f"{where}: the grammar does not parse: {str(exc).splitlines()[0] if str(exc) else exc}",
                  where, "invalid_grammar") from None


def _vllm_value(key: str, value, where: str) -> GrammarSpec:
    if key == "json":
        return GrammarSpec("json_schema", _schema(value, where))
    if key == "regex":
        if not isinstance(value, str) or not value:
            raise bad(f"{where} must be a non-empty regular expression", where)
        return GrammarSpec("regex", _text_size(value, where))
    if key == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise bad(f"{where} must be a non-empty list of non-empty strings", where)
        if len(value) > MAX_CHOICES:
            raise bad(f"{where} holds {len(value)} strings; the limit is {MAX_CHOICES}", where, "invalid_grammar")
        check_encodable(value, where)
        return GrammarSpec("lark", _text_size("start: " + " | ".join(lark_string(c) for c in value), where))
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
    """One app's compiler of grammar specs into per-request constraints. llguidance's tokenizer is built from the
    export's tokenizer once, by :meth:`build` (called when the app is made, before the server listens: ``/health``
    answering means it is built, and no request pays for it); each spec is compiled (with its first mask) on the
    compiling threads (:data:`COMPILE_THREADS`, :data:`COMPILE_STACK_BYTES`) within :data:`COMPILE_TIMEOUT_S`, which
    covers that compile only, and a spec that cannot be compiled in time, or at all, is a 400 ``invalid_grammar``
    naming the field and why. Without llguidance (or without an eos id) the server still starts: its constrained
    requests are 400s naming what is missing."""

    def __init__(self, tokenizer, eos_token_ids, timeout: float | None = None):
        self.tokenizer, self.eos_token_ids = tokenizer, tuple(eos_token_ids)
        self.timeout = COMPILE_TIMEOUT_S if timeout is None else timeout
        self._grammars = None
        #: why grammars cannot be compiled here (llguidance missing, no eos id...), once :meth:`build` has run
        self.unavailable: QeffKvError | None = None
        self._built = threading.Event()
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    @property
    def built(self) -> bool:
        """:meth:`build` has run (llguidance's tokenizer is ready, or :attr:`unavailable` says why not)."""
        return self._built.is_set()

    def build(self) -> None:
        """Build llguidance's tokenizer (once; later calls return at once, concurrent ones wait for the first)."""
        with self._lock:
            if self._built.is_set():
                return
            try:
                from qeff_kv.serve.structured.constrained import Grammars

                self._grammars = Grammars(self.tokenizer, self.eos_token_ids)
            except QeffKvError as exc:
                self.unavailable = exc
            except Exception as exc:   # noqa: BLE001 - llguidance's own, on a tokenizer it cannot take
                why = f"{type(exc).__name__}: {str(exc)[:200]}"
                self.unavailable = RuntimeInputError("structured output is unavailable: llguidance cannot take this "
                                                     f"export's tokenizer ({why})")
            finally:
                self._built.set()

    def grammars(self):
        self.build()
        if self.unavailable is not None:
            raise self.unavailable
        return self._grammars

    def pool(self) -> ThreadPoolExecutor:
        """The compiling threads, started (all of them, with their large stacks) on first use."""
        with self._lock:
            if self._pool is None:
                self._pool = big_stack_pool(COMPILE_THREADS, COMPILE_STACK_BYTES, "qeff-kv-grammar")
            return self._pool

    def _compile(self, spec: GrammarSpec):
        return self.grammars().compile(spec)

    async def compile(self, spec: GrammarSpec, field: str):
        from qeff_kv.serve.structured.constrained import ConstraintError

        if not self.built:   # built with the app; one made without that builds here, outside the compile's time
            await asyncio.to_thread(self.build)
        work = asyncio.get_running_loop().run_in_executor(self.pool(), self._compile, spec)
        try:
            return await asyncio.wait_for(work, self.timeout)
        except asyncio.TimeoutError:
            raise bad(f"{field}: the grammar did not compile within {self.timeout:g} s", field,
                      "invalid_grammar") from None
        except ConstraintError as exc:
            raise bad(f"{field}: the grammar cannot be compiled: {exc}", field, "invalid_grammar") from None
        except QeffKvError as exc:
            raise bad(f"{field}: {exc}", field) from None
        except (RecursionError, ValueError, TypeError, RuntimeError) as exc:   # llguidance's own, on odd input
            raise bad(f"{field}: the grammar cannot be compiled ({type(exc).__name__}: {str(exc)[:200]})", field,
                      "invalid_grammar") from None


def big_stack_pool(n: int, stack_bytes: int, name: str) -> ThreadPoolExecutor:
    """A pool of ``n`` threads, each with a ``stack_bytes`` stack: all started now, while the stack size is set
    (each blocks on a barrier, so that every submit starts a new thread), then the size is put back."""
    pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix=name)
    barrier = threading.Barrier(n + 1)
    with _STACK_LOCK:
        before = threading.stack_size(stack_bytes)
        try:
            for _ in range(n):
                pool.submit(barrier.wait)
        finally:
            threading.stack_size(before)
    barrier.wait()
    return pool


_STACK_LOCK = threading.Lock()
