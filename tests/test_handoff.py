"""Disaggregated prefill -> decode: two separate processes, tokens identical to one uninterrupted run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from safetensors.numpy import load_file

A = "5,17,42,99,130,7,201,64"
LLAMA_A = [124, 176, 188, 78, 77, 163, 243, 166]


def cli(*args) -> dict:
    proc = subprocess.run([sys.executable, "-m", "qeff_kv_cli.main", "generate", *args, "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "tokens/s" in proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.parametrize("prefill_graph, decode_graph, extra", [
    ("qeff_llama_vllm.onnx", "qeff_llama_vllm.onnx", []),
    ("qeff_llama_vllm.onnx", "qeff_llama_cb_vllm.onnx", []),  # prefill graph and decode graph differ
    ("qeff_llama_cb_default.onnx", "qeff_llama_default.onnx", ["--temperature", "1.3", "--top-p", "0.9", "--seed", "11"]),
])
def test_two_process_handoff(peer_dir, tmp_path, prefill_graph, decode_graph, extra):
    common = ["--ctx-len", "16", "--prefill-seq-len", "5", "--ignore-eos", *extra]
    whole = cli(str(peer_dir / prefill_graph), "--prompt-ids", A, "--max-new-tokens", "8", *common)
    state = tmp_path / "kv.safetensors"
    first = cli(str(peer_dir / prefill_graph), "--prompt-ids", A, "--max-new-tokens", "0",
                "--save-state", str(state), *common)
    assert first["sequences"][0]["tokens"] == [] and first["saved_state"] == str(state)
    if "vllm" in prefill_graph:  # the serving regex .*VLLM.* chose exactly the KV buffers
        assert all("VLLM" in k for k in load_file(str(state)))
    second = cli(str(peer_dir / decode_graph), "--load-state", str(state), "--max-new-tokens", "8", *common)
    assert second["sequences"][0]["tokens"] == whole["sequences"][0]["tokens"]
    if not extra:
        assert whole["sequences"][0]["tokens"] == LLAMA_A


def test_handoff_mid_generation(peer_dir, tmp_path):
    g = str(peer_dir / "qeff_llama_cb_vllm.onnx")
    common = ["--ctx-len", "16", "--prefill-seq-len", "8"]
    state = tmp_path / "mid.safetensors"
    a = cli(g, "--prompt-ids", A, "--max-new-tokens", "3", "--save-state", str(state), *common)
    b = cli(g, "--load-state", str(state), "--max-new-tokens", "5", *common)
    assert a["sequences"][0]["tokens"] + b["sequences"][0]["tokens"] == LLAMA_A
