"""``qeff-kv export`` through click's CliRunner, and the promise that serving hosts need no torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from suite import requires_torch
from qeff_kv_cli.main import main

BAD_PREFIXES = [
    ("", "is empty"),
    ("a_b", "'_' (LOW LINE)"),
    ("a.b", "'.' (FULL STOP)"),
    ("past-key", "'-' (HYPHEN-MINUS)"),
    ("a b", "whitespace"),
    ("tab\there", "whitespace"),
    ("caf\u00e9", "LATIN SMALL LETTER E WITH ACUTE"),
    ("x\u00b2", "SUPERSCRIPT TWO"),
    ("\uff36\uff2c\uff2c\uff2d", "FULLWIDTH LATIN CAPITAL LETTER V"),
    ("kv\u0661\u0662", "ARABIC-INDIC DIGIT ONE"),
    ("A" * 65, "65 characters long; at most 64"),
    ("vllmRetainedState", "contains 'RetainedState'"),
]


@pytest.mark.parametrize("prefix, reason", BAD_PREFIXES)
def test_bad_prefix_exits_2_with_one_line_and_writes_nothing(prefix, reason, tmp_path, monkeypatch):
    monkeypatch.setenv("QEFF_KV_HOME", str(tmp_path / "home"))
    out = tmp_path / "out"
    res = CliRunner().invoke(main, ["export", "-o", str(out), "--kv-cache-prefix", prefix])
    assert res.exit_code == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: KV-cache prefix")
    assert reason in lines[0]
    assert "Traceback" not in res.output
    assert not out.exists() and not (tmp_path / "home").exists()


def test_bad_options_one_line(tmp_path):
    res = CliRunner().invoke(main, ["export", "-o", str(tmp_path / "o"), "--ctx-len", "8",
                                    "--prefill-seq-len", "16"])
    assert res.exit_code == 2
    assert res.stderr.strip() == "error: prefill_seq_len 16 is larger than ctx_len 8"
    res = CliRunner().invoke(main, ["export", str(tmp_path / "nope")])
    assert res.exit_code == 2 and "no such model folder" in res.stderr


def test_help_explains_every_option():
    res = CliRunner().invoke(main, ["export", "--help"])
    assert res.exit_code == 0
    for opt in ("--output", "--kv-cache-prefix", "--ctx-len", "--prefill-seq-len", "--dtype",
                "--continuous-batching", "--full-batch-size", "--force", "--specializations-format"):
        assert opt in res.output


@requires_torch
def test_export_prints_location_and_buffer_table(tmp_path):
    out = tmp_path / "out"
    args = ["export", "-o", str(out), "--kv-cache-prefix", "VLLM", "--ctx-len", "64",
            "--prefill-seq-len", "8", "--specializations-format", "named"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    assert f"exported: {out / 'qeff-kv-tiny-llama.onnx'}" in res.stdout
    assert "past_value.1_VLLM_RetainedState" in res.stdout
    assert "tracing LlamaForCausalLM" in res.stderr  # progress goes to stderr
    spec = json.loads((out / "specializations.json").read_text())
    assert [s["name"] for s in spec["specializations"]] == ["Prefill", "Decode"]
    assert spec["specializations"][0]["symbols"] == {"batch_size": "1", "seq_len": "8", "ctx_len": "64"}
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["ctx_len"] == 64 and manifest["prefill_seq_len"] == 8 and manifest["prefix"] == "VLLM"
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["qeff-kv-tiny-llama.onnx", "manifest.json", "export_params.json", "custom_io.yaml",
         "specializations.json", "tokenizer.json", "tokenizer_config.json", "genai_config.json",
         "inference_metadata.yaml"])


def _run_without_torch(code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter where importing torch or transformers fails."""
    guard = ("import sys\n"
             "for m in ('torch', 'transformers'):\n"
             "    sys.modules[m] = None\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = (str(Path(__file__).resolve().parents[2] / "tests" / "helpers") + os.pathsep
                         + env.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", guard + code], capture_output=True, text=True, env=env,
                          timeout=120)


def test_library_and_non_export_commands_work_without_torch(graphs):
    code = (
        "import qeff_kv, qeff_kv.export, qeff_kv.tools.rewrite, qeff_kv.tools.check.rules, qeff_kv.tools.buffers, qeff_kv.runtime\n"
        "from click.testing import CliRunner\n"
        "from qeff_kv_cli.main import main\n"
        f"r = CliRunner().invoke(main, ['buffers', {str(graphs / 'qeff_llama_vllm.onnx')!r}])\n"
        "assert r.exit_code == 0, r.output\n"
        f"r = CliRunner().invoke(main, ['check', {str(graphs / 'qeff_llama_vllm.onnx')!r}])\n"
        "assert r.exit_code == 0, r.output\n"
        "r = CliRunner().invoke(main, ['export', '--kv-cache-prefix', 'VLLM', '-o', '/nonexistent/x'])\n"
        "print(r.exit_code, r.stderr.strip())\n"
        "assert 'torch' not in sys.modules or sys.modules['torch'] is None\n"
    )
    proc = _run_without_torch(code)
    assert proc.returncode == 0, proc.stderr
    code_line = proc.stdout.strip().splitlines()[-1]
    assert code_line.startswith("2 error: export needs torch and transformers")
