"""The peer's round-two graphs (issue 33): QEfficient's MLA latent and expanded DeepSeek-V3 graphs, its speculative
target (TLM) Llama, its hybrid Qwen3.5-MoE language graph (gated-delta-net states beside a full-attention layer) and
its sliding-window GPT-OSS, read from ../shared/fixtures/qeff-peer-2 (``QEFF_KV_PEER2_FIXTURES``; skipped with the
reason where absent).

Every graph checks (exporter-made output dims matched to the inputs; broken copies still fail), strips to the plain
graph's names exactly, selects exactly its state buffers by ``.*VLLM.*`` and generates transformers' greedy tokens
(prefilled in one chunk and in chunks of 5, a prompt inside and past the sliding window); a state's kind follows
from its shapes (a copy of the hybrid with Qwen3.5 dense's naming, ``past_key``/``past_value`` for the recurrent
states, runs the same); speculative lookup on the TLM graph gives the plain tokens with ``--speculative-k``.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import helper, numpy_helper

import _kv_graphs as kvg
from suite import requires_torch
from qeff_kv.tools import check as qcheck
from qeff_kv.graph import graphio
from qeff_kv.contract import naming
from qeff_kv.tools.buffers import buffers_report
from qeff_kv.errors import ContractError, RuntimeInputError
from qeff_kv.tools.rewrite import rewrite
from qeff_kv.runtime import Session
from qeff_kv.runtime.memory import ring as ring_mod
from qeff_kv.runtime.decoding.speculative import PromptLookup, SpeculativeDecoder
from qeff_kv_cli.main import main

P12 = [5, 17, 42, 99, 7, 130, 64, 23, 88, 11, 201, 3]   # the README's prompt
P21 = P12 + P12[:9]                                      # past GPT-OSS's window of 8
NEW, CTX = 8, 32
IMAGE_TOKEN = 250                                        # the hybrid VLM's image_token_id (no image here)
MODELS = {"llama_tlm": "llama_tlm", "gpt_oss_swa": "gpt_oss_swa", "deepseek_v3_mla": "deepseek_v3_mla",
          "deepseek_v3_fullkv": "deepseek_v3_mla", "qwen3_5_moe_vlm_hybrid": "qwen3_5_moe_vlm_hybrid"}
PAIRS = ["llama_tlm", "gpt_oss_swa", "deepseek_v3_mla", "qwen3_5_moe_vlm_hybrid"]   # plain + vllm
GRAPHS = [f"{m}_{v}.onnx" for m in PAIRS for v in ("plain", "vllm")] + ["deepseek_v3_fullkv_vllm.onnx"]


def model_of(graph: str) -> str:
    return MODELS[graph.rsplit("_", 1)[0]]


def session_kwargs(graph: str) -> dict:
    kw: dict = {"ctx_len": CTX}
    if graph.startswith("gpt_oss"):
        kw["sliding_window"] = 8          # the model's window: the peer's graph records none
    if graph.startswith("qwen3_5"):
        kw["image_token_id"] = IMAGE_TOKEN
    return kw


@pytest.fixture(scope="module")
def fx(peer2_dir):
    return peer2_dir


@pytest.fixture(scope="module")
def want(fx):
    """transformers' greedy tokens (fp32, its built-in classes) on each model folder, for both prompts."""
    pytest.importorskip("torch")
    import torch
    import transformers

    out = {}
    for name in sorted(set(MODELS.values())):
        cls = (transformers.AutoModelForImageTextToText if name.startswith("qwen3_5")
               else transformers.AutoModelForCausalLM)
        model = cls.from_pretrained(fx / "models" / name, dtype=torch.float32).eval()
        for prompt in (P12, P21):
            ids = torch.tensor([prompt])
            with torch.no_grad():
                gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                                     min_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
            out[(name, len(prompt))] = gen[0, len(prompt):].tolist()
    return out


def _io_names(path) -> tuple[list[str], list[str]]:
    m = onnx.load(str(path), load_external_data=False)
    return [i.name for i in m.graph.input], [o.name for o in m.graph.output]


# ============================================================================================ check
@pytest.mark.parametrize("graph", GRAPHS)
def test_every_graph_checks(fx, graph):
    report = qcheck.check(fx / graph)
    assert report.ok, report.format_text()
    assert report.prefix == ("VLLM" if "_vllm" in graph else None)


def test_hybrid_made_up_dims_are_matched_to_the_inputs(fx):
    """The peer declares the hybrid's retained outputs with dims its exporter made up; the scatter (past_key.3) and
    shape inference (the recurrent states) match them to the inputs; the batch axis inference leaves open (a Where
    broadcast) is said in a note, and the replaced recurrent states in the inplace rule's note."""
    layout = graphio.layout_of(graphio.load(fx / "qwen3_5_moe_vlm_hybrid_plain.onnx"))
    for p in layout.pairs:
        assert p.output.shape[1:] == p.input.shape[1:], p.output_name
    assert layout.output("past_key.3_RetainedState").shape == ("batch_size", 2, "ctx_len", 32)
    assert layout.made_up == {f"recurrent_state.{i}_RetainedState": (0,) for i in range(3)}
    s = Session(fx / "qwen3_5_moe_vlm_hybrid_plain.onnx", **session_kwargs("qwen3_5"))
    assert s.inplace and s.describe()["recurrent_double_buffered"]   # KV in place, the replaced states two buffers
    s.generate([P12], max_new_tokens=2, stop_tokens=[])
    before = s.kv_data_pointers()            # after the last run's swap: the buffers the next run reads
    outs = s.bound_output_pointers()         # where the last run wrote
    assert outs["past_key.3_RetainedState"] == before["past_key.3"]
    assert outs["recurrent_state.0_RetainedState"] == before["recurrent_state.0"]   # written to the spare, swapped
    s.generate([(s.sequences[0], [7])], max_new_tokens=1, stop_tokens=[])
    assert s.kv_data_pointers()["recurrent_state.0"] != before["recurrent_state.0"]   # the two sets alternate
    assert s.kv_data_pointers()["past_key.3"] == before["past_key.3"]
    report = qcheck.check(fx / "qwen3_5_moe_vlm_hybrid_plain.onnx")
    assert "recurrent_state.0_RetainedState" in report.rule("pair-match").note
    assert report.rule("inplace").note.startswith("recurrent state replaced whole, not updated in place: "
                                                  "conv_state.0, recurrent_state.0, conv_state.1")


def _edit(src, dst, edit):
    m = onnx.load(str(src))
    edit(m.graph)
    onnx.save(m, str(dst))
    return dst


def _reroute(graph, name: str, node) -> None:
    """Let ``node`` produce the graph output ``name`` from what produced it before (renamed ``name + '_inner'``)."""
    for n in graph.node:
        for i, o in enumerate(n.output):
            if o == name:
                n.output[i] = name + "_inner"
    graph.node.append(node)


def test_broken_copies_of_the_hybrid_still_fail(fx, tmp_path):
    src = fx / "qwen3_5_moe_vlm_hybrid_plain.onnx"
    # 1. a retained output that really is another shape (transposed), still declared with made-up dims
    out = "conv_state.1_RetainedState"
    bad = _edit(src, tmp_path / "transposed.onnx", lambda g: _reroute(
        g, out, helper.make_node("Transpose", [out + "_inner"], [out], perm=[0, 1, 3, 2])))
    report = qcheck.check(bad)
    assert report.failed == ["pair-match", "inplace"] or report.failed == ["pair-match"]
    msgs = [v.message for v in report.rule("pair-match").violations]
    assert msgs == ["conv_state.1 dim 2 is 64 but conv_state.1_RetainedState dim 2 is 4",
                    "conv_state.1 dim 3 is 4 but conv_state.1_RetainedState dim 3 is 64"]

    # 2. a retained KV output that is no longer the scatter's (doubled along the positions): nothing matches axis 2
    out = "past_key.3_RetainedState"
    doubled = _edit(src, tmp_path / "doubled.onnx", lambda g: _reroute(
        g, out, helper.make_node("Concat", [out + "_inner", out + "_inner"], [out], axis=2)))
    violations = qcheck.check(doubled).rule("pair-match").violations
    assert [v.message for v in violations] == [
        "past_key.3 dim 2 is 'ctx_len' but past_key.3_RetainedState dim 2 is "
        "'CtxScatterpast_key.3_RetainedState_dim_2', a dim the exporter made up that neither the graph's scatter nor "
        "shape inference matches"]

    # 3. a declared static dim that differs from the input's
    def declare(g):
        o = next(o for o in g.output if o.name == "recurrent_state.0_RetainedState")
        o.type.tensor_type.shape.dim[3].Clear()
        o.type.tensor_type.shape.dim[3].dim_value = 8
    report = qcheck.check(_edit(src, tmp_path / "declared.onnx", declare))
    assert report.failed == ["pair-match"]
    assert [v.message for v in report.rule("pair-match").violations] == [
        "recurrent_state.0 dim 3 is 16 but recurrent_state.0_RetainedState dim 3 is 8"]


# ============================================================================================ names
@pytest.mark.parametrize("model", PAIRS)
def test_strip_gives_the_plain_graphs_names_exactly(fx, model, tmp_path):
    dst = tmp_path / "stripped.onnx"
    rewrite(fx / f"{model}_vllm.onnx", dst, strip=True)
    assert _io_names(dst) == _io_names(fx / f"{model}_plain.onnx")
    assert qcheck.check(dst, expected_prefix=None).ok


def test_strip_of_the_expanded_deepseek_graph(fx, tmp_path):
    dst = tmp_path / "stripped.onnx"
    rewrite(fx / "deepseek_v3_fullkv_vllm.onnx", dst, strip=True)
    ins, outs = _io_names(fx / "deepseek_v3_fullkv_vllm.onnx")
    assert _io_names(dst) == ([n.replace("_VLLM", "") for n in ins], [n.replace("_VLLM", "") for n in outs])


@pytest.mark.parametrize("graph", [g for g in GRAPHS if "_vllm" in g])
def test_vllm_regex_selects_exactly_the_state_buffers(fx, graph):
    sel = buffers_report(fx / graph, regex=".*VLLM.*").to_json()["selection"]
    ins, outs = _io_names(fx / graph)
    state = [n for n in ins + outs if naming.parse_kv_name(n) is not None]
    assert sel["selected"] == state and sel["equals_kv_set"] and sel["selects_non_kv"] == []
    assert not any(n.startswith(("vision_embeds", "image_idx", "logits")) for n in sel["selected"])


# ============================================================================================ kinds
def test_state_kinds_agree_across_buffers_check_and_the_runtime(fx):
    kinds = {
        "qwen3_5_moe_vlm_hybrid_vllm.onnx": {0: "recurrent", 1: "recurrent", 2: "recurrent", 3: "full"},
        "gpt_oss_swa_vllm.onnx": {0: "ring", 1: "full"},
        "deepseek_v3_mla_vllm.onnx": {0: "latent", 1: "latent"},
        "deepseek_v3_fullkv_vllm.onnx": {0: "full", 1: "full"},
        "llama_tlm_vllm.onnx": {0: "full", 1: "full"}}
    for graph, by_layer in kinds.items():
        j = buffers_report(fx / graph).to_json()
        assert {p["layer"]: p["state"] for p in j["pairs"]} == by_layer, graph
        s = Session(fx / graph, **session_kwargs(graph))
        assert sorted(s.cache.recurrent.shapes) == sorted(p["input"] for p in j["pairs"] if p["state"] == "recurrent")
        assert sorted(s.rings.capacities) == sorted(p["input"] for p in j["pairs"] if p["state"] == "ring")


def _dense_naming(src, dst):
    """The hybrid with Qwen3.5 dense's naming: layer i's conv state is ``past_key.{i}`` ``[batch, 128, 4]`` (rank 3,
    reshaped from and to the graph's own ``[batch, 2, 64, 4]``), its recurrent state ``past_value.{i}``."""
    def edit(g):
        g.initializer.extend([numpy_helper.from_array(np.array([-1, 2, 64, 4], np.int64), "to_rank4"),
                              numpy_helper.from_array(np.array([-1, 128, 4], np.int64), "to_rank3")])
        del g.value_info[:]
        for i in range(3):
            conv, rec = f"conv_state.{i}", f"recurrent_state.{i}"
            key, value = f"past_key.{i}", f"past_value.{i}"
            for n in g.node:
                n.input[:] = [value if x == rec else x for x in n.input]
                n.output[:] = [value + "_RetainedState" if x == rec + "_RetainedState" else x for x in n.output]
            _reroute(g, conv + "_RetainedState",
                     helper.make_node("Reshape", [conv + "_RetainedState_inner", "to_rank3"], [key + "_RetainedState"]))
            g.node.insert(0, helper.make_node("Reshape", [key, "to_rank4"], [conv]))
            for v in list(g.input) + list(g.output):
                base = v.name.removesuffix("_RetainedState")
                retained = v.name != base
                if base in (conv, rec):
                    shape = ["batch_size", 128, 4] if base == conv else ["batch_size", 4, 16, 16]
                    name = (key if base == conv else value) + ("_RetainedState" if retained else "")
                    new = helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, shape)
                    v.CopyFrom(new)
    return _edit(src, dst, edit)


@requires_torch
def test_recurrent_states_named_past_key_and_past_value_are_recurrent(fx, want, tmp_path):
    """State kinds follow from shapes and axes, not the stem: the dense-naming copy checks, its layers 0-2 are
    recurrent everywhere, it runs to the same tokens, and its state file keeps those states whole."""
    path = _dense_naming(fx / "qwen3_5_moe_vlm_hybrid_plain.onnx", tmp_path / "dense_naming.onnx")
    report = qcheck.check(path)
    assert report.ok, report.format_text()
    j = buffers_report(path).to_json()
    assert [(p["input"], p["state"], p["capacity"]) for p in j["pairs"]] == [
        (f"past_{s}.{i}", "recurrent" if i < 3 else "full", None)
        for i in range(4) for s in ("key", "value")]
    s = Session(path, **session_kwargs("qwen3_5"))
    assert s.recurrent and sorted(s.cache.recurrent.shapes) == sorted(f"past_{k}.{i}" for i in range(3)
                                                                      for k in ("key", "value"))
    [g] = s.generate([P21], max_new_tokens=NEW, stop_tokens=[])
    assert g.tokens == want[("qwen3_5_moe_vlm_hybrid", 21)]
    # a state file: saved after 20 prompt tokens, loaded into a fresh session, fed the last one: the same tokens
    s2 = Session(path, **session_kwargs("qwen3_5"))
    seq = s2.add_sequence()
    s2.prefill(seq, P21[:20])
    saved = s2.save_state(seq, tmp_path / "state.safetensors")
    from safetensors.numpy import load_file

    assert load_file(str(saved))["past_key.0"].shape == (1, 128, 4)   # whole, never cut by position
    s3 = Session(path, **session_kwargs("qwen3_5"))
    [g3] = s3.generate([(s3.load_state(saved), [P21[20]])], max_new_tokens=NEW, stop_tokens=[])
    assert g3.tokens == want[("qwen3_5_moe_vlm_hybrid", 21)]


def test_dense_naming_with_torchscript_made_up_output_dims(fx, tmp_path):
    """Issue 42: the dense-naming copy, prefixed VLLM, its recurrent states' retained outputs reshaped and declared
    with TorchScript's ``Reshape<name>_dim_<k>`` (fixed input dims, no position axis): check passes with the prefix,
    strips, checks plain and runs to the plain hybrid's tokens; a size that differs still fails in one line."""
    dense = _dense_naming(fx / "qwen3_5_moe_vlm_hybrid_plain.onnx", tmp_path / "dense_naming.onnx")
    rewrite(dense, tmp_path / "dense_vllm.onnx", prefix="VLLM")
    outs = [f"past_{s}.{i}_VLLM_RetainedState" for i in range(3) for s in ("key", "value")]

    def made_up(declare=None):
        def edit(g):
            for out in outs:
                kvg.torchscript_output(g, out, (declare or {}).get(out))
        return edit
    path = _edit(tmp_path / "dense_vllm.onnx", tmp_path / "made_up.onnx", made_up())
    assert graphio.layout_of(graphio.load(path)).made_up == {o: tuple(range(3 if "key" in o else 4)) for o in outs}
    run = CliRunner().invoke
    r = run(main, ["check", str(path), "--kv-cache-prefix", "VLLM"])
    assert r.exit_code == 0 and r.output.splitlines()[-1] == "OK: 10 passed, 0 failed, 2 skipped", r.output
    r = run(main, ["rewrite", str(path), "-o", str(tmp_path / "stripped.onnx"), "--strip-prefix"])
    assert r.exit_code == 0, r.output
    r = run(main, ["check", str(tmp_path / "stripped.onnx"), "--no-kv-cache-prefix"])
    assert r.exit_code == 0, r.output
    tokens = []
    for graph in (fx / "qwen3_5_moe_vlm_hybrid_plain.onnx", tmp_path / "stripped.onnx"):
        [g] = Session(graph, **session_kwargs("qwen3_5")).generate([P21], max_new_tokens=NEW, stop_tokens=[])
        tokens.append(g.tokens)
    assert tokens[1] == tokens[0]
    bad = _edit(tmp_path / "dense_vllm.onnx", tmp_path / "bad.onnx", made_up({outs[1]: {2: 8}}))
    r = run(main, ["check", str(bad)])
    assert r.exit_code == 1 and r.output.splitlines()[-1] == "FAILED (pair-match): 9 passed, 1 failed, 2 skipped"
    assert "past_value.0_VLLM dim 2 is 16 but past_value.0_VLLM_RetainedState dim 2 is 8" in r.output


def test_ambiguous_state_is_refused_in_one_line(fx, tmp_path):
    """A layer whose past_key has no position axis (rank 3) but whose past_value has one: what does it retain?"""
    path = _dense_naming(fx / "qwen3_5_moe_vlm_hybrid_plain.onnx", tmp_path / "dense_naming.onnx")

    def confuse(g):
        v = next(v for v in g.input if v.name == "past_value.0")
        v.CopyFrom(helper.make_tensor_value_info("past_value.0", onnx.TensorProto.FLOAT,
                                                 ["batch_size", 4, "ctx_len", 16]))
    bad = _edit(path, tmp_path / "ambiguous.onnx", confuse)
    msg = ("past_key.0 has shape ('batch_size', 128, 4) (no position axis: a recurrent state) but past_value.0 has "
           "('batch_size', 4, 'ctx_len', 16); cannot tell what layer 0 retains")
    report = qcheck.check(bad)
    assert msg in [v.message for v in report.rule("pair-match").violations]
    with pytest.raises(ContractError, match=r"^" + msg.replace("(", r"\(").replace(")", r"\)") + "$"):
        Session(bad, **session_kwargs("qwen3_5"))


# ============================================================================================ generate
@requires_torch
@pytest.mark.parametrize("chunk", [16, 5])
@pytest.mark.parametrize("graph", GRAPHS)
def test_every_graph_generates_transformers_tokens(fx, want, graph, chunk):
    s = Session(fx / graph, prefill_seq_len=chunk, **session_kwargs(graph))
    for prompt in (P12, P21):
        [g] = s.generate([prompt], max_new_tokens=NEW, stop_tokens=[])
        assert g.tokens == want[(model_of(graph), len(prompt))], (graph, len(prompt))
        s.remove_sequence(g.sequence)


@requires_torch
def test_sliding_window_graph_is_fed_within_its_ring(fx, want):
    """The peer's GPT-OSS graph writes a chunk into its ring before attending: a chunk that wraps the ring (8 slots)
    gives other tokens; the session's plan fills the ring up to its last slot, then feeds one token at a time."""
    assert ring_mod.within_ring([(0, 5), (5, 5), (10, 5), (15, 5), (20, 1)], 0, 8) == \
        [(0, 5), (5, 3)] + [(p, 1) for p in range(8, 21)]
    s = Session(fx / "gpt_oss_swa_vllm.onnx", prefill_seq_len=5, **session_kwargs("gpt_oss"))
    assert s.rings.capacity == 8
    [g] = s.generate([P21], max_new_tokens=NEW, stop_tokens=[])
    assert g.tokens == want[("gpt_oss_swa", 21)]
    s.remove_sequence(g.sequence)
    s._ring_within = False   # what feeding chunks past the window gives: not transformers' tokens
    [bad] = s.generate([P21], max_new_tokens=NEW, stop_tokens=[])
    assert bad.tokens != want[("gpt_oss_swa", 21)]


# ============================================================================================ speculative
@requires_torch
@pytest.mark.parametrize("graph", ["llama_tlm_plain.onnx", "llama_tlm_vllm.onnx"])
def test_speculative_lookup_on_the_tlm_graph_gives_the_plain_tokens(fx, want, graph):
    s = Session(fx / graph, ctx_len=CTX, prefill_seq_len=16)
    assert s.speculative and s.speculative_tokens is None
    with pytest.raises(RuntimeInputError, match=rf"^{graph} records no K \(speculative_tokens\); give "
                                                r"--speculative-k K \(drafts per step\)$"):
        SpeculativeDecoder(s, PromptLookup())
    with pytest.raises(RuntimeInputError, match=r"^k=16: a verification step of 17 tokens exceeds the prefill "
                                                r"length 16, the most the graph is run with"):
        SpeculativeDecoder(s, PromptLookup(), k=16)
    dec = SpeculativeDecoder(s, PromptLookup(), k=3)
    g = dec.generate(P21, max_new_tokens=NEW, stop_tokens=[])
    assert g.tokens == want[("llama_tlm", 21)]
    assert dec.stats.verifications >= 1 and dec.stats.accepted >= 1   # drafts were verified, some kept


@requires_torch
def test_generate_cli_takes_speculative_k(fx, want):
    path = str(fx / "llama_tlm_vllm.onnx")
    ids = ",".join(map(str, P21))
    base = ["generate", path, "--prompt-ids", ids, "--ctx-len", str(CTX), "--max-new-tokens", str(NEW),
            "--ignore-eos", "--json"]
    r = CliRunner().invoke(main, base + ["--speculative", "lookup", "--speculative-k", "3"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["sequences"][0]["tokens"] == want[("llama_tlm", 21)] and d["timings"]["speculative"]["drafted"] >= 1
    r = CliRunner().invoke(main, base + ["--speculative", "lookup"])
    assert r.exit_code == 2 and r.stderr == ("error: llama_tlm_vllm.onnx records no K (speculative_tokens); give "
                                             "--speculative-k K (drafts per step)\n")
    r = CliRunner().invoke(main, base + ["--speculative-k", "3"])
    assert r.exit_code == 2 and r.stderr == "error: --speculative-k goes with --speculative\n"


def test_serve_takes_speculative_k_on_the_tlm_graph(fx):
    pytest.importorskip("fastapi")
    from qeff_kv.serve.config import ServeConfig
    from qeff_kv.serve.server import build_engine

    path = str(fx / "llama_tlm_vllm.onnx")
    with pytest.raises(RuntimeInputError, match=r"records no K \(speculative_tokens\); give --speculative-k K"):
        build_engine(ServeConfig(export_dir=path, speculative="lookup", ctx_len=CTX, max_sequences=1))
    engine = build_engine(ServeConfig(export_dir=path, speculative="lookup", speculative_k=3, ctx_len=CTX,
                                      max_sequences=1))
    assert engine.speculation.k == 3


# ============================================================================================ hand-off
@pytest.fixture(scope="module")
def ours(fx, tmp_path_factory):
    """Our exports of two fixture checkpoints: DeepSeek-V3 with the latent cache, the TLM's Llama plain."""
    pytest.importorskip("torch")
    from qeff_kv.export.api import export_model

    out = tmp_path_factory.mktemp("ours")
    return {"deepseek_v3_mla": export_model(fx / "models" / "deepseek_v3_mla", out / "mla", ctx_len=CTX,
                                            mla_cache="latent").onnx_path,
            "llama_tlm": export_model(fx / "models" / "llama_tlm", out / "llama", ctx_len=CTX).onnx_path}


HANDOFFS = [("deepseek_v3_mla", "deepseek_v3_mla_plain.onnx"), ("llama_tlm", "llama_tlm_plain.onnx")]


@requires_torch
@pytest.mark.parametrize("model, peer", HANDOFFS)
@pytest.mark.parametrize("direction", ["peer-to-ours", "ours-to-peer"])
@pytest.mark.parametrize("via", ["file", "memory"])
def test_handoff_between_the_peers_graph_and_ours_gives_one_process_tokens(fx, want, ours, model, peer,
                                                                           direction, via, tmp_path):
    """The first 20 prompt tokens prefilled in one graph, the state handed to the other exporter's graph of the same
    checkpoint (a state file, or in memory), the last prompt token and the decode there: one process's tokens."""
    a, b = (fx / peer, ours[model]) if direction == "peer-to-ours" else (ours[model], fx / peer)
    src, dst = Session(a, ctx_len=CTX, prefill_seq_len=16), Session(b, ctx_len=CTX, prefill_seq_len=16)
    seq = src.add_sequence()
    src.prefill(seq, P21[:20])
    if via == "file":
        moved = dst.load_state(src.save_state(seq, tmp_path / "state.safetensors"))
    else:
        moved = dst.import_state(src.export_state(seq, checksum=False))
    assert moved.length == 20
    [g] = dst.generate([(moved, [P21[20]])], max_new_tokens=NEW, stop_tokens=[])
    assert g.tokens == want[(model, 21)]


@requires_torch
def test_handoff_is_refused_in_one_line_where_layouts_or_weights_differ(fx, ours, tmp_path):
    from qeff_kv.errors import StateFileError

    src = Session(ours["deepseek_v3_mla"], ctx_len=CTX)
    seq = src.add_sequence()
    src.prefill(seq, P12)
    saved = src.save_state(seq, tmp_path / "latent.safetensors")
    # the peer's expanded per-head cache of the same checkpoint: another layout
    full = Session(fx / "deepseek_v3_fullkv_vllm.onnx", ctx_len=CTX)
    with pytest.raises(StateFileError, match=r"^.*latent.safetensors: saved from a graph with another KV contract "
                                             r"\(buffers \['compressed_kv.0', 'compressed_kv.1'\]\.\.\., prefix "
                                             r"'\(none\)'; this graph has \['past_key.0_VLLM', 'past_value.0_VLLM'\]"):
        full.load_state(saved)
    # the peer's latent graph with one weight changed: another model, same KV contract
    def nudge(g):
        t = next(t for t in g.initializer if t.name == "model.embed_tokens.weight")
        arr = numpy_helper.to_array(t).copy()
        arr[3, 5] += 1.0
        t.CopyFrom(numpy_helper.from_array(arr, t.name))
    other = Session(_edit(fx / "deepseek_v3_mla_plain.onnx", tmp_path / "other.onnx", nudge), ctx_len=CTX)
    with pytest.raises(StateFileError, match=r"saved from another model \(same KV contract, different weights or "
                                             r"structure; the file names a checkpoint, this graph records none"):
        other.load_state(saved)


# ============================================================================================ compile-config
COMPILE = {
    "llama_tlm_vllm.onnx": ({"speculative_tokens": 3}, [{"num_logits_to_keep": "1", "seq_len": "16"},
                                                        {"num_logits_to_keep": "4", "seq_len": "4"}]),
    "gpt_oss_swa_vllm.onnx": ({"sliding_window": 8, "prefill_seq_len": 8}, [{"sliding_window": "8", "seq_len": "8"},
                                                                            {"sliding_window": "8", "seq_len": "1"}]),
    "deepseek_v3_mla_vllm.onnx": ({}, [{"seq_len": "16"}, {"seq_len": "1"}]),
    "deepseek_v3_fullkv_vllm.onnx": ({}, [{"seq_len": "16"}, {"seq_len": "1"}]),
    "qwen3_5_moe_vlm_hybrid_vllm.onnx": ({"img_size": 32, "vision_size": 16},
                                         [{"seq_len": "16", "vision_size": "16"}, {"seq_len": "1", "vision_size": "16"}]),
}


@pytest.mark.parametrize("graph", sorted(COMPILE))
def test_compile_config_writes_what_the_peers_compile_step_expects(fx, graph, tmp_path):
    """custom_io for every prefixed state buffer (recurrent states too; vision_embeds at its own dtype), the
    specializations with num_logits_to_keep (K given: the graph records none) and sliding_window."""
    from qeff_kv.tools.compile_from_graph import write_compile_config_for_graph

    extra, want = COMPILE[graph]
    kw = {"prefill_seq_len": 16, "ctx_len": CTX, **extra}
    write_compile_config_for_graph(fx / graph, tmp_path, **kw)
    specs = json.loads((tmp_path / "specializations.json").read_text())["specializations"]
    assert [{k: s[k] for k in w} for s, w in zip(specs, want)] == want and len(specs) == 2
    assert all(s["ctx_len"] == str(CTX) and s["batch_size"] == "1" for s in specs)
    io = (tmp_path / "custom_io.yaml").read_text()
    ins, outs = _io_names(fx / graph)
    state = [n for n in ins + outs if naming.parse_kv_name(n) is not None]
    named = [line.split("IOName: ")[1] for line in io.splitlines() if "IOName: " in line]
    assert [n for n in named if n in state] == state and all(n.endswith(("_VLLM", "_VLLM_RetainedState"))
                                                            for n in state)
    assert all(f"IOName: {n}\n   Precision: float16" in io for n in state)
