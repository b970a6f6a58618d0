"""Issue 22, classes 8 and 9: an unknown onnxruntime provider is refused in one line; what torch and onnxruntime
print while failing is captured (the user sees one line; ``--debug`` shows the libraries' text)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from suite import requires_torch
from qeff_kv.support import capture
from qeff_kv.errors import ExportError, RuntimeInputError
from qeff_kv.runtime import Session
from cli_checks import cli, one_error, tree
from ring_graphs import ring_graph

QEFF_KV = Path(sys.executable).with_name("qeff-kv")


# ------------------------------------------------------------------------------------------------ class 8
@pytest.mark.parametrize("providers", [["FooExecutionProvider"], ["CPUExecutionProvider", "CUDAExecutionProviderX"]])
def test_an_unknown_provider_is_refused_naming_the_available_ones(tmp_path, providers):
    path = ring_graph(tmp_path / "g")
    bad = [p for p in providers if p not in ort.get_available_providers()][0]
    with pytest.raises(RuntimeInputError) as exc:
        Session(path, ctx_len=32, providers=providers)
    assert str(exc.value) == (f"onnxruntime provider {bad!r} is not available here (available: "
                              f"{', '.join(ort.get_available_providers())})")


# ------------------------------------------------------------------------------------------------ class 9
def _noisy_graph(folder: Path) -> Path:
    """A ring graph onnxruntime cannot load, logging its own error line first (a Resize kernel with a bad mode)."""
    path = ring_graph(folder)
    m = onnx.load(path)
    m.graph.initializer.append(numpy_helper.from_array(np.array([1.0, 2.0], dtype=np.float32), "rscale"))
    m.graph.node.insert(0, helper.make_node("Cast", ["position_ids"], ["posf"], to=TensorProto.FLOAT))
    m.graph.node.insert(1, helper.make_node("Resize", ["posf", "", "rscale"], ["noisy"], mode="bogus"))
    m.graph.output.append(helper.make_tensor_value_info("noisy", TensorProto.FLOAT, None))
    onnx.save(m, path)
    return path


def _run(*args) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "QEFF_KV_DEBUG"}
    return subprocess.run([str(QEFF_KV), *map(str, args)], capture_output=True, text=True, env=env, timeout=300)


def test_onnxruntime_log_lines_are_captured_behind_debug(tmp_path):
    path = _noisy_graph(tmp_path / "g")
    res = _run("generate", path, "--prompt-ids", "1", "--ctx-len", "8")
    assert res.returncode == 2
    [line] = res.stderr.splitlines()   # onnxruntime's own "[E:onnxruntime:, inference_session.cc...]" is not shown
    assert line.startswith(f"error: {path}: onnxruntime cannot load it ([ONNXRuntimeError] : 1 : FAIL : Exception "
                           "during initialization: ") and "mode attribute is bogus" in line, line
    loud = _run("--debug", "generate", path, "--prompt-ids", "1", "--ctx-len", "8")
    assert "[E:onnxruntime:" in loud.stderr and "Traceback" in loud.stderr


def test_library_output_is_attached_to_the_error_and_fd_output_never_leaks(capfd):
    with pytest.raises(ExportError) as exc:
        with capture.library_output():
            os.write(1, b"graph(%0 : Float(4, 4)):\n" * 500)
            os.write(2, b"[E:onnxruntime:] something\n")
            print("python print to stdout")
            print("python print to stderr", file=sys.stderr)
            raise ExportError("tracing failed for M: RuntimeError: unsupported")
    out, err = capfd.readouterr()
    assert out == "" and err == ""
    text = exc.value.library_output
    assert text.count("graph(%0") == 500 and "[E:onnxruntime:]" in text and "python print to stderr" in text
    assert str(exc.value) == "tracing failed for M: RuntimeError: unsupported"
    # success: dropped, and the descriptors are back
    with capture.library_output():
        os.write(1, b"dropped\n")
    os.write(1, b"visible\n")
    assert capfd.readouterr().out == "visible\n"


@requires_torch
def test_an_operator_without_onnx_form_is_one_line_not_the_traced_graph(tmp_path, monkeypatch, capfd):
    """The exporter's failure on an operator it cannot express (torch prints the whole traced graph first)."""
    import torch

    from qeff_kv.export import trace as trace_mod

    class NoOnnxForm(torch.nn.Module):
        def forward(self, x):
            return torch.linalg.svd(x)[0]

    def trace(model, options, path, facts=None, vision=None, **_kw):
        try:   # what trace.run_exporter does with torch.onnx.export's failures
            torch.onnx.export(NoOnnxForm(), (torch.zeros(4, 4),), str(path), dynamo=False, opset_version=17)
        except Exception as exc:
            raise ExportError(f"tracing failed for {type(model).__name__}: {type(exc).__name__}: "
                              f"{str(exc).splitlines()[0]}") from None

    monkeypatch.setattr(trace_mod, "trace_language", trace)
    capfd.readouterr()
    before = tree(tmp_path)
    res = cli("export", "-o", tmp_path / "out", "--ctx-len", 64, "--prefill-seq-len", 8, "--no-verify", "-q")
    line = one_error(res, "tracing failed for LlamaForCausalLM")
    assert res.stdout == "" and "Torch IR graph" not in res.output
    out, err = capfd.readouterr()
    assert "Torch IR graph" not in out + err and "graph(" not in out + err
    assert tree(tmp_path) == before
    assert line.count("\n") == 0


def test_a_daemon_thread_does_not_stop_capturing_a_worker_thread_does(capfd):
    """tqdm's monitor (left running by a transformers progress bar) is a daemon thread: the command line's one line
    must survive it. A host's own (non-daemon) worker thread makes capturing stand aside."""
    import threading

    stop = threading.Event()
    for daemon, leaks in ((True, False), (False, True)):
        t = threading.Thread(target=stop.wait, daemon=daemon)
        t.start()
        try:
            with pytest.raises(ExportError):
                with capture.library_output():
                    os.write(1, b"graph(%0)\n")
                    raise ExportError("tracing failed")
        finally:
            stop.set()
            t.join()
            stop.clear()
        out, _ = capfd.readouterr()
        assert ("graph(%0)" in out) == leaks
