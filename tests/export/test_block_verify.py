"""Verification a block of decoder layers at a time (qeff_kv/graph/blocks.py, BlockProbeRunner): the same verdict
as the whole graph's, chosen where the whole graph's verification does not fit, a broken layer caught, and a graph
that cannot be cut at the residual stream verified whole or refused in one line, never passed wrongly."""

from __future__ import annotations

import re

import numpy as np
import onnx
import pytest

from suite import requires_torch
from qeff_kv.errors import VerificationError, VerificationMemoryError

pytestmark = [requires_torch]

CTX, CHUNK = 32, 8


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    """A tiny seeded three-layer Llama saved in bf16 (the streamed path), untied head, norms away from 1.0."""
    import torch
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   tie_word_embeddings=False)
    torch.manual_seed(5)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.input_layernorm.weight.uniform_(0.5, 1.5)
            layer.post_attention_layernorm.weight.uniform_(0.5, 1.5)
    out = tmp_path_factory.mktemp("blocks") / "llama3-bf16"
    model.to(torch.bfloat16).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def unverified(llama3, tmp_path_factory):
    """``dtype -> the written graph`` (exported without verification)."""
    from qeff_kv.export import export_model

    root = tmp_path_factory.mktemp("unverified")
    return {dt: export_model(llama3, root / dt, ctx_len=CTX, prefill_seq_len=CHUNK, dtype=dt, verify=False).onnx_path
            for dt in ("float16", "float32")}


def _probe_and_reference(llama3, dtype: str, **probe_kw):
    import torch
    import transformers

    from qeff_kv.export import verify

    model = transformers.LlamaForCausalLM.from_pretrained(llama3, torch_dtype=getattr(torch, dtype)).eval()
    probe = verify.make_probe(256, CTX, CHUNK)
    for k, v in probe_kw.items():
        setattr(probe, k, v)
    return probe, verify.reference_run(model, probe)


def _walk(runner, probe, ref):
    """The probe's steps (chunks, then the reference's decode tokens) through ``runner``."""
    out, start = [], 0
    while start < len(probe.prompt):
        part = probe.prompt[start:start + probe.chunk]
        pad = probe.chunk - len(part)
        out.append(runner.step(part + [0] * pad, list(range(start, start + len(part))) + [-1] * pad, 0))
        start += len(part)
    for k in range(probe.decode_steps):
        out.append(runner.step([ref.tokens[k]], [len(probe.prompt) + k], 0))
    return out


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_blocks_of_one_layer_pass_are_recorded_and_agree_with_the_whole_graph(llama3, unverified, tmp_path,
                                                                              monkeypatch, dtype):
    from qeff_kv.export import export_model, verify
    from qeff_kv.export.probe_runner import BLOCK_ENV, BlockProbeRunner, ProbeRunner

    kw = dict(ctx_len=CTX, prefill_seq_len=CHUNK, dtype=dtype)
    whole = export_model(llama3, tmp_path / "whole", **kw).manifest["verification"]
    monkeypatch.setenv(BLOCK_ENV, "1")
    notes: list[str] = []
    v = export_model(llama3, tmp_path / "blocks", progress=notes.append, **kw).manifest["verification"]
    assert v["status"] == "passed" and v["blocks"] == 3 and "blocks" not in whole
    same = ("steps", "prompt_len", "chunk")
    assert {k: v[k] for k in same} == {k: whole[k] for k in same}
    assert abs(v["max_abs_diff"] - whole["max_abs_diff"]) <= 0.05 * whole["tolerance"]
    assert any(n.startswith("verified in 3 blocks: max |logit difference| ") for n in notes)

    # the same graph run whole and a layer at a time: the same logits and greedy tokens at every step
    probe, ref = _probe_and_reference(llama3, dtype)
    at_once = _walk(ProbeRunner(unverified[dtype], CTX, 1), probe, ref)
    blocks = BlockProbeRunner(unverified[dtype], CTX, 1, None, 1)
    assert [(b.first, b.last) for b in blocks.plan] == [(0, 0), (1, 1), (2, 2)]
    by_block = blocks.run_steps([(str(k), w) for k, w in enumerate(_walk(blocks, probe, ref))])
    assert len(by_block) == len(at_once) == probe.decode_steps + 2
    close = {"float32": 1e-5, "float16": 2e-3}[dtype]   # float16: a cut rounds the hidden state where onnxruntime's
    for (_label, got), want in zip(by_block, at_once):   # float32 kernels kept it whole: a few float16 steps at most
        assert int(np.argmax(got)) == int(np.argmax(want))
        np.testing.assert_allclose(got, want, rtol=0, atol=close * max(1.0, float(np.abs(want).max())))


def test_blocks_are_chosen_where_the_whole_graph_does_not_fit(llama3, tmp_path, monkeypatch):
    """A float16 graph whose weights onnxruntime would hold twice over: as many layers to a block as fit; where not
    even one layer fits, the one-line refusal says what a layer at a time needs."""
    import torch
    import transformers

    from qeff_kv.support import limits
    from qeff_kv.export import export_model, verify

    model = transformers.LlamaForCausalLM.from_pretrained(llama3, torch_dtype=torch.float16)
    n, layer, rest = verify.layer_bytes(model)   # rest: the embedding or the head, and the final norm
    assert n == 3 and layer > 0 and rest == 256 * 64 * 2 + 64 * 2
    monkeypatch.setattr(verify, "MEMORY_MARGIN", 0)
    monkeypatch.setattr(limits, "available_memory", lambda: 2 * (2 * layer + rest))   # two layers, not three
    notes: list[str] = []
    kw = dict(ctx_len=CTX, prefill_seq_len=CHUNK, dtype="float16")
    v = export_model(llama3, tmp_path / "fits", progress=notes.append, **kw).manifest["verification"]
    assert v["status"] == "passed" and v["blocks"] == 2
    assert any(n.startswith("verifying 2 layers at a time (about 0.0 GiB; the whole graph would need more than")
               for n in notes)
    # --verify (verification asked for, not only on by default) takes blocks too (the 8B float16 benchmark row)
    assert export_model(llama3, tmp_path / "asked", verify=True, **kw).manifest["verification"]["blocks"] == 2
    monkeypatch.setattr(verify, "BLOCK_LAYER_BYTES", 2 * layer)   # bounded even where more would fit
    monkeypatch.setattr(limits, "available_memory", lambda: 1 << 40)
    assert verify.block_layers_for(model, True, 1 << 50, notes.append)[0] == 1
    monkeypatch.setattr(limits, "available_memory", lambda: 2 * (layer + rest) - 1)
    with pytest.raises(VerificationMemoryError, match=r"^verification needs about 0\.0 GiB \(onnxruntime's CPU kernels "
                                                      r"hold a float16 graph's weights as float32; a layer at a time, "
                                                      r"about 0\.0 GiB\) and 0\.0 GiB is available: free memory, or "
                                                      r"pass --no-verify to export without verification"):
        export_model(llama3, tmp_path / "refused", **kw)
    assert not (tmp_path / "refused" / "manifest.json").exists()


def _rewrite(src, dst, change) -> None:
    model = onnx.load(str(src))
    change(model.graph)
    onnx.save_model(model, str(dst), save_as_external_data=True, location=dst.name + ".data")


def test_a_weight_broken_in_one_layer_fails_block_verification(llama3, unverified, tmp_path):
    from onnx import numpy_helper

    from qeff_kv.export import verify

    probe, ref = _probe_and_reference(llama3, "float16", block_layers=1)
    kw = dict(ctx_len=CTX, dtype="float16")
    assert verify.verify_graph(unverified["float16"], probe, ref, **kw).extra == {"blocks": 3}

    def break_layer_one(graph):
        node = next(n for n in graph.node if "layers.1/mlp/down_proj" in n.name and n.op_type == "MatMul")
        init = next(t for t in graph.initializer if t.name in node.input)
        init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) * 3, init.name))

    broken = tmp_path / "broken.onnx"
    _rewrite(unverified["float16"], broken, break_layer_one)
    with pytest.raises(VerificationError, match=r"^verification failed after the prompt: logits differ from PyTorch "
                                                r"by up to [0-9.e+-]+ \(tolerance [0-9.e+-]+\)"):
        verify.verify_graph(broken, probe, ref, **kw)


def _skip_a_layer(src: int):
    """A rewrite: layer ``src + 1`` also adds layer ``src``'s attention output times zero (the same logits)."""
    from onnx import helper

    def change(graph):
        nodes = list(graph.node)
        attn = next(n for n in nodes if n.name.endswith(f"layers.{src}/self_attn/o_proj/MatMul")).output[0]
        add = next(n for n in nodes if n.name.startswith(f"/model/layers.{src + 1}/") and n.op_type == "Add"
                   and any(i.startswith(f"/model/layers.{src + 1}/self_attn/o_proj") for i in n.input))
        at = nodes.index(add)
        extra = [helper.make_node("Constant", [], ["skip_zero"], value=helper.make_tensor("z", 1, [], [0.0])),
                 helper.make_node("Mul", [attn, "skip_zero"], ["skip_mul"]),
                 helper.make_node("Add", [add.input[0], "skip_mul"], ["skip_add"])]
        add.input[0] = "skip_add"
        del graph.node[:]
        graph.node.extend(nodes[:at] + extra + nodes[at:])

    return change


@pytest.mark.parametrize("src,why", [
    # layer 1 reads layer 1's input and layer 2 reads layer 1's attention: no node's outputs alone separate them
    (1, "no residual value separates layer 1 from layer 2"),
    # layer 0's own input is the embedding (no state in it): the structure allows a cut after layer 0's attention,
    # which the traced names refuse
    (0, "node '/model/layers.0/Add' falls in layer 1 by the graph's structure"),
])
def test_a_graph_not_cut_at_the_residual_stream_is_verified_whole_or_refused(llama3, unverified, tmp_path, src, why):
    """A layer also reads an earlier layer's attention output: blocks are refused; forced, the graph is verified
    whole; chosen for memory, the export is refused in one line."""
    from qeff_kv.contract import naming
    from qeff_kv.graph import blocks
    from qeff_kv.export import verify
    from qeff_kv.export.probe_runner import BlockRunRefused

    skipped = tmp_path / "skip.onnx"
    _rewrite(unverified["float32"], skipped, _skip_a_layer(src))
    with pytest.raises(BlockRunRefused, match=f"^{re.escape(why)}$"):
        verify.BlockProbeRunner(skipped, CTX, 1, None, 1)
    with pytest.raises(blocks.BlockCutError):
        blocks.Cut(onnx.load(str(skipped), load_external_data=False),
                   [(i, naming.kv_input_name(s, i), naming.kv_retained_name(s, i)) for i in range(3)
                    for s in ("past_key", "past_value")])

    probe, ref = _probe_and_reference(llama3, "float32", block_layers=1)
    notes: list[str] = []
    v = verify.verify_graph(skipped, probe, ref, ctx_len=CTX, dtype="float32", say=notes.append)
    assert v.status == "passed" and "blocks" not in v.extra
    assert notes == [f"verifying a block of layers at a time is not possible ({why}): the whole graph at once"]
    probe.block_reason = "verification needs about 9.0 GiB and 1.0 GiB is available: free memory, or pass --no-verify"
    with pytest.raises(VerificationMemoryError, match=r"^the graph cannot be verified a block of layers at a time "
                                                      rf"\({re.escape(why)}\), and verification needs about 9\.0 GiB"):
        verify.verify_graph(skipped, probe, ref, ctx_len=CTX, dtype="float32", say=notes.append)
