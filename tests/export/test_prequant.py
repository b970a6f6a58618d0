"""Pre-quantized int4 checkpoints (issue 39, item 2): AWQ GEMM, GPTQ (v1/v2, symmetric/asymmetric, with and without
act-order ``g_idx``) and compressed-tensors ``pack-quantized`` exported to ``MatMulNBits`` with their own scales,
zero points and groups. The checkpoints are written here (tests/helpers/prequant_checkpoints.py, from the formats'
published descriptions); the proofs: detection and one-line refusals; the unpacked integers equal the ones the test
packed; onnxruntime's dequantization of the repacked blocks equals the format's ``scale * (q - zero)`` bit for bit;
exported graphs give transformers' greedy tokens on the dequantized weights."""

from __future__ import annotations

import json

import numpy as np
import pytest

from suite import requires_torch
from qeff_kv.errors import ExportError
from qeff_kv.export.weights import prequant

PROMPT = [5, 17, 42, 99, 13, 7, 101, 64, 3, 77, 21]
CTX, CHUNK, NEW = 32, 4, 8

#: name -> (kind, make_checkpoint options)
CASES = {
    "awq-g32": ("awq", dict(group=32)),
    "gptq-sym-v1-g32": ("gptq", dict(group=32, sym=True, v1=True)),
    "gptq-asym-v1-perchannel": ("gptq", dict(group=-1, sym=False, v1=True)),
    "gptq-asym-v2-actorder-g32": ("gptq", dict(group=32, sym=False, v1=False, act_order=True)),
    "gptq-sym-v1-actorder-g16": ("gptq", dict(group=16, sym=True, v1=True, act_order=True)),
    "ct-sym-g32": ("compressed-tensors", dict(group=32, sym=True)),
    "ct-asym-channel": ("compressed-tensors", dict(group=-1, sym=False)),
    "ct-asym-actorder-g32": ("compressed-tensors", dict(group=32, sym=False, act_order=True)),
    # Qwen2 (q/k/v biases), one Linear left in float16 by the checkpoint (AWQ's modules_to_not_convert)
    "awq-qwen2-bias-skip": ("awq", dict(group=32, arch="qwen2", keep_float=("model.layers.1.mlp.down_proj",))),
}


# ------------------------------------------------------------------------------------------------ detection
def _cfg(qc):
    return {"architectures": ["LlamaForCausalLM"], "quantization_config": qc}


def test_detection_reads_each_layout():
    from prequant_checkpoints import quantization_config as qc

    assert prequant.detect({"architectures": ["LlamaForCausalLM"]}) is None
    s = prequant.detect(_cfg(qc("awq", 128, False, False)))
    assert (s.format, s.group_size, s.symmetric, s.zeros_minus_one, s.layout, s.block_size) == \
        ("awq", 128, False, False, "gemm", 128)
    s = prequant.detect(_cfg(qc("gptq", 32, True, True, v1=True)))
    assert (s.format, s.symmetric, s.act_order, s.zeros_minus_one, s.layout) == ("gptq", True, True, True, "gptq")
    s = prequant.detect(_cfg(qc("gptq", -1, False, False, v1=False)))
    assert (s.group_size, s.zeros_minus_one, s.layout, s.block_size) == (-1, False, "gptq_v2", None)
    s = prequant.detect(_cfg(qc("compressed-tensors", 64, False, True)))
    assert (s.format, s.group_size, s.symmetric, s.act_order, s.layout) == \
        ("compressed-tensors", 64, False, True, "pack-quantized")
    assert prequant.detect(_cfg(qc("compressed-tensors", -1, True, False))).group_size == -1
    assert prequant.detect(_cfg(qc("awq", 256, False, False))).block_size == 128   # two blocks per group
    assert prequant.detect(_cfg(qc("gptq", 96, False, False))).block_size == 32    # three blocks per group


def _ct(**weights):
    from prequant_checkpoints import quantization_config as qc

    cfg = qc("compressed-tensors", 32, True, False)
    cfg["config_groups"]["group_0"]["weights"].update(weights)
    return cfg


REFUSALS = [
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "a 8-bit GPTQ checkpoint is not read: the exporter "
     "takes 4-bit checkpoints' own blocks into MatMulNBits (bits 4)"),
    ({"quant_method": "awq", "bits": 3, "group_size": 128}, "a 3-bit AWQ checkpoint is not read"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"},
     "an AWQ checkpoint with version 'gemv' is not read: only the GEMM packing (version 'gemm') is known exactly "
     "(GEMV and exllama/marlin/ipex layouts are kernel-specific)"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "exllama"},
     "an AWQ checkpoint with version 'exllama' is not read"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
     "a GPTQ checkpoint in format 'marlin' is not read: only the gptq (v1) and gptq_v2 layouts are known exactly "
     "(marlin, bitblas and exllama layouts are kernel-specific)"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 24}, "a group of 24 values is not a whole number of "
     "MatMulNBits blocks (a power of two >= 16 must divide it)"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quantization_config quant_method 'bitsandbytes' is not "
     "read (the exporter reads int4 awq, gptq, compressed-tensors checkpoints)"),
    ({**_ct(), "format": "float-quantized"}, "a compressed-tensors checkpoint in format 'float-quantized' is not "
     "read: only 'pack-quantized' int4 weights map onto MatMulNBits"),
    (_ct(num_bits=8), "a 8-bit compressed-tensors checkpoint is not read"),
    (_ct(strategy="tensor"), "compressed-tensors weights with strategy 'tensor' are not read (group or channel)"),
    ({**_ct(), "config_groups": {"g": {"targets": ["Linear"], "input_activations": {"num_bits": 8},
                                       "weights": _ct()["config_groups"]["group_0"]["weights"]}}},
     "compressed-tensors config group 'g' quantizes activations too: only weight-only (W4A16) checkpoints map onto "
     "MatMulNBits"),
]


@pytest.mark.parametrize("qc,message", REFUSALS, ids=[m.split(":")[0][:40] for _, m in REFUSALS])
def test_unsupported_variants_are_refused_in_one_line(qc, message):
    with pytest.raises(ExportError) as exc:
        prequant.detect(_cfg(qc))
    assert str(exc.value).startswith(message) and "\n" not in str(exc.value)


# ------------------------------------------------------------------------------------------- checkpoints
@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    pytest.importorskip("torch")
    from prequant_checkpoints import make_checkpoint

    made = {}

    def get(name):
        if name not in made:
            kind, kw = CASES[name]
            made[name] = make_checkpoint(kind, tmp_path_factory.mktemp(name), seed=1, **kw)
        return made[name]

    return get


@requires_torch
@pytest.mark.parametrize("name", list(CASES))
def test_unpacking_gives_the_integers_the_checkpoint_packed(checkpoints, name):
    from qeff_kv.export.weights.prequant.folder import Tensors, quantized_linears

    ck = checkpoints(name)
    scheme = prequant.detect(json.loads((ck.folder / "config.json").read_text()))
    got = {ql.name: ql for ql in quantized_linears(Tensors(ck.folder), scheme)}
    assert sorted(got) == sorted(ck.linears)
    for mod, want in ck.linears.items():
        ql = got[mod]
        assert np.array_equal(ql.q, want.q) and np.array_equal(ql.zeros, want.zeros), mod
        assert np.array_equal(ql.scales, want.scales.astype(np.float32)), mod
        assert np.array_equal(ql.groups, want.g_idx), mod
        assert np.array_equal(ql.dequantize(), want.dequantize()), mod   # the exact float32 products


def _two_linear_graph(path, w_a, w_b):
    """A float graph as a fused target lays them out: ``y = x @ [W_a | W_b]`` (two Linears packed side by side) and
    ``z = x @ W_a`` alone."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    k = w_a.shape[1]
    packed = np.concatenate([w_a, w_b]).T.copy()
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", k])
    outs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", packed.shape[1]]),
            helper.make_tensor_value_info("z", TensorProto.FLOAT, ["n", w_a.shape[0]])]
    nodes = [helper.make_node("MatMul", ["x", "W_packed"], ["y"], name="mm_packed"),
             helper.make_node("MatMul", ["x", "W_a"], ["z"], name="mm_a")]
    graph = helper.make_graph(nodes, "g", [x], outs, [numpy_helper.from_array(packed, "W_packed"),
                                                      numpy_helper.from_array(w_a.T.copy(), "W_a")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.save(model, str(path))


@requires_torch
@pytest.mark.parametrize("name", list(CASES))
def test_matmulnbits_dequantizes_to_the_checkpoints_weights_bit_for_bit(checkpoints, name, tmp_path):
    import onnx_ir as ir
    import onnxruntime as ort

    from qeff_kv.export.weights.prequant import graph

    ck = checkpoints(name)
    a, b = ck.linears["model.layers.0.self_attn.q_proj"], ck.linears["model.layers.0.self_attn.k_proj"]
    _two_linear_graph(tmp_path / "float.onnx", a.dequantize(), b.dequantize())
    report = {}
    model = graph.apply(tmp_path / "float.onnx", ck.folder, graph.folder_scheme(ck.folder), 1, report=report)
    ir.save(model, str(tmp_path / "q.onnx"))
    ops = [n.op_type for n in model.graph]
    act_order = CASES[name][1].get("act_order", False)
    assert ops.count("MatMulNBits") == (3 if act_order else 2) and "MatMul" not in ops
    assert ops.count("Gather") == (2 if act_order else 0)       # one per distinct (input, order): q's and k's
    assert ops.count("Concat") == (1 if act_order else 0)       # q and k read the input in different orders
    sess = ort.InferenceSession(str(tmp_path / "q.onnx"), providers=["CPUExecutionProvider"])
    eye = np.eye(a.q.shape[1], dtype=np.float32)
    y, z = sess.run(["y", "z"], {"x": eye})
    want = np.concatenate([a.dequantize(), b.dequantize()]).T
    assert np.array_equal(y, want) and np.array_equal(z, a.dequantize().T)    # bit for bit
    assert report["linears_taken"] == 2 and report["kept_float"] == []


# -------------------------------------------------------------------------------------------- export parity
#: (case, target, accuracy level: None is the default 4, int8 activations; 1 keeps them float32)
PARITY = [("awq-g32", "onnxruntime", None), ("gptq-sym-v1-g32", "onnxruntime", None),
          ("gptq-asym-v1-perchannel", "onnxruntime", None), ("gptq-asym-v2-actorder-g32", "onnxruntime-fused", None),
          ("gptq-sym-v1-actorder-g16", "onnxruntime", 1), ("ct-sym-g32", "onnxruntime", None),
          ("ct-asym-channel", "onnxruntime-fused", 1), ("ct-asym-actorder-g32", "onnxruntime-fused", None),
          ("awq-qwen2-bias-skip", "onnxruntime", None)]


@requires_torch
@pytest.mark.parametrize("name,target,acc", PARITY)
def test_export_gives_transformers_greedy_tokens_on_the_dequantized_weights(checkpoints, name, target, acc, tmp_path):
    from hf_models import PlainLoop, hf_greedy

    from qeff_kv.export import export_model

    ck = checkpoints(name)
    res = export_model(ck.folder, tmp_path / "ex", ctx_len=CTX, prefill_seq_len=CHUNK, target=target,
                       accuracy_level=acc)
    w = res.manifest["weights"]
    if acc == 1:   # float32 activations: the same weights as the float graph, only the order of the sums differs
        assert w["check"]["top1_agreement"] == 1.0 and w["check"]["max_abs_logit_diff"] < 1e-4
    kind = CASES[name][0]
    assert w["scheme"] == "int4" and w["prequantized"]["format"] == kind
    assert w["zero_points"] is not w["symmetric"]   # the checkpoint's scheme, not --zero-points' default
    skipped = len(CASES[name][1].get("keep_float", ()))
    assert w["prequantized"]["linears"] == w["prequantized"]["linears_taken"] == 14 - skipped
    assert w["prequantized"]["linears_not_taken"] == [] and w["quantizer"].startswith("none: the checkpoint's own")
    assert len(w["prequantized"]["kept_float"]) == skipped   # the checkpoint's float Linear stays float
    assert res.manifest["verification"]["status"] == "passed"
    import onnx

    proto = onnx.load(str(res.onnx_path), load_external_data=False)
    inits = {t.name for t in proto.graph.initializer}
    ops = [n.op_type for n in proto.graph.node]
    assert ops.count("MatMulNBits") >= 8      # 7 Linears per layer, fewer nodes where a fused target packed them
    # the head reads the vocabulary table through a Gemm; no other MatMul reads a float weight but a float Linear's
    assert len([n for n in proto.graph.node if n.op_type == "MatMul" and n.input[1] in inits]) == skipped
    assert PlainLoop(res.onnx_path, CTX).greedy(PROMPT, NEW, CHUNK) == hf_greedy(ck.reference, PROMPT, NEW)


# ------------------------------------------------------------------------------------------------- refusals
@requires_torch
def test_export_refusals_name_the_checkpoint_and_the_flag(checkpoints):
    from qeff_kv.export import export_model

    ck = checkpoints("gptq-sym-v1-g32")
    what = f"{ck.folder.name} is a pre-quantized gptq (gptq) int4, groups of 32, symmetric checkpoint"
    for kw, tail in ((dict(target="portable"), ": its weights become onnxruntime's MatMulNBits, which the portable "
                      "target cannot hold; use --target onnxruntime or onnxruntime-fused"),
                     (dict(target="onnxruntime", weights="int8"), ": --weights int8 would requantize it; export it "
                      "without --weights"),
                     (dict(target="onnxruntime", block_size=64), ": its blocks are its own (32); --block-size 64 "
                      "cannot change them"),
                     (dict(target="onnxruntime", dtype="float16"), ": its dequantized weights scale * (q - zero) "
                      "need float32 (up to 15 significant bits; float16 would round them); use --dtype float32")):
        with pytest.raises(ExportError) as exc:
            export_model(ck.folder, "/nonexistent/never-written", **kw)
        assert str(exc.value) == what + tail


@requires_torch
def test_gptq_v1_zero_point_that_wrapped_is_refused(tmp_path):
    from prequant_checkpoints import Quantized, gptq_tensors

    from qeff_kv.export.weights.prequant import gptq

    k, n = 32, 8
    ql = Quantized(np.zeros((n, k), np.uint8), np.zeros((n, 1), np.uint8), np.ones((n, 1), np.float32),
                   np.zeros(k, np.int64))
    parts = gptq_tensors(ql, v1=True)          # zero point 0 stored as -1
    scheme = prequant.detect(_cfg({"quant_method": "gptq", "bits": 4, "group_size": 32}))
    with pytest.raises(ExportError) as exc:
        gptq.read("m", lambda key: parts[key.split(".")[-1]], scheme)
    assert str(exc.value) == ("m: a GPTQ v1 zero point of 0 was stored as -1 (it reads back as 16, which no 4-bit "
                              "zero point holds); re-save the checkpoint in gptq_v2 format")


@requires_torch
def test_cli_exports_the_checkpoint_without_a_flag_and_refuses_portable_in_one_line(checkpoints, tmp_path):
    from click.testing import CliRunner

    from qeff_kv_cli.main import main

    ck = checkpoints("ct-sym-g32")
    res = CliRunner().invoke(main, ["export", str(ck.folder), "-o", str(tmp_path / "p"), "--ctx-len", str(CTX)])
    assert res.exit_code == 2 and not (tmp_path / "p").exists()
    assert res.stderr.strip() == (
        f"error: {ck.folder.name} is a pre-quantized compressed-tensors (pack-quantized) int4, groups of 32, "
        "symmetric checkpoint: its weights become onnxruntime's MatMulNBits, which the portable target cannot hold; "
        "use --target onnxruntime or onnxruntime-fused")
    res = CliRunner().invoke(main, ["export", str(ck.folder), "-o", str(tmp_path / "o"), "--ctx-len", str(CTX),
                                    "--prefill-seq-len", str(CHUNK), "--target", "onnxruntime"])
    assert res.exit_code == 0, res.output
    manifest = json.loads((tmp_path / "o" / "manifest.json").read_text())
    assert manifest["weights"]["prequantized"]["format"] == "compressed-tensors"
    assert manifest["options"]["prequant"] == "compressed-tensors" and manifest["options"]["weights"] == "int4"
