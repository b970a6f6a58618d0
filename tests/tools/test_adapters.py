"""PEFT LoRA adapters read without torch (qeff_kv/tools/adapters.py): the folded scaling is PEFT's own (each
module's delta equals PEFT's lora layer minus its base layer), every variant that is not plain LoRA is refused in
one line, and the stacked graph inputs hold each adapter in its slot, zero-padded, slot 0 zero."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from suite import requires_torch
from qeff_kv.contract.lora import LoraGeometry, LoraModule
from qeff_kv.errors import AdapterError
from qeff_kv.tools.adapters import fit, read_adapter, stack, summary

pytestmark = requires_torch

REPO = Path(__file__).resolve().parents[2]
PLAIN = dict(r=4, alpha=8, targets=["q_proj", "v_proj", "down_proj"], seed=1)
RSLORA = dict(r=8, alpha=4, targets=r".*\.self_attn\.(q_proj|o_proj)", seed=2, rslora=True)
PATTERN = dict(r=8, alpha=16, targets=["q_proj", "o_proj"], seed=3, dtype="bfloat16",
               rank_pattern={"o_proj": 2, "layers.1.self_attn.q_proj": 3}, alpha_pattern={"q_proj": 5})
#: the tiny Llama's adaptable modules: (in_features, out_features)
FEATURES = {"self_attn.q_proj": (64, 64), "self_attn.v_proj": (64, 32), "self_attn.o_proj": (64, 64),
            "mlp.down_proj": (128, 64)}


def geometry(max_rank=8, dtype="float32", layers=2, modules=tuple(FEATURES), **features) -> LoraGeometry:
    feats = {**FEATURES, **features}
    return LoraGeometry(tuple(LoraModule(i, m, *feats[m]) for i in range(layers) for m in modules), dtype, max_rank)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """The tiny Llama and its adapters (plain, rslora with a regex target, rank/alpha patterns saved as bf16, DoRA,
    modules_to_save), made once."""
    pytest.importorskip("peft")
    from hf_models import make_model_dir
    from lora_adapters import make_adapter

    root = tmp_path_factory.mktemp("adapters")
    model = make_model_dir("llama", root)
    out = {"model": model}
    for name, spec in (("plain", PLAIN), ("rslora", RSLORA), ("pattern", PATTERN)):
        out[name] = make_adapter(model, root / name, **spec)
    out["dora"] = make_adapter(model, root / "dora", **{**PLAIN, "dora": True})
    out["saved"] = make_adapter(model, root / "saved", **PLAIN, modules_to_save=["lm_head"])
    return out


@pytest.fixture(scope="module")
def read(made):
    return {name: read_adapter(made[name]) for name in ("plain", "rslora", "pattern")}


def edited(src: Path, dst: Path, **changes) -> Path:
    """A copy of adapter folder ``src`` whose config has ``changes`` (a value ``None`` deletes the field)."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "adapter_config.json").read_text())
    config.update(changes)
    (dst / "adapter_config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return dst


# ------------------------------------------------------------------------------------------------ reading
def test_read_adapter_modules_rank_and_identity(made, read):
    plain, rs, pat = read["plain"], read["rslora"], read["pattern"]
    assert plain.name == "plain" and plain.path == made["plain"]
    assert plain.modules == ("mlp.down_proj", "self_attn.q_proj", "self_attn.v_proj")
    assert plain.layers == (0, 1) and plain.rank == 4 and plain.alpha == 8 and not plain.rslora
    assert plain.base_model == str(made["model"])
    assert rs.modules == ("self_attn.o_proj", "self_attn.q_proj") and rs.rslora and rs.rank == 8
    # rank_pattern: o_proj everywhere r=2, layer 1's q_proj r=3, layer 0's q_proj the default r=8
    ranks = {key: a.shape[1] for key, (a, b) in pat.weights.items()}
    assert ranks == {(0, "self_attn.o_proj"): 2, (1, "self_attn.o_proj"): 2, (0, "self_attn.q_proj"): 8,
                     (1, "self_attn.q_proj"): 3}
    assert pat.rank == 8
    a, b = plain.weights[(0, "self_attn.v_proj")]
    assert a.shape == (64, 4) and b.shape == (4, 32) and a.dtype == b.dtype == np.float32
    assert plain.nbytes == sum(a.nbytes + b.nbytes for a, b in plain.weights.values()) > 0
    assert not a.flags.writeable
    assert summary(plain) == {"name": "plain", "path": str(made["plain"]), "rank": 4, "alpha": 8.0,
                              "rslora": False, "modules": list(plain.modules), "bytes": plain.nbytes,
                              "base_model": str(made["model"])}
    assert read_adapter(made["plain"], name="sql").name == "sql"


def test_bf16_file_is_read(made, read):
    raw = (made["pattern"] / "adapter_model.safetensors").read_bytes()
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"BF16"}
    a, _ = read["pattern"].weights[(0, "self_attn.q_proj")]
    # bf16 values widened exactly: their low 16 bits are zero
    assert np.all(a.view(np.uint32) & 0xFFFF == 0) and np.abs(a).max() > 0


@pytest.mark.parametrize("name", ["plain", "rslora", "pattern"])
def test_folded_scaling_is_peft_delta(made, read, name):
    """x @ A @ B with our folded B equals PEFT's lora layer minus its base layer, on every adapted module."""
    import torch
    from lora_adapters import peft_model

    model = peft_model(made["model"], made[name])
    modules = dict(model.named_modules())
    gen = np.random.default_rng(0)
    for (layer, module), (a, b) in read[name].weights.items():
        lora_layer = modules[f"base_model.model.model.layers.{layer}.{module}"]
        x = gen.standard_normal((3, a.shape[0])).astype(np.float32)
        with torch.no_grad():
            tx = torch.from_numpy(x)
            want = (lora_layer(tx) - lora_layer.base_layer(tx)).numpy()
        got = x @ a @ b
        assert np.abs(want).max() > 1e-2, "the adapter must change the module's output"
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())


def test_import_needs_no_torch():
    code = ("import sys, qeff_kv.tools.adapters; "
            "print(sorted(m for m in ('torch', 'transformers', 'peft') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("field, value, words", [
    ("use_dora", True, "DoRA"),
    ("use_qalora", True, "QA-LoRA"),
    ("lora_bias", True, "lora_bias"),
    ("bias", "all", "bias='all'"),
    ("bias", "lora_only", "bias='lora_only'"),
    ("fan_in_fan_out", True, "fan_in_fan_out"),
    ("modules_to_save", ["lm_head"], "modules_to_save"),
    ("layer_replication", [[0, 2], [1, 2]], "layer_replication"),
    ("trainable_token_indices", [3, 4], "trainable_token_indices"),
    ("alora_invocation_tokens", [5, 6], "alora_invocation_tokens"),
    ("target_parameters", ["mlp.experts.down_proj"], "target_parameters"),
    ("use_bdlora", {"nblocks": 2}, "use_bdlora"),
    ("kasa_config", {"x": 1}, "kasa_config"),
    ("peft_type", "IA3", "peft_type is 'IA3'"),
    ("init_lora_weights", "pissa_niter_4", "changes the base model's weights"),
    ("init_lora_weights", "olora", "changes the base model's weights"),
    ("r", 5, "r = 5"),
    ("target_modules", ["q_proj", "v_proj"], "down_proj"),
    ("target_modules", r".*\.(q_proj|v_proj)", "down_proj"),
    ("exclude_modules", ["v_proj"], "v_proj"),
    ("layers_to_transform", [0], "layers.1"),
    ("rank_pattern", {"q_proj": 2}, "r = 2"),
])
def test_config_refusals(made, tmp_path, field, value, words):
    folder = edited(made["plain"], tmp_path / "a", **{field: value})
    with pytest.raises(AdapterError, match="^adapter a: ") as err:
        read_adapter(folder)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_real_dora_and_modules_to_save_folders_are_refused(made, tmp_path):
    with pytest.raises(AdapterError, match=r"DoRA \(use_dora\) is not supported"):
        read_adapter(made["dora"])
    with pytest.raises(AdapterError, match="modules_to_save"):
        read_adapter(made["saved"])
    # PEFT saves the trained lm_head as base_model.model.lm_head.weight: the key alone is refused too
    with pytest.raises(AdapterError, match=r"tensor base_model\.model\.lm_head\.weight is not a lora_A/lora_B"):
        read_adapter(edited(made["saved"], tmp_path / "s", modules_to_save=None))
    # DoRA's magnitude vectors, its config flag gone
    with pytest.raises(AdapterError, match=r"lora_magnitude_vector"):
        read_adapter(edited(made["dora"], tmp_path / "d", use_dora=False))


def test_folder_refusals(made, tmp_path):
    with pytest.raises(AdapterError, match="is not a folder"):
        read_adapter(tmp_path / "nowhere")
    bare = tmp_path / "bare"
    bare.mkdir()
    with pytest.raises(AdapterError, match="has no adapter_config.json"):
        read_adapter(bare)
    pickled = edited(made["plain"], tmp_path / "pickled")
    (pickled / "adapter_model.safetensors").rename(pickled / "adapter_model.bin")
    with pytest.raises(AdapterError, match="holds only adapter_model.bin .a pickle, unsafe"):
        read_adapter(pickled)
    (pickled / "adapter_model.bin").unlink()
    with pytest.raises(AdapterError, match="has no adapter_model.safetensors"):
        read_adapter(pickled)
    (pickled / "adapter_config.json").write_text("{not json")
    with pytest.raises(AdapterError, match="not valid JSON"):
        read_adapter(pickled)
    cut = edited(made["plain"], tmp_path / "cut")
    data = (cut / "adapter_model.safetensors").read_bytes()
    (cut / "adapter_model.safetensors").write_bytes(data[:-100])
    with pytest.raises(AdapterError, match=r"^adapter cut: .*adapter_model.safetensors: the tensors cover \d+ bytes "
                                           r"but the data section holds \d+ \(truncated: a corrupt file\)$"):
        read_adapter(cut)
    tail = edited(made["plain"], tmp_path / "tail")   # bytes no tensor names: refused as safetensors refuses them
    (tail / "adapter_model.safetensors").write_bytes(data + bytes(16))
    with pytest.raises(AdapterError, match=r"^adapter tail: .*\(bytes no tensor names: a corrupt file\)$"):
        read_adapter(tail)


def test_unmappable_keys_are_refused(made, tmp_path):
    from safetensors.numpy import save_file

    folder = edited(made["plain"], tmp_path / "emb")
    tensors = {"base_model.model.model.embed_tokens.lora_embedding_A": np.ones((4, 128), np.float32),
               "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": np.ones((4, 64), np.float32),
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": np.ones((64, 4), np.float32)}
    save_file(tensors, folder / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match=r"tensor base_model\.model\.model\.embed_tokens\.lora_embedding_A is"):
        read_adapter(folder)
    del tensors["base_model.model.model.embed_tokens.lora_embedding_A"]
    tensors["base_model.model.model.vision.layers.0.self_attn.q_proj.lora_A.weight"] = np.ones((4, 64), np.float32)
    tensors["base_model.model.model.vision.layers.0.self_attn.q_proj.lora_B.weight"] = np.ones((64, 4), np.float32)
    save_file(tensors, folder / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match="two different layer stacks"):
        read_adapter(folder)


# ------------------------------------------------------------------------------------------------ the graph
def test_fit_accepts_a_matching_graph(read):
    for adapter in read.values():
        fit(adapter, geometry())
    fit(read["plain"], geometry(max_rank=None), base_name="/models/TINY-LLAMA/")


@pytest.mark.parametrize("geo, base, words", [
    (dict(modules=("self_attn.q_proj", "self_attn.v_proj")), None,
     "adapts mlp.down_proj, which the graph does not adapt (the graph adapts self_attn.q_proj, self_attn.v_proj)"),
    (dict(layers=1), None, "adapts layer 1, but the graph's adapted layers end at 0"),
    (dict(max_rank=2), None, "has rank 4, more than the graph's max_rank 2"),
    ({"self_attn.v_proj": (64, 16)}, None,
     "hidden sizes do not match: self_attn.v_proj of layer 0 maps 64 -> 32 features in the adapter, 64 -> 16"),
    ({}, "meta-llama/Llama-3.2-1B", "was trained on"),
])
def test_fit_refusals(read, geo, base, words):
    with pytest.raises(AdapterError) as err:
        fit(read["plain"], geometry(**geo), base_name=base)
    assert words in str(err.value)


def test_stack_slots_padding_and_dtype(read):
    plain, pat = read["plain"], read["pattern"]
    geo = geometry()
    inputs = stack([plain, pat], geo)
    assert set(inputs) == {n for m in geo.modules for n in (m.a_name, m.b_name)}
    for m in geo.modules:
        a, b = inputs[m.a_name], inputs[m.b_name]
        assert a.shape == (3, m.in_features, 8) and b.shape == (3, 8, m.out_features)
        assert a.dtype == b.dtype == np.float32
        assert not a[0].any() and not b[0].any()
    a, b = inputs["lora_A.1.self_attn.q_proj"], inputs["lora_B.1.self_attn.q_proj"]
    want_a, want_b = pat.weights[(1, "self_attn.q_proj")]
    np.testing.assert_array_equal(a[2, :, :3], want_a)
    np.testing.assert_array_equal(b[2, :3], want_b)
    assert not a[2, :, 3:].any() and not b[2, 3:].any()
    # padding is exact: the padded product is the adapter's delta
    x = np.random.default_rng(1).standard_normal((2, 64)).astype(np.float32)
    np.testing.assert_allclose(x @ a[2] @ b[2], x @ want_a @ want_b, rtol=1e-6, atol=1e-6)
    # a module the adapter leaves alone stays zero in its slot
    assert not inputs["lora_A.0.self_attn.o_proj"][1].any() and not inputs["lora_B.0.mlp.down_proj"][2].any()
    np.testing.assert_array_equal(inputs["lora_B.0.mlp.down_proj"][1, :4], plain.weights[(0, "mlp.down_proj")][1])


def test_stack_rank_axis_and_half(read):
    plain = read["plain"]
    assert stack([plain], geometry(max_rank=None))["lora_A.0.self_attn.q_proj"].shape == (2, 64, 4)
    assert stack([], geometry(max_rank=None))["lora_B.1.mlp.down_proj"].shape == (1, 1, 64)
    assert stack([plain], geometry(), rank=6)["lora_A.0.self_attn.q_proj"].shape == (2, 64, 6)
    with pytest.raises(AdapterError, match="less than the largest adapter rank 4"):
        stack([plain], geometry(), rank=3)
    with pytest.raises(AdapterError, match="more than the graph's max_rank 8"):
        stack([plain], geometry(), rank=9)
    half = stack([plain], geometry(dtype="float16"))
    assert {v.dtype for v in half.values()} == {np.dtype(np.float16)}
    np.testing.assert_allclose(half["lora_B.0.self_attn.q_proj"][1, :4], plain.weights[(0, "self_attn.q_proj")][1],
                               rtol=1e-3)
    with pytest.raises(AdapterError, match="not float32 or float16"):
        stack([plain], geometry(dtype="int64"))
    with pytest.raises(AdapterError, match="more than the graph's max_rank 2"):
        stack([plain], geometry(max_rank=2))
