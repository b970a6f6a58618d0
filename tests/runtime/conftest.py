"""Fixtures of the runtime tests alone (tests/conftest.py holds the ones other folders share too)."""

from __future__ import annotations

from pathlib import Path

import pytest

from suite import HAS_PEER_VLM, PEER_GRAPHS, PEER_VLM_DIR, PEER_VLM_MISSING


@pytest.fixture(scope="session")
def peer_vlm_dir() -> Path:
    if not HAS_PEER_VLM:
        pytest.skip(PEER_VLM_MISSING)
    return PEER_VLM_DIR


@pytest.fixture(params=PEER_GRAPHS)
def peer_graph(request, peer_dir) -> Path:
    return peer_dir / request.param


@pytest.fixture(scope="session")
def own_graph(own_graphs) -> Path:
    """Portable, no prefix."""
    return own_graphs.export("qeff_llama_default.onnx").out_dir
