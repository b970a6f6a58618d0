"""Shared test fixtures. Peer graphs are read from ../shared/fixtures/qeff-peer (skipped where absent)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PEER_DIR = Path(os.environ.get("QEFF_KV_PEER_FIXTURES", REPO.parent / "shared" / "fixtures" / "qeff-peer"))
PEER_GRAPHS = [
    "qeff_llama_default.onnx",
    "qeff_llama_vllm.onnx",
    "qeff_llama_cb_default.onnx",
    "qeff_llama_cb_vllm.onnx",
    "qeff_llama_subfn_vllm.onnx",
    "qeff_qwen2_vllm.onnx",
]
HAS_TORCH = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("transformers") is not None

requires_torch = pytest.mark.skipif(not HAS_TORCH, reason="needs the [export] extra (torch, transformers)")


@pytest.fixture(scope="session")
def peer_dir() -> Path:
    if not (PEER_DIR / "README.md").is_file():
        pytest.skip(f"peer fixtures not found at {PEER_DIR} (set QEFF_KV_PEER_FIXTURES to their folder)")
    return PEER_DIR


@pytest.fixture(params=PEER_GRAPHS)
def peer_graph(request, peer_dir) -> Path:
    return peer_dir / request.param


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path_factory, monkeypatch):
    """Keep the export cache of every test away from the user's ~/.cache."""
    monkeypatch.setenv("QEFF_KV_HOME", str(tmp_path_factory.getbasetemp() / "qeff_kv_home"))
