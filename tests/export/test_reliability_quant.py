"""Issue 31, item 12: a quantized export is measured against its float graph on natural text (a fixed paragraph,
teacher-forced) when it has a tokenizer; past the documented perplexity ratio the export says so loudly and its
manifest's check is ``"failed"``, never ``"passed"``."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def int4(tmp_path_factory):
    from qeff_kv.export import export_model

    lines: list[str] = []
    res = export_model(None, tmp_path_factory.mktemp("int4") / "tiny-int4", ctx_len=64, prefill_seq_len=8,
                       target="onnxruntime-fused", weights="int4", progress=lines.append)
    return res, lines


def test_an_int4_export_with_a_tokenizer_is_measured_on_natural_text(int4):
    from qeff_kv.export.weights.quantize import MAX_PERPLEXITY_RATIO, NATURAL_TEXT

    res, lines = int4
    chk = res.manifest["weights"]["check"]
    nat = chk["natural_text"]
    assert nat["threshold"] == MAX_PERPLEXITY_RATIO
    assert nat["tokens"] == min(48, len(__import__("tokenizers").Tokenizer.from_file(
        str(res.out_dir / "tokenizer.json")).encode(NATURAL_TEXT).ids))
    assert 0.0 <= nat["top1_agreement"] <= 1.0
    ratio = nat["perplexity_quantized"] / nat["perplexity_float"]
    assert abs(ratio - nat["perplexity_ratio"]) < 1e-3 * ratio
    assert chk["status"] == nat["status"] == ("passed" if nat["perplexity_ratio"] <= MAX_PERPLEXITY_RATIO
                                              else "failed")
    assert any("on a natural paragraph" in ln for ln in lines)


def _broken_copy(src, dst, scale):
    """``src``'s float graph with its output head multiplied by ``scale`` (a quantization gone wrong)."""
    import onnx
    from onnx import numpy_helper

    m = onnx.load(str(src), load_external_data=True)
    head = [n for n in m.graph.node if n.op_type in ("MatMul", "Gemm", "MatMulNBits")][-1]
    inits = {t.name: t for t in m.graph.initializer}
    w = inits[head.input[1]]
    arr = numpy_helper.to_array(w) * scale
    w.CopyFrom(numpy_helper.from_array(arr.astype(numpy_helper.to_array(w).dtype), w.name))
    onnx.save(m, str(dst), save_as_external_data=True, location=dst.name + ".data")
    return dst


def test_the_check_fails_a_graph_that_degrades_the_text(tmp_path):
    from qeff_kv.export import export_model
    from qeff_kv.export.weights.quantize import MAX_PERPLEXITY_RATIO, natural_text_check

    res = export_model(None, tmp_path / "tiny", ctx_len=64, prefill_seq_len=8, target="onnxruntime")
    ids = [5, 17, 42, 99, 13, 7, 101, 64, 3, 77, 21, 8, 30]
    same = natural_text_check(res.onnx_path, res.onnx_path, ids, ctx_len=64)
    assert same["status"] == "passed" and same["perplexity_ratio"] == 1.0 and same["top1_agreement"] == 1.0
    broken = _broken_copy(res.onnx_path, tmp_path / "broken.onnx", -40.0)
    bad = natural_text_check(res.onnx_path, broken, ids, ctx_len=64)
    assert bad["status"] == "failed" and bad["perplexity_ratio"] > MAX_PERPLEXITY_RATIO, bad
    assert np.isfinite(bad["perplexity_quantized"])
