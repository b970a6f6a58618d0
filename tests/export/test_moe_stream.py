"""Streaming MoE checkpoints (issue 51, qeff_kv/export/weights/expert_keys.py): a checkpoint that stores one tensor
per expert (the Hub's format, which ``save_pretrained`` writes back) streams into the fused expert parameters
transformers builds (``mlp.experts.gate_up_proj [E, 2I, H]``), one fused tensor at a time.

Proofs: the streamed graph is the whole-model graph (nodes, names, initializer bytes) and decodes the same greedy
tokens as transformers; the store's fused tensors are transformers' own loaded parameters, their chunks the same
bytes, with a bounded number of checkpoint tensors alive; a checkpoint already in the fused layout streams too
(the KV probe runs the experts as the trace does: the model's own grouped_mm refuses a stand-in's strides); a
conversion that is not a stacking of experts refuses streaming in one line.
"""

from __future__ import annotations

import numpy as np
import pytest

from suite import requires_torch
from onnx_digest import graph_digest as _graph_digest

pytestmark = requires_torch


def _checkpoint_keys(folder) -> set[str]:
    from qeff_kv.export.weights.checkpoint_store import read_header

    return {k for f in folder.glob("*.safetensors") for k in read_header(f)[1]}


def _export_both(folder, tmp_path, monkeypatch, **kw):
    """``(whole, streamed, streamed progress notes)``: the export with the model loaded whole (unverified) and the
    streamed one (verified)."""
    from families import CTX

    from qeff_kv.export import export_model

    kw = dict(ctx_len=CTX, prefill_seq_len=4, **kw)
    monkeypatch.setenv("QEFF_KV_EXPORT_STREAM", "0")
    whole = export_model(folder, tmp_path / "whole", verify=False, **kw)
    monkeypatch.setenv("QEFF_KV_EXPORT_STREAM", "1")
    notes: list[str] = []
    streamed = export_model(folder, tmp_path / "streamed", progress=notes.append, **kw)
    return whole, streamed, notes


def _assert_streamed(notes, name):
    assert any(n.startswith(f"building tiny-{name} without its weights") for n in notes), notes
    assert not any("loading the whole model" in n or "streaming is not possible" in n for n in notes), notes


@pytest.mark.parametrize("name,target,stored", [
    ("qwen3_moe", "portable", ".experts.0.gate_proj.weight"),
    ("qwen3_moe", "onnxruntime-fused", ".experts.0.gate_proj.weight"),
    ("mixtral", "portable", "block_sparse_moe.experts.0.w1.weight"),
    ("mixtral", "onnxruntime-fused", "block_sparse_moe.experts.0.w1.weight"),
    ("qwen2_moe", "onnxruntime-fused", ".experts.0.gate_proj.weight"),
    ("deepseek_v3", "portable", ".experts.0.gate_proj.weight"),
    ("granitemoe", "portable", "block_sparse_moe.input_linear.weight"),
    ("gpt_oss", "portable", "self_attn.sinks"),
])
def test_moe_checkpoint_streams_to_the_whole_model_graph(family_models, family_refs, tmp_path, monkeypatch,
                                                         name, target, stored):
    """qwen3_moe/mixtral: routed experts stored per expert; qwen2_moe: a shared expert behind a sigmoid gate;
    deepseek_v3: shared experts, a dense first layer (MLA: portable only); granitemoe: stacked experts under
    other names (renamed, not stacked); gpt_oss: the attention sinks traced as a reshaped view of their
    parameter."""
    from dialect_loops import greedy_loop
    from families import CTX, NEW, PROMPTS

    folder = family_models(name)
    keys = _checkpoint_keys(folder)
    assert any(k.endswith(stored) for k in keys)   # the checkpoint's own layout, not the model's
    if stored.endswith(("gate_proj.weight", "w1.weight")):
        assert not any("gate_up_proj" in k for k in keys)
    whole, streamed, notes = _export_both(folder, tmp_path, monkeypatch, target=target)
    _assert_streamed(notes, name)
    assert streamed.manifest["verification"]["status"] == "passed"
    assert _graph_digest(whole.onnx_path) == _graph_digest(streamed.onnx_path)
    assert whole.manifest["checkpoint"] == streamed.manifest["checkpoint"]
    tokens = [greedy_loop(streamed.onnx_path, p, NEW, capacity=CTX) for p in PROMPTS]
    assert tokens == [greedy_loop(whole.onnx_path, p, NEW, capacity=CTX) for p in PROMPTS]
    assert tokens == family_refs(name)


def test_per_expert_checkpoint_streams_int4(family_models, tmp_path, monkeypatch):
    """``--weights int4`` packed as the weights stream, from per-expert tensors: the whole-model path's graph."""
    from qeff_kv.export.weights import quantize

    monkeypatch.setattr(quantize, "STREAM", True)
    whole, streamed, notes = _export_both(family_models("qwen3_moe"), tmp_path, monkeypatch,
                                          target="onnxruntime-fused", weights="int4")
    _assert_streamed(notes, "qwen3_moe")
    assert any(n.endswith("(packed as they are written)") for n in notes)
    digest = _graph_digest(streamed.onnx_path)
    assert any(n[0] == "MatMulNBits" for n in digest["nodes"])
    assert _graph_digest(whole.onnx_path) == digest
    assert streamed.manifest["verification"]["status"] == "passed"


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_fused_parameters_are_transformers_loaded_ones(family_models, monkeypatch, name):
    """Every parameter read through the converted store (by the model's name) equals the parameter transformers
    loads (its conversion mapping applied); a fused one's chunks are its bytes in order, one expert at a time;
    the store never holds more than one fused tensor's parts at once."""
    import torch
    import transformers

    from qeff_kv.export.weights import stream
    from qeff_kv.export.weights.checkpoint_store import CheckpointStore
    from qeff_kv.export.weights.expert_keys import ConvertedStore, converted_store

    folder = family_models(name)
    skel = stream.skeleton(folder, torch.float32)
    store = converted_store(CheckpointStore(folder), skel)
    assert isinstance(store, ConvertedStore) and store.fused
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    plan = stream.plan(skel, store)
    assert set(plan.keys.values()) >= set(store.fused)
    for pname, want in loaded.state_dict().items():
        if pname not in dict(skel.named_parameters()):
            continue
        got = store.array(pname, torch.float32)
        np.testing.assert_array_equal(got, want.numpy(), err_msg=pname)
        if pname in store.fused:
            sizes, joined = [], b""
            for chunk in store.chunks(pname, torch.float32):
                sizes.append(chunk.shape)
                joined += chunk.tobytes()
            del chunk
            assert sizes == [tuple(want.shape[1:])] * want.shape[0]   # one expert's slab at a time
            assert joined == got.tobytes()
        del got
    assert store.live == 0 and store.max_live <= 3   # the fused tensor, one expert's slab and one of its parts


def test_fused_layout_checkpoint_streams(tmp_path, monkeypatch):
    """A checkpoint already in transformers' fused layout (the model's own state dict) streams: the KV probe runs
    the experts gathered, as the trace does (the model's own grouped_mm refuses a stand-in's zero strides)."""
    import torch
    import transformers
    from safetensors.torch import save_file

    from families import FAMILIES

    fam = FAMILIES["qwen3_moe"]
    cfg = getattr(transformers, fam.config_class)(**fam.config_kwargs())
    cfg.architectures = [fam.model_class]
    torch.manual_seed(0)
    model = getattr(transformers, fam.model_class)(cfg).eval()
    folder = tmp_path / "tiny-qwen3_moe"
    folder.mkdir()
    cfg.save_pretrained(folder)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, folder / "model.safetensors",
              metadata={"format": "pt"})
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in _checkpoint_keys(folder))
    whole, streamed, notes = _export_both(folder, tmp_path, monkeypatch, target="portable")
    _assert_streamed(notes, "qwen3_moe")
    assert streamed.manifest["verification"]["status"] == "passed"
    assert _graph_digest(whole.onnx_path) == _graph_digest(streamed.onnx_path)


def test_a_conversion_that_is_not_a_stacking_refuses_streaming():
    """Only stacking the experts (then joining gate and up), or joining several tensors, streams; any other
    operation is named in one line."""
    from transformers.core_model_loading import Chunk, Concatenate, MergeModulelist, WeightConverter

    from qeff_kv.export.weights.expert_keys import ConversionRefused, conversion_ops

    fused = WeightConverter(["mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"],
                            "mlp.experts.gate_up_proj", operations=[MergeModulelist(dim=0), Concatenate(dim=1)])
    assert conversion_ops(fused) == (0, 1)
    joined = WeightConverter(["q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight"], "conv1d.weight",
                             operations=[Concatenate(dim=0)])   # Kimi Linear: no experts, three tensors joined
    assert conversion_ops(joined) == (None, 0)
    split = WeightConverter("mlp.gate_up.weight", ["mlp.gate.weight", "mlp.up.weight"], operations=[Chunk(dim=0)])
    with pytest.raises(ConversionRefused, match=r"^the checkpoint converts mlp\.gate\.weight by Chunk, which is "
                                                r"not streamed$"):
        conversion_ops(split)
    on_experts = WeightConverter(["mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"],
                                 "mlp.experts.gate_up_proj", operations=[MergeModulelist(dim=0), Concatenate(dim=0)])
    with pytest.raises(ConversionRefused, match="joins mlp.experts.gate_up_proj on its expert axis"):
        conversion_ops(on_experts)


@pytest.mark.parametrize("name", ["longcat_flash", "lfm2_moe"])
def test_streamed_reference_reads_weights_used_outside_their_module(family_models, name):
    """A weight its module's parent reads (LongcatFlash's router: ``F.linear(x, self.classifier.weight)``; LFM2's
    short convolution: ``self.conv.weight``) is read when accessed: the streamed skeleton gives transformers'
    own logits (it ran on the stand-in before: verification failed by 2.15 and 5.53)."""
    import torch
    import transformers

    from qeff_kv.export.weights import stream
    from qeff_kv.export.weights.checkpoint_store import CheckpointStore
    from qeff_kv.export.weights.expert_keys import converted_store

    folder = family_models(name)
    skel = stream.skeleton(folder, torch.float32)
    store = converted_store(CheckpointStore(folder), skel)
    plan = stream.plan(skel, store)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                            attn_implementation="eager").eval()
    ids = torch.tensor([[5, 17, 42, 99, 13, 7]])
    with torch.no_grad(), stream.streamed_weights(skel, plan, store):
        got = skel(input_ids=ids, use_cache=False).logits
    with torch.no_grad():
        want = ref(input_ids=ids, use_cache=False).logits
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-5)
    assert store.live == 0
    assert torch.nn.Module.__getattr__.__name__ == "__getattr__"   # the access hook is gone


def test_a_view_by_axes_of_size_one_is_read_back_as_that_view():
    """GPT-OSS's ``sinks.reshape(1, -1, 1, 1)``, folded by the exporter, is its parameter's checkpoint tensor
    reshaped; a transposed 2-D weight is its permutation; a slice (an offset into the stand-in) is no view."""
    import torch

    from qeff_kv.export.weights import stream
    from qeff_kv.export.weights.views import NotAView, view_of

    sinks = stream.stand_in((4,), torch.float32)
    assert view_of(sinks.reshape(1, -1, 1, 1), (4,)) == (None, (1, 4, 1, 1))
    w = stream.stand_in((3, 5), torch.float32)
    assert view_of(w.t(), (3, 5)) == ((1, 0), None)
    assert view_of(w.t().reshape(5, 1, 3), (3, 5)) == ((1, 0), (5, 1, 3))
    with pytest.raises(NotAView, match=r"^a folded weight of shape \(2, 5\) is not a view of its parameter"):
        view_of(w[1:], (3, 5))

    class Store:
        def shape(self, key):
            return (3, 5)

        def array(self, key, dtype):
            return np.arange(15, dtype=np.float32).reshape(3, 5)

    got = stream.lazy_tensor(Store(), "w", (1, 0), torch.float32, "w", (5, 1, 3))
    assert tuple(got.shape) == (5, 1, 3)
    np.testing.assert_array_equal(got.numpy(), np.arange(15, dtype=np.float32).reshape(3, 5).T.reshape(5, 1, 3))
