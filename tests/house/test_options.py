"""Options as one object from the command line to the library: each command's click options are named as the
fields of the object it fills (``ExportOptions``, ``GenerateRequest`` and its sampling, ``ServeConfig``), the
sampling fields are one list, and each option is checked where it is defined, before anything is read."""

from __future__ import annotations

import dataclasses

import pytest

from qeff_kv.errors import ExportError, PrefixError, RuntimeInputError
from qeff_kv.export import ExportOptions, export_model
from qeff_kv.export.options import GIVEN_FIELDS, options_of
from qeff_kv.runtime.decoding import sampling
from qeff_kv.runtime.generate_job import GenerateRequest
from qeff_kv.serve.config import ServeConfig
from qeff_kv.serve.engine import defaults
from qeff_kv_cli.export_cmd import export
from qeff_kv_cli.generate_cmd import generate_cmd
from qeff_kv_cli.serve_cmd import serve_cmd


def _params(cmd) -> set[str]:
    """The options that fill the command's object (a deprecated alias that fills another option is not one)."""
    return {p.name for p in cmd.params if p.expose_value}


def _fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def test_export_options_are_the_fields_of_export_options():
    run = {"model", "out_dir", "specializations_format", "verify", "force", "quiet"}
    assert _params(export) - run == set(GIVEN_FIELDS)
    assert set(GIVEN_FIELDS) == _fields(ExportOptions) - {"prequant"}


def test_generate_options_are_the_fields_of_the_request_and_its_sampling():
    filled = _fields(GenerateRequest) - {"sampling", "resized"}
    assert _params(generate_cmd) - {"as_json"} == filled | set(sampling.FIELDS)
    assert set(sampling.FIELDS) == _fields(sampling.SamplingParams)


def test_serve_options_are_the_fields_of_serve_config():
    """The options are the fields of ServeConfig's sections (and its export_dir); -h lists each section's options
    under its group (``--ray-address``, in both Ray sections, under the first)."""
    from qeff_kv.serve.config import SECTIONS
    from qeff_kv_cli.serve_cmd import option_groups

    assert _fields(ServeConfig) - {"unread"} == {"export_dir"} | {attr for attr, *_ in SECTIONS}
    sections = {f"{title} options": _fields(cls) for _, cls, title, _ in SECTIONS}
    assert _params(serve_cmd) == {"export_dir"}.union(*sections.values())
    groups = dict(option_groups([p.name for p in serve_cmd.params if p.name != "export_dir"]))
    assert "Options" not in groups   # every option is in a section
    assert {title: set(names) for title, names in groups.items()} == {
        title: fields - ({"ray_address"} if title.startswith("P/D") else set()) for title, fields in sections.items()}


def test_one_list_of_the_sampling_fields_a_server_default_fills():
    assert set(sampling.DEFAULTED) <= set(sampling.FIELDS)
    assert tuple(defaults.OPENAI) == (*sampling.DEFAULTED, "max_tokens")
    assert set(ServeConfig("x").sampling.flags()) == {*sampling.DEFAULTED, "max_tokens"}
    assert set(sampling.DEFAULTED) | {"max_tokens"} <= _fields(defaults.SamplingDefaults)


def test_export_options_check_their_kinds_when_made():
    with pytest.raises(PrefixError, match="contains ' '"):
        ExportOptions(kv_cache_prefix="a b")
    with pytest.raises(ExportError, match=r"^continuous_batching must be True or False, got 'no'$"):
        ExportOptions(continuous_batching="no")
    with pytest.raises(ExportError, match=r"^block_size must be an integer, got str '32'$"):
        ExportOptions(block_size="32")
    assert ExportOptions(hidden_states=1).hidden_states is True


def test_export_model_keywords_are_the_fields():
    with pytest.raises(TypeError, match=r"^export_model\(\) got an unexpected keyword argument 'ctx_length'$"):
        export_model(None, None, ctx_length=64)
    with pytest.raises(TypeError, match="unexpected keyword argument 'prequant'"):   # read from the checkpoint only
        export_model(None, None, prequant="awq")
    with pytest.raises(PrefixError):   # before the model is looked at
        export_model("/nonexistent/model", None, kv_cache_prefix="bad prefix")
    base = ExportOptions(ctx_len=64, target="onnxruntime")
    assert options_of(base, {"ctx_len": 128}) == ExportOptions(ctx_len=128, target="onnxruntime")
    assert options_of(None, {}) == ExportOptions()
    with pytest.raises(ExportError, match="options must be an ExportOptions, got dict"):
        options_of({"ctx_len": 64}, {})


def test_resolved_options_take_the_model_ctx_len_and_parse_ccl():
    o = ExportOptions(prefill_seq_len=16, ccl="auto", weights="int4", target="onnxruntime").resolved(8192)
    assert (o.ctx_len, o.ccl, o.block_size, o.accuracy_level) == (4096, (512, 1024, 2048, 4096), 32, 4)
    assert ExportOptions().resolved(None).ctx_len == 4096
    with pytest.raises(ExportError, match="^prefill_seq_len 64 is larger than ctx_len 32$"):
        ExportOptions(ctx_len=32, prefill_seq_len=64).resolved(None)


def test_generate_request_from_options():
    req = GenerateRequest.from_options(model="m.onnx", prompt_ids=("5,17", "3"), temperature=0.5, seed=7,
                                       logit_bias=("15=-100",), stop_tokens=(2,), prompts=("hi",))
    assert req.prompt_ids == [[5, 17], [3]] and req.prompts == ["hi"] and req.stop_tokens == [2]
    assert req.sampling == sampling.SamplingParams(temperature=0.5, seed=7, logit_bias=((15, -100.0),))
    with pytest.raises(RuntimeInputError, match=r"^--prompt-ids 'x': 'x' is not an integer"):
        GenerateRequest.from_options(model="m.onnx", prompt_ids=("x",))
    with pytest.raises(RuntimeInputError, match=r"^min_p must be in \[0, 1\], got 3"):
        GenerateRequest.from_options(model="m.onnx", min_p=3.0)


def test_serve_config_checks_combinations_before_anything_is_read(tmp_path):
    with pytest.raises(RuntimeInputError, match="^--prefill-replicas, .* go with --disaggregate"):
        ServeConfig(str(tmp_path / "missing"), decode_replicas=2).check()
    with pytest.raises(RuntimeInputError, match="go with --disaggregate"):
        ServeConfig(str(tmp_path / "missing"), ray_address="auto").check()
    with pytest.raises(RuntimeInputError, match="^--kv-role must be one of"):
        ServeConfig(str(tmp_path / "missing"), kv_role="middle").check()
    ServeConfig(str(tmp_path / "missing"), ray_address="auto", kv_role="both").check()   # values only: no file read
    assert ServeConfig("x", allowed_origins="https://a.example, *,").http.allowed_origins == ["https://a.example", "*"]
    assert ServeConfig("x", allowed_origins="").http.allowed_origins is None
