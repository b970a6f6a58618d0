"""Fixtures of the tools tests alone (tests/conftest.py holds the ones other folders share too)."""

from __future__ import annotations

from pathlib import Path

import pytest

from suite import ALL_GRAPHS


@pytest.fixture(params=ALL_GRAPHS, ids=[f"{k}-{n}" for k, n in ALL_GRAPHS])
def any_graph(request) -> Path:
    """Each of our graphs that mirrors a peer graph (a bare .onnx of the same name), then each peer graph."""
    kind, name = request.param
    return request.getfixturevalue(f"{kind}_graphs") / name
