"""The adapter inputs' names and layout (naming contract, contract/lora.py) and the export's adapter options."""

from __future__ import annotations

import json

import numpy as np
import pytest

from qeff_kv.contract import naming
from qeff_kv.contract.layout import TensorInfo
from qeff_kv.contract.lora import LoraGeometry
from qeff_kv.errors import ContractError, ExportError
from qeff_kv.export.options import ExportOptions


def test_names_round_trip_and_are_never_kv():
    name = naming.lora_input_name("A", 3, "self_attn.q_proj")
    assert name == "lora_A.3.self_attn.q_proj"
    assert naming.parse_lora_name(name) == ("A", 3, "self_attn.q_proj")
    assert naming.parse_lora_name("lora_B.0.mlp.down_proj") == ("B", 0, "mlp.down_proj")
    for bad in ("lora_C.0.q_proj", "lora_A.01.q_proj", "lora_A.0.", "lora_A.x.q_proj", "past_key.0"):
        assert naming.parse_lora_name(bad) is None, bad
    assert naming.is_lora_input(naming.LORA_IDS_INPUT) and naming.is_lora_input(naming.LORA_SCALES_INPUT)
    assert naming.parse_any_kv_name(name) is None and not naming.looks_like_kv(name)
    for regex in [*naming.canonical_regexes("VLLM").values(), *naming.legacy_regexes()]:
        assert not naming.regex_selects(regex, name)
    with pytest.raises(ValueError, match="part A or B"):
        naming.lora_input_name("C", 0, "q_proj")


def _inputs(dtype="float32", rank="lora_rank", skip=()):
    out = [TensorInfo("lora_ids", "int64", ("batch_size",)), TensorInfo("lora_scales", dtype, ("batch_size",))]
    for layer in (0, 1):
        out += [TensorInfo(f"lora_A.{layer}.self_attn.q_proj", dtype, ("lora_slots", 64, rank)),
                TensorInfo(f"lora_B.{layer}.self_attn.q_proj", dtype, ("lora_slots", rank, 32))]
    return [t for t in out if t.name not in skip]


def test_geometry_from_inputs_and_zero_feeds():
    meta = {naming.LORA_META: json.dumps({"max_rank": 8, "modules": ["self_attn.q_proj"], "adapters": ["a"]})}
    geo = LoraGeometry.from_io(_inputs(), meta)
    assert [(m.layer, m.module, m.in_features, m.out_features) for m in geo.modules] == \
        [(0, "self_attn.q_proj", 64, 32), (1, "self_attn.q_proj", 64, 32)]
    assert (geo.max_rank, geo.dtype, geo.proved_with, geo.module_names) == (8, "float32", ("a",), ("self_attn.q_proj",))
    feeds = geo.zero_feeds(3)
    assert feeds["lora_ids"].tolist() == [0, 0, 0] and feeds["lora_scales"].dtype == np.float32
    assert feeds["lora_A.1.self_attn.q_proj"].shape == (1, 64, 1) and feeds["lora_B.0.self_attn.q_proj"].shape == (1, 1, 32)
    assert not any(v.any() for v in feeds.values())
    assert LoraGeometry.from_io([TensorInfo("input_ids", "int64", (1, 1))]) is None


@pytest.mark.parametrize("inputs, message", [
    (_inputs(skip=("lora_B.1.self_attn.q_proj",)), "lora_A.1.self_attn.q_proj has no lora_B.1.self_attn.q_proj input"),
    (_inputs(skip=("lora_A.0.self_attn.q_proj",)), "lora_B.0.self_attn.q_proj has no lora_A.0.self_attn.q_proj input"),
    (_inputs(skip=("lora_ids",)), "no lora_ids input"),
    (_inputs()[:2], "no lora_A/lora_B weight inputs"),
    (_inputs()[:2] + [TensorInfo("lora_A.0.q_proj", "float32", ("lora_slots", 64, 4)),
                      TensorInfo("lora_B.0.q_proj", "float32", ("lora_slots", 8, 32))], "has rank axis 4 but"),
    (_inputs()[:2] + [TensorInfo("lora_A.0.q_proj", "float16", ("lora_slots", 64, 4)),
                      TensorInfo("lora_B.0.q_proj", "float16", ("lora_slots", 4, 32))], "one float type"),
    (_inputs()[:2] + [TensorInfo("lora_A.0.q_proj", "float32", ("lora_slots", "hidden", 4)),
                      TensorInfo("lora_B.0.q_proj", "float32", ("lora_slots", 4, 32))], "must be fixed"),
])
def test_malformed_adapter_inputs_are_refused_in_one_line(inputs, message):
    with pytest.raises(ContractError, match=message) as info:
        LoraGeometry.from_io(inputs)
    assert "\n" not in str(info.value)


def test_bad_metadata_is_refused():
    with pytest.raises(ContractError, match="max_rank must be a positive integer"):
        LoraGeometry.from_io(_inputs(), {naming.LORA_META: json.dumps({"max_rank": 0})})
    with pytest.raises(ContractError, match="is not JSON"):
        LoraGeometry.from_io(_inputs(), {naming.LORA_META: "{"})


def test_export_options_take_adapters_as_pairs_or_strings():
    opts = ExportOptions(lora=["a=/x/a", ("b", "/x/b")], max_lora_rank=16)
    assert opts.lora == (("a", "/x/a"), ("b", "/x/b")) and opts.adapts
    assert opts.to_json()["lora"] == [["a", "/x/a"], ["b", "/x/b"]] and opts.to_json()["max_lora_rank"] == 16
    assert ExportOptions(lora=()).lora is None and not ExportOptions().adapts
    assert "lora" not in ExportOptions().to_json() and "max_lora_rank" not in ExportOptions().to_json()


@pytest.mark.parametrize("fields, message", [
    (dict(lora=["a"]), "--lora takes name=PEFT_DIR, got 'a'"),
    (dict(lora=["a="]), "--lora takes name=PEFT_DIR"),
    (dict(lora="a=/x"), "lora must be a list of name=PEFT_DIR"),
    (dict(lora=["a b=/x"]), "adapter name 'a b'"),
    (dict(lora=["a=/x", "a=/y"]), "adapter name 'a' is given twice"),
    (dict(max_lora_rank=0), "max_lora_rank"),
    (dict(max_lora_rank="8"), "max_lora_rank"),
])
def test_bad_adapter_options_are_refused_when_made(fields, message):
    with pytest.raises(ExportError, match=message):
        ExportOptions(**fields)


@pytest.mark.parametrize("fields, message", [
    (dict(lora_targets="q_proj"), "--lora-targets needs --max-lora-rank R"),
    (dict(lora=["a=/x"], lora_targets="q_proj", max_lora_rank=4), "--lora-targets is for --max-lora-rank alone"),
    (dict(max_lora_rank=4, lora_targets="q_proj,,v"), "--lora-targets takes module names"),
])
def test_bad_adapter_combinations_are_refused_when_validated(fields, message):
    with pytest.raises(ExportError, match=message):
        ExportOptions(ctx_len=64, **fields).validate()
