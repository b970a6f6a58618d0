"""Reading values out of a model's ``config.json`` dict (no torch): the first of several keys that is set, and an
integer or a float that may be missing or of the wrong kind. Shared by the family facts and the recurrent facts."""

from __future__ import annotations


def first_of(cfg: dict, *keys, default=None):
    """The value of the first of ``keys`` that ``cfg`` sets (not ``None``), else ``default``."""
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    return default


def int_or_none(v) -> int | None:
    """``v`` as an int, or ``None`` when it is missing, a bool, or not a number."""
    return _number_or_none(int, v)


def float_or_none(v) -> float | None:
    """``v`` as a float, or ``None`` when it is missing, a bool, or not a number."""
    return _number_or_none(float, v)


def _number_or_none(kind, v):
    if v is None or isinstance(v, bool):
        return None
    try:
        return kind(v)
    except (TypeError, ValueError):
        return None
