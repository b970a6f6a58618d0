"""The one room between the exporter and transformers' internals (qeff_kv/export/transformers_adapter.py): the
supported versions, the cache protocol across the signatures transformers 5.23-5.24 use, the cache keyword of a
forward, and a quiet export."""

from __future__ import annotations

import functools
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from suite import requires_torch
from qeff_kv.errors import UnsupportedVersionError
from qeff_kv.export import transformers_adapter as hf

REPO = Path(__file__).resolve().parents[2]


def test_supported_versions_are_named_and_match_pyproject():
    assert hf.TESTED == ("5.23.0", "5.24.0")
    assert hf.supported_range() == ">=5.23,<5.25"
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pins = [d for d in extras["export"] if d.startswith("transformers")]
    assert pins == [f"transformers{hf.supported_range()}"]
    for version in hf.TESTED:
        assert hf.version_refusal(version) is None


@requires_torch
def test_installed_transformers_is_supported():
    import transformers

    reason = hf.version_refusal(transformers.__version__)
    assert reason is None, reason


@pytest.mark.parametrize("version", ["5.22.2", "5.25.0", "6.0.0", "4.57.1"])
def test_unsupported_version_refused_in_one_line(version, monkeypatch):
    monkeypatch.delenv(hf.UNTESTED_ENV, raising=False)
    with pytest.raises(UnsupportedVersionError) as err:
        hf.check_version(version)
    msg = str(err.value)
    assert msg == (f"transformers {version} is not supported: qeff-kv export is tested on transformers 5.23.0, "
                   f"5.24.0 (pip install 'transformers>=5.23,<5.25', or install with -c constraints.txt)")
    monkeypatch.setenv(hf.UNTESTED_ENV, "1")
    hf.check_version(version)   # the check against the newest releases lifts it on purpose


@requires_torch
def test_export_refuses_an_unsupported_transformers(monkeypatch, tmp_path):
    import transformers

    from qeff_kv.export import export_model

    monkeypatch.delenv(hf.UNTESTED_ENV, raising=False)
    monkeypatch.setattr(transformers, "__version__", "5.22.0")
    with pytest.raises(UnsupportedVersionError, match="transformers 5.22.0 is not supported"):
        export_model(None, out_dir=tmp_path / "out")
    assert not (tmp_path / "out").exists()


class _Recorder(hf.CacheProtocol):
    def __init__(self):
        super().__init__(3)
        self.calls = []

    def write(self, key, value, layer_idx):
        self.calls.append((key, value, layer_idx))
        return key, value


def test_cache_update_takes_every_signature_transformers_uses():
    cache = _Recorder()
    assert cache.update("k", "v", 0) == ("k", "v")                                  # no extras
    assert cache.update("k", "v", 1, {"cache_position": None}) == ("k", "v")        # 5.23: cache_kwargs positional
    assert cache.update("k", "v", 2, cache_kwargs={"sin": 0}) == ("k", "v")         # 5.23: by name
    assert cache.update("k", "v", 0, kwargs={"position_ids": None}) == ("k", "v")   # 5.24: kwargs=
    assert [c[2] for c in cache.calls] == [0, 1, 2, 0]
    assert len(cache) == 3 and cache.get_seq_length() == 0 and cache.is_sliding == [False] * 3
    assert cache.layers == [] and cache.is_compileable is False


def _deprecating(fn):
    """A stand-in for transformers' deprecate_kwarg decorator (functools.wraps over the new signature)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)
    return wrapper


def test_cache_keyword_follows_the_forward_signature():
    def new(self, input_ids=None, cache=None, **kwargs): ...
    def old(self, input_ids=None, past_key_values=None, **kwargs): ...
    def mamba(self, input_ids=None, cache_params=None, **kwargs): ...
    def unknown(*args, **kwargs): ...
    assert hf.cache_keyword(_deprecating(new)) == "cache"
    assert hf.cache_keyword(old) == "past_key_values"
    assert hf.cache_keyword(mamba) == "cache_params"
    assert hf.cache_keyword(unknown) == "past_key_values"


def test_returned_cache_and_attention_cache_read_either_name():
    class Out:
        pass

    for name in hf.CACHE_KEYWORDS:
        out = Out()
        setattr(out, name, "the cache")
        assert hf.returned_cache(out) == "the cache"
    assert hf.returned_cache(Out()) is None
    for name in ("cache", "past_key_values"):
        kwargs = {name: "c", "position_ids": 1}
        assert hf.attention_cache(kwargs) == "c" and kwargs == {"position_ids": 1}


@requires_torch
def test_export_output_has_no_library_warnings(tmp_path):
    """The README's main command prints progress, the result and the buffer table: no FutureWarning from
    transformers or torch unless --debug."""
    env = {"QEFF_KV_HOME": str(tmp_path / "home"), "PATH": "/usr/bin:/bin"}
    res = subprocess.run([sys.executable, "-m", "qeff_kv_cli.main", "export", "-o", str(tmp_path / "o"),
                          "--kv-cache-prefix", "VLLM"], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr
    assert "Warning" not in res.stderr and "Warning" not in res.stdout, res.stderr
    assert "tracing LlamaForCausalLM (2 layers" in res.stderr + res.stdout
    assert "past_key.0_VLLM_RetainedState" in res.stdout


@requires_torch
def test_causal_lm_loader_registers_the_configs_own_causal_lm_class():
    """``AutoModelForCausalLM`` loads a type transformers maps to a causal LM; where it maps none (Mistral4:
    transformers 5.24 ships ``Mistral4ForCausalLM`` but maps ``mistral4`` to no causal LM) the config's
    ``*ForCausalLM`` class of that very type is registered for it first; never a class of another type, nor a class
    that is not a causal LM."""
    import transformers

    assert "mistral4" not in hf.causal_lm_architectures()
    auto = transformers.AutoModelForCausalLM
    cfg = transformers.Mistral4Config(vocab_size=32, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                      kv_lora_rank=8, q_lora_rank=None, qk_rope_head_dim=4, qk_nope_head_dim=8,
                                      v_head_dim=8, n_routed_experts=2, num_experts_per_tok=1)
    for archs in (["LlamaForCausalLM"], ["Mistral4ForTokenClassification"]):   # nothing to register
        cfg.architectures = archs
        assert hf.causal_lm_loader(transformers, cfg) is auto
    assert hf.causal_lm_loader(transformers, {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}) is auto
    cfg.architectures = ["Mistral4ForCausalLM"]
    assert hf.causal_lm_loader(transformers, cfg.to_dict()) is auto
    assert type(auto.from_config(cfg)) is transformers.Mistral4ForCausalLM
