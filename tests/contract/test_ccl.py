"""Compute context length (CCL, contract section 9): export --ccl, the runtime's choice of comp_ctx_lengths,
specializations, refusals, and that the Slice really limits attention. Graphs are made here (bundled default)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

pytest.importorskip("torch")

from qeff_kv.errors import ExportError  # noqa: E402
from qeff_kv.export import export_model  # noqa: E402
from qeff_kv.contract.ccl import auto_ccl  # noqa: E402
from qeff_kv.runtime import Session  # noqa: E402
from qeff_kv.runtime.ccl import allowed_lengths  # noqa: E402

CCL = [16, 32, 64]
PROMPT = [(7 * i + 3) % 200 + 3 for i in range(12)]
NEW = 30  # prompt 12 + 30 new tokens: positions cross 16 and 32


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("ccl")
    ccl = export_model(None, root / "ccl", ctx_len=64, prefill_seq_len=8, ccl=CCL)
    plain = export_model(None, root / "plain", ctx_len=64, prefill_seq_len=8)
    return root, ccl, plain


def _greedy(folder, **kw):
    sess = Session(folder, **kw)
    gen = sess.generate(PROMPT, max_new_tokens=NEW, stop_tokens=[])[0]
    return sess, gen.tokens


def test_export_records_ccl(exports):
    _, ccl, _ = exports
    m = ccl.manifest
    assert m["ccl"] == CCL and m["options"]["ccl"] == CCL
    assert m["verification"]["status"] == "passed"
    import onnx

    g = onnx.load(str(ccl.onnx_path), load_external_data=False).graph
    names = [i.name for i in g.input]
    assert names[-1] == "comp_ctx_lengths"
    inp = g.input[-1].type.tensor_type
    assert inp.elem_type == onnx.TensorProto.INT64
    assert [d.dim_param for d in inp.shape.dim] == ["comp_ctx_lengths"]


def test_greedy_tokens_equal_without_ccl(exports):
    _, ccl, plain = exports
    sess, with_ccl = _greedy(ccl.out_dir)
    _, without = _greedy(plain.out_dir)
    assert with_ccl == without and len(with_ccl) == NEW
    assert sess.ccl is not None and sess.ccl.lengths == CCL
    assert sess.cache.sequences[0].length == len(PROMPT) + NEW - 1 > 32


def test_runtime_steps_up(exports):
    _, ccl, _ = exports
    sess = Session(ccl.out_dir)
    seq = sess.add_sequence()
    sess.prefill(seq, PROMPT)
    assert sess.binding.ccl_bound == 16
    seen = []
    tok = 5
    while seq.length < 40:
        sess.decode({seq: tok})
        seen.append(sess.binding.ccl_bound)
    assert seen[0] == 16 and 32 in seen and seen[-1] == 64
    # position p is fed at the smallest listed L > p
    assert seen[16 - len(PROMPT) - 1] == 16 and seen[16 - len(PROMPT)] == 32


def test_peer_style_graph_without_manifest(exports, tmp_path):
    """A bare graph with comp_ctx_lengths (no manifest list): powers of two up to the capacity."""
    _, ccl, plain = exports
    shutil.copy(ccl.onnx_path, tmp_path / "model.onnx")
    sess = Session(tmp_path / "model.onnx", ctx_len=64, prefill_seq_len=8)
    assert sess.ccl.lengths == [1, 2, 4, 8, 16, 32, 64]
    toks = sess.generate(PROMPT, max_new_tokens=NEW, stop_tokens=[])[0].tokens
    assert toks == _greedy(plain.out_dir)[1]
    assert allowed_lengths(100, [16, 64, 128]) == [16, 64, 100]
    assert auto_ccl(4096) == (512, 1024, 2048, 4096) and auto_ccl(3000) == (512, 1024, 2048, 3000)
    assert auto_ccl(64) == (64,)


def test_specializations_per_length(exports, tmp_path):
    _, ccl, _ = exports
    flat = json.loads((ccl.out_dir / "specializations.json").read_text())["specializations"]
    assert [(s["seq_len"], s["comp_ctx_lengths"]) for s in flat] == \
        [("8", "16"), ("8", "32"), ("8", "64"), ("1", "16"), ("1", "32"), ("1", "64")]
    assert all(s["ctx_len"] == "64" for s in flat)
    named = export_model(None, tmp_path / "named", ctx_len=64, prefill_seq_len=8, ccl="auto",
                         specializations_format="named", verify=False)
    spec = json.loads((named.out_dir / "specializations.json").read_text())["specializations"]
    assert [s["name"] for s in spec] == ["Prefill_ccl64", "Decode_ccl64"]
    assert spec[1]["symbols"] == {"batch_size": "1", "seq_len": "1", "ctx_len": "64", "comp_ctx_lengths": "64"}
    assert named.manifest["ccl"] == [64]


@pytest.mark.parametrize("ccl,message", [
    ([32, 16], "--ccl must be strictly increasing (sorted, no duplicates), got 32,16"),
    ([16, 16], "--ccl must be strictly increasing (sorted, no duplicates), got 16,16"),
    ([16, 128], "--ccl value 128 is larger than ctx_len 64"),
    ([0, 16], "--ccl values must be positive integers, got 0"),
    ([-16], "--ccl values must be positive integers, got -16"),
    ([16.0], "--ccl values must be positive integers, got 16.0"),
    ("16,x", "--ccl values must be positive integers, got 'x'"),
    ([], "--ccl needs at least one value"),
])
def test_bad_lists_refused(tmp_path, ccl, message):
    out = tmp_path / "out"
    with pytest.raises(ExportError) as exc:
        export_model(None, out, ctx_len=64, prefill_seq_len=8, ccl=ccl)
    assert str(exc.value) == message
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_fused_refuses_ccl(tmp_path):
    from click.testing import CliRunner

    from qeff_kv_cli.main import main

    res = CliRunner().invoke(main, ["export", "-q", "-o", str(tmp_path / "f"), "--target", "onnxruntime-fused",
                                   "--ctx-len", "64", "--ccl", "16,64"])
    assert res.exit_code != 0
    assert "--target onnxruntime-fused does not support --ccl" in res.output
    assert len(res.output.strip().splitlines()) == 1
    assert not (tmp_path / "f").exists()


def test_slice_limits_attention(exports):
    """Fed by hand: any L that holds the positions gives the same logits; a shorter L changes them."""
    import onnxruntime as ort

    _, ccl, _ = exports
    sess = ort.InferenceSession(str(ccl.onnx_path), providers=["CPUExecutionProvider"])
    kv = {i.name: np.zeros((1, i.shape[1], 64, i.shape[3]), np.float32)
          for i in sess.get_inputs() if i.name.startswith("past_")}
    outs = [o.name for o in sess.get_outputs()]

    def run(ids, start, length, kv):
        feeds = {"input_ids": np.array([ids], np.int64),
                 "position_ids": np.arange(start, start + len(ids), dtype=np.int64)[None],
                 "comp_ctx_lengths": np.ones(length, np.int64), **kv}
        res = dict(zip(outs, sess.run(None, feeds)))
        return res["logits"][0, -1], {k: res[k + "_RetainedState"] for k in kv}

    prompt = [(5 * i + 1) % 200 + 3 for i in range(20)]
    _, kv = run(prompt[:8], 0, 16, kv)
    _, kv = run(prompt[8:16], 8, 16, kv)
    _, kv = run(prompt[16:], 16, 32, kv)
    at32, _ = run([9], 20, 32, kv)
    at64, _ = run([9], 20, 64, kv)
    at16, _ = run([9], 20, 16, kv)      # too short: slots 16..20 (the new token's own key too) are cut off
    np.testing.assert_allclose(at32, at64, rtol=1e-5, atol=1e-5)
    assert np.max(np.abs(at16 - at32)) > 1e-3


def test_check_passes(exports):
    from qeff_kv.tools.check import check

    _, ccl, _ = exports
    report = check(ccl.onnx_path)
    assert report.ok, report.format_text()
    assert report.to_json()["comp_ctx_lengths"] is True


def test_onnxruntime_target_and_continuous_batching(tmp_path):
    """onnxruntime target: CCL combined with the valid length (min of the two); CB: L covers every row."""
    ort_t = export_model(None, tmp_path / "ort", ctx_len=64, prefill_seq_len=8, ccl=CCL, target="onnxruntime")
    assert ort_t.manifest["verification"]["status"] == "passed"
    plain = export_model(None, tmp_path / "plain", ctx_len=64, prefill_seq_len=8, target="onnxruntime",
                         verify=False)
    assert _greedy(ort_t.out_dir)[1] == _greedy(plain.out_dir)[1]
    cb = export_model(None, tmp_path / "cb", ctx_len=64, prefill_seq_len=8, ccl=CCL, continuous_batching=True,
                      full_batch_size=2)
    assert cb.manifest["verification"]["status"] == "passed"
    sess = Session(cb.out_dir)
    short, long_ = [4, 5, 6], PROMPT + PROMPT[:8]
    gens = sess.generate([short, long_], max_new_tokens=16, stop_tokens=[])
    assert sess.binding.ccl_bound == 64    # the long row (20 + 15 positions) needs 64, the short one 32
    for prompt, gen in zip((short, long_), gens):
        alone = Session(cb.out_dir, max_sequences=1).generate(prompt, max_new_tokens=16, stop_tokens=[])[0]
        assert gen.tokens == alone.tokens


def test_compile_config_for_an_existing_ccl_graph(exports, tmp_path):
    """compile-config on a graph with comp_ctx_lengths: --ccl required, per-L entries written; refused on a
    graph without the input."""
    import json

    from click.testing import CliRunner

    from qeff_kv_cli.main import main

    _, ccl, plain = exports
    graph = str(ccl.onnx_path)
    runner = CliRunner()
    base = ["compile-config", graph, "--prefill-seq-len", "8", "--ctx-len", "64"]
    res = runner.invoke(main, base + ["-o", str(tmp_path / "a")])
    assert res.exit_code == 2 and res.output.strip().splitlines() == [
        f"error: {graph} takes comp_ctx_lengths: give --ccl L1,L2,... (or auto) for its compute-context-length "
        "specializations"]
    assert not (tmp_path / "a").exists()
    res = runner.invoke(main, base + ["-o", str(tmp_path / "b"), "--ccl", "16,32,64"])
    assert res.exit_code == 0, res.output
    spec = json.loads((tmp_path / "b" / "specializations.json").read_text())["specializations"]
    assert [s["comp_ctx_lengths"] for s in spec] == ["16", "32", "64"] * 2
    res = runner.invoke(main, base + ["-o", str(tmp_path / "c"), "--ccl", "32,16"])
    assert res.exit_code == 2 and "strictly increasing" in res.output
    res = runner.invoke(main, ["compile-config", str(plain.onnx_path), "--prefill-seq-len", "8", "--ctx-len", "64",
                               "-o", str(tmp_path / "d"), "--ccl", "auto"])
    assert res.exit_code == 2 and "has no comp_ctx_lengths input; --ccl does not apply" in res.output
    assert not (tmp_path / "d").exists()
