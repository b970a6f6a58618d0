"""`qeff-kv buffers` and `qeff-kv compile-config`, on our own graphs and the peer's (``graphs``, ``any_graph``)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

import _kv_graphs as kvg
from qeff_kv import graphio, naming
from qeff_kv.buffers import (RegexError, buffers_report, format_buffer_table, regex_selection,
                             write_compile_config_for_graph)
from qeff_kv.errors import ContractError, RuntimeInputError
from qeff_kv_cli.main import main


def test_buffers_table(any_graph):
    report = buffers_report(any_graph, ctx_len=16)
    prefix = "VLLM" if "vllm" in any_graph.name else None
    j = report.to_json()
    assert j["prefix"] == prefix and j["num_layers"] == 2 and j["ctx_len"] == 16
    batch = "full_batch_size" if "_cb_" in any_graph.name else "batch_size"
    assert j["pairs"] == [
        {"layer": layer, "kind": stem, "input": naming.kv_input_name(stem, layer, prefix),
         "retained": naming.kv_retained_name(stem, layer, prefix), "dtype": "float32",
         "shape": [batch, 2, "ctx_len", 16], "bytes_per_sequence": 2 * 16 * 16 * 4}
        for layer in range(2) for stem in ("past_key", "past_value")]
    assert j["bytes_per_sequence"] == 4 * 2048
    assert j["non_kv_retained"] == [] and j["unpaired"] == {"inputs": [], "outputs": []}
    assert j["regexes"] == naming.canonical_regexes(prefix)
    assert j["selection"] is None


def test_regex_selection(graphs):
    report = buffers_report(graphs / "qeff_llama_vllm.onnx", regex=".*VLLM.*")
    sel = report.selection.to_json()
    assert sel["equals_kv_set"] is True and sel["selects_non_kv"] == [] and sel["misses_kv"] == []
    assert sel["selected"] == ["past_key.0_VLLM", "past_value.0_VLLM", "past_key.1_VLLM", "past_value.1_VLLM",
                               "past_key.0_VLLM_RetainedState", "past_value.0_VLLM_RetainedState",
                               "past_key.1_VLLM_RetainedState", "past_value.1_VLLM_RetainedState"]
    # A legacy-style regex for one stem misses the other stem's buffers.
    legacy = buffers_report(graphs / "qeff_llama_vllm.onnx", regex="past_key.*").selection
    assert not legacy.equals_kv
    assert legacy.missed == ["past_value.0_VLLM", "past_value.1_VLLM", "past_value.0_VLLM_RetainedState",
                             "past_value.1_VLLM_RetainedState"]
    wide = buffers_report(graphs / "qeff_llama_default.onnx", regex=".*_.*").selection
    assert wide.extra == ["input_ids", "position_ids"] and wide.missed == []
    assert "!= the KV buffers:\n  selects non-KV: input_ids, position_ids" in wide.format_text()


def test_text_output(graphs):
    text = buffers_report(graphs / "qeff_llama_cb_vllm.onnx", regex=".*VLLM.*", ctx_len=16).format_text()
    lines = text.splitlines()
    assert lines[1].split() == ["layer", "kind", "input", "retained", "dtype", "shape", "bytes/seq", "@ctx_len=16"]
    assert lines[3].split()[:5] == ["0", "past_key", "past_key.0_VLLM", "past_key.0_VLLM_RetainedState", "float32"]
    assert lines[3].endswith("[full_batch_size, 2, ctx_len, 16]  2 KiB")
    assert "4 KV pairs, 2 layers, prefix VLLM, 8 KiB (8192 bytes) per sequence" in text
    assert "non-KV retained buffers: none" in text
    assert "  substring: .*VLLM.*" in text
    assert text.rstrip().endswith("= exactly the 8 KV buffers")


def test_format_buffer_table_without_ctx_len(graphs):
    layout = graphio.layout_of(graphio.load(graphs / "qeff_llama_default.onnx"))
    text = format_buffer_table(layout)
    assert "4 KV pairs, 2 layers, prefix (none); pass --ctx-len N for bytes per sequence" in text
    assert text.splitlines()[2].rstrip().endswith("?")


def test_non_kv_and_unpaired_listed(tmp_path):
    path = kvg.save(kvg.build(2, "P", non_kv_retained=["vision_embeds", "vision_embeds_RetainedState"],
                              drop_outputs=["past_value.1_P_RetainedState"]), tmp_path / "m.onnx")
    report = buffers_report(path, ctx_len=8)
    j = report.to_json()
    assert j["non_kv_retained"] == [{"input": "vision_embeds", "retained": "vision_embeds_RetainedState"}]
    assert j["unpaired"] == {"inputs": ["past_value.1_P"], "outputs": []}
    assert [p["input"] for p in j["pairs"]] == ["past_key.0_P", "past_value.0_P", "past_key.1_P"]
    assert j["pairs"][0]["bytes_per_sequence"] == 2 * 8 * 4 * 4
    text = report.format_text()
    assert "unpaired KV buffers: past_value.1_P" in text
    assert "non-KV retained buffers: vision_embeds -> vision_embeds_RetainedState" in text
    # The serving regex for prefix P leaves the (unprefixed) non-KV retained buffer alone.
    sel = regex_selection(report.layout, ".*P.*")
    assert "vision_embeds" not in sel.selected and "vision_embeds_RetainedState" not in sel.selected
    assert sel.equals_kv and "past_value.1_P" in sel.selected  # the unpaired input is still a KV name


def test_mixed_prefixes_have_no_canonical_regexes(tmp_path):
    path = kvg.save(kvg.build(2, ["A", "B"]), tmp_path / "m.onnx")
    report = buffers_report(path)
    assert report.regexes is None and report.to_json()["prefixes"] == ["A", "B"]
    assert "canonical regexes: none (mixed prefixes)" in report.format_text()


def test_bad_regex_and_ctx_len(graphs):
    with pytest.raises(RegexError, match=r"regex '\(' does not compile: missing \), unterminated subpattern"):
        buffers_report(graphs / "qeff_llama_vllm.onnx", regex="(")
    with pytest.raises(RuntimeInputError, match="ctx_len must be a positive integer, got 0"):
        buffers_report(graphs / "qeff_llama_vllm.onnx", ctx_len=0)


def test_cli_buffers(graphs):
    runner = CliRunner()
    r = runner.invoke(main, ["buffers", str(graphs / "qeff_qwen2_vllm.onnx"), "--regex", ".*VLLM.*",
                             "--ctx-len", "16", "--json"])
    assert r.exit_code == 0, r.output
    j = json.loads(r.output)
    assert j["schema"] == "qeff-kv.buffers/1" and j["selection"]["equals_kv_set"] is True
    r = runner.invoke(main, ["buffers", str(graphs / "qeff_qwen2_vllm.onnx")])
    assert r.exit_code == 0 and "past_value.1_VLLM_RetainedState" in r.output
    r = runner.invoke(main, ["buffers", str(graphs / "qeff_qwen2_vllm.onnx"), "--regex", "["])
    assert r.exit_code == 2 and r.stderr.startswith("error: regex '[' does not compile")
    r = runner.invoke(main, ["buffers", str(graphs / "qeff_qwen2_vllm.onnx"), "--ctx-len", "0"])
    assert r.exit_code == 2


# ------------------------------------------------------------------------------------------------ compile-config
def test_compile_config_prefixed(graphs, tmp_path):
    r = CliRunner().invoke(main, ["compile-config", str(graphs / "qeff_llama_vllm.onnx"), "-o",
                                  str(tmp_path / "cc"), "--prefill-seq-len", "8", "--ctx-len", "16"])
    assert r.exit_code == 0, r.stderr
    assert r.output.splitlines() == [f"wrote {tmp_path / 'cc' / 'custom_io.yaml'}",
                                     f"wrote {tmp_path / 'cc' / 'specializations.json'}"]
    text = (tmp_path / "cc" / "custom_io.yaml").read_text()
    names = [line.split(": ", 1)[1] for line in text.splitlines() if "IOName" in line]
    assert names == [naming.kv_input_name(s, i, "VLLM") for i in range(2) for s in naming.EXPORT_STEMS] + \
        [naming.kv_retained_name(s, i, "VLLM") for i in range(2) for s in naming.EXPORT_STEMS]
    assert text.count("   Precision: float16") == 8
    spec = json.loads((tmp_path / "cc" / "specializations.json").read_text())
    assert spec == {"specializations": [{"batch_size": "1", "seq_len": "8", "ctx_len": "16"},
                                        {"batch_size": "1", "seq_len": "1", "ctx_len": "16"}]}


def test_compile_config_cb_named(graphs, tmp_path):
    out = tmp_path / "cc"
    r = CliRunner().invoke(main, ["compile-config", str(graphs / "qeff_llama_cb_default.onnx"), "-o", str(out),
                                  "--prefill-seq-len", "8", "--ctx-len", "16", "--full-batch-size", "4",
                                  "--specializations-format", "named"])
    assert r.exit_code == 0, r.stderr
    spec = json.loads((out / "specializations.json").read_text())
    assert spec == {"specializations": [
        {"name": "Prefill", "symbols": {"batch_size": "1", "seq_len": "8", "ctx_len": "16", "full_batch_size": "4"}},
        {"name": "Decode", "symbols": {"batch_size": "4", "seq_len": "1", "ctx_len": "16", "full_batch_size": "4"}}]}
    assert " - IOName: past_key.0\n" in (out / "custom_io.yaml").read_text()


def test_compile_config_refusals(graphs, tmp_path):
    with pytest.raises(RuntimeInputError, match="continuous-batching graph .* give --full-batch-size"):
        write_compile_config_for_graph(graphs / "qeff_llama_cb_vllm.onnx", tmp_path / "a", prefill_seq_len=8,
                                       ctx_len=16)
    with pytest.raises(RuntimeInputError, match="is not a continuous-batching graph"):
        write_compile_config_for_graph(graphs / "qeff_llama_vllm.onnx", tmp_path / "b", prefill_seq_len=8,
                                       ctx_len=16, full_batch_size=2)
    with pytest.raises(RuntimeInputError, match="prefill_seq_len 32 is larger than ctx_len 16"):
        write_compile_config_for_graph(graphs / "qeff_llama_vllm.onnx", tmp_path / "c", prefill_seq_len=32,
                                       ctx_len=16)
    path = kvg.save(kvg.build(2, ["A", "B"]), tmp_path / "mixed.onnx")
    with pytest.raises(ContractError, match="mixed prefixes"):
        write_compile_config_for_graph(path, tmp_path / "d", prefill_seq_len=8, ctx_len=16)
    for d in "abcd":
        assert not (tmp_path / d).exists()
    r = CliRunner().invoke(main, ["compile-config", str(graphs / "qeff_llama_vllm.onnx"), "-o", str(tmp_path / "e"),
                                  "--prefill-seq-len", "8"])
    assert r.exit_code == 2 and "--ctx-len" in r.stderr
