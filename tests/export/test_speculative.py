"""Speculative decoding (issue 21): ``--speculative-tokens K`` graphs on every target (names unchanged, verified
row by row, compile files and tools), the runtime's verification step and O(1) rewind giving exactly the tokens
of plain decoding (greedy and seeded sampling; prompt lookup on repetitive and free text; a draft export), the
CLI, and the refusals. Tiny seeded models (tests/helpers/hf_models.py); the exports are made once per module."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("torch")

from click.testing import CliRunner  # noqa: E402

from qeff_kv.graph import graphio
from qeff_kv.tools.buffers import buffers_report  # noqa: E402
from qeff_kv.tools.compile_from_graph import write_compile_config_for_graph  # noqa: E402
from qeff_kv.tools.check import check  # noqa: E402
from qeff_kv.errors import ExportError, RuntimeInputError  # noqa: E402
from qeff_kv.export import export_model  # noqa: E402
from qeff_kv.runtime import Session  # noqa: E402
from qeff_kv.runtime.decoding.sampling import SamplingParams  # noqa: E402
from qeff_kv.runtime.decoding.speculative import DraftModel, PromptLookup, SpeculativeDecoder, score  # noqa: E402
from qeff_kv_cli.main import main as cli  # noqa: E402

from hf_models import hf_greedy, make_model_dir  # noqa: E402

K = 4
CTX = 96
TARGETS = ("portable", "onnxruntime", "onnxruntime-fused")
REPEAT = [int(t) for t in np.random.default_rng(5).integers(3, 128, 10)] * 3     # a passage quoted three times
FREE = [int(t) for t in np.random.default_rng(6).integers(3, 128, 17)]
NEW = 40
SEEDED = SamplingParams(temperature=0.9, top_k=40, seed=11)


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    root = tmp_path_factory.mktemp("speculative")
    target = make_model_dir("llama", root / "target", seed=0)
    draft = _truncated(target, root / "draft")
    out = {t: export_model(target, root / f"spec-{t}", ctx_len=CTX, prefill_seq_len=8, target=t,
                           speculative_tokens=K) for t in TARGETS}
    out["plain"] = export_model(target, root / "plain", ctx_len=CTX, prefill_seq_len=8, target="onnxruntime-fused")
    out["draft"] = export_model(draft, root / "draft-export", ctx_len=CTX, prefill_seq_len=8, target="onnxruntime")
    out["model_dir"] = target
    return out


def _truncated(model_dir, out):
    """The draft: the target's first layer, embeddings and head (the same vocabulary; agrees with it often)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    model.model.layers = model.model.layers[:1]
    model.config.num_hidden_layers = 1
    model.save_pretrained(out, safe_serialization=True)
    return out


def _plain(folder, prompt, sampling=None) -> list[int]:
    return Session(folder).generate([prompt], max_new_tokens=NEW, sampling=sampling, stop_tokens=[])[0].tokens


@pytest.mark.parametrize("target", TARGETS)
def test_export_graph_names_and_verification(spec, target):
    res, plain = spec[target], spec["plain"]
    assert res.manifest["speculative_tokens"] == K and res.manifest["options"]["speculative_tokens"] == K
    assert "speculative_tokens" not in plain.manifest["options"] and plain.manifest["speculative_tokens"] is None
    ver = res.manifest["verification"]
    assert ver["status"] == "passed" and ver["steps"] == 1 + K + 1    # the prompt, then K+1 rows in one step
    g = graphio.load(res.onnx_path)
    lay, ref = graphio.layout_of(g), graphio.layout_of(graphio.load(plain.onnx_path))
    assert [(p.input_name, p.output_name) for p in lay.pairs] == [(p.input_name, p.output_name) for p in ref.pairs]
    assert [i.name for i in g.graph.inputs][-1] == "num_logits_to_keep"
    assert [i.name for i in g.graph.inputs][:-1] == [i.name for i in graphio.load(plain.onnx_path).graph.inputs]
    assert [d if isinstance(d, int) else str(d) for d in g.graph.outputs[0].shape] == \
        ["batch_size", "num_logits_to_keep", 128]
    assert g.metadata_props["qeff_kv.speculative_tokens"] == str(K)


def test_score_rows_equal_single_steps(spec):
    """The verification step's K+1 rows are the logits K+1 single decode steps give."""
    s = Session(spec["onnxruntime-fused"].out_dir)
    one = s.add_sequence()
    s.prefill(one, FREE)
    feed = [5, 9, 33, 7, 100]
    singles = [s.decode({one: t})[one] for t in feed]
    s.truncate(one, len(FREE))
    rows = score(s, one, feed)
    assert rows.shape == (K + 1, 128) and one.length == len(FREE) + K + 1
    np.testing.assert_allclose(rows, np.stack(singles), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("target", TARGETS)
def test_lookup_greedy_equals_transformers(spec, target):
    want = hf_greedy(spec["model_dir"], REPEAT, NEW)
    dec = SpeculativeDecoder(Session(spec[target].out_dir), PromptLookup())
    got = dec.generate(REPEAT, max_new_tokens=NEW, stop_tokens=[])
    assert got.tokens == want
    assert dec.stats.accepted > 0 and dec.stats.verifications < NEW - 1   # fewer steps than tokens
    assert got.sequence.length == len(REPEAT) + NEW - 1


@pytest.mark.parametrize("prompt", [REPEAT, FREE], ids=["repetitive", "free"])
@pytest.mark.parametrize("sampling", [None, SEEDED], ids=["greedy", "seeded"])
def test_lookup_equals_plain_decoding(spec, prompt, sampling):
    want = _plain(spec["plain"].out_dir, prompt, sampling)     # the ordinary export, plain decoding
    dec = SpeculativeDecoder(Session(spec["onnxruntime-fused"].out_dir), PromptLookup())
    assert dec.generate(prompt, max_new_tokens=NEW, sampling=sampling, stop_tokens=[]).tokens == want
    assert dec.stats.decode_tokens == NEW - 1


@pytest.mark.parametrize("sampling", [None, SEEDED], ids=["greedy", "seeded"])
def test_draft_export_equals_plain_decoding(spec, sampling):
    want = _plain(spec["plain"].out_dir, FREE, sampling)
    dec = SpeculativeDecoder(Session(spec["onnxruntime"].out_dir), DraftModel(Session(spec["draft"].out_dir)))
    assert dec.generate(FREE, max_new_tokens=NEW, sampling=sampling, stop_tokens=[]).tokens == want
    assert dec.stats.accepted > 0 and dec.stats.verifications < NEW - 1


def test_stop_token_inside_accepted_drafts(spec):
    want = _plain(spec["plain"].out_dir, REPEAT)
    stop = want[NEW // 2]
    plain = Session(spec["plain"].out_dir).generate([REPEAT], max_new_tokens=NEW, stop_tokens=[stop])[0]
    got = SpeculativeDecoder(Session(spec["portable"].out_dir), PromptLookup()).generate(
        REPEAT, max_new_tokens=NEW, stop_tokens=[stop])
    assert got.tokens == plain.tokens and got.finish_reason == plain.finish_reason == "stop"


def test_tools_know_the_speculative_graph(spec, tmp_path):
    path = spec["onnxruntime"].onnx_path
    report = check(path)
    assert report.ok and report.to_json()["num_logits_to_keep"] == {"speculative_tokens": K}
    assert "num_logits_to_keep" not in check(spec["plain"].onnx_path).to_json()
    assert buffers_report(path).to_json()["speculative_tokens"] == K
    write_compile_config_for_graph(path, tmp_path, prefill_seq_len=8, ctx_len=CTX)
    assert json.loads((tmp_path / "specializations.json").read_text())["specializations"] == [
        {"batch_size": "1", "seq_len": "8", "ctx_len": str(CTX), "num_logits_to_keep": "1"},
        {"batch_size": "1", "seq_len": str(K + 1), "ctx_len": str(CTX), "num_logits_to_keep": str(K + 1)}]
    exported = json.loads((spec["onnxruntime"].out_dir / "specializations.json").read_text())
    assert exported == json.loads((tmp_path / "specializations.json").read_text())
    with pytest.raises(RuntimeInputError, match="no num_logits_to_keep input"):
        write_compile_config_for_graph(spec["plain"].onnx_path, tmp_path, prefill_seq_len=8, ctx_len=CTX,
                                       speculative_tokens=K)


def test_cli_generate_speculative(spec):
    folder = str(spec["onnxruntime-fused"].out_dir)
    ids = ",".join(map(str, REPEAT))
    runner = CliRunner()
    r = runner.invoke(cli, ["generate", folder, "--prompt-ids", ids, "--max-new-tokens", str(NEW), "--ignore-eos",
                            "--speculative", "lookup", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["sequences"][0]["tokens"] == _plain(spec["plain"].out_dir, REPEAT)
    sp = out["timings"]["speculative"]
    assert sp["drafter"] == "lookup" and 0 < sp["acceptance_rate"] <= 1 and sp["accepted"] > 0
    r = runner.invoke(cli, ["generate", folder, "--prompt-ids", ids, "--max-new-tokens", "8", "--ignore-eos",
                            "--speculative", str(spec["draft"].out_dir), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout.strip().splitlines()[-1])["timings"]["speculative"]["drafter"] == "draft-model"
    r = runner.invoke(cli, ["generate", folder, "--prompt-ids", "5,6", "--prompt-ids", "7", "--speculative", "lookup"])
    assert r.exit_code == 2 and "error: --speculative decodes one sequence" in r.output


def test_refusals(spec, tmp_path):
    with pytest.raises(ExportError, match=r"^--speculative-tokens 8: a verification step of 9 tokens does not fit "
                                          r"in ctx_len 8$"):
        export_model(None, tmp_path / "x", ctx_len=8, prefill_seq_len=4, speculative_tokens=8)
    with pytest.raises(ExportError, match="speculative_tokens must be a positive"):
        export_model(None, tmp_path / "x", ctx_len=64, speculative_tokens=0)
    assert not (tmp_path / "x").exists()
    plain = Session(spec["plain"].out_dir)
    with pytest.raises(RuntimeInputError, match="is not a speculative-decoding graph"):
        SpeculativeDecoder(plain, PromptLookup())
    seq = plain.add_sequence()
    plain.prefill(seq, FREE)
    with pytest.raises(RuntimeInputError, match="one row of logits per step"):
        score(plain, seq, [1, 2])
    with pytest.raises(RuntimeInputError, match=rf"k=5 drafts exceed the graph's speculative_tokens={K}"):
        SpeculativeDecoder(Session(spec["portable"].out_dir), PromptLookup(), k=K + 1)
    dec = SpeculativeDecoder(Session(spec["portable"].out_dir), PromptLookup())
    with pytest.raises(RuntimeInputError, match="capacity is ctx_len=96"):
        dec.generate(FREE, max_new_tokens=CTX)
