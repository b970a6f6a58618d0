"""Export: token parity with transformers for every architecture, naming, determinism, cache, CB, padding."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from suite import requires_torch
from qeff_kv.graph import graphio
from qeff_kv.contract import naming
from qeff_kv.errors import ExportError
from qeff_kv.graph.inplace import inplace_issues

pytestmark = [requires_torch]

PROMPT = [5, 17, 42, 99, 13, 7, 101, 64, 3, 77, 21]  # 11 tokens: three prefill chunks of 4, the last padded
CTX, CHUNK, NEW = 32, 4, 8


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from hf_models import ARCHS, make_model_dir

    root = tmp_path_factory.mktemp("hf")
    return {arch: make_model_dir(arch, root, seed=i) for i, arch in enumerate(ARCHS)}


@pytest.fixture(scope="module")
def ort_exports(models, tmp_path_factory):
    from qeff_kv.export import export_model

    root = tmp_path_factory.mktemp("ort_exports")
    return {arch: export_model(d, root / arch, ctx_len=CTX, prefill_seq_len=CHUNK, target="onnxruntime")
            for arch, d in models.items()}


@pytest.fixture(scope="module")
def fused_exports(models, tmp_path_factory):
    from qeff_kv.export import export_model

    root = tmp_path_factory.mktemp("fused_exports")
    return {arch: export_model(d, root / arch, ctx_len=CTX, prefill_seq_len=CHUNK, target="onnxruntime-fused")
            for arch, d in models.items()}


@pytest.fixture(scope="module")
def exports(models, tmp_path_factory):
    from qeff_kv.export import export_model

    root = tmp_path_factory.mktemp("exports")
    return {arch: export_model(d, root / arch, ctx_len=CTX, prefill_seq_len=CHUNK) for arch, d in models.items()}


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "phi3", "granite"])
def test_greedy_tokens_match_transformers(arch, models, exports):
    from hf_models import PlainLoop, hf_greedy

    ref = hf_greedy(models[arch], PROMPT, NEW)
    got = PlainLoop(exports[arch].onnx_path, CTX).greedy(PROMPT, NEW, CHUNK)
    assert got == ref


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "phi3", "granite"])
def test_onnxruntime_target_matches_transformers_and_attends_valid_slots_only(arch, models, ort_exports):
    from hf_models import PlainLoop, hf_greedy

    r = ort_exports[arch]
    assert PlainLoop(r.onnx_path, CTX).greedy(PROMPT, NEW, CHUNK) == hf_greedy(models[arch], PROMPT, NEW)
    model = graphio.load(r.onnx_path)
    assert inplace_issues(model, graphio.layout_of(model)) == []
    # Attention reads a Slice of each scattered buffer, never the whole capacity.
    for v in model.graph.outputs[1:]:
        readers = {u.node.op_type for u in v.uses()}
        assert readers == {"Slice"}, (v.name, readers)
    assert r.manifest["target"] == "onnxruntime"


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "phi3", "granite"])
def test_fused_target_matches_transformers_in_place(arch, models, fused_exports):
    """onnxruntime-fused: GroupQueryAttention appends to the bound buffer itself; same tokens, same I/O."""
    from hf_models import PlainLoop, hf_greedy
    from qeff_kv.runtime import Session

    r = fused_exports[arch]
    ref = hf_greedy(models[arch], PROMPT, NEW)
    assert PlainLoop(r.onnx_path, CTX).greedy(PROMPT, NEW, CHUNK) == ref   # separate output buffers
    session = Session(r.out_dir)                                            # one buffer bound as both
    assert session.inplace
    before = session.kv_data_pointers()
    [g] = session.generate([PROMPT], max_new_tokens=NEW)
    assert g.tokens == ref and session.kv_data_pointers() == before
    model = graphio.load(r.onnx_path)
    assert inplace_issues(model, graphio.layout_of(model)) == []
    gqa = [n for n in model.graph if n.op_type == "GroupQueryAttention"]
    assert len(gqa) == 2 and all(n.domain == "com.microsoft" for n in gqa)
    for n in gqa:  # each past input is updated by its GQA node into the retained output of the same pair
        assert n.outputs[1].name == naming.retained_name(n.inputs[3].name)
        assert n.outputs[2].name == naming.retained_name(n.inputs[4].name)
    # Every norm that follows a residual add (all but layer 0's input norm) is one fused node.
    assert sum(n.op_type == "SkipSimplifiedLayerNormalization" for n in model.graph) == 4
    packed = all(n.inputs[1] is None and n.inputs[2] is None for n in gqa)
    # q/k norms (Qwen3) and an already fused qkv_proj (Phi-3) keep separate inputs; the rest are packed.
    assert packed == (arch in ("llama", "mistral", "qwen2", "granite"))


def test_fused_target_fills_capacity_and_refuses_cb(models, tmp_path):
    from hf_models import hf_greedy
    from qeff_kv.export import export_model
    from qeff_kv.runtime import Session

    r = export_model(models["llama"], tmp_path / "f", ctx_len=12, prefill_seq_len=5, target="onnxruntime-fused")
    prompt = list(range(3, 14))  # 11 tokens in capacity 12: the last chunk is sent unpadded
    [g] = Session(r.out_dir).generate([prompt], max_new_tokens=2)
    assert g.tokens == hf_greedy(models["llama"], prompt, 2)
    with pytest.raises(ExportError, match="does not support --continuous-batching"):
        export_model(models["llama"], tmp_path / "cb", target="onnxruntime-fused", continuous_batching=True,
                     full_batch_size=2)


def test_onnxruntime_target_same_io_as_portable(exports, ort_exports):
    a = graphio.io_of(graphio.load(exports["llama"].onnx_path))
    b = graphio.io_of(graphio.load(ort_exports["llama"].onnx_path))
    assert a == b


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_graph_contract(arch, exports):
    path = exports[arch].onnx_path
    onnx.checker.check_model(str(path), full_check=True)
    proto = onnx.load(str(path))
    assert proto.ir_version <= 10
    assert {(o.domain, o.version) for o in proto.opset_import} == {("", 17)}
    model = graphio.load(path)
    ins, outs = graphio.io_of(model)
    n = 2
    kv_in = [naming.kv_input_name(s, i) for i in range(n) for s in naming.EXPORT_STEMS]
    assert [t.name for t in ins] == ["input_ids", "position_ids", *kv_in]
    assert [t.name for t in outs] == ["logits", *[naming.retained_name(x) for x in kv_in]]
    for t in ins[:2]:
        assert (t.dtype, t.shape) == ("int64", ("batch_size", "seq_len"))
    for t in ins[2:]:
        assert (t.dtype, t.shape) == ("float32", ("batch_size", 2, "ctx_len", 16))
    assert outs[0].shape == ("batch_size", 1, 128)
    by_name = {t.name: t for t in outs}
    for t in ins[2:]:
        out = by_name[naming.retained_name(t.name)]
        assert (out.dtype, out.shape) == (t.dtype, t.shape)
    assert inplace_issues(model, graphio.layout_of(model)) == []
    # Each KV update is a ScatterND reading the graph input and producing the graph output directly.
    for v in model.graph.inputs[2:]:
        users = [u.node for u in v.uses() if u.node.op_type != "Shape"]
        assert [u.op_type for u in users] == ["ScatterND"]
        assert users[0].outputs[0].name == naming.retained_name(v.name)


def test_prefix_renames_exactly_the_kv_buffers(models, exports, tmp_path):
    from qeff_kv.export import export_model

    plain = exports["llama"]
    pre = export_model(models["llama"], tmp_path / "vllm", ctx_len=CTX, prefill_seq_len=CHUNK,
                       kv_cache_prefix="VLLM")
    a_in, a_out = graphio.io_of(graphio.load(plain.onnx_path))
    b_in, b_out = graphio.io_of(graphio.load(pre.onnx_path))
    for a, b in zip(a_in + a_out, b_in + b_out):
        parsed = naming.parse_kv_name(a.name)
        expected = a.name if parsed is None else naming.rename_kv(a.name, "VLLM")
        assert b.name == expected
        assert (b.dtype, b.shape) == (a.dtype, a.shape)
    assert b_in[2].name == "past_key.0_VLLM" and b_out[1].name == "past_key.0_VLLM_RetainedState"
    assert naming.select(naming.substring_regex("VLLM"), [t.name for t in b_in + b_out]) == \
        [t.name for t in b_in + b_out if naming.parse_kv_name(t.name)]
    cio = (pre.out_dir / "custom_io.yaml").read_text()
    assert " - IOName: past_value.1_VLLM\n   Precision: float16\n" in cio
    assert " - IOName: past_value.1_VLLM_RetainedState\n   Precision: float16\n" in cio
    manifest = json.loads(pre.manifest_path.read_text())
    assert manifest["prefix"] == "VLLM"
    assert manifest["regexes"]["exact"] == r"^(past_key|past_value)\.\d+_VLLM(_RetainedState)?$"
    assert manifest["buffers"][0]["input"] == "past_key.0_VLLM"
    # Same computation: identical tokens.
    from hf_models import PlainLoop

    assert PlainLoop(pre.onnx_path, CTX).greedy(PROMPT, NEW, CHUNK) == \
        PlainLoop(plain.onnx_path, CTX).greedy(PROMPT, NEW, CHUNK)


def test_export_is_deterministic(models, tmp_path):
    from qeff_kv.export import export_model

    a = export_model(models["qwen2"], tmp_path / "a", ctx_len=CTX, prefill_seq_len=CHUNK, kv_cache_prefix="P1")
    b = export_model(models["qwen2"], tmp_path / "b", ctx_len=CTX, prefill_seq_len=CHUNK, kv_cache_prefix="P1")
    assert a.onnx_path.read_bytes() == b.onnx_path.read_bytes()
    assert a.manifest["options_hash"] == b.manifest["options_hash"]


def test_export_cache_reuse_force_and_hash_separation(tmp_path, monkeypatch):
    from qeff_kv.export import export_model

    monkeypatch.setenv("QEFF_KV_HOME", str(tmp_path / "home"))
    first = export_model(None, ctx_len=64, prefill_seq_len=8)
    assert not first.reused
    assert first.out_dir.parent == tmp_path / "home" / "LlamaForCausalLM"
    name, digest = first.out_dir.name.rsplit("-", 1)
    assert name == "qeff-kv-tiny-llama" and len(digest) == 16 and int(digest, 16) >= 0
    params = json.loads((first.out_dir / "export_params.json").read_text())
    assert params["options"]["kv_cache_prefix"] is None and params["config"]["model_type"] == "llama"
    again = export_model(None, ctx_len=64, prefill_seq_len=8)
    assert again.reused and again.out_dir == first.out_dir
    mtime = first.onnx_path.stat().st_mtime_ns
    forced = export_model(None, ctx_len=64, prefill_seq_len=8, force=True)
    assert not forced.reused and forced.out_dir == first.out_dir
    assert forced.onnx_path.stat().st_mtime_ns != mtime
    prefixed = export_model(None, ctx_len=64, prefill_seq_len=8, kv_cache_prefix="VLLM")
    assert prefixed.out_dir != first.out_dir
    assert prefixed.out_dir.parent == first.out_dir.parent
    other_ctx = export_model(None, ctx_len=128, prefill_seq_len=8)
    assert other_ctx.out_dir not in (first.out_dir, prefixed.out_dir)
    leftovers = [p.name for p in first.out_dir.parent.iterdir() if p.name.startswith(".")]
    assert leftovers == []


def test_killed_export_leaves_no_half_files(tmp_path, monkeypatch):
    from qeff_kv.export import export_model, publish

    def boom(*a, **k):
        raise ExportError("simulated failure while writing the graph")

    monkeypatch.setattr(publish, "save_graph", boom)
    out = tmp_path / "out"
    with pytest.raises(ExportError, match="simulated failure"):
        export_model(None, out, ctx_len=32, prefill_seq_len=4)
    assert not out.exists() or list(out.iterdir()) == []
    assert [p.name for p in tmp_path.iterdir()] in ([], ["out"])
    monkeypatch.setenv("QEFF_KV_HOME", str(tmp_path / "home"))
    with pytest.raises(ExportError):
        export_model(None, ctx_len=32, prefill_seq_len=4)
    arch_dir = tmp_path / "home" / "LlamaForCausalLM"
    assert not arch_dir.exists() or list(arch_dir.iterdir()) == []


def test_padded_prompt_gives_finite_logits_and_cache(exports):
    from hf_models import PlainLoop

    loop = PlainLoop(exports["llama"].onnx_path, CTX)
    # One chunk of 4 with a single valid token: three padding rows.
    logits = loop.step(np.array([[9, 0, 0, 0]]), np.array([[0, -1, -1, -1]]))
    assert np.isfinite(logits).all()
    for v in loop.kv.values():
        assert np.isfinite(v).all()
        # Padding wrote nothing beyond the valid slot 0 (zero-initialised buffer stays zero there).
        assert not v[:, :, 1:, :].any()
        assert v[:, :, 0, :].any()
    # The same token unpadded gives the same logits.
    fresh = PlainLoop(exports["llama"].onnx_path, CTX)
    ref = fresh.step(np.array([[9]]), np.array([[0]]))
    np.testing.assert_allclose(logits, ref, rtol=1e-5, atol=1e-5)


def test_prompt_filling_capacity_with_padding_keeps_last_slot(models, tmp_path):
    """A padded final chunk whose last valid position is ctx_len-1 must not let padding overwrite that slot."""
    from hf_models import PlainLoop, hf_greedy
    from qeff_kv.export import export_model

    ctx = 12
    r = export_model(models["llama"], tmp_path / "small", ctx_len=ctx, prefill_seq_len=5)
    prompt = list(range(3, 3 + ctx))  # 12 tokens: chunks 5 + 5 + 2 (3 padding rows)
    loop = PlainLoop(r.onnx_path, ctx)
    logits = loop.prefill(prompt, 5)
    ref = hf_greedy(models["llama"], prompt, 1)
    assert int(logits[0, -1].argmax()) == ref[0]


@pytest.mark.parametrize("target", ["portable", "onnxruntime"])
def test_continuous_batching_two_slots_decode_together(target, models, tmp_path):
    from hf_models import PlainLoop, hf_greedy
    from qeff_kv.export import export_model

    r = export_model(models["llama"], tmp_path / "cb", ctx_len=CTX, prefill_seq_len=CHUNK,
                     continuous_batching=True, full_batch_size=2, kv_cache_prefix="VLLM", target=target)
    ins, _ = graphio.io_of(graphio.load(r.onnx_path))
    by = {t.name: t for t in ins}
    assert by["batch_index"].shape == ("batch_size", 1)
    assert by["past_key.0_VLLM"].shape == ("full_batch_size", 2, "ctx_len", 16)
    spec = json.loads((r.out_dir / "specializations.json").read_text())["specializations"]
    assert spec[0]["batch_size"] == "1" and spec[1]["batch_size"] == "2" and spec[1]["full_batch_size"] == "2"
    prompts = [PROMPT, [120, 3, 88, 19, 60, 45]]
    refs = [hf_greedy(models["llama"], p, NEW) for p in prompts]
    loop = PlainLoop(r.onnx_path, CTX, batch=2)
    toks, pos = [], []
    for slot, p in enumerate(prompts):
        logits = loop.prefill(p, CHUNK, slot=slot)
        toks.append([int(logits[0, -1].argmax())])
        pos.append(len(p))
    for _ in range(NEW - 1):
        logits = loop.step(np.array([[toks[0][-1]], [toks[1][-1]]]), np.array([[pos[0]], [pos[1]]]),
                           np.array([[0], [1]]))
        assert np.isfinite(logits).all()
        for i in range(2):
            toks[i].append(int(logits[i, -1].argmax()))
            pos[i] += 1
    assert toks == refs


def test_float16_export_loads_and_runs(tmp_path):
    from hf_models import PlainLoop
    from qeff_kv.export import export_model

    r = export_model(None, tmp_path / "fp16", ctx_len=32, prefill_seq_len=4, dtype="float16")
    ins, outs = graphio.io_of(graphio.load(r.onnx_path))
    assert {t.dtype for t in ins[2:]} == {"float16"} and outs[0].dtype == "float16"
    toks = PlainLoop(r.onnx_path, 32).greedy([1, 2, 3, 4, 5], 4, 4)
    assert len(toks) == 4 and all(0 <= t < 256 for t in toks)


@pytest.mark.parametrize("kwargs, message", [
    (dict(ctx_len=0), "ctx_len must be a positive integer"),
    (dict(ctx_len=16, prefill_seq_len=32), "prefill_seq_len 32 is larger than ctx_len 16"),
    (dict(continuous_batching=True), "--continuous-batching needs --full-batch-size"),
    (dict(full_batch_size=4), "only meaningful with --continuous-batching"),
    (dict(dtype="int8"), "dtype must be one of"),
    (dict(target="gpu"), "target must be one of portable, onnxruntime, onnxruntime-fused"),
])
def test_bad_options_refused_before_anything_is_written(kwargs, message, tmp_path):
    from qeff_kv.export import export_model

    with pytest.raises(ExportError, match=message):
        export_model(None, tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()


def test_bad_model_folders(tmp_path):
    from qeff_kv.export import export_model

    with pytest.raises(ExportError, match="no such model folder"):
        export_model(tmp_path / "missing", tmp_path / "o")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ExportError, match=r"no \*\.safetensors weights"):
        export_model(tmp_path / "empty", tmp_path / "o")
    assert not (tmp_path / "o").exists()


def test_prefill_chunk_longer_than_the_window_refused(tmp_path):
    """A ring buffer of W slots cannot take a chunk of more than W positions in one ScatterND: refused up front
    in one line, nothing written."""
    from hf_models import make_model_dir
    from qeff_kv.export import export_model

    d = make_model_dir("mistral", tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["sliding_window"] = 16
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ExportError) as err:
        export_model(d, tmp_path / "o", ctx_len=64, prefill_seq_len=32)
    assert str(err.value) == ("prefill_seq_len 32 is longer than the sliding window 16: a prefill chunk must fit in "
                              "the sliding layers' ring buffers; export with --prefill-seq-len 16 or less")
    assert not (tmp_path / "o").exists()


def test_large_weights_go_to_external_data(models, tmp_path, monkeypatch):
    """Above the threshold (64 MiB in production, lowered here) weights go to <name>.onnx.data beside the graph."""
    from hf_models import PlainLoop, hf_greedy
    from qeff_kv.export import export_model
    from qeff_kv.export import options as opt

    monkeypatch.setattr(opt, "EXTERNAL_DATA_THRESHOLD", 10_000)
    r = export_model(models["qwen3"], tmp_path / "ext", ctx_len=CTX, prefill_seq_len=CHUNK)
    data = r.out_dir / (r.onnx_path.name + ".data")
    assert data.is_file() and data.stat().st_size > 100_000
    assert r.onnx_path.stat().st_size < data.stat().st_size
    proto = onnx.load(str(r.onnx_path), load_external_data=False)
    locations = {e.value for t in proto.graph.initializer for e in t.external_data if e.key == "location"}
    assert locations == {data.name}
    assert PlainLoop(r.onnx_path, CTX).greedy(PROMPT, NEW, CHUNK) == hf_greedy(models["qwen3"], PROMPT, NEW)
