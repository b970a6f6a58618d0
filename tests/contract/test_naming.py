"""The naming contract: prefix validation, name parsing, selection regexes (with hypothesis properties)."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qeff_kv.contract import naming
from qeff_kv.errors import PrefixError, QeffKvError

ASCII_PREFIX = st.from_regex(r"[A-Za-z0-9]{1,64}", fullmatch=True).filter(lambda p: "RetainedState" not in p)


# --------------------------------------------------------------------------------------------- validation
@pytest.mark.parametrize("prefix", ["VLLM", "vllmKvCache", "a", "0", "A1b2", "x" * 64])
def test_valid_prefixes(prefix):
    assert naming.validate_prefix(prefix) == prefix
    assert naming.is_valid_prefix(prefix)


@pytest.mark.parametrize("prefix, fragment", [
    ("", "is empty"),
    ("_", "'_' (LOW LINE): not a letter or digit"),
    (".", "'.' (FULL STOP): not a letter or digit"),
    ("-", "'-' (HYPHEN-MINUS): not a letter or digit"),
    ("a_b", "'_' (LOW LINE)"),
    ("a.b", "'.' (FULL STOP)"),
    ("past-key", "'-' (HYPHEN-MINUS)"),
    (" ", "' ' (SPACE): whitespace"),
    ("a b", "' ' (SPACE): whitespace"),
    ("VLLM\t", "'\\t' (U+0009): whitespace"),
    ("\n", "whitespace"),
    ("é", "'é' (LATIN SMALL LETTER E WITH ACUTE): a non-ASCII letter or digit"),
    ("²", "'²' (SUPERSCRIPT TWO): a non-ASCII letter or digit"),
    ("ＶＬＬＭ", "'Ｖ' (FULLWIDTH LATIN CAPITAL LETTER V): a non-ASCII letter or digit"),
    ("٠١٢", "'٠' (ARABIC-INDIC DIGIT ZERO): a non-ASCII letter or digit"),
    ("x" * 65, "is 65 characters long; at most 64 are allowed"),
    ("RetainedState", "contains 'RetainedState'"),
    ("myRetainedStateX", "contains 'RetainedState'"),
])
def test_invalid_prefixes_name_the_reason(prefix, fragment):
    with pytest.raises(PrefixError) as ei:
        naming.validate_prefix(prefix)
    msg = str(ei.value)
    assert fragment in msg
    assert "\n" not in msg
    assert not naming.is_valid_prefix(prefix)


@pytest.mark.parametrize("value, typename", [(123, "int"), (None, "NoneType"), (b"VLLM", "bytes"),
                                             (["VLLM"], "list"), (1.5, "float")])
def test_non_string_prefix(value, typename):
    with pytest.raises(PrefixError, match=f"must be a string, got {typename}"):
        naming.validate_prefix(value)


def test_isalnum_accepts_what_we_refuse():
    # The peer validates with str.isalnum(); these all pass there and must fail here.
    for p in ("é", "²", "ＶＬＬＭ", "٠١٢"):
        assert p.isalnum()
        assert not naming.is_valid_prefix(p)


def test_prefix_error_is_typed():
    err = pytest.raises(PrefixError, naming.validate_prefix, "a b").value
    assert isinstance(err, QeffKvError) and isinstance(err, ValueError) and err.exit_code == 2


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(max_size=80), ASCII_PREFIX))
def test_validation_property(s):
    expected = re.fullmatch(r"[A-Za-z0-9]{1,64}", s) is not None and "RetainedState" not in s
    assert naming.is_valid_prefix(s) == expected
    if not expected:
        msg = str(pytest.raises(PrefixError, naming.validate_prefix, s).value)
        assert "\n" not in msg and msg


@settings(max_examples=200, deadline=None)
@given(stem=st.sampled_from(naming.KV_STEMS), layer=st.integers(0, 10_000),
       prefix=st.one_of(st.none(), ASCII_PREFIX), retained=st.booleans())
def test_names_round_trip_through_parse(stem, layer, prefix, retained):
    name = (naming.kv_retained_name if retained else naming.kv_input_name)(stem, layer, prefix)
    parsed = naming.parse_kv_name(name)
    assert parsed == naming.KVName(stem, layer, prefix, retained)
    assert parsed.name == name
    # change and strip
    assert naming.rename_kv(name, None) == (naming.kv_retained_name if retained else naming.kv_input_name)(stem, layer)
    assert naming.rename_kv(naming.rename_kv(name, "Q"), prefix) == name
    # the exact regex for the prefix selects it, the one for another prefix does not
    assert naming.regex_selects(naming.exact_regex(prefix, naming.KV_STEMS), name)
    other = "Zz9" if prefix != "Zz9" else "Yy8"
    assert not naming.regex_selects(naming.exact_regex(other, naming.KV_STEMS), name)


# --------------------------------------------------------------------------------------------- parsing
@pytest.mark.parametrize("name, expected", [
    ("past_key.0", naming.KVName("past_key", 0)),
    ("past_value.12_RetainedState", naming.KVName("past_value", 12, None, True)),
    ("past_key.3_VLLM", naming.KVName("past_key", 3, "VLLM")),
    ("past_key.3_VLLM_RetainedState", naming.KVName("past_key", 3, "VLLM", True)),
    ("compressed_kv.1_P", naming.KVName("compressed_kv", 1, "P")),
    ("recurrent_state.0", naming.KVName("recurrent_state", 0)),
    ("past_repetition_penalty_buffer", None),
    ("past_presence_penalty_buffer", None),
    ("past_keys.0", None),
    ("past_key.01", None),
    ("past_key.0_a_b", None),
    ("past_key.0_é", None),
    ("vision_embeds_RetainedState", None),
    ("logits", None),
])
def test_parse_kv_name(name, expected):
    assert naming.parse_kv_name(name) == expected


def test_retained_pairing_rule():
    assert naming.retained_name("past_key.0_VLLM") == "past_key.0_VLLM_RetainedState"
    assert naming.retained_source("past_key.0_VLLM_RetainedState") == "past_key.0_VLLM"
    assert naming.retained_source("image_idx_output") == "image_idx"
    assert naming.retained_source("logits") is None
    assert naming.retained_source("_RetainedState") is None


def test_canonical_regexes():
    rx = naming.canonical_regexes("VLLM")
    assert rx == {"exact": r"^(past_key|past_value)\.\d+_VLLM(_RetainedState)?$", "substring": ".*VLLM.*"}
    assert naming.canonical_regexes(None) == {"exact": r"^(past_key|past_value)\.\d+(_RetainedState)?$",
                                              "legacy": ["past_key.*", "past_value.*"]}
    names = ["input_ids", "past_key.0_VLLM", "past_key.0_VLLM_RetainedState", "logits"]
    assert naming.select(rx["substring"], names) == ["past_key.0_VLLM", "past_key.0_VLLM_RetainedState"]


@pytest.mark.parametrize("name, expected", [
    ("past_key.0_a-b", True), ("past_key.01", True), ("k_pe.7", True),
    ("past_keys.0", False), ("past_repetition_penalty_buffer", False), ("logits", False)])
def test_looks_like_kv(name, expected):
    assert naming.looks_like_kv(name) is expected


@pytest.mark.parametrize("name, expected", [
    ("vision_embeds_VLLM", ("vision_embeds", "VLLM")),
    ("vision_embeds_VLLM_RetainedState", ("vision_embeds", "VLLM")),
    ("vision_embeds", None), ("vision_embeds_RetainedState", None), ("image_idx_output", None),
    ("past_key.0_VLLM", None)])
def test_prefixed_non_kv(name, expected):
    assert naming.prefixed_non_kv(name) == expected


def test_index_key_is_a_prefixable_position_stem():
    """DeepSeek sparse attention's indexer keys (contract section 11) pair and take a prefix like any KV buffer."""
    assert naming.kv_input_name("index_key", 3, "VLLM") == "index_key.3_VLLM"
    assert naming.parse_kv_name("index_key.3_VLLM_RetainedState") == naming.KVName("index_key", 3, "VLLM", True)
    assert naming.rename_kv("index_key.0", "kvCache") == "index_key.0_kvCache"
    assert naming.INDEX_STEM in naming.POSITION_STEMS and naming.INDEX_STEM not in naming.EXPORT_STEMS
    assert naming.regex_selects(naming.exact_regex("VLLM", naming.INDEXED_STEMS), "index_key.1_VLLM_RetainedState")
