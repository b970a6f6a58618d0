"""DeepSeek sparse attention (issue 53, item 2; contract section 11): the indexer's keys as ``index_key.{i}``.

The matrix's tiny seeded deepseek_v32 and glm_moe_dsa (tests/helpers/families.py: MLA, a dense and a MoE layer,
``index_topk`` 6 of a 32-slot context, so the selection matters; GLM's second layer reuses the first one's selection
and keeps no indexer keys) exported once per target by the session's ``family_exports``: names, shapes and the
state spec as the contract says, the selection in graph form, the persistent cache with state files across
targets and a rewind, ``check``/``buffers``, a prefix rewrite, and the refusals (from the config, before loading).
"""

from __future__ import annotations

import json

import onnx
import pytest
from click.testing import CliRunner

from suite import requires_torch
from families import CHUNK, CTX, NEW, PROMPTS

pytestmark = [requires_torch]

INDEX_DIM, KV_LORA, ROPE = 16, 32, 8


def _io(path):
    m = onnx.load(str(path), load_external_data=False)
    dims = lambda t: [d.dim_param or d.dim_value for d in t.type.tensor_type.shape.dim]  # noqa: E731
    return {i.name: dims(i) for i in m.graph.input}, {o.name: dims(o) for o in m.graph.output}, m


@pytest.mark.parametrize("name, indexed", [("deepseek_v32", (0, 1)), ("glm_moe_dsa", (0,))])
def test_index_key_names_shapes_and_state_spec(family_exports, name, indexed):
    ins, outs, model = _io(family_exports(name, "onnxruntime").onnx_path)
    want = []
    for i in range(2):
        want += [f"past_key.{i}", f"past_value.{i}"] + ([f"index_key.{i}"] if i in indexed else [])
    assert list(ins) == ["input_ids", "position_ids", *want]
    assert list(outs) == ["logits", *[n + "_RetainedState" for n in want]]
    for i in indexed:
        assert ins[f"index_key.{i}"] == outs[f"index_key.{i}_RetainedState"] == ["batch_size", 1, "ctx_len", INDEX_DIM]
    spec = json.loads({p.key: p.value for p in model.metadata_props}["qeff_kv.state_spec"])
    assert [(s["layer"], s["kind"], s["stems"]) for s in spec] == [
        (i, "indexed", ["past_key", "past_value", "index_key"]) if i in indexed else
        (i, "full", ["past_key", "past_value"]) for i in range(2)]
    assert spec[0]["shapes"] == [[1, "ctx_len", KV_LORA], [1, "ctx_len", ROPE], [1, "ctx_len", INDEX_DIM]]


def test_selection_is_a_topk_of_at_most_the_slots_read(family_exports):
    """One ``TopK`` per indexer, its ``k`` a ``Min`` of ``index_topk`` and the row's width (the onnxruntime target
    reads only the valid slots, fewer than ``index_topk`` early on)."""
    _, _, model = _io(family_exports("deepseek_v32", "onnxruntime").onnx_path)
    producers = {o: n for n in model.graph.node for o in n.output}
    topks = [n for n in model.graph.node if n.op_type == "TopK" and producers[n.input[1]].op_type == "Min"]
    assert len(topks) == 2


def test_selection_matters_in_the_tiny_config(family_models, family_refs, tmp_path):
    """With every position selected (index_topk above the context) transformers' tokens differ: the matrix's
    parity proves the selection, not only MLA."""
    import transformers

    from hf_models import hf_greedy

    d = family_models("deepseek_v32")
    model = transformers.AutoModelForCausalLM.from_pretrained(d)
    model.config.index_topk = 64
    for layer in model.model.layers:
        layer.self_attn.indexer.index_topk = 64
    model.save_pretrained(tmp_path / "dense")
    assert [hf_greedy(tmp_path / "dense", p, NEW) for p in PROMPTS] != family_refs("deepseek_v32")


def test_persistent_cache_state_files_and_rewind(family_exports, family_refs, tmp_path):
    """The Session's persistent cache holds the indexer keys beside the pair; a state file written by the portable
    export continues on the onnxruntime one; a rewind into the prompt decodes the same tokens again."""
    from safetensors.numpy import load_file

    from qeff_kv.runtime import Session

    refs = family_refs("deepseek_v32")
    s = Session(family_exports("deepseek_v32", "portable").out_dir, max_sequences=2)
    [g] = s.generate([PROMPTS[0]], max_tokens=3, stop_tokens=[])
    assert g.tokens == refs[0][:3]
    path = s.save_state(g.sequence, tmp_path / "kv.safetensors")
    stored = load_file(str(path))
    assert sorted(stored) == sorted(f"{stem}.{i}" for i in range(2) for stem in ("past_key", "past_value",
                                                                                   "index_key"))
    assert stored["index_key.1"].shape == (1, 1, len(PROMPTS[0]) + 2, INDEX_DIM)
    s2 = Session(family_exports("deepseek_v32", "onnxruntime").out_dir, max_sequences=2)
    [rest] = s2.generate([s2.load_state(path)], max_tokens=NEW - 3, stop_tokens=[])
    assert g.tokens + rest.tokens == refs[0]
    s2.truncate(rest.sequence, 7)
    [again] = s2.generate([(rest.sequence, PROMPTS[0][7:])], max_tokens=NEW, stop_tokens=[])
    assert again.tokens == refs[0]
    [p] = s.generate([PROMPTS[1]], max_tokens=0)            # the hand-off: prefill here, decode there
    state = s.export_state(p.sequence, select=r"^index_key\..*|^past_.*")
    assert sorted(state.tensors) == sorted(stored)
    [rest] = s2.generate([s2.import_state(state)], max_tokens=NEW, stop_tokens=[])
    assert rest.tokens == refs[1]


def test_check_buffers_and_prefix_rewrite(family_exports, family_refs, tmp_path):
    from hf_models import PlainLoop
    from qeff_kv.tools.buffers import buffers_report
    from qeff_kv.tools.check import check
    from qeff_kv.tools.rewrite import rewrite
    from qeff_kv_cli.main import main as cli

    path = family_exports("glm_moe_dsa", "portable").onnx_path
    j = buffers_report(path, ctx_len=CTX).to_json()
    assert [(p["input"], p["kind"]) for p in j["pairs"]] == [
        ("past_key.0", "past_key"), ("past_value.0", "past_value"), ("index_key.0", "index_key"),
        ("past_key.1", "past_key"), ("past_value.1", "past_value")]
    assert j["bytes_per_token"] == (2 * (KV_LORA + ROPE) + INDEX_DIM) * 4
    out = tmp_path / "kvc.onnx"
    rewrite(path, out, prefix="kvCache")
    ins, outs, _ = _io(out)
    assert "index_key.0_kvCache" in ins and "index_key.0_kvCache_RetainedState" in outs
    report = check(out, expected_prefix="kvCache")
    assert report.ok, report.format_text()
    assert PlainLoop(out, CTX).greedy(PROMPTS[1], NEW, CHUNK) == family_refs("glm_moe_dsa")[1]
    r = CliRunner().invoke(cli, ["compile-config", str(path), "-o", str(tmp_path / "cc"), "--prefill-seq-len",
                                 str(CHUNK), "--ctx-len", str(CTX)])
    assert r.exit_code == 0, r.output
    text = (tmp_path / "cc" / "custom_io.yaml").read_text()
    assert "IOName: index_key.0" in text and "IOName: index_key.0_RetainedState" in text


def _config_only(src, dest, **changes):
    """A folder with ``src``'s config.json (``changes`` applied) and weights that cannot be read: a refusal must
    come from the config."""
    cfg = json.loads((src / "config.json").read_text()) if src is not None else {}
    dest.mkdir()
    (dest / "config.json").write_text(json.dumps({**cfg, **changes}))
    (dest / "model.safetensors").write_bytes(b"not read: the refusal comes first")
    return dest


def test_latent_cache_is_refused_before_loading(family_models, tmp_path):
    """``--mla-cache latent`` would drop the indexer (its absorbed attention attends everywhere): refused in one
    line from the config, nothing written."""
    from qeff_kv.errors import ExportError
    from qeff_kv.export import export_model

    d = _config_only(family_models("deepseek_v32"), tmp_path / "v32")
    with pytest.raises(ExportError) as err:
        export_model(d, tmp_path / "out", ctx_len=CTX, prefill_seq_len=CHUNK, mla_cache="latent")
    assert str(err.value) == ("--mla-cache latent does not support DeepseekV32ForCausalLM's DeepSeek sparse "
                              "attention (its absorbed attention has no indexer selection); export with "
                              "--mla-cache full")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("target", ["portable", "onnxruntime-fused"])
def test_deepseek_v4_is_refused_from_its_config(tmp_path, target):
    """A DeepSeek-V4 config as its checkpoints ship it (the older ``compress_ratios`` per layer): refused before
    any weight is read (it used to fail with an ``IndexError`` after loading)."""
    from qeff_kv.errors import ExportError
    from qeff_kv.export import export_model

    d = _config_only(None, tmp_path / "v4", architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4",
                     num_hidden_layers=4, hidden_size=64, vocab_size=128, compress_ratios=[0, 4, 128, 4],
                     hc_mult=4, index_topk=512, index_head_dim=128, index_n_heads=64)
    with pytest.raises(ExportError) as err:
        export_model(d, tmp_path / "out", ctx_len=CTX, prefill_seq_len=CHUNK, target=target)
    assert str(err.value).startswith("DeepseekV4ForCausalLM: its compressed attention layers (compress_rates) keep "
                                     "running compressor buffers that emit one cache entry per window")
    assert "\n" not in str(err.value) and not (tmp_path / "out").exists()
