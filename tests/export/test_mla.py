"""MLA's compressed (latent) cache, ``--mla-cache latent`` (issue 20; contract section 11).

A tiny seeded DeepSeek-V3 (2 layers, hidden 64, 4 heads, q_lora_rank 24, kv_lora_rank 32, qk_rope 8, qk_nope 16,
v_head 16; layer 0 dense, layer 1 a tiny MoE) exported with the latent cache on the portable and onnxruntime
targets (the latter with continuous batching), both with the ``VLLM`` prefix: names and shapes exactly as the
contract says, greedy tokens equal transformers' (a prompt of four prefill chunks, its last one padded, among
them), two sequences at different lengths in one batch, state files, rewind, the hand-off, ``check``,
``buffers``, ``compile-config`` and the refusals.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from suite import requires_torch
from families import FAMILIES, PROMPTS

pytestmark = [requires_torch]

CTX, CHUNK, NEW = 32, 4, 8
#: four prefill chunks of CHUNK, the last one holding 2 tokens and 2 padded rows
LONG = [9, 31, 4, 88, 120, 15, 2, 47, 63, 5, 77, 18, 101, 33]
ALL = [PROMPTS[0], PROMPTS[1], LONG]
KV_LORA, ROPE, NOPE, V_HEAD, HEADS = 32, 8, 16, 16, 4
LAT_IN = ["compressed_kv.0_VLLM", "k_pe.0_VLLM", "compressed_kv.1_VLLM", "k_pe.1_VLLM"]


@pytest.fixture(scope="module")
def mla_dir(mla_latent_dir):
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(mla_latent_dir)
    assert (cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim,
            cfg.num_attention_heads) == (KV_LORA, ROPE, NOPE, V_HEAD, HEADS)
    return mla_latent_dir


@pytest.fixture(scope="module")
def refs(mla_dir):
    from hf_models import hf_greedy

    got = [hf_greedy(mla_dir, p, NEW) for p in ALL]
    assert any(len(set(t)) > 1 for t in got), "greedy tokens do not vary: the parity proves little"
    return got


@pytest.fixture(scope="module")
def exports(mla_latent_exports):
    """The session's latent exports (tests/export/conftest.py): ``portable`` and ``cb``."""
    return mla_latent_exports


def _io(path):
    m = onnx.load(str(path), load_external_data=False)
    dims = lambda t: [d.dim_param or d.dim_value for d in t.type.tensor_type.shape.dim]  # noqa: E731
    return ({i.name: dims(i) for i in m.graph.input}, {o.name: dims(o) for o in m.graph.output}, m)


@pytest.mark.parametrize("which", ["portable", "cb"])
def test_names_shapes_and_state_spec(exports, which):
    result = exports[which]
    ins, outs, model = _io(result.onnx_path)
    batch = "full_batch_size" if which == "cb" else "batch_size"
    extra = ["batch_index"] if which == "cb" else []
    assert list(ins) == ["input_ids", "position_ids", *LAT_IN, *extra]
    assert list(outs) == ["logits", *[n + "_RetainedState" for n in LAT_IN]]
    for i in range(2):
        for name, width in ((f"compressed_kv.{i}_VLLM", KV_LORA), (f"k_pe.{i}_VLLM", ROPE)):
            assert ins[name] == outs[name + "_RetainedState"] == [batch, 1, "ctx_len", width]
    meta = {p.key: p.value for p in model.metadata_props}
    spec = json.loads(meta["qeff_kv.state_spec"])
    assert spec == [{"layer": i, "kind": "latent", "stems": ["compressed_kv", "k_pe"],
                     "shapes": [[1, "ctx_len", KV_LORA], [1, "ctx_len", ROPE]], "position_axis": 2,
                     "capacity": None} for i in range(2)]
    assert json.loads(meta["qeff_kv.mla"]) == {"heads": HEADS, "kv_lora_rank": KV_LORA, "qk_nope_head_dim": NOPE,
                                               "qk_rope_head_dim": ROPE, "v_head_dim": V_HEAD}
    man = result.manifest
    assert man["verification"]["status"] == "passed" and man["options"]["mla_cache"] == "latent"
    assert man["regexes"]["exact"] == r"^(compressed_kv|k_pe)\.\d+_VLLM(_RetainedState)?$"


def test_attention_is_absorbed(exports):
    """The graph never expands the cache: no MatMul takes ``kv_b_proj``'s weight ``[kv_lora_rank, heads *
    (qk_nope + v_head)]``; the key and value halves appear per head, ``[H, qk_nope, r]`` and ``[H, r, v_head]``."""
    import onnx

    _, _, model = _io(exports["portable"].onnx_path)
    known = {t.name: list(t.dims) for t in model.graph.initializer}   # (a streamed export computes the per-head
    for v in onnx.shape_inference.infer_shapes(model).graph.value_info:   # halves from kv_b_proj's initializer)
        dims = [d.dim_value if d.HasField("dim_value") else d.dim_param for d in v.type.tensor_type.shape.dim]
        known.setdefault(v.name, dims)
    shapes = [known.get(x) for n in model.graph.node if n.op_type == "MatMul" for x in n.input]
    assert [KV_LORA, HEADS * (NOPE + V_HEAD)] not in shapes
    assert shapes.count([HEADS, NOPE, KV_LORA]) == 2 and shapes.count([HEADS, KV_LORA, V_HEAD]) == 2


@pytest.mark.parametrize("which", ["portable", "cb"])
def test_tokens_equal_transformers(exports, refs, which):
    from hf_models import PlainLoop

    loop_tokens = [PlainLoop(exports[which].onnx_path, CTX, batch=2 if which == "cb" else 1).greedy(p, NEW, CHUNK)
                   for p in ALL]
    assert loop_tokens == refs


def test_continuous_batching_two_lengths(exports, refs):
    from qeff_kv.runtime import Session

    s = Session(exports["cb"].out_dir)
    assert s.continuous_batching
    gens = s.generate([LONG, PROMPTS[1]], max_new_tokens=NEW, stop_tokens=[])
    assert [g.tokens for g in gens] == [refs[2], refs[1]]


def test_state_file_round_trip_and_truncate(exports, refs, tmp_path):
    from safetensors.numpy import load_file

    from qeff_kv.runtime import Session

    s = Session(exports["cb"].out_dir)
    [g] = s.generate([LONG], max_new_tokens=3, stop_tokens=[])
    path = s.save_state(g.sequence, tmp_path / "kv.safetensors")
    stored = load_file(str(path))
    assert sorted(stored) == sorted(LAT_IN)
    assert stored["compressed_kv.0_VLLM"].shape == (1, 1, len(LONG) + 2, KV_LORA)
    assert stored["k_pe.1_VLLM"].shape == (1, 1, len(LONG) + 2, ROPE)
    s2 = Session(exports["portable"].out_dir)          # another export of the same model and contract
    [rest] = s2.generate([s2.load_state(path)], max_new_tokens=5, stop_tokens=[])
    assert g.tokens + rest.tokens == refs[2]
    s2.truncate(rest.sequence, 9)                        # rewind into the prompt, decode again
    [again] = s2.generate([(rest.sequence, LONG[9:])], max_new_tokens=NEW, stop_tokens=[])
    assert again.tokens == refs[2]


def test_handoff_with_serving_regex(exports, refs):
    from qeff_kv.runtime import Session

    pre = Session(exports["portable"].out_dir)
    [g] = pre.generate([PROMPTS[0]], max_new_tokens=0)
    state = pre.export_state(g.sequence, select=".*VLLM.*")
    assert sorted(state.tensors) == sorted(LAT_IN)
    dec = Session(exports["cb"].out_dir)
    dec.add_sequence()
    seq = dec.import_state(state)
    assert seq.slot == 1
    [rest] = dec.generate([seq], max_new_tokens=NEW, stop_tokens=[])
    assert rest.tokens == refs[0]


def test_rewrite_prefix_of_a_latent_graph(exports, refs, tmp_path):
    """``rewrite`` renames the latent pair like any KV pair; the state spec and the tokens stay."""
    from hf_models import PlainLoop
    from qeff_kv.tools.check import check
    from qeff_kv.tools.rewrite import rewrite

    out = tmp_path / "kvc.onnx"
    rewrite(exports["portable"].onnx_path, out, prefix="kvCache")
    ins, outs, model = _io(out)
    assert [n for n in ins if n not in ("input_ids", "position_ids")] == [n.replace("VLLM", "kvCache") for n in LAT_IN]
    assert "k_pe.1_kvCache_RetainedState" in outs
    assert check(out, expected_prefix="kvCache").ok
    assert PlainLoop(out, CTX).greedy(PROMPTS[1], NEW, CHUNK) == refs[1]


def test_check_buffers_compile_config(exports, tmp_path):
    from qeff_kv.tools.buffers import buffers_report
    from qeff_kv.tools.check import check
    from qeff_kv_cli.main import main as cli

    path = exports["cb"].onnx_path
    assert check(path).ok
    report = buffers_report(path, ctx_len=CTX)
    per_token = 2 * (KV_LORA + ROPE) * 4
    full = 2 * HEADS * (NOPE + ROPE + V_HEAD) * 4
    j = report.to_json()
    assert (j["bytes_per_token"], j["mla_full_bytes_per_token"]) == (per_token, full)
    assert j["bytes_per_sequence"] == per_token * CTX
    assert [(p["input"], p["kind"]) for p in j["pairs"]] == [(n, n.split(".")[0]) for n in LAT_IN]
    assert (f"KV bytes per token (one sequence, all layers): {per_token}; MLA latent cache (compressed_kv + k_pe), "
            f"the expanded per-head cache would take {full} ({full / per_token:.1f}x)") in report.format_text()
    r = CliRunner().invoke(cli, ["compile-config", str(path), "-o", str(tmp_path / "cc"), "--prefill-seq-len",
                                 str(CHUNK), "--ctx-len", str(CTX), "--full-batch-size", "2", "--precision",
                                 "float16"])
    assert r.exit_code == 0, r.output
    text = (tmp_path / "cc" / "custom_io.yaml").read_text()
    names = [line.split(": ", 1)[1] for line in text.splitlines() if "IOName" in line]
    assert sorted(names) == sorted(LAT_IN + [n + "_RetainedState" for n in LAT_IN])
    assert text.count("Precision: float16") == len(names)
    # the export's own custom_io.yaml (float32 export: KV in float32)
    own = (exports["cb"].out_dir / "custom_io.yaml").read_text()
    assert sorted(line.split(": ", 1)[1] for line in own.splitlines() if "IOName" in line) == sorted(names)


def _latent_graph(tmp_path, **kw):
    """A hand-built latent graph of 2 layers (``tests/helpers/_kv_graphs.py``: ScatterND updates, in-place safe)."""
    import _kv_graphs as kvg

    return kvg.save(kvg.build(2, stems=("compressed_kv", "k_pe"), **kw), tmp_path / "latent.onnx")


def test_check_latent_rules(tmp_path):
    from qeff_kv.tools.check import check

    ok = check(_latent_graph(tmp_path))
    assert ok.ok, ok.format_text()
    missing = check(_latent_graph(tmp_path, drop_inputs=["k_pe.1"], drop_outputs=["k_pe.1_RetainedState"]))
    layers = next(r for r in missing.rules if r.id == "layers")
    assert not missing.ok and layers.status == "fail"
    assert any("k_pe" in v.message for v in layers.violations), layers.violations
    skewed = ["batch_size", 2, "ctx_len2", 4]
    skew = check(_latent_graph(tmp_path, input_dims={"k_pe.1": skewed}, output_dims={"k_pe.1_RetainedState": skewed}))
    pm = next(r for r in skew.rules if r.id == "pair-match")
    assert pm.status == "fail"
    assert any("k_pe.1 dim 2 is 'ctx_len2' but compressed_kv.1 dim 2 is 'ctx_len'; a layer's latent pair shares "
               "its ctx axis" in v.message for v in pm.violations), pm.violations


FUSED = ("--target onnxruntime-fused does not support --mla-cache latent (GroupQueryAttention cannot attend over a "
         "compressed cache); use --target portable or onnxruntime")


@pytest.mark.parametrize("kw,message", [
    (dict(target="onnxruntime-fused"), FUSED),
    (dict(ccl="16,32"), "--mla-cache latent does not support --ccl yet; export without it or with --mla-cache full"),
    (dict(target="onnxruntime", weights="int8"),
     "--mla-cache latent does not support --weights yet; export without it or with --mla-cache full"),
    (dict(mla_cache="compressed"), "mla_cache must be one of full, latent, got 'compressed'"),
])
def test_refusals(mla_dir, tmp_path, kw, message):
    from qeff_kv.errors import ExportError
    from qeff_kv.export import export_model

    kw = {"mla_cache": "latent", **kw}
    with pytest.raises(ExportError) as err:
        export_model(mla_dir, tmp_path / "out", ctx_len=CTX, prefill_seq_len=CHUNK, **kw)
    assert str(err.value) == message
    assert not (tmp_path / "out").exists()


def test_supported_models_row_is_what_this_file_proves(exports):
    """The generated page's MLA row: exact on the targets exported here, the fused target's refusal as tested."""
    from gen_supported_models import MLA_ROWS
    from families import TARGETS

    [(name, cls, _, cells)] = MLA_ROWS
    assert (name, cls) == ("deepseek_v3", FAMILIES["deepseek_v3"].model_class)
    proved = {"portable": "exact", "onnxruntime": "exact", "onnxruntime-fused": "refused: " + FUSED}
    assert {exports["portable"].manifest["target"], exports["cb"].manifest["target"]} == {"portable", "onnxruntime"}
    for target, cell in zip(TARGETS, cells):
        assert proved[target].startswith(cell), (target, cell)


def test_refuses_a_model_without_mla(family_models, tmp_path):
    from qeff_kv_cli.main import main as cli

    r = CliRunner().invoke(cli, ["export", str(family_models("llama")), "-o", str(tmp_path / "out"), "--ctx-len",
                                 "32", "--mla-cache", "latent"])
    assert r.exit_code == 2
    assert r.stderr == ("error: --mla-cache latent is for models with multi-head latent attention (kv_lora_rank); "
                        "LlamaForCausalLM has none\n")
    assert not (tmp_path / "out").exists()


def test_refuses_deepseek_v2_latent(tmp_path):
    """DeepSeek-V2's attention rotates through complex numbers (``apply_rotary_emb``), not absorbed: one line."""
    import torch
    import transformers

    from qeff_kv.errors import ExportError
    from qeff_kv.export import export_model

    cfg = transformers.DeepseekV2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
                                        q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                                        first_k_dense_replace=2, max_position_embeddings=128)
    cfg.architectures = ["DeepseekV2ForCausalLM"]
    torch.manual_seed(0)
    transformers.DeepseekV2ForCausalLM(cfg).eval().save_pretrained(tmp_path / "v2")
    with pytest.raises(ExportError) as err:
        export_model(tmp_path / "v2", tmp_path / "out", ctx_len=CTX, prefill_seq_len=CHUNK, mla_cache="latent")
    assert str(err.value) == ("--mla-cache latent: DeepseekV2ForCausalLM's attention is not DeepSeek-V3's MLA "
                              "(rotary through apply_rotary_pos_emb) in every layer (0 of 2); it cannot be absorbed")
    assert not (tmp_path / "out").exists()
