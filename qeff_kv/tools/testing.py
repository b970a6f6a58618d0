"""Assert-style helpers for other projects' test suites (pytest, unittest: plain ``AssertionError``).

    from qeff_kv.tools.testing import assert_retained_state_graph

    def test_export_is_servable(tmp_path):
        path = my_exporter(tmp_path, kv_cache_prefix="VLLM")
        assert_retained_state_graph(path, prefix="VLLM")

Imports nothing beyond onnx/onnx_ir (no torch).
"""

from __future__ import annotations

import os
from typing import Iterable

from qeff_kv.tools import check as _check
from qeff_kv.graph import graphio
from qeff_kv.contract import naming

__all__ = ["assert_retained_state_graph", "assert_kv_selected_by", "ANY"]

ANY = _check.ANY


def assert_retained_state_graph(path: str | os.PathLike, *, prefix: object = ANY,
                                ignore: Iterable[str] = (), num_layers: int | None = None) -> _check.CheckReport:
    """Run ``qeff-kv check`` on ``path`` and raise ``AssertionError`` listing every failing rule.

    ``prefix``: ``ANY`` (default) accepts any single prefix, a string requires it, ``None`` requires an
    unprefixed graph. ``ignore``: rule ids not to enforce (see :data:`qeff_kv.tools.check.RULES`).
    ``num_layers``: also require this many layers. Returns the report when everything passes.
    """
    ignore = set(ignore)
    unknown = ignore - set(_check.RULES)
    if unknown:
        raise ValueError(f"unknown rule ids {sorted(unknown)}; known: {', '.join(_check.RULES)}")
    report = _check.check(path, expected_prefix=prefix)
    failing = [r for r in report.rules if r.status == _check.FAIL and r.id not in ignore]
    problems = [f"[{v.rule}] {v.message}" for r in failing for v in r.violations]
    if num_layers is not None and report.num_layers != num_layers:
        problems.append(f"[layers] graph has {report.num_layers} layers, expected {num_layers}")
    if problems:
        ids = sorted({r.id for r in failing})
        head = f"{path}: retained-state graph check failed ({', '.join(ids) or 'layers'}):"
        raise AssertionError("\n  ".join([head] + problems))
    return report


def assert_kv_selected_by(path: str | os.PathLike, regex: str) -> None:
    """Raise ``AssertionError`` unless ``regex`` (full-match) selects exactly the graph's KV inputs/outputs."""
    layout = graphio.layout_of(graphio.load(path))
    kv = set(layout.kv_names)
    sel = set(naming.select(regex, layout.io_names))
    if sel != kv:
        extra, missed = sorted(sel - kv), sorted(kv - sel)
        raise AssertionError(
            f"{path}: regex {regex!r} does not select exactly the KV buffers; "
            f"selects non-KV {extra}, misses KV {missed}")
