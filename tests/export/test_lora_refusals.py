"""LoRA adapters that do not fit the export (docs/lora.md): each refused in one line (ExportError or AdapterError),
before anything is written — the output folder is never created, and a folder already there is left as it was.

Adapters made with PEFT from seeded random weights (tests/helpers/lora_adapters.py), edited where a case needs
what PEFT would not write (a module the model lacks, another base model's name)."""

from __future__ import annotations

import json
import shutil

import pytest

from suite import requires_torch
from qeff_kv.errors import AdapterError, ExportError

pytestmark = [requires_torch]

CTX, CHUNK = 64, 8


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """The base (a tiny Llama, hidden 64), adapters of it (rank 8 on q/v; DoRA), and an adapter of a Llama of
    hidden 32 whose folder has the same name (so only its hidden sizes tell it apart)."""
    from hf_models import make_model_dir
    from lora_adapters import make_adapter

    root = tmp_path_factory.mktemp("lora_refusals")
    base = make_model_dir("llama", root / "base", seed=4)
    small = make_model_dir("llama", root / "small", seed=5, hidden_size=32, intermediate_size=64, head_dim=8)
    return {"base": base,
            "r8": make_adapter(base, root / "r8", r=8, alpha=16, targets=["q_proj", "v_proj"], seed=21),
            "dora": make_adapter(base, root / "dora", r=4, alpha=8, targets=["q_proj"], seed=22, dora=True),
            "small": make_adapter(small, root / "small-r4", r=4, alpha=8, targets=["q_proj", "v_proj"], seed=23),
            "root": root}


def edited(src, dest, *, rename: tuple[str, str] | None = None, base_model: str | None = None):
    """A copy of the adapter folder ``src`` with a module renamed in its config and tensors, or another
    ``base_model_name_or_path``."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dest)
    cfg = json.loads((dest / "adapter_config.json").read_text())
    if base_model is not None:
        cfg["base_model_name_or_path"] = base_model
    if rename is not None:
        old, new = rename
        cfg["target_modules"] = [new if t == old else t for t in cfg["target_modules"]]
        tensors = load_file(dest / "adapter_model.safetensors")
        save_file({k.replace(f".{old}.", f".{new}."): v for k, v in tensors.items()},
                  dest / "adapter_model.safetensors")
    (dest / "adapter_config.json").write_text(json.dumps(cfg))
    return dest


def refused(tmp_path, error, message: str, model, **options) -> str:
    """The export raises ``error`` with one line starting ``message``; nothing is written: no output folder, and
    a folder already there keeps its files untouched."""
    from cli_checks import tree
    from qeff_kv.export import export_model

    options = dict(ctx_len=CTX, prefill_seq_len=CHUNK, **options)
    with pytest.raises(error) as exc:
        export_model(model, tmp_path / "out", **options)
    text = str(exc.value)
    assert "\n" not in text and text.startswith(message), text
    assert not (tmp_path / "out").exists()
    kept = tmp_path / "kept"   # an export folder already there (a previous export): left as it was
    kept.mkdir()
    (kept / "manifest.json").write_text("{}")
    before = tree(tmp_path)
    with pytest.raises(error):
        export_model(model, kept, force=True, **options)
    assert tree(tmp_path) == before
    return text


def test_rank_above_max_lora_rank(made, tmp_path):
    refused(tmp_path, ExportError, "adapter 'big' has rank 8, above --max-lora-rank 4", made["base"],
            lora=[f"big={made['r8']}"], max_lora_rank=4)


def test_module_the_model_lacks(made, tmp_path):
    """An adapter naming ``self_attn.w_proj`` (its q/v tensors renamed): the model's layers have no such Linear."""
    bad = edited(made["r8"], tmp_path / "w_proj", rename=("v_proj", "w_proj"))
    refused(tmp_path, ExportError, "the adapters adapt self_attn.w_proj, which is not a Linear module of "
            "LlamaForCausalLM's layers", made["base"], lora=[f"w={bad}"])


@pytest.mark.parametrize("verify", [None, False])
def test_hidden_sizes_of_another_model(made, tmp_path, verify):
    """An adapter made on a Llama of hidden 32 (its folder has the base's name): refused at export whether or not
    the export is verified."""
    refused(tmp_path, AdapterError, "adapter small: hidden sizes do not match: self_attn.q_proj of layer 0 maps "
            "32 -> 32 features in the adapter, 64 -> 64 in the graph", made["base"], lora=[f"small={made['small']}"],
            verify=verify)


@pytest.mark.parametrize("verify", [None, False])
def test_base_model_name_of_another_model(made, tmp_path, verify):
    """``base_model_name_or_path`` naming another model than the source (compared by its last path component, as
    a Session compares it with the manifest's source)."""
    other = edited(made["r8"], tmp_path / "other", base_model="meta-llama/Llama-3.2-1B")
    refused(tmp_path, AdapterError, "adapter o was trained on meta-llama/Llama-3.2-1B, not on the graph's model ",
            made["base"], lora=[f"o={other}"], verify=verify)
    # the same adapter under the base's own name (a hub id whose last part is the folder's name) is taken
    from qeff_kv.export import export_model

    same = edited(made["r8"], tmp_path / "same", base_model="someone/tiny-llama")
    r = export_model(made["base"], tmp_path / "ok", ctx_len=CTX, prefill_seq_len=CHUNK, lora=[f"s={same}"],
                     verify=verify)
    assert r.manifest["lora"]["adapters"] == ["s"]


def test_dora_adapter(made, tmp_path):
    refused(tmp_path, AdapterError, "adapter d: DoRA (use_dora) is not supported", made["base"],
            lora=[f"d={made['dora']}"])


def test_lora_targets_with_lora(made, tmp_path):
    refused(tmp_path, ExportError, "--lora-targets is for --max-lora-rank alone", made["base"],
            lora=[f"a={made['r8']}"], lora_targets="q_proj")


def test_mla_latent_cache_with_adapters(mla_latent_dir, made, tmp_path):
    refused(tmp_path, ExportError, "LoRA adapters are not supported with --mla-cache latent", mla_latent_dir,
            mla_cache="latent", max_lora_rank=4)


def test_cli_bad_lora_is_one_error_line(made, tmp_path):
    from cli_checks import cli, one_error

    res = cli("export", made["base"], "-o", tmp_path / "out", "--lora", "bad")
    one_error(res, "--lora takes name=PEFT_DIR, got 'bad'")
    assert not (tmp_path / "out").exists()
    res = cli("export", made["base"], "-o", tmp_path / "out", "--lora", f"d={made['dora']}")
    one_error(res, "adapter d: DoRA (use_dora) is not supported")
    assert not (tmp_path / "out").exists()
