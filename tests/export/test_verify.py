"""Verification at export: on by default, recorded in the manifest, and it catches a graph broken on purpose."""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir
import pytest
from click.testing import CliRunner

from suite import requires_torch
from qeff_kv.errors import ExportError, VerificationError

pytestmark = [requires_torch]


def _break_lm_head(model: ir.Model) -> None:
    """Scale the output head's weight by 1.5: a graph that still loads, runs and passes ``check``."""
    node = model.graph.outputs[0].producer()
    while not any(v is not None and v.const_value is not None and len(v.shape or ()) == 2 for v in node.inputs):
        node = next(v.producer() for v in node.inputs if v is not None and v.producer() is not None)
    value = next(v for v in node.inputs if v is not None and v.const_value is not None and len(v.shape) == 2)
    value.const_value = ir.tensor(value.const_value.numpy() * 1.5, name=value.name)


def test_default_export_is_verified_and_recorded(tmp_path):
    from qeff_kv.export import export_model

    r = export_model(None, tmp_path / "out", ctx_len=24, prefill_seq_len=4)
    v = r.manifest["verification"]
    assert v["status"] == "passed"
    assert v["steps"] == 5 and v["prompt_len"] == 6 and v["chunk"] == 4   # one full chunk, one padded
    assert 0 <= v["max_abs_diff"] <= v["tolerance"]
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["verification"] == v


def test_graph_broken_on_purpose_is_refused_and_nothing_is_written(tmp_path, monkeypatch):
    from qeff_kv.export import export_model, graph_passes

    real = graph_passes.finalize

    def broken(model, options, geometry):
        real(model, options, geometry)
        _break_lm_head(model)

    monkeypatch.setattr(graph_passes, "finalize", broken)
    out = tmp_path / "out"
    with pytest.raises(VerificationError, match=r"^verification failed after the prompt: logits differ from "
                                                 r"PyTorch by up to [0-9.e-]+ \(tolerance [0-9.e-]+\)"):
        export_model(None, out, ctx_len=24, prefill_seq_len=4)
    assert not out.exists() or list(out.iterdir()) == []
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []   # staging removed


def test_decode_only_breakage_is_named_by_step():
    """A graph right after the prompt but wrong at decode: the message names the decode step."""
    from qeff_kv.export import verify
    from qeff_kv.export.verify import Probe, Reference

    class FakeRunner:
        def __init__(self, *a, **kw):
            self.n = 0

        def step(self, ids, pos, slot, rope_rows=None):
            self.n += 1
            out = np.zeros(8)
            out[3] = 5.0
            if self.n >= 3:          # prompt (one chunk) and decode step 1 fine, step 2 wrong
                out[4] = 9.0
            return out

    ref_logits = [np.eye(8)[3] * 5.0 for _ in range(4)]
    ref = Reference(logits=ref_logits, tokens=[3, 3, 3, 3])
    probe = Probe(prompt=[1, 2], chunk=2, decode_steps=3)
    orig = verify.ProbeRunner
    verify.ProbeRunner = FakeRunner
    try:
        with pytest.raises(VerificationError, match=r"after decode step 2: logits differ from PyTorch by up to 9 "
                                                     r"\(tolerance 0.005\); greedy token 4, PyTorch 3"):
            verify.verify_graph("unused.onnx", probe, ref, ctx_len=8, dtype="float32")
    finally:
        verify.ProbeRunner = orig


def test_no_verify_and_memory_rule(tmp_path, monkeypatch):
    from qeff_kv.support import limits
    from qeff_kv.export import export_model

    r = export_model(None, tmp_path / "a", ctx_len=16, prefill_seq_len=4, verify=False)
    assert r.manifest["verification"] == {"status": "skipped", "reason": "turned off (--no-verify)"}
    monkeypatch.setattr(limits, "available_memory", lambda: 1 << 30)
    # verification is on by default at every size: where it cannot fit, a one-line refusal, nothing written
    with pytest.raises(ExportError, match=r"^verification needs about 1\.0 GiB and 1\.0 GiB is available: free "
                                          r"memory, or pass --no-verify to export without verification "
                                          r"\(recorded as skipped\)$"):
        export_model(None, tmp_path / "b", ctx_len=16, prefill_seq_len=4)
    assert not (tmp_path / "b" / "manifest.json").exists()
    r = export_model(None, tmp_path / "c", ctx_len=16, prefill_seq_len=4, verify=True)   # forced
    assert r.manifest["verification"]["status"] == "passed"


def test_cli_verify_flags_and_one_line_failure(tmp_path, monkeypatch):
    from qeff_kv.export import graph_passes
    from qeff_kv_cli.main import main

    runner = CliRunner()
    res = runner.invoke(main, ["export", "-q", "-o", str(tmp_path / "ok"), "--ctx-len", "16", "--prefill-seq-len", "4"])
    assert res.exit_code == 0, res.output
    assert "(verified against PyTorch)" in res.output
    res = runner.invoke(main, ["export", "-q", "-o", str(tmp_path / "nv"), "--ctx-len", "16", "--prefill-seq-len", "4",
                                "--no-verify"])
    assert res.exit_code == 0 and "(not verified)" in res.output
    real = graph_passes.finalize
    monkeypatch.setattr(graph_passes, "finalize", lambda m, o, g: (real(m, o, g), _break_lm_head(m)))
    res = runner.invoke(main, ["export", "-q", "-o", str(tmp_path / "bad"), "--ctx-len", "16", "--prefill-seq-len", "4"])
    assert res.exit_code == 2
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: verification failed after the prompt")
    assert not (tmp_path / "bad" / "manifest.json").exists()
    assert issubclass(VerificationError, ExportError)


def test_the_probe_binds_its_kv_in_place(tmp_path):
    """Verification's runner binds each KV buffer as its pair's input and output (issue 51: no second copy of the
    cache per step): the same logits as feeding copies back, and the same arrays updated in place."""
    from qeff_kv.export import export_model
    from qeff_kv.export.probe_runner import ProbeRunner

    r = export_model(None, tmp_path / "out", ctx_len=24, prefill_seq_len=4, verify=False)
    bound, copied = ProbeRunner(r.onnx_path, 24, 1), ProbeRunner(r.onnx_path, 24, 1)
    copied.in_place = False
    assert bound.in_place
    address = {k: v.__array_interface__["data"][0] for k, v in bound.kv.items()}
    got, want = [bound.step([5, 9, 2, 7], [0, 1, 2, 3], 0)], [copied.step([5, 9, 2, 7], [0, 1, 2, 3], 0)]
    for t in range(4):
        token = int(np.argmax(got[-1]))
        got.append(bound.step([token], [4 + t], 0))
        want.append(copied.step([token], [4 + t], 0))
    np.testing.assert_array_equal(np.stack(got), np.stack(want))
    assert {k: v.__array_interface__["data"][0] for k, v in bound.kv.items()} == address
    for name, arr in bound.kv.items():
        np.testing.assert_array_equal(arr, copied.kv[name])
