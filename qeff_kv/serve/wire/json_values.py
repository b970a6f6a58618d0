"""JSON values read from a request, with the refusals every reader shares (a 400 naming where):

* :func:`decode_json`: a request body: invalid JSON, nesting too deep for Python (``RecursionError``), strings no
  UTF-8 can carry (a lone surrogate such as ``"\\ud800"``);
* :func:`json_in_string`: JSON given inside a JSON string (a schema, a past tool call's ``arguments``) parsed with
  the same refusals, plus a depth bound (:data:`MAX_INNER_DEPTH`);
* :func:`check_encodable`, :func:`json_depth`: the two checks alone.

Below the HTTP routes and structured output, which both read such values (moved from ``serve/http/bodies.py``).
"""

from __future__ import annotations

import json
import re

from qeff_kv.serve.wire.openai_io import bad

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
#: the deepest nesting accepted in JSON given inside a string, and in a schema (no schema or argument object a
#: person writes comes near it; deeper ones made Python's and llguidance's recursion fail)
MAX_INNER_DEPTH = 64


def decode_json(raw: bytes):
    """The JSON value of a request body; 400 for invalid JSON, deep nesting or a lone surrogate."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise bad("the request body is nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad(f"the request body is not valid JSON ({exc})") from None
    if _SURROGATE_ESCAPE.search(raw):
        where = _unencodable(body, "")
        if where is not None:
            raise bad(f"{where or 'the body'} holds a lone UTF-16 surrogate (an escape like \\ud800 that is not "
                      "half of a pair); text must be valid Unicode", where.split("[")[0].split(".")[0] or None)
    return body


def json_in_string(text: str, where: str, *, keep_text: bool = False):
    """The JSON value of ``text`` (a string inside the request), or a 400 naming ``where``: not JSON (``keep_text``:
    the text itself is returned instead), nested deeper than :data:`MAX_INNER_DEPTH`, or holding a lone surrogate."""
    try:
        value = json.loads(text)
    except RecursionError:
        value = None
        depth = MAX_INNER_DEPTH + 1
    except ValueError as exc:
        if keep_text:
            return text
        raise bad(f"{where} is not valid JSON ({exc})", where) from None
    else:
        depth = json_depth(value)
    if depth > MAX_INNER_DEPTH:
        raise bad(f"{where} is nested deeper than {MAX_INNER_DEPTH} levels", where)
    check_encodable(value, where)
    return value


def check_encodable(value, where: str) -> None:
    """A 400 naming ``where`` when a string in ``value`` holds a lone surrogate."""
    bad_at = _unencodable(value, "")
    if bad_at is not None:
        raise bad(f"{where}{'.' + bad_at if bad_at else ''} holds a lone UTF-16 surrogate (an escape like \\ud800 "
                  "that is not half of a pair); text must be valid Unicode", where)


def json_depth(value) -> int:
    """How deeply ``value`` nests objects and lists (0: a scalar); iterative (no recursion limit)."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            stack.extend((x, d + 1) for x in v.values())
        elif isinstance(v, list):
            stack.extend((x, d + 1) for x in v)
        else:
            deepest = max(deepest, d)
            continue
        deepest = max(deepest, d + 1)
    return deepest


def _unencodable(value, where: str) -> str | None:
    """The path of the first string (or key) in ``value`` that UTF-8 cannot encode, else None."""
    stack = [(value, where)]
    while stack:
        v, w = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return w
        elif isinstance(v, dict):
            for k, x in v.items():
                name = f"{w}.{k}" if w else str(k)
                if not isinstance(k, str) or _unencodable(k, "") is not None:
                    return w or "a key"
                stack.append((x, name))
        elif isinstance(v, list):
            stack.extend((x, f"{w}[{i}]") for i, x in enumerate(v))
    return None
