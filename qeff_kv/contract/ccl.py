"""Compute context length (CCL, contract section 9): the ``--ccl`` list of lengths an export or its compile files
offer, as given (``"auto"``, ``"512,1024"`` or a list of ints) and as checked (strictly increasing positive ints, at
most ``ctx_len`` and, given the prefill length, at least it). Shared by the exporter's options and the
``compile-config`` tool; the runtime's choice among the listed lengths is :mod:`qeff_kv.runtime.ccl`. Errors are
the caller's type (``error=``), one line each."""

from __future__ import annotations

import re

from qeff_kv.errors import QeffKvError, RuntimeInputError

_ASCII_DIGITS = re.compile(r"[0-9]+")


#: ``--ccl auto`` starts at this many slots (or at ctx_len when it is smaller)
CCL_AUTO_START = 512


def auto_ccl(ctx_len: int, prefill_seq_len: int | None = None) -> tuple[int, ...]:
    """``--ccl auto``: powers of two from ``min(ctx_len, 512)`` up to ``ctx_len``, always ending at ``ctx_len``
    (4096 -> 512, 1024, 2048, 4096; 3000 -> 512, 1024, 2048, 3000; 256 -> 256); values below
    ``prefill_seq_len`` are left out (their prefill specialization could not hold a chunk)."""
    v = min(ctx_len, CCL_AUTO_START)
    out = []
    while v < ctx_len:
        if prefill_seq_len is None or v >= prefill_seq_len:
            out.append(v)
        v *= 2
    return tuple(out + [ctx_len])


def check_ccl(values, ctx_len: int, *, error: type[QeffKvError] = RuntimeInputError,
              prefill_seq_len: int | None = None) -> tuple[int, ...]:
    """Raise a one-line ``error`` unless ``values`` is a strictly increasing list of positive ints
    at most ``ctx_len`` (and, given ``prefill_seq_len``, at least it: each value has a prefill specialization,
    which must hold a whole chunk); return it as a tuple."""
    vals = list(values)
    if not vals:
        raise error("--ccl needs at least one value")
    for v in vals:
        if isinstance(v, bool) or not isinstance(v, int):
            raise error(f"--ccl values must be positive integers, got {v!r}")
        if v <= 0:
            raise error(f"--ccl values must be positive integers, got {v}")
    for a, b in zip(vals, vals[1:]):
        if b <= a:
            raise error(f"--ccl must be strictly increasing (sorted, no duplicates), got "
                              f"{','.join(str(v) for v in vals)}")
    if vals[-1] > ctx_len:
        raise error(f"--ccl value {vals[-1]} is larger than ctx_len {ctx_len}")
    if prefill_seq_len is not None and vals[0] < prefill_seq_len:
        raise error(ccl_below_prefill(vals[0], prefill_seq_len))
    return tuple(vals)


def ccl_below_prefill(value: int, prefill_seq_len: int) -> str:
    return (f"--ccl value {value} is smaller than prefill_seq_len {prefill_seq_len}: its prefill specialization "
            f"could not hold a {prefill_seq_len}-token chunk; give values of {prefill_seq_len} or more")


def parse_ccl(value, ctx_len: int, *, error: type[QeffKvError] = RuntimeInputError,
              prefill_seq_len: int | None = None) -> tuple[int, ...] | None:
    """``None``, ``"auto"``, ``"512,1024"`` or a list of ints -> a checked tuple (or ``None``). ``"auto"`` leaves
    out values below ``prefill_seq_len``; a given list is checked against it later (:func:`check_ccl` with
    ``prefill_seq_len``, :func:`specializations`), after the options that refuse CCL altogether."""
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip()
        if text.lower() == "auto":
            return auto_ccl(ctx_len, prefill_seq_len)
        parts = [p.strip() for p in text.split(",")] if text else []
        vals = []
        for p in parts:
            if not _ASCII_DIGITS.fullmatch(p):  # int() also takes '١٦', '1_0', '+5': refused
                raise error(f"--ccl values must be positive integers, got {p!r}")
            vals.append(int(p))
        return check_ccl(vals, ctx_len, error=error)
    if isinstance(value, (list, tuple)):
        return check_ccl(value, ctx_len, error=error)
    raise error(f"--ccl must be 'auto' or a list of integers, got {value!r}")
