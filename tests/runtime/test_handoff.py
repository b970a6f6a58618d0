"""Disaggregated prefill -> decode: two separate processes, tokens identical to one uninterrupted run.

Runs on our own graphs and on the peer's (``graphs``), each compared with its own reference tokens."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from safetensors.numpy import load_file

from suite import PROMPT_A

A = ",".join(map(str, PROMPT_A))


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
def test_two_process_handoff(graphs, tmp_path, prefill_graph, decode_graph, extra):
    common = ["--ctx-len", "16", "--prefill-seq-len", "5", "--ignore-eos", *extra]
    whole = cli(str(graphs / prefill_graph), "--prompt-ids", A, "--max-new-tokens", "8", *common)
    state = tmp_path / "kv.safetensors"
    first = cli(str(graphs / prefill_graph), "--prompt-ids", A, "--max-new-tokens", "0",
                "--save-state", str(state), *common)
    assert first["sequences"][0]["tokens"] == [] and first["saved_state"] == str(state)
    if "vllm" in prefill_graph:  # the serving regex .*VLLM.* chose exactly the KV buffers
        assert all("VLLM" in k for k in load_file(str(state)))
    second = cli(str(graphs / decode_graph), "--load-state", str(state), "--max-new-tokens", "8", *common)
    assert second["sequences"][0]["tokens"] == whole["sequences"][0]["tokens"]
    if not extra:
        assert whole["sequences"][0]["tokens"] == graphs.llama_a


def test_handoff_mid_generation(graphs, tmp_path):
    g = str(graphs / "qeff_llama_cb_vllm.onnx")
    common = ["--ctx-len", "16", "--prefill-seq-len", "8"]
    state = tmp_path / "mid.safetensors"
    a = cli(g, "--prompt-ids", A, "--max-new-tokens", "3", "--save-state", str(state), *common)
    b = cli(g, "--load-state", str(state), "--max-new-tokens", "5", *common)
    assert a["sequences"][0]["tokens"] + b["sequences"][0]["tokens"] == graphs.llama_a


def test_handoff_between_export_folders(own_vllm_graph, own_cb_graph, own_graphs, tmp_path):
    """As a user runs it: `qeff-kv export` folders (the manifest gives ctx_len and the prefill length), the
    prefill on a single-sequence export, the decode on a continuous-batching export of the same model."""
    common = ["--ignore-eos"]
    whole = cli(str(own_vllm_graph), "--prompt-ids", A, "--max-new-tokens", "8", *common)
    assert whole["ctx_len"] == 64 and whole["prefill_seq_len"] == 8
    state = tmp_path / "kv.safetensors"
    cli(str(own_vllm_graph), "--prompt-ids", A, "--max-new-tokens", "0", "--save-state", str(state), *common)
    second = cli(str(own_cb_graph), "--load-state", str(state), "--max-new-tokens", "8", *common)
    assert second["sequences"][0]["tokens"] == whole["sequences"][0]["tokens"] == own_graphs.llama_a
