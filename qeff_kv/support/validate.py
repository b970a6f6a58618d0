"""Argument checks shared by the CLI and the Python API: every refusal is a one-line :class:`QeffKvError`
subclass naming the argument.

* :func:`ascii_int`: an integer written in ASCII digits (``"16"``, ``"-3"``); Unicode digits (``"١٦"``),
  underscores (``"1_000"``), signs like ``"+5"`` and blanks inside are refused: Python's ``int()`` takes all of them.
* :func:`flag`: a real ``bool`` (``"no"`` is a non-empty string, hence true to Python; here it is refused).
* :func:`integer`, :func:`optional_int`: an ``int`` (numpy integers too, never a ``bool`` or a ``float``) in a range.
* :func:`path_like`, :func:`text`, :func:`callable_or_none`, :func:`choice`: the other argument kinds.
* :func:`integer_array`: an array of an integer dtype (a float or string array is refused, never cut).
"""

from __future__ import annotations

import os
import re

import numpy as np

from qeff_kv.errors import QeffKvError, RuntimeInputError
from qeff_kv.support.limits import MAX_DIM, MAX_INT64

_ASCII_INT = re.compile(r"-?[0-9]+")


def ascii_int(label: str, text, *, error: type[QeffKvError] = RuntimeInputError) -> int:
    """``text`` (a string) as an int when it is ASCII digits with an optional leading ``-``; else one line."""
    if not isinstance(text, str) or not _ASCII_INT.fullmatch(text):
        raise error(f"{label}: {text!r} is not an integer (ASCII digits 0-9)")
    return int(text)


def flag(label: str, value, *, optional: bool = False, error: type[QeffKvError] = RuntimeInputError) -> bool | None:
    """``value`` when it is ``True`` or ``False`` (or ``None`` when ``optional``); one line otherwise."""
    if value is None and optional:
        return None
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    allowed = "True, False or None" if optional else "True or False"
    raise error(f"{label} must be {allowed}, got {value!r}")


def integer(label: str, value, *, minimum: int = 1, maximum: int = MAX_DIM,
            error: type[QeffKvError] = RuntimeInputError) -> int:
    """``value`` as an int in ``[minimum, maximum]``: Python or numpy integers only (no bool, float, string)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise error(f"{label} must be an integer, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise error(f"{label} must be {'a positive integer' if minimum == 1 else f'an integer >= {minimum}'}, "
                    f"got {int(value)}")
    if value > maximum:
        raise error(f"{label} {int(value)} is larger than the largest supported value {maximum}")
    return int(value)


def optional_int(label: str, value, *, minimum: int = 1, maximum: int = MAX_DIM,
                 error: type[QeffKvError] = RuntimeInputError) -> int | None:
    return None if value is None else integer(label, value, minimum=minimum, maximum=maximum, error=error)


def token_id(label: str, value, *, error: type[QeffKvError] = RuntimeInputError) -> int | None:
    """A token id: ``None`` or an integer in ``[0, 2**63 - 1]``."""
    return optional_int(label, value, minimum=0, maximum=MAX_INT64, error=error)


def path_like(label: str, value, *, optional: bool = False, error: type[QeffKvError] = RuntimeInputError):
    """A ``str`` or ``os.PathLike`` (``None`` when ``optional``); an empty string is refused."""
    if value is None and optional:
        return None
    if isinstance(value, str) and value == "":
        raise error(f"{label} is an empty path")
    if not isinstance(value, (str, os.PathLike)):
        raise error(f"{label} must be a path (str or os.PathLike), got {type(value).__name__} {value!r}")
    return value


def text(label: str, value, *, optional: bool = True, error: type[QeffKvError] = RuntimeInputError) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise error(f"{label} must be a string, got {type(value).__name__} {value!r}")
    return value


def choice(label: str, value, allowed, *, optional: bool = False,
           error: type[QeffKvError] = RuntimeInputError):
    if value is None and optional:
        return None
    if not isinstance(value, str) or value not in allowed:
        raise error(f"{label} must be one of {', '.join(map(str, allowed))}, got {value!r}")
    return value


def callable_or_none(label: str, value, *, error: type[QeffKvError] = RuntimeInputError):
    if value is not None and not callable(value):
        raise error(f"{label} must be a callable or None, got {type(value).__name__} {value!r}")
    return value


def integer_array(label: str, arr, *, error: type[QeffKvError] = RuntimeInputError) -> np.ndarray:
    """``arr`` when its dtype is an integer dtype (a bool, float, string or object array is refused: floats are
    never cut to integers)."""
    arr = np.asarray(arr)
    if arr.dtype.kind not in "iu":
        raise error(f"{label} must be an integer array, got dtype {arr.dtype}")
    return arr
