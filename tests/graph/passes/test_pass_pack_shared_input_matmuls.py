"""PackSharedInputMatMulsPass: MatMul / MatMulNBits nodes reading one input become one node and a Split; each
Split output equals the original node's output (onnxruntime before and after, exactly), nodes that must stay
are left alone, and on real exports (float and int4, onnxruntime-fused) greedy tokens equal the unpacked
graph's and ``check`` passes."""

from __future__ import annotations

import shutil

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from suite import requires_torch
from qeff_kv.errors import PassInvariantError
from qeff_kv.graph import graphio
from qeff_kv.graph.passes import PackSharedInputMatMulsPass

RNG = np.random.default_rng(0)
K, BLOCK = 64, 32


def _model(nodes, inputs, outputs, inits=()) -> ir.Model:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    return ir.serde.deserialize_model(proto)


def _run(model: ir.Model, feeds: dict) -> dict[str, np.ndarray]:
    proto = ir.serde.serialize_model(model)
    proto.ir_version = 8
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


def _ops(model: ir.Model) -> list[str]:
    return [n.op_type for n in model.graph]


def _outs(names):
    return [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in names]


def _h():
    return [helper.make_tensor_value_info("h", TensorProto.FLOAT, ["B", "S", K])]


FEEDS = {"h": RNG.standard_normal((1, 5, K)).astype(np.float32)}


def test_float_matmuls_packed_each_output_unchanged():
    # three projections of h (q/k/v-like widths), each read by its own node; one MatMul of another input stays
    ws = {f"W{i}": RNG.standard_normal((K, n)).astype(np.float32) for i, n in enumerate((48, 16, 16))}
    ws["Wx"] = RNG.standard_normal((K, 8)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["h", f"W{i}"], [f"p{i}"]) for i in range(3)]
    nodes += [helper.make_node("Relu", ["h"], ["r"]), helper.make_node("MatMul", ["r", "Wx"], ["px"])]
    nodes += [helper.make_node("Sigmoid", [f"p{i}"], [f"y{i}"]) for i in range(3)]
    nodes += [helper.make_node("Add", ["p1", "p2"], ["y12"])]   # a second reader of two outputs
    model = _model(nodes, _h(), _outs(["y0", "y1", "y2", "y12", "px"]),
                   [onnx.numpy_helper.from_array(v, k) for k, v in ws.items()])
    before = _run(model, FEEDS)
    p = PackSharedInputMatMulsPass()
    assert p(model).modified and p.packed == [3]
    assert _ops(model).count("MatMul") == 2 and _ops(model).count("Split") == 1
    after = _run(model, FEEDS)
    assert [o.name for o in model.graph.outputs] == ["y0", "y1", "y2", "y12", "px"]
    for name in before:
        np.testing.assert_array_equal(after[name], before[name])


def test_graph_outputs_other_k_and_lone_nodes_stay():
    w1, w2 = RNG.standard_normal((K, 8)).astype(np.float32), RNG.standard_normal((K, 8)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["h", "W1"], ["p1"]),           # a graph output: stays
             helper.make_node("MatMul", ["h", "W2"], ["p2"]),           # then alone in its group: stays
             helper.make_node("Relu", ["p2"], ["y2"])]
    model = _model(nodes, _h(), _outs(["p1", "y2"]),
                   [onnx.numpy_helper.from_array(w1, "W1"), onnx.numpy_helper.from_array(w2, "W2")])
    assert not PackSharedInputMatMulsPass()(model).modified
    # a weight read as an input (not a constant) is not packed either
    nodes = [helper.make_node("MatMul", ["h", "W1"], ["p1"]), helper.make_node("MatMul", ["h", "Wi"], ["p2"]),
             helper.make_node("Add", ["p1", "p2"], ["y"])]
    model = _model(nodes, _h() + [helper.make_tensor_value_info("Wi", TensorProto.FLOAT, [K, 8])], _outs(["y"]),
                   [onnx.numpy_helper.from_array(w1, "W1")])
    assert not PackSharedInputMatMulsPass()(model).modified


def _nbits(name: str, n: int, zero_points: bool, scales_2d: bool = False):
    kb = K // BLOCK
    b = RNG.integers(0, 256, (n, kb, BLOCK // 2), dtype=np.uint8)
    s = (RNG.random((n, kb) if scales_2d else (n * kb,)) * 0.1 + 0.01).astype(np.float32)
    inits = [onnx.numpy_helper.from_array(b, f"{name}_B"), onnx.numpy_helper.from_array(s, f"{name}_s")]
    ins = ["h", f"{name}_B", f"{name}_s"]
    if zero_points:
        zp = RNG.integers(0, 256, (n, (kb + 1) // 2), dtype=np.uint8)
        inits.append(onnx.numpy_helper.from_array(zp, f"{name}_zp"))
        ins.append(f"{name}_zp")
    node = helper.make_node("MatMulNBits", ins, [f"p_{name}"], domain="com.microsoft", K=K, N=n, bits=4,
                            block_size=BLOCK, accuracy_level=4)
    return node, inits


@pytest.mark.parametrize("zero_points", [False, True])
def test_matmulnbits_packed_each_output_unchanged(zero_points):
    # gate/up-like pair plus a third reader of h; the packed node keeps K, bits, block_size, accuracy_level
    parts = [_nbits(nm, n, zero_points) for nm, n in (("gate", 96), ("up", 96), ("third", 32))]
    nodes = [p[0] for p in parts] + [helper.make_node("Sigmoid", ["p_gate"], ["sg"]),
                                     helper.make_node("Mul", ["sg", "p_up"], ["y"]),
                                     helper.make_node("Relu", ["p_third"], ["z"])]
    model = _model(nodes, _h(), _outs(["y", "z"]), [t for p in parts for t in p[1]])
    before = _run(model, FEEDS)
    p = PackSharedInputMatMulsPass()
    assert p(model).modified and p.packed == [3]
    packed = [n for n in model.graph if n.op_type == "MatMulNBits"]
    assert len(packed) == 1
    attrs = {a.name: a.value for a in packed[0].attributes.values()}
    assert attrs == {"K": K, "N": 224, "bits": 4, "block_size": BLOCK, "accuracy_level": 4}
    assert len([v for v in packed[0].inputs if v is not None]) == (4 if zero_points else 3)
    after = _run(model, FEEDS)
    for name in before:
        np.testing.assert_array_equal(after[name], before[name])


def test_matmulnbits_of_different_layouts_not_mixed():
    a, ia = _nbits("a", 32, False)
    b, ib = _nbits("b", 32, False, scales_2d=True)
    c, ic = _nbits("c", 32, True)
    model = _model([a, b, c, helper.make_node("Sum", ["p_a", "p_b", "p_c"], ["y"])], _h(), _outs(["y"]),
                   ia + ib + ic)
    assert not PackSharedInputMatMulsPass()(model).modified


# ------------------------------------------------------------------------------------------ real exports
PROMPT = [5, 17, 42, 99, 13, 7, 101, 64, 3, 77, 21]


@pytest.fixture(scope="module")
def unpacked(tmp_path_factory):
    """onnxruntime-fused exports, float and int4, made with the pass switched off (what exporter version 7 made
    of gate/up), and one int4 export as shipped (the pass on)."""
    from hf_models import make_model_dir

    from qeff_kv.export import export_model

    root = tmp_path_factory.mktemp("pack")
    src = make_model_dir("llama", root / "hf", seed=3, vocab_size=256, tie_word_embeddings=True)
    out = {"shipped": export_model(src, root / "shipped", ctx_len=32, prefill_seq_len=4,
                                   target="onnxruntime-fused", weights="int4", verify=False)}
    saved = PackSharedInputMatMulsPass.dtypes
    PackSharedInputMatMulsPass.dtypes = ()   # applies to no dtype: the target's pipeline leaves it out
    try:
        for key, w in (("float", None), ("int4", "int4")):
            out[key] = export_model(src, root / key, ctx_len=32, prefill_seq_len=4, target="onnxruntime-fused",
                                    weights=w, verify=False)
    finally:
        PackSharedInputMatMulsPass.dtypes = saved
    return out


def _greedy(path) -> list[int]:
    from qeff_kv.runtime import Session

    sess = Session(path)
    assert sess.inplace
    return sess.generate(PROMPT, max_new_tokens=8)[0].tokens


def _packed_copy(export, dst) -> tuple[object, PackSharedInputMatMulsPass]:
    shutil.copytree(export.out_dir, dst)
    path = dst / export.onnx_path.name
    model = graphio.load(path)
    p = PackSharedInputMatMulsPass()
    p(model)
    graphio.save(model, path, source_dir=dst)
    return path, p


@requires_torch
@pytest.mark.parametrize("key,op", [("float", "MatMul"), ("int4", "MatMulNBits")])
def test_packed_export_tokens_equal_unpacked(unpacked, key, op, tmp_path):
    from qeff_kv.tools.check import check

    path, p = _packed_copy(unpacked[key], tmp_path / key)
    layers = 2
    assert p.packed == [2] * layers   # gate/up of every layer (q/k/v are already one projection for GQA)
    count = lambda m: sum(1 for n in m.graph if n.op_type == op)  # noqa: E731
    assert count(graphio.load(path)) == count(graphio.load(unpacked[key].onnx_path)) - layers
    assert _greedy(path) == _greedy(unpacked[key].onnx_path)
    report = check(path)
    assert report.ok, report.format_text()


@requires_torch
def test_shipped_int4_export_is_packed(unpacked):
    from qeff_kv.tools.check import check

    shipped = graphio.load(unpacked["shipped"].onnx_path)
    plain = graphio.load(unpacked["int4"].onnx_path)
    nbits = lambda m: sum(1 for n in m.graph if n.op_type == "MatMulNBits")  # noqa: E731
    assert nbits(shipped) == nbits(plain) - 2 and sum(1 for n in shipped.graph if n.op_type == "Split") == 2
    assert _greedy(unpacked["shipped"].onnx_path) == _greedy(unpacked["int4"].onnx_path)
    assert check(unpacked["shipped"].onnx_path).ok


# ------------------------------------------------------------------------------------------------ ensures
def _two_projections() -> ir.Model:
    ws = {f"W{i}": RNG.standard_normal((K, 8)).astype(np.float32) for i in range(2)}
    nodes = [helper.make_node("MatMul", ["h", f"W{i}"], [f"p{i}"], name=f"proj{i}") for i in range(2)]
    nodes += [helper.make_node("Relu", [f"p{i}"], [f"y{i}"]) for i in range(2)]
    return _model(nodes, _h(), _outs(["y0", "y1"]), [onnx.numpy_helper.from_array(v, k) for k, v in ws.items()])


def test_ensures_refuses_projections_of_one_input_left_separate():
    class Idle(PackSharedInputMatMulsPass):
        def call(self, model):
            return ir.passes.PassResult(model, modified=False)

    with pytest.raises(PassInvariantError, match=r"^PackSharedInputMatMulsPass broke its invariant: the nodes "
                                                 r"proj0, proj1 still read one input separately$"):
        Idle()(_two_projections())
    p = PackSharedInputMatMulsPass()
    assert p(_two_projections()).modified and p.packed == [2]   # the real pass: ensures holds


def test_ensures_refuses_a_dropped_graph_output():
    class Drops(PackSharedInputMatMulsPass):
        def call(self, model):
            result = super().call(model)
            model.graph.outputs.pop()
            return result

    with pytest.raises(PassInvariantError, match=r"it changed the graph outputs \(y0, y1 -> y0\)$"):
        Drops()(_two_projections())
