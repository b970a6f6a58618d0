"""Tools on an int8 KV cache (``--kv-cache-dtype int8``): ``check`` refuses a pair that disagrees on dtype and an
int8 buffer without its scales (or with scales of the wrong shape); ``buffers`` states the cache dtype; ``rewrite``
keeps pairs, dtypes and scales (the rewritten graph runs to the same tokens) and refuses, in one line, the
static-cache dialect that cannot carry a quantized cache."""

import numpy as np
import onnx_ir as ir
import pytest

from families import CHUNK, CTX, NEW, PROMPTS
from suite import requires_torch

from qeff_kv.contract import naming
from qeff_kv.errors import DialectError
from qeff_kv.graph import graphio
from qeff_kv.tools.check.rules import check, check_model

pytestmark = requires_torch


def _failures(report) -> list[str]:
    return [f"{r.id}: {v.message}" for r in report.rules for v in r.violations]


def test_check_int8_pair_dtype_and_scales(int8_kv_export):
    path = int8_kv_export.onnx_path
    assert check(path, skip_checker=True).ok
    model = graphio.load(path)
    out = next(v for v in model.graph.outputs if v.name == "past_value.1_RetainedState")
    out.dtype = ir.DataType.FLOAT
    assert _failures(check_model(model)) == [
        "pair-match: past_value.1 is int8 but past_value.1_RetainedState is float32"]

    model = graphio.load(path)
    inits = model.graph.initializers
    missing = naming.kv_scale_name("past_key", 0)
    inits.pop(missing)
    wrong = inits[naming.kv_scale_name("past_value", 1)]
    wrong.const_value = ir.tensor(np.ones((1, 2, 1, 8), np.float32))
    wrong.shape = ir.Shape([1, 2, 1, 8])
    assert _failures(check_model(model)) == [
        "pair-match: past_key.0 is int8 but the graph has no initializer kv_scale.past_key.0 (its static scales); "
        "re-export with --kv-cache-dtype int8",
        "pair-match: kv_scale.past_value.1 is float32 [1, 2, 1, 8], but past_value.1 needs float32 [1, 2, 1, 16] "
        "(one scale per KV head and channel)"]


def test_buffers_states_int8_cache(int8_kv_export, family_exports):
    from qeff_kv.tools.buffers import buffers_report

    report = buffers_report(int8_kv_export.onnx_path, ctx_len=CTX)
    assert report.to_json()["kv_cache_dtype"] == "int8" and report.to_json()["bytes_per_token"] == 128
    assert ("KV bytes per token (one sequence, all layers): 128, KV cache int8 (its scales are initializers, "
            "not per sequence)") in report.format_text()
    plain = buffers_report(family_exports("llama", "onnxruntime-fused").onnx_path, ctx_len=CTX)
    assert "kv_cache_dtype" not in plain.to_json() and "KV cache" not in plain.format_text()


def test_rewrite_int8_cache_keeps_scales_and_tokens(int8_kv_export, tmp_path):
    """A prefix set with a conversion to past/present, then stripped back to retained state."""
    from qeff_kv.runtime.session import Session
    from qeff_kv.tools.rewrite import rewrite

    src = int8_kv_export.onnx_path
    (tmp_path / "back").mkdir()
    stripped = tmp_path / "back" / "stripped.onnx"   # its own folder: the sidecars beside a graph are its own
    rewrite(rewrite(src, tmp_path / "kv.onnx", to="shared-past-present", prefix="P2").output, stripped, strip=True, to="retained-state")
    for path in (tmp_path / "kv.onnx", stripped):
        report = check(path, skip_checker=True)
        assert report.ok and report.to_json()["kv_cache_dtype"] == "int8"
        layout = graphio.layout_of(graphio.load(path))
        assert {p.input.dtype for p in layout.pairs} == {p.output.dtype for p in layout.pairs} == {"int8"}
    before, after = graphio.load(src).graph.initializers, graphio.load(tmp_path / "kv.onnx").graph.initializers
    scales = [naming.kv_scale_name(s, i) for i in range(2) for s in naming.EXPORT_STEMS]
    assert all(np.array_equal(before[n].const_value.numpy(), after[n].const_value.numpy()) for n in scales)
    want = Session(src).generate([PROMPTS[0]], max_tokens=NEW)[0].tokens
    for path in (tmp_path / "kv.onnx", stripped):
        got = Session(path, ctx_len=CTX, prefill_seq_len=CHUNK).generate([PROMPTS[0]], max_tokens=NEW)[0].tokens
        assert got == want


def test_rewrite_int8_cache_to_static_refused(int8_kv_export, tmp_path):
    from qeff_kv.tools.rewrite import rewrite

    with pytest.raises(DialectError) as err:
        rewrite(int8_kv_export.onnx_path, tmp_path / "static.onnx", to="static-cache")
    assert str(err.value) == (
        "cannot convert to static-cache: its KV cache is int8 (--kv-cache-dtype), and the static-cache dialect's "
        "runtimes (mobius-onnx, onnxruntime-genai) feed a float cache with no scales; keep it retained-state or "
        "shared-past-present, or convert an export with a float cache")
    assert not (tmp_path / "static.onnx").exists()


def test_compile_config_keeps_int8_cache_precision(int8_kv_export, family_exports):
    from qeff_kv.errors import RuntimeInputError
    from qeff_kv.tools.compile_config import custom_io_yaml

    precisions = {line.strip() for line in (int8_kv_export.onnx_path.parent / "custom_io.yaml").read_text().splitlines()
                  if "Precision" in line}
    assert precisions == {"Precision: int8"}   # the export's own compile files
    import yaml   # ... and its workflow sidecar: the KV cells and the zeros that seed them are int8
    inputs = yaml.safe_load((int8_kv_export.onnx_path.parent / "inference_metadata.yaml").read_text())
    seeds = {k: v for k, v in inputs["pipeline"]["workflow"]["inputs"].items() if "_seed_" in k}
    assert seeds and {v["contract"]["dtype"] for v in seeds.values()} == {"int8"}
    assert {v["default"] for v in seeds.values()} == {0}
    layout = graphio.layout_of(graphio.load(int8_kv_export.onnx_path))
    assert custom_io_yaml(layout, "int8") == custom_io_yaml(layout)
    with pytest.raises(RuntimeInputError) as err:
        custom_io_yaml(layout, "float16")
    assert str(err.value) == ("KV precision float16 for a graph whose KV cache is int8 (exported with "
                              "--kv-cache-dtype int8): its buffers hold int8 values; use --precision int8 (its default)")
    plain = graphio.layout_of(graphio.load(family_exports("llama", "onnxruntime-fused").onnx_path))
    assert "Precision: float16" in custom_io_yaml(plain) and "int8" not in custom_io_yaml(plain)
