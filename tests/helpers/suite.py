"""The suite's shared constants and markers, importable from every test folder (``from suite import ...``).

tests/helpers/ is on pytest's ``pythonpath`` (pyproject.toml), so ``suite`` is one module whichever folder a test
lives in; the conftest.py files hold fixtures only (``from conftest import`` would be ambiguous with one conftest.py
per folder). The peer fixture folders and the own graphs are described in tests/conftest.py.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PEER_DIR = Path(os.environ.get("QEFF_KV_PEER_FIXTURES", REPO.parent / "shared" / "fixtures" / "qeff-peer"))
HAS_PEER = (PEER_DIR / "README.md").is_file()
PEER_MISSING = f"peer fixtures not found at {PEER_DIR} (set QEFF_KV_PEER_FIXTURES to their folder)"
#: The peer's vision-language and CCL graphs, with the tiny models they were made from (tests/runtime/test_peer_vlm.py).
PEER_VLM_DIR = Path(os.environ.get("QEFF_KV_PEER_VLM_FIXTURES", REPO.parent / "shared" / "fixtures" / "qeff-peer-vlm"))
HAS_PEER_VLM = (PEER_VLM_DIR / "README.md").is_file()
PEER_VLM_MISSING = (f"peer vision-language fixtures not found at {PEER_VLM_DIR} (set QEFF_KV_PEER_VLM_FIXTURES to "
                    "their folder)")
#: The peer's round-two graphs (MLA latent, speculative target, hybrid recurrent, sliding window) with their tiny
#: models (tests/tools/test_peer_round2.py).
PEER2_DIR = Path(os.environ.get("QEFF_KV_PEER2_FIXTURES", REPO.parent / "shared" / "fixtures" / "qeff-peer-2"))
HAS_PEER2 = (PEER2_DIR / "README.md").is_file()
PEER2_MISSING = f"peer round-two fixtures not found at {PEER2_DIR} (set QEFF_KV_PEER2_FIXTURES to their folder)"
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

#: Prompts of the peer's README (token ids below 256, the vocabulary of both tiny models).
PROMPT_A = [5, 17, 42, 99, 130, 7, 201, 64]
PROMPT_B = [250, 3, 88, 19, 160, 45, 12, 222]
#: The peer's README reference tokens (greedy, 8 new tokens, from transformers on the peer's tiny models).
PEER_LLAMA_A = [124, 176, 188, 78, 77, 163, 243, 166]
PEER_LLAMA_B = [53, 42, 18, 53, 42, 18, 53, 42]
PEER_QWEN2_A = [108, 48, 11, 28, 105, 147, 141, 48]

#: Our own graphs: file name (the peer's name where the peer has such a graph) -> (model, export options).
#: "bundled" is the bundled default (a tiny Llama, vocab 256); "qwen2" a tiny seeded Qwen2 of the same sizes.
#: Every one is portable unless its options say otherwise, ctx_len 64, prefill 8.
OWN_CTX_LEN, OWN_PREFILL = 64, 8
OWN_GRAPHS: dict[str, tuple[str, dict]] = {
    "qeff_llama_default.onnx": ("bundled", {}),
    "qeff_llama_vllm.onnx": ("bundled", dict(kv_cache_prefix="VLLM")),
    "qeff_llama_cb_default.onnx": ("bundled", dict(continuous_batching=True, full_batch_size=3)),
    "qeff_llama_cb_vllm.onnx": ("bundled", dict(kv_cache_prefix="VLLM", continuous_batching=True,
                                                 full_batch_size=3)),
    "qeff_qwen2_vllm.onnx": ("qwen2", dict(kv_cache_prefix="VLLM")),
    "own_llama_fused_vllm.onnx": ("bundled", dict(kv_cache_prefix="VLLM", target="onnxruntime-fused")),
    "own_llama_ort_cb_vllm.onnx": ("bundled", dict(kv_cache_prefix="VLLM", target="onnxruntime",
                                                   continuous_batching=True, full_batch_size=3)),
}
#: The own graphs that mirror a peer graph (same file name, same model sizes and KV contract).
OWN_AS_PEER = [n for n in PEER_GRAPHS if n in OWN_GRAPHS]
#: (set, file name) of every graph of the peer's kinds: ours first, then the peer's (skipped without them).
ALL_GRAPHS = [("own", n) for n in OWN_AS_PEER] + [("peer", n) for n in PEER_GRAPHS]
