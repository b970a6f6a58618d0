"""The streaming export (issue 39, qeff_kv/export/weights/stream.py): captured without the weights, each weight read from
the checkpoint when the graph is written, verified with a reference that holds one module's weights at a time.

Proofs: the graphs are the same as the whole-model path's (nodes, names, initializer bytes), from sharded bf16
checkpoints too; the checkpoint store never has more than a few tensors alive at once while the model has many;
the reference is the same as transformers' on the loaded model; verification that cannot fit is refused in one line.
"""

from __future__ import annotations


import numpy as np
import pytest

from onnx_digest import graph_digest
from suite import requires_torch

pytestmark = requires_torch


@pytest.fixture(scope="module")
def sharded_bf16(tmp_path_factory):
    """A tiny seeded Llama saved in bf16 over several shards (model.safetensors.index.json), untied head."""
    import torch
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   tie_word_embeddings=False)
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():   # norms away from 1.0 (two layers keep equal ones: the exporter merges equal tensors)
        for i, layer in enumerate(model.model.layers):
            layer.input_layernorm.weight.uniform_(0.5, 1.5)
            if i > 0:
                layer.post_attention_layernorm.weight.copy_(model.model.layers[0].post_attention_layernorm.weight)
    out = tmp_path_factory.mktemp("stream") / "llama-bf16"
    model.to(torch.bfloat16).save_pretrained(out, max_shard_size="40KB")
    assert (out / "model.safetensors.index.json").is_file() and len(list(out.glob("*.safetensors"))) > 2
    return out


@pytest.mark.parametrize("target,dtype", [("portable", "float32"), ("onnxruntime-fused", "float32"),
                                          ("onnxruntime", "float16")])
def test_streamed_graph_is_the_whole_model_graph(sharded_bf16, tmp_path, monkeypatch, target, dtype):
    from qeff_kv.export import export_model
    from qeff_kv.export.weights import checkpoint_store as weights

    monkeypatch.setattr(weights, "CHUNK_BYTES", 200)   # the identity hashed a few rows at a time: the same digest
    kw = dict(ctx_len=32, prefill_seq_len=8, target=target, dtype=dtype)
    monkeypatch.setenv("QEFF_KV_EXPORT_STREAM", "0")
    old_notes: list[str] = []
    old = export_model(sharded_bf16, tmp_path / "old", verify=False, progress=old_notes.append, **kw)
    assert not any("without its weights" in n for n in old_notes)
    monkeypatch.setenv("QEFF_KV_EXPORT_STREAM", "1")
    notes: list[str] = []
    new = export_model(sharded_bf16, tmp_path / "new", progress=notes.append, **kw)
    assert any(n.startswith("building llama-bf16 without its weights") for n in notes)
    assert graph_digest(old.onnx_path) == graph_digest(new.onnx_path)
    assert old.manifest["checkpoint"] == new.manifest["checkpoint"]
    assert new.manifest["verification"]["status"] == "passed"


@pytest.mark.parametrize("target,weights,external", [("onnxruntime", "int8", False),
                                                     ("onnxruntime-fused", "int4", True),
                                                     ("onnxruntime", "int4-zp", False)])
def test_streamed_quantization_is_the_whole_graph_quantizer(sharded_bf16, tmp_path, monkeypatch, target, weights,
                                                            external):
    """--weights quantized as the weights stream from the checkpoint (qeff_kv/export/weights/quantize_stream.py; no float
    graph written or checked): the same nodes, initializer names, order and bytes as onnxruntime's whole-graph
    quantizer on the whole-model export's float graph; verified against the reference on the quantized then
    dequantized weights at float32's tolerance. ``external``: every graph written with external data (as a large
    model is). The blocks are computed a few columns at a time (CHUNK_BYTES): the same bytes."""
    import onnx

    from qeff_kv.export import export_model, options
    from qeff_kv.export.weights import quantize, quantize_stream

    if external:
        monkeypatch.setattr(options, "EXTERNAL_DATA_THRESHOLD", 0)
    monkeypatch.setattr(quantize_stream, "CHUNK_BYTES", 1000)

    weights, zp = weights.split("-")[0], weights.endswith("-zp")   # -zp: --zero-points (asymmetric blocks)
    kw = dict(ctx_len=32, prefill_seq_len=8, target=target, weights=weights, zero_points=zp or None)
    monkeypatch.setenv("QEFF_KV_EXPORT_STREAM", "0")
    monkeypatch.setattr(quantize, "STREAM", False)
    old = export_model(sharded_bf16, tmp_path / "old", verify=False, **kw)
    monkeypatch.setenv("QEFF_KV_EXPORT_STREAM", "1")
    monkeypatch.setattr(quantize, "STREAM", True)
    notes: list[str] = []
    new = export_model(sharded_bf16, tmp_path / "new", progress=notes.append, **kw)
    assert any(n.endswith("(packed as they are written)") for n in notes)
    assert not any("streaming is not possible" in n for n in notes)
    assert (new.onnx_path.parent / (new.onnx_path.name + ".data")).is_file() == external
    digest = graph_digest(new.onnx_path)
    assert any(n[0] == "MatMulNBits" for n in digest["nodes"])
    assert graph_digest(old.onnx_path) == digest
    a, b = onnx.load(str(old.onnx_path), load_external_data=False), onnx.load(str(new.onnx_path),
                                                                               load_external_data=False)
    assert [(o.domain, o.version) for o in a.opset_import] == [(o.domain, o.version) for o in b.opset_import]
    assert any(n.op_type == "MatMulNBits" and len(n.input) > 3 and n.input[3] for n in b.graph.node) is zp
    assert {p.key: p.value for p in a.metadata_props} == {p.key: p.value for p in b.metadata_props}
    assert old.manifest["checkpoint"] == new.manifest["checkpoint"]
    # no float graph: quantized before it is written, never compared with a float graph
    assert not any("against the float graph" in n for n in notes)
    assert [n for n in notes if n.startswith(("quantized ", "verifying"))][0].startswith("quantized ")
    ver = new.manifest["verification"]
    assert ver["status"] == "passed" and ver["rtol"] == 1e-3 and ver["max_abs_diff"] <= ver["tolerance"]
    assert ver["reference"].startswith(f"PyTorch on the checkpoint's weights quantized to {weights} and dequantized")
    # the float weights' bytes, though no float graph was written
    assert new.manifest["weights"]["float_graph_bytes"] > new.manifest["weights"]["graph_bytes"]


def test_each_weight_is_quantized_once(sharded_bf16, tmp_path, monkeypatch):
    """One quantization per weight (issue 51): the blocks the streamed reference packs (and dequantizes) are the
    blocks the writer writes (qeff_kv/export/weights/packed_spill.py): onnxruntime's ``qbits_block_quant`` runs
    once per packed weight of the graph, not once for the reference and again for the writer; the graph is byte for
    byte the one the writer packs itself (without verification, no reference: no spill)."""
    from onnxruntime.quantization import matmul_nbits_quantizer as mnq

    from qeff_kv.export import export_model

    calls = []
    real = mnq.DefaultWeightOnlyQuantizer.qbits_block_quant

    def counting(self, fp32weight):
        calls.append(tuple(fp32weight.shape))
        return real(self, fp32weight)

    monkeypatch.setattr(mnq.DefaultWeightOnlyQuantizer, "qbits_block_quant", counting)
    kw = dict(ctx_len=32, prefill_seq_len=8, target="onnxruntime-fused", weights="int4")
    alone = export_model(sharded_bf16, tmp_path / "alone", verify=False, **kw)
    # every column of every packed weight ([N, K/block, blob]; QKV and gate/up are packed: one weight each)
    columns = sum(t[2][0] for t in graph_digest(alone.onnx_path)["initializers"] if t[0].endswith("_Q4"))
    assert columns == 3 * (64 + 2 * 32 + 64 + 2 * 128 + 64) + 2 * 256
    assert sum(shape[1] for shape in calls) == columns   # the writer alone packs each column once
    calls.clear()
    both = export_model(sharded_bf16, tmp_path / "both", **kw)
    assert both.manifest["verification"]["status"] == "passed"
    # the reference packs each checkpoint weight (q, k and v apart), the writer writes those blocks: once
    assert len(calls) == 3 * 7 + 2 and sum(shape[1] for shape in calls) == columns
    assert graph_digest(both.onnx_path) == graph_digest(alone.onnx_path)


def test_a_corrupted_packed_block_fails_verification(sharded_bf16, tmp_path, monkeypatch):
    """The quantized graph is held to the quantize-dequantize reference: one packed block changed as the writer
    writes it (the first block of each column of the first weight the reference packed) fails verification, and
    nothing is written."""
    from qeff_kv.errors import VerificationError
    from qeff_kv.export import export_model
    from qeff_kv.export.weights.packed_spill import PackedSpill

    real = PackedSpill.take
    calls = []

    def corrupting(self, tensor, symmetric, transposed, dtype):
        got = real(self, tensor, symmetric, transposed, dtype)
        if got is not None and not calls:
            packed, scales, zp = got
            packed = packed.copy()
            packed[:, 0, :] ^= 0x77
            got = packed, scales, zp
        calls.append(got is not None)
        return got

    monkeypatch.setattr(PackedSpill, "take", corrupting)
    with pytest.raises(VerificationError, match=r"^verification failed after the prompt: logits differ from PyTorch "
                                                r"by up to \S+ \(tolerance 0\.001\); .* \(a streamed export: "
                                                r"QEFF_KV_EXPORT_STREAM=0 loads the whole model instead\)$"):
        export_model(sharded_bf16, tmp_path / "e", ctx_len=32, prefill_seq_len=8, target="onnxruntime-fused",
                     weights="int4")
    assert calls and not (tmp_path / "e" / "manifest.json").exists()


def test_dequantized_weights_are_what_matmulnbits_computes():
    """The reference's weights (quantize_stream.dequantized, rows a chunk at a time) equal onnxruntime's own
    MatMulNBits on the blocks the exporter packs, read back through an identity input."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from qeff_kv.export.weights import quantize_stream
    from qeff_kv.export.schemes import WeightScheme

    rng = np.random.default_rng(0)
    for scheme in (WeightScheme("int4", 32, 0), WeightScheme("int8", 16, 0)):
        w = rng.standard_normal((48, 80)).astype(np.float32)   # [out, in]; in is not a whole number of blocks
        quantizer = quantize_stream._quantizer(scheme, True)
        packed, scales, _zp = quantizer.qbits_block_quant(np.ascontiguousarray(w.T))
        node = helper.make_node("MatMulNBits", ["x", "w", "s"], ["y"], domain="com.microsoft", K=80, N=48,
                                bits=scheme.bits, block_size=scheme.block_size)
        graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [80, 80])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [80, 48])],
                                  [numpy_helper.from_array(packed, "w"), numpy_helper.from_array(scales, "s")])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                        helper.make_opsetid("com.microsoft", 1)])
        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        want = sess.run(None, {"x": np.eye(80, dtype=np.float32)})[0].T
        quantize_stream.CHUNK_BYTES, saved = 7 * 80 * 4, quantize_stream.CHUNK_BYTES
        try:
            got = quantize_stream.dequantized(w.copy(), scheme)
        finally:
            quantize_stream.CHUNK_BYTES = saved
        np.testing.assert_array_equal(got, want)
        assert 0 < np.abs(got - w).max() < (0.5 if scheme.bits == 4 else 0.05)


@pytest.mark.parametrize("quant", [None, "int4"])
def test_streaming_holds_a_bounded_number_of_checkpoint_tensors(sharded_bf16, tmp_path, monkeypatch, quant):
    """An instrumented store: every tensor it hands out is counted while alive; the exporter (identity, the
    verification reference, the lazy initializers, the fused target's packed weights; with ``--weights int4`` the
    dequantized reference and the blocks packed as written) never holds more than a few at once, while the model
    has many more."""
    from qeff_kv.export import export_model
    from qeff_kv.export.weights import checkpoint_store as weights

    stores = []
    original = weights.CheckpointStore.__init__

    def recording(self, folder):
        original(self, folder)
        stores.append(self)

    monkeypatch.setattr(weights.CheckpointStore, "__init__", recording)
    r = export_model(sharded_bf16, tmp_path / "e", ctx_len=32, prefill_seq_len=8, target="onnxruntime-fused",
                     weights=quant)
    assert r.manifest["verification"]["status"] == "passed"
    assert ("weights" in r.manifest) == (quant is not None)
    (store,) = stores
    tensors = len(store.keys())
    assert tensors == 3 * 9 + 3
    # every tensor read for the identity, again per reference step (int4: one pass, the decode tokens fixed in
    # advance), and once more when written; with int4 the packed weights are not read again: the writer writes the
    # blocks the reference packed (one quantization per weight)
    if quant is None:
        assert store.reads >= tensors * 3
    else:
        assert tensors * 2 < store.reads <= tensors * 2 + tensors - (3 * 7 + 2)
    assert store.max_live <= 3   # the packed QKV weight reads its three parts together
    assert store.live == 0


def test_streamed_reference_equals_the_loaded_model(sharded_bf16):
    """The skeleton with its weights streamed module by module gives transformers' own logits."""
    import torch
    import transformers

    from qeff_kv.export.weights import stream
    from qeff_kv.export.weights.checkpoint_store import CheckpointStore

    store = CheckpointStore(sharded_bf16)
    skel = stream.skeleton(sharded_bf16, torch.float32)
    plan = stream.plan(skel, store)
    ref = transformers.AutoModelForCausalLM.from_pretrained(sharded_bf16, dtype=torch.float32,
                                                            attn_implementation="eager").eval()
    ids = torch.tensor([[5, 17, 42, 99, 130, 7]])
    with torch.no_grad(), stream.streamed_weights(skel, plan, store):
        got = skel(input_ids=ids).logits
    with torch.no_grad():
        want = ref(input_ids=ids).logits
    np.testing.assert_array_equal(got.numpy(), want.numpy())
    assert store.live == 0
    # the skeleton's parameters hold one element per row, not the weights
    standin = dict(skel.named_parameters())["model.layers.0.mlp.up_proj.weight"]
    assert standin.shape == (128, 64) and standin.untyped_storage().nbytes() == 128 * 4


def test_checkpoint_that_does_not_match_by_name_loads_whole(sharded_bf16, tmp_path):
    """A checkpoint whose tensors are not the model's parameters by name: one line, then the whole-model path
    (which refuses it here: a parameter is missing)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from qeff_kv.errors import ExportError
    from qeff_kv.export import export_model

    bad = tmp_path / "renamed"
    bad.mkdir()
    shutil.copy(sharded_bf16 / "config.json", bad / "config.json")
    tensors = {}
    for f in sorted(sharded_bf16.glob("*.safetensors")):
        tensors.update(load_file(f))
    tensors["model.final_norm.weight"] = tensors.pop("model.norm.weight")
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    notes: list[str] = []
    with pytest.raises(ExportError, match=r"the weights do not match config.json: 1 tensors are missing"):
        export_model(bad, tmp_path / "e", ctx_len=32, prefill_seq_len=8, progress=notes.append)
    assert ("streaming is not possible (parameter model.norm.weight is not a tensor of the checkpoint under that "
            "name): loading the whole model") in notes


def test_verification_that_cannot_fit_is_refused_up_front(sharded_bf16, tmp_path, monkeypatch):
    from qeff_kv.support import limits
    from qeff_kv.errors import ExportError
    from qeff_kv.export import export_model

    monkeypatch.setattr(limits, "available_memory", lambda: 1 << 29)
    # streamed: three of the largest tensors (the float32 embedding, 256 x 64) and the 1 GiB margin
    with pytest.raises(ExportError, match=r"^verification needs about 1\.0 GiB and 0\.5 GiB is available: free "
                                          r"memory, or pass --no-verify to export without verification"):
        export_model(sharded_bf16, tmp_path / "e", ctx_len=32, prefill_seq_len=8)
    assert not (tmp_path / "e").exists() or not (tmp_path / "e" / "manifest.json").exists()
    r = export_model(sharded_bf16, tmp_path / "nv", ctx_len=32, prefill_seq_len=8, verify=False)
    assert r.manifest["verification"] == {"status": "skipped", "reason": "turned off (--no-verify)"}


def test_verification_runs_block_quantized_matmuls_on_float32_kernels(sharded_bf16, tmp_path):
    """Verification's runner computes the graph's MatMulNBits prepacked at accuracy level 1 (float32) through a
    copy of the proto beside the graph (the weights file shared, the copy removed once the session holds it):
    the same logits as the unpacked path, which ignores the level, to float32's rounding; the graph on disk keeps
    the level it ships."""
    import onnx

    from qeff_kv.export import export_model
    from qeff_kv.export.probe_runner import ProbeRunner, float32_kernels_copy

    res = export_model(sharded_bf16, tmp_path / "e", ctx_len=32, prefill_seq_len=8, target="onnxruntime-fused",
                       weights="int4")
    ver = res.manifest["verification"]
    assert ver["status"] == "passed" and ver["kernels"].startswith("onnxruntime's prepacked MatMulNBits at accuracy "
                                                                   "level 1 (float32 activations)")
    path = res.onnx_path
    levels = lambda m: {a.i for n in m.graph.node if n.op_type == "MatMulNBits"   # noqa: E731
                        for a in n.attribute if a.name == "accuracy_level"}
    assert levels(onnx.load(str(path), load_external_data=False)) == {4}
    copy, quantized = float32_kernels_copy(path)
    assert quantized and copy.parent == path.parent and levels(onnx.load(str(copy), load_external_data=False)) == {1}
    copy.unlink()
    before = sorted(p.name for p in path.parent.iterdir())
    runs = []
    for fast in (False, True):
        runner = ProbeRunner(path, 32, 1, float32_kernels=fast)
        runs.append([runner.step([5, 9, 3, 7, 1, 0, 0, 0], [0, 1, 2, 3, 4, -1, -1, -1], 0)]
                    + [runner.step([t], [5 + k], 0) for k, t in enumerate((11, 2, 40))])
    assert sorted(p.name for p in path.parent.iterdir()) == before   # the copy is gone
    np.testing.assert_allclose(np.array(runs[1]), np.array(runs[0]), rtol=0, atol=1e-4)
    assert np.abs(np.array(runs[0])).max() > 0.05
    m = onnx.load(str(path), load_external_data=False)   # a graph without block-quantized MatMuls: no copy
    for n in [n for n in m.graph.node if n.op_type == "MatMulNBits"]:
        n.ClearField("attribute")
    plain = tmp_path / "plain.onnx"
    onnx.save(m, str(plain))
    assert float32_kernels_copy(plain) == (None, True)   # the default level: float32 already
    for n in [n for n in m.graph.node if n.op_type == "MatMulNBits"]:
        n.op_type = "MatMulNBitsNot"
    onnx.save(m, str(plain))
    assert float32_kernels_copy(plain) == (None, False)


class _Terminal:
    """A stderr that says it is a terminal, keeping what is written."""

    def __init__(self):
        self.text = ""

    def isatty(self):
        return True

    def write(self, s):
        self.text += s
        return len(s)

    def flush(self):
        pass


def test_progress_lines_on_a_terminal(sharded_bf16, tmp_path, monkeypatch):
    """On a terminal, each long stage of a streamed export draws one progress line with an ETA: the identity
    over the checkpoint's tensors, each reference pass over the weights it reads, the weights as written; off a
    terminal, nothing but the stage lines."""
    import sys

    from qeff_kv.export import export_model
    from qeff_kv.export import options as opt

    monkeypatch.setattr(opt, "EXTERNAL_DATA_THRESHOLD", 0)   # written as external data, as a large model is
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    lines = []
    export_model(sharded_bf16, tmp_path / "e", ctx_len=32, prefill_seq_len=8, target="onnxruntime-fused",
                 weights="int4", progress=lines.append)
    monkeypatch.undo()
    drawn = [part for part in term.text.replace("\n", "\r").split("\r") if part]
    n_tensors = 3 * 9 + 3   # three layers of nine, the embedding, the final norm and the head
    for label, count in (("identity", n_tensors), ("reference pass 1", n_tensors), ("weights", None)):
        mine = [d for d in drawn if d.startswith(label + " [")]
        assert mine and "ETA" in mine[-1] and " 100% " in mine[-1], (label, drawn[:3])
        if count is not None:
            assert f"tensor {count}/{count} " in mine[-1]
    assert any(line.startswith("verified: max |logit difference|") for line in lines)
    quiet = _Terminal()
    quiet.isatty = lambda: False
    monkeypatch.setattr(sys, "stderr", quiet)
    export_model(sharded_bf16, tmp_path / "f", ctx_len=32, prefill_seq_len=8, target="onnxruntime-fused",
                 weights="int4", progress=lambda _m: None)
    monkeypatch.undo()
    assert quiet.text == ""


def test_shape_inference_never_sees_a_stand_in(sharded_bf16, tmp_path, monkeypatch):
    """torch serializes every tensor handed to its ONNX shape inference as a whole contiguous copy (an expanded
    stand-in too: 7.6 GB at the 8B shape); the streamed capture hands it the parameter table without them."""
    import torch

    from qeff_kv.export import export_model

    real = torch._C._jit_pass_onnx_graph_shape_type_inference
    seen = []

    def recording(graph, params, opset):
        seen.append((len(params), [tuple(t.shape) for t in params.values() if t.numel() > 1 and 0 in t.stride()]))
        return real(graph, params, opset)

    monkeypatch.setattr(torch._C, "_jit_pass_onnx_graph_shape_type_inference", recording)
    export_model(sharded_bf16, tmp_path / "e", ctx_len=32, prefill_seq_len=8, target="portable")
    assert len(seen) >= 2 and all(expanded == [] for _n, expanded in seen)
    seen.clear()
    monkeypatch.setenv("QEFF_KV_EXPORT_STREAM", "0")   # the whole model: its real weights are handed over
    export_model(sharded_bf16, tmp_path / "w", ctx_len=32, prefill_seq_len=8, target="portable")
    assert seen and max(n for n, _e in seen) >= 3 * 9 + 3


def test_verification_memory_counts_what_onnxruntime_holds():
    """The up-front estimate: a streamed float32 model needs three of its largest tensors; a float16 graph's
    weights twice over (onnxruntime's CPU kernels hold them as float32), said in the refusal; one loaded whole
    needs its own copy as well; a graph quantized as it streams holds blocks, not float16 weights."""
    import torch

    from qeff_kv.export import verify

    def model(dtype):
        return torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False), torch.nn.Linear(32, 16, bias=False)).to(dtype)

    margin = verify.MEMORY_MARGIN
    f32, f16 = model(torch.float32), model(torch.float16)
    assert verify.verification_bytes(f32, streamed=True) == (3 * 64 * 32 * 4 + margin, "")
    assert verify.verification_bytes(f32, streamed=False) == (2 * (64 * 32 + 32 * 16) * 4 + margin, "")
    half = (64 * 32 + 32 * 16) * 2
    assert verify.verification_bytes(f16, streamed=True) == (2 * half + margin, verify.HALF_ON_CPU)
    assert verify.verification_bytes(f16, streamed=False) == (3 * half + margin, verify.HALF_ON_CPU)
    assert verify.verification_bytes(f16, streamed=True, quantized=True) == (3 * 64 * 32 * 2 + margin, "")
    ok, note = verify.memory_allows(1 << 60, verify.HALF_ON_CPU)
    assert not ok and note.startswith("verification needs about 1073741824.0 GiB (onnxruntime's CPU kernels hold "
                                      "a float16 graph's weights as float32) and ")
