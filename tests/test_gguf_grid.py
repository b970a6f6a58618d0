"""``--weights int4 --gguf-grid`` (issue 21, build item 4): MatMul weights whose GGUF type maps onto MatMulNBits
exactly (Q4_0: ``d * (q - 8)``, zero point 8) take the GGUF's own blocks, and onnxruntime's dequantized weights
are bit-identical to gguf's own dequantization; weights of other types (Q4_1 here) are requantized and reported
with the reason; the refusals. The GGUF is written in the test with the ``gguf`` package's writer (seeded)."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from qeff_kv.errors import ExportError  # noqa: E402
from qeff_kv.export.gguf_grid import FITS, WHY_NOT, plan  # noqa: E402
from qeff_kv.export.quantize import quantize_graph  # noqa: E402
from qeff_kv.export.schemes import WeightScheme  # noqa: E402

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
    assert by_out["y_W_up"].op_type == by_out["y_W_free"].op_type == "MatMulNBits"
    assert not by_out["y_W_up"].input[1].endswith("_gguf")
    # onnxruntime's dequantized weights (x = identity: y = 1 * w, exact in float32) equal gguf's, bit for bit
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    eye = np.eye(K, dtype=np.float32)
    got = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {"x": eye})))
    for name in ("W_q", "W_kv"):
        assert np.array_equal(got[f"y_{name}"], files["weights"][name]), name
    # the requantized Q4_1 weight is not (RTN int4 on another grid)
    assert not np.array_equal(got["y_W_up"], files["weights"]["W_up"])
    # and a MatMul's output on real activations matches the float product to float32 rounding
    x = np.random.default_rng(3).standard_normal((5, K)).astype(np.float32)
    y = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {"x": x})))
    np.testing.assert_allclose(y["y_W_q"], x @ files["weights"]["W_q"], rtol=1e-5, atol=1e-5)


def test_the_report_says_what_fits_and_why_not(files):
    _, _, report = _quantized(files)
    assert report["gguf_types"] == {"Q4_0": 3, "Q4_1": 1}
    assert report["fitted"]["weights"] == 2
    assert report["fitted"]["gguf_tensors"] == ["blk.0.attn_k.weight", "blk.0.attn_q.weight", "blk.0.attn_v.weight"]
    assert report["fitted"]["how"] == {"Q4_0": FITS["Q4_0"]}
    assert report["requantized"] == [{"type": "Q4_1", "gguf_tensors": 1, "why": WHY_NOT["Q4_1"],
                                      "examples": ["blk.0.ffn_up.weight"]}]
    assert report["not_from_gguf"] == ["W_free"] and report["not_taken"] == []


def test_q4_1_zero_points_are_not_integers(files):
    """Why Q4_1 does not fit, measured on its blocks: -m/d is an integer in [0, 15] in (almost) no block."""
    reader = gguf.GGUFReader(str(files["gguf"]))
    [t] = [t for t in reader.tensors if t.tensor_type == Q.Q4_1]
    blocks = np.asarray(t.data).reshape(-1, 20)
    d = blocks[:, 0:2].copy().view(np.float16)[:, 0].astype(np.float64)
    m = blocks[:, 2:4].copy().view(np.float16)[:, 0].astype(np.float64)
    zp = -m / d
    fits = (zp == np.round(zp)) & (zp >= 0) & (zp <= 15)
    assert fits.mean() < 0.05
    assert plan({"W_up": files["weights"]["W_up"]}, files["gguf"]).fitted == {}


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
