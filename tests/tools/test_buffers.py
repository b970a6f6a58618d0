"""`qeff-kv buffers` and `qeff-kv compile-config`, on our own graphs and the peer's (``graphs``, ``any_graph``)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

import _kv_graphs as kvg
from qeff_kv.graph import graphio
from qeff_kv.contract import naming
from qeff_kv.tools.buffers import RegexError, buffers_report, format_buffer_table, regex_selection
from qeff_kv.tools.compile_from_graph import write_compile_config_for_graph
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
         "shape": [batch, 2, "ctx_len", 16], "capacity": 16, "bytes_per_sequence": 2 * 16 * 16 * 4, "state": "full"}
        for layer in range(2) for stem in ("past_key", "past_value")]
    assert j["bytes_per_sequence"] == 4 * 2048
    assert j["sliding_window"] is None and j["sliding_layers"] == []
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
    assert lines[1].split() == ["layer", "kind", "input", "retained", "dtype", "shape", "capacity", "bytes/seq",
                                "@ctx_len=16"]
    assert lines[3].split()[:5] == ["0", "past_key", "past_key.0_VLLM", "past_key.0_VLLM_RetainedState", "float32"]
    assert lines[3].endswith("[full_batch_size, 2, ctx_len, 16]  16        2 KiB")
    assert "sliding-window" not in text
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


# ------------------------------------------------------------------------------------------------ sliding windows
def _sliding_graph(tmp_path, window=6, name="sw.onnx", **kw):
    """Layers 0 and 2 are ring buffers [batch, 2, 'sliding_window', 4]; layer 1 keeps 'ctx_len'."""
    return kvg.save(kvg.build(3, sliding_layers=[0, 2], sliding_window=window, **kw), tmp_path / name)


def test_buffers_sliding_capacities(tmp_path):
    report = buffers_report(_sliding_graph(tmp_path), ctx_len=32)
    j = report.to_json()
    assert (j["ctx_len"], j["sliding_window"], j["sliding_layers"]) == (32, 6, [0, 2])
    assert [(p["input"], p["shape"][2], p["capacity"], p["bytes_per_sequence"]) for p in j["pairs"]] == [
        ("past_key.0", "sliding_window", 6, 2 * 6 * 4 * 4), ("past_value.0", "sliding_window", 6, 2 * 6 * 4 * 4),
        ("past_key.1", "ctx_len", 32, 2 * 32 * 4 * 4), ("past_value.1", "ctx_len", 32, 2 * 32 * 4 * 4),
        ("past_key.2", "sliding_window", 6, 2 * 6 * 4 * 4), ("past_value.2", "sliding_window", 6, 2 * 6 * 4 * 4)]
    assert j["bytes_per_sequence"] == 4 * 192 + 2 * 1024 == 2816
    lines = report.format_text().splitlines()
    assert lines[1].split()[-2:] == ["bytes/seq", "@ctx_len=32,sliding_window=6"]
    assert lines[3].split()[-5:] == ["sliding_window,", "4]", "6", "192", "B"]
    assert lines[5].split()[-5:] == ["ctx_len,", "4]", "32", "1", "KiB"]
    assert "6 KV pairs, 3 layers, prefix (none), 2.8 KiB (2816 bytes) per sequence" in lines
    assert "sliding-window layers (window 6): 0, 2" in lines


def test_buffers_sliding_window_from_the_caller(tmp_path):
    """A peer graph has the axis but no metadata: W comes from the caller; without it the ring buffers' bytes are
    unknown and the table says what to pass."""
    path = _sliding_graph(tmp_path, window=None)
    report = buffers_report(path, ctx_len=32)
    j = report.to_json()
    assert j["sliding_window"] is None and j["bytes_per_sequence"] is None
    assert [p["capacity"] for p in j["pairs"]] == [None, None, 32, 32, None, None]
    text = report.format_text()
    assert "6 KV pairs, 3 layers, prefix (none); pass --sliding-window N for bytes per sequence" in text
    assert "sliding-window layers (window unknown): 0, 2" in text
    assert "; pass --ctx-len N and --sliding-window N for bytes per sequence" in buffers_report(path).format_text()
    j = buffers_report(path, ctx_len=32, sliding_window=8).to_json()
    assert j["sliding_window"] == 8 and j["bytes_per_sequence"] == 4 * 256 + 2 * 1024
    assert [p["capacity"] for p in j["pairs"]] == [8, 8, 32, 32, 8, 8]


def test_buffers_sliding_window_refusals(tmp_path):
    path = _sliding_graph(tmp_path)
    with pytest.raises(RuntimeInputError, match=r"^sliding_window must be a positive integer, got 0$"):
        buffers_report(path, sliding_window=0)
    with pytest.raises(RuntimeInputError, match=r"^sliding_window must be a positive integer, got '6'$"):
        buffers_report(path, sliding_window="6")
    with pytest.raises(RuntimeInputError, match=r"^sliding window 8 differs from the graph's own "
                                                r"qeff_kv.sliding_window = 6$"):
        buffers_report(path, sliding_window=8)
    assert buffers_report(path, sliding_window=6).sliding_window == 6


def test_layout_capacity_api(tmp_path):
    layout = graphio.layout_of(graphio.load(_sliding_graph(tmp_path)))
    assert layout.has_sliding and layout.sliding_layers == [0, 2] and layout.sliding_window == 6
    ring, full = layout.pair("past_key", 0), layout.pair("past_key", 1)
    assert ring.is_sliding and not full.is_sliding
    assert (ring.capacity(32, 6), full.capacity(32, 6), ring.capacity(32), full.capacity()) == (6, 32, None, None)
    assert full.bytes_per_sequence(32) == 1024 and ring.bytes_per_sequence(32) is None     # positional ctx_len
    assert ring.bytes_per_sequence(32, 6) == 192
    assert layout.to_json(32)["pairs"][0]["capacity"] == 6                                # W from the metadata
    plain = graphio.layout_of(graphio.load(kvg.save(kvg.build(1), tmp_path / "p.onnx")))
    assert not plain.has_sliding and plain.sliding_window is None and plain.sliding_layers == []


def test_cli_buffers_sliding_window(tmp_path):
    path = _sliding_graph(tmp_path, window=None)
    runner = CliRunner()
    r = runner.invoke(main, ["buffers", str(path), "--ctx-len", "32", "--sliding-window", "6", "--json"])
    assert r.exit_code == 0, r.output
    j = json.loads(r.output)
    assert (j["sliding_window"], j["bytes_per_sequence"]) == (6, 2816)
    for bad in ("0", "-1", "x"):
        r = runner.invoke(main, ["buffers", str(path), "--sliding-window", bad])
        assert r.exit_code == 2 and r.stderr.startswith("error: ") and len(r.stderr.splitlines()) == 1, r.stderr


def _compile(path, out, **kw):
    return write_compile_config_for_graph(path, out, prefill_seq_len=4, ctx_len=32, **kw)


def test_compile_config_sliding_window_flat_and_named(tmp_path):
    path = _sliding_graph(tmp_path)
    _compile(path, tmp_path / "flat")
    spec = json.loads((tmp_path / "flat" / "specializations.json").read_text())
    assert spec == {"specializations": [
        {"batch_size": "1", "seq_len": "4", "ctx_len": "32", "sliding_window": "6"},
        {"batch_size": "1", "seq_len": "1", "ctx_len": "32", "sliding_window": "6"}]}
    text = (tmp_path / "flat" / "custom_io.yaml").read_text()
    names = [line.split(": ", 1)[1] for line in text.splitlines() if "IOName" in line]
    assert names == [naming.kv_input_name(s, i) for i in range(3) for s in naming.EXPORT_STEMS] + \
        [naming.kv_retained_name(s, i) for i in range(3) for s in naming.EXPORT_STEMS]
    _compile(path, tmp_path / "named", fmt="named", sliding_window=6)
    spec = json.loads((tmp_path / "named" / "specializations.json").read_text())
    assert spec == {"specializations": [
        {"name": "Prefill", "symbols": {"batch_size": "1", "seq_len": "4", "ctx_len": "32", "sliding_window": "6"}},
        {"name": "Decode", "symbols": {"batch_size": "1", "seq_len": "1", "ctx_len": "32", "sliding_window": "6"}}]}


def test_compile_config_library_sliding_window_argument(tmp_path):
    """The exporter passes the model's window; a graph without ring buffers writes no sliding_window symbol."""
    from qeff_kv.tools.compile_config import write_compile_config

    layout = graphio.layout_of(graphio.load(_sliding_graph(tmp_path, window=None)))
    write_compile_config(layout, tmp_path / "a", prefill_seq_len=4, ctx_len=32, sliding_window=6, ccl=[16, 32])
    spec = json.loads((tmp_path / "a" / "specializations.json").read_text())["specializations"]
    assert [e["sliding_window"] for e in spec] == ["6"] * 4
    assert list(spec[0]) == ["batch_size", "seq_len", "ctx_len", "sliding_window", "comp_ctx_lengths"]
    plain = graphio.layout_of(graphio.load(kvg.save(kvg.build(1), tmp_path / "p.onnx")))
    write_compile_config(plain, tmp_path / "b", prefill_seq_len=4, ctx_len=32, sliding_window=6)
    spec = json.loads((tmp_path / "b" / "specializations.json").read_text())["specializations"]
    assert all("sliding_window" not in e for e in spec)
    with pytest.raises(RuntimeInputError, match=r"^graph has sliding-window KV buffers \(axis 'sliding_window'\); "
                                                r"give --sliding-window N$"):
        write_compile_config(layout, tmp_path / "c", prefill_seq_len=4, ctx_len=32)
    with pytest.raises(RuntimeInputError, match=r"^sliding_window must be a positive integer, got -6$"):
        write_compile_config(layout, tmp_path / "d", prefill_seq_len=4, ctx_len=32, sliding_window=-6)
    assert not (tmp_path / "c").exists() and not (tmp_path / "d").exists()


def test_compile_config_sliding_window_refusals(tmp_path):
    peer = _sliding_graph(tmp_path, window=None, name="peer.onnx")
    with pytest.raises(RuntimeInputError, match=r"^graph has sliding-window KV buffers \(axis 'sliding_window'\); "
                                                r"give --sliding-window N$"):
        _compile(peer, tmp_path / "a")
    with pytest.raises(RuntimeInputError, match=r"^sliding_window must be a positive integer, got 0$"):
        _compile(peer, tmp_path / "b", sliding_window=0)
    with pytest.raises(RuntimeInputError, match=r"^sliding_window must be a positive integer, got True$"):
        _compile(peer, tmp_path / "c", sliding_window=True)
    with pytest.raises(RuntimeInputError, match=r"^sliding window 8 differs from the graph's own "
                                                r"qeff_kv.sliding_window = 6$"):
        _compile(_sliding_graph(tmp_path), tmp_path / "d", sliding_window=8)
    plain = kvg.save(kvg.build(2), tmp_path / "plain.onnx")
    with pytest.raises(RuntimeInputError, match=r"has no sliding-window KV buffers \(axis 'sliding_window'\); "
                                                r"--sliding-window does not apply$"):
        _compile(plain, tmp_path / "e", sliding_window=6)
    bad_meta = kvg.save(kvg.build(2, sliding_layers=[0], sliding_window="abc"), tmp_path / "bad.onnx")
    with pytest.raises(ContractError, match=r"fails check rule 'pair-match' \(graph metadata "
                                            r"qeff_kv.sliding_window is 'abc'; it must be a positive integer"):
        _compile(bad_meta, tmp_path / "f", sliding_window=6)
    for d in "abcdef":
        assert not (tmp_path / d).exists()
    _compile(peer, tmp_path / "g", sliding_window=6)
    spec = json.loads((tmp_path / "g" / "specializations.json").read_text())["specializations"]
    assert [e["sliding_window"] for e in spec] == ["6", "6"]


def test_cli_compile_config_sliding_window(tmp_path):
    peer = _sliding_graph(tmp_path, window=None, name="peer.onnx")
    runner = CliRunner()
    base = ["compile-config", str(peer), "--prefill-seq-len", "4", "--ctx-len", "32", "-o"]
    r = runner.invoke(main, base + [str(tmp_path / "a")])
    assert r.exit_code == 2
    assert r.stderr == "error: graph has sliding-window KV buffers (axis 'sliding_window'); give --sliding-window N\n"
    r = runner.invoke(main, base + [str(tmp_path / "b"), "--sliding-window", "0"])
    assert r.exit_code == 2 and len(r.stderr.splitlines()) == 1 and "--sliding-window" in r.stderr
    r = runner.invoke(main, base + [str(tmp_path / "c"), "--sliding-window", "6", "--full-batch-size", "2"])
    assert r.exit_code == 2 and "is not a continuous-batching graph" in r.stderr
    r = runner.invoke(main, base + [str(tmp_path / "d"), "--sliding-window", "6",
                                    "--specializations-format", "named"])
    assert r.exit_code == 0, r.stderr
    spec = json.loads((tmp_path / "d" / "specializations.json").read_text())["specializations"]
    assert [e["symbols"]["sliding_window"] for e in spec] == ["6", "6"]
