"""Accelerator compile artifacts for a retained-state graph: ``custom_io.yaml`` and ``specializations.json``.

Shared by ``qeff-kv export`` and ``qeff-kv compile-config``. Buffer names come from the graph's
:class:`~qeff_kv.layout.KVLayout`, so the files follow whatever prefix the graph carries.

A graph with sliding-window ring buffers (a KV axis 2 named ``sliding_window``) gets the symbol
``sliding_window`` = ``str(W)`` in every specialization (flat and named formats, with or without CCL), as the
peer writes; ``custom_io.yaml`` lists every pair whatever its capacity. ``W`` comes from the caller
(``sliding_window=``, ``--sliding-window N``) or the graph metadata ``qeff_kv.sliding_window``; a graph with the
axis and no known ``W`` is refused in one line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal, Sequence as Seq

from . import fsutil, naming
from .errors import QeffKvError, RuntimeInputError
from .layout import KVLayout
from .limits import positive_int

SpecFormat = Literal["flat", "named"]
CUSTOM_IO_FILE = "custom_io.yaml"
SPECIALIZATIONS_FILE = "specializations.json"
#: Precisions a compiler accepts for the KV buffers in ``custom_io.yaml``.
PRECISIONS = ("float16", "bfloat16", "float32", "mxint8", "int8")


def check_precision(precision: str) -> str:
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise RuntimeInputError(f"unknown KV precision {precision!r}; use one of {', '.join(PRECISIONS)}")
    return precision


def custom_io_yaml(layout: KVLayout, precision: str = "float16") -> str:
    """`` - IOName: X`` / ``   Precision: <precision>`` for every KV input and its retained output."""
    check_precision(precision)
    layout.require_valid()
    pairs = sorted(layout.pairs, key=lambda p: (p.layer, p.stem))
    lines = ["# Model Inputs", ""]
    for p in pairs:
        lines += [f" - IOName: {p.input_name}", f"   Precision: {precision}", ""]
    lines += ["# Model Outputs", ""]
    for p in pairs:
        lines += [f" - IOName: {p.output_name}", f"   Precision: {precision}", ""]
    return "\n".join(lines)


def check_sliding_window(value) -> int | None:
    """``None``, or ``value`` as a positive int (one-line :class:`RuntimeInputError` otherwise)."""
    if value is None:
        return None
    return positive_int(naming.SLIDING_DIM, value)


def resolve_sliding_window(layout: KVLayout, sliding_window=None, *, required: bool = False) -> int | None:
    """The window ``W`` of ``layout``'s ring buffers: ``sliding_window`` when given (a positive int), else the graph
    metadata ``qeff_kv.sliding_window``. A given window that differs from the metadata's is refused; with
    ``required``, a graph with ring buffers (axis ``sliding_window``) and no known window is refused too."""
    sliding_window = check_sliding_window(sliding_window)
    meta = layout.sliding_window
    if sliding_window is not None and meta is not None and sliding_window != meta:
        raise RuntimeInputError(f"sliding window {sliding_window} differs from the graph's own "
                                f"{naming.SLIDING_WINDOW_META} = {meta}")
    window = sliding_window if sliding_window is not None else meta
    if required and window is None and layout.has_sliding:
        raise RuntimeInputError(f"graph has sliding-window KV buffers (axis {naming.SLIDING_DIM!r}); "
                            "give --sliding-window N")
    return window


def specializations(prefill_seq_len: int, ctx_len: int, *, batch_size: int = 1,
                    full_batch_size: int | None = None, fmt: SpecFormat = "flat",
                    ccl: "Seq[int] | None" = None, sliding_window: int | None = None) -> dict:
    """Prefill (``seq_len`` = prefill length) and decode (``seq_len`` = 1) specializations.

    ``flat`` is the format every compiler release reads; ``named`` is the newer
    ``{"specializations": [{"name": ..., "symbols": {...}}]}`` form. Values are strings, as the peer writes.
    Under continuous batching, prefill runs one sequence (``batch_size`` 1) and decode runs
    ``full_batch_size`` rows.

    With ``ccl`` (compute-context lengths, contract section 9): one prefill per value, then one decode per
    value, each with the symbol ``comp_ctx_lengths``; named entries are ``Prefill_ccl<L>`` / ``Decode_ccl<L>``.

    With ``sliding_window`` (the window ``W`` of a graph with ring buffers, axis ``sliding_window``): every entry
    carries ``"sliding_window": str(W)`` after ``ctx_len``.
    """
    for label, v in (("prefill_seq_len", prefill_seq_len), ("ctx_len", ctx_len), ("batch_size", batch_size)):
        positive_int(label, v)
    if full_batch_size is not None:
        positive_int("full_batch_size", full_batch_size)
    check_sliding_window(sliding_window)
    if prefill_seq_len > ctx_len:
        raise RuntimeInputError(f"prefill_seq_len {prefill_seq_len} is larger than ctx_len {ctx_len}")
    if fmt not in ("flat", "named"):
        raise RuntimeInputError(f"unknown specializations format {fmt!r}; use 'flat' or 'named'")
    if full_batch_size is not None:
        prefill = {"batch_size": "1", "seq_len": str(prefill_seq_len), "ctx_len": str(ctx_len),
                   "full_batch_size": str(full_batch_size)}
        decode = {"batch_size": str(full_batch_size), "seq_len": "1", "ctx_len": str(ctx_len),
                  "full_batch_size": str(full_batch_size)}
    else:
        prefill = {"batch_size": str(batch_size), "seq_len": str(prefill_seq_len), "ctx_len": str(ctx_len)}
        decode = {"batch_size": str(batch_size), "seq_len": "1", "ctx_len": str(ctx_len)}
    if sliding_window is not None:
        prefill, decode = (_after_ctx_len(d, naming.SLIDING_DIM, str(sliding_window)) for d in (prefill, decode))
    if ccl:
        for v in ccl:
            positive_int(naming.CCL_INPUT, v)
        entries = [(f"Prefill_ccl{v}", {**prefill, naming.CCL_INPUT: str(v)}) for v in ccl]
        entries += [(f"Decode_ccl{v}", {**decode, naming.CCL_INPUT: str(v)}) for v in ccl]
    else:
        entries = [("Prefill", prefill), ("Decode", decode)]
    if fmt == "flat":
        return {"specializations": [sym for _, sym in entries]}
    return {"specializations": [{"name": name, "symbols": sym} for name, sym in entries]}


def _after_ctx_len(d: dict, key: str, value: str) -> dict:
    out: dict = {}
    for k, v in d.items():
        out[k] = v
        if k == "ctx_len":
            out[key] = value
    return out


def write_compile_config(layout: KVLayout, out_dir: str | Path, *, prefill_seq_len: int, ctx_len: int,
                         batch_size: int = 1, full_batch_size: int | None = None, fmt: SpecFormat = "flat",
                         precision: str = "float16", ccl: "Seq[int] | None" = None,
                         sliding_window: int | None = None) -> list[Path]:
    """Write both files into ``out_dir`` atomically; return their paths.

    ``sliding_window``: the model's window ``W`` (default: the graph metadata ``qeff_kv.sliding_window``). It
    lands in the specializations only when the graph has ring buffers (a KV axis 2 named ``sliding_window``);
    such a graph without a known window is refused in one line (:class:`RuntimeInputError`), nothing written."""
    out_dir = Path(out_dir)
    check_precision(precision)
    window = resolve_sliding_window(layout, sliding_window, required=True)
    spec = specializations(prefill_seq_len, ctx_len, batch_size=batch_size,
                           full_batch_size=full_batch_size, fmt=fmt, ccl=ccl,
                           sliding_window=window if layout.has_sliding else None)
    text = custom_io_yaml(layout, precision)
    cio, sp = out_dir / CUSTOM_IO_FILE, out_dir / SPECIALIZATIONS_FILE
    fsutil.write_text(cio, text)
    fsutil.write_text(sp, json.dumps(spec, indent=2) + "\n")
    return [cio, sp]


# ------------------------------------------------------------------------------------ compute context length
#: ``--ccl auto`` starts at this many slots (or at ctx_len when it is smaller)
CCL_AUTO_START = 512


def auto_ccl(ctx_len: int) -> tuple[int, ...]:
    """``--ccl auto``: powers of two from ``min(ctx_len, 512)`` up to ``ctx_len``, always ending at ``ctx_len``
    (4096 -> 512, 1024, 2048, 4096; 3000 -> 512, 1024, 2048, 3000; 256 -> 256)."""
    v = min(ctx_len, CCL_AUTO_START)
    out = []
    while v < ctx_len:
        out.append(v)
        v *= 2
    return tuple(out + [ctx_len])


def check_ccl(values, ctx_len: int, *, error: type[QeffKvError] = RuntimeInputError) -> tuple[int, ...]:
    """Raise a one-line ``error`` unless ``values`` is a strictly increasing list of positive ints
    at most ``ctx_len``; return it as a tuple."""
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
    return tuple(vals)


def parse_ccl(value, ctx_len: int, *, error: type[QeffKvError] = RuntimeInputError) -> tuple[int, ...] | None:
    """``None``, ``"auto"``, ``"512,1024"`` or a list of ints -> a checked tuple (or ``None``)."""
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip()
        if text.lower() == "auto":
            return auto_ccl(ctx_len)
        parts = [p.strip() for p in text.split(",")] if text else []
        vals = []
        for p in parts:
            try:
                vals.append(int(p))
            except ValueError:
                raise error(f"--ccl values must be positive integers, got {p!r}") from None
        return check_ccl(vals, ctx_len, error=error)
    if isinstance(value, (list, tuple)):
        return check_ccl(value, ctx_len, error=error)
    raise error(f"--ccl must be 'auto' or a list of integers, got {value!r}")
