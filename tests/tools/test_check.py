"""`qeff-kv check`: every rule on our exports, the peer's graphs and graphs broken one rule at a time; JSON; CLI;
testing API."""

from __future__ import annotations

import json
import re
from pathlib import Path

import onnx
import pytest
from click.testing import CliRunner

import _kv_graphs as kvg
from qeff_kv.tools import check as qcheck
from qeff_kv.contract import naming
from qeff_kv.contract.layout import NO_KV
from qeff_kv.errors import ExternalDataError, GraphReadError, PrefixError
from qeff_kv.tools.testing import assert_kv_selected_by, assert_retained_state_graph
from qeff_kv_cli.main import main

REPO = Path(__file__).resolve().parents[2]
RULE_IDS = ["kv-present", "pairing", "pair-match", "layers", "prefix", "regex-exact", "regex-substring",
            "non-kv-unprefixed", "inplace", "sidecar", "lora", "onnx-checker"]


def _check(tmp_path: Path, proto: onnx.ModelProto, **kw) -> qcheck.CheckReport:
    return qcheck.check(kvg.save(proto, tmp_path / "m.onnx"), **kw)


def _violations(report: qcheck.CheckReport) -> list[tuple[str, str | None, str]]:
    return [(v.rule, v.buffer, v.message) for v in report.violations]


# ------------------------------------------------------------------------------------ our exports and the peer's
def test_rule_ids_are_stable():
    assert list(qcheck.RULES) == RULE_IDS


def test_graphs_pass(any_graph):
    """Our exports and the peer's graphs pass every rule."""
    prefix = "VLLM" if "vllm" in any_graph.name else None
    report = qcheck.check(any_graph, expected_prefix=prefix)
    assert report.ok, report.format_text()
    # the graphs sit in a shared folder without sidecars: that rule alone is skipped
    assert [(r.id, r.status) for r in report.rules] == [(i, "skip" if i in ("sidecar", "lora") else "pass")
                                                       for i in RULE_IDS]
    assert report.num_layers == 2 and report.prefix == prefix
    assert_retained_state_graph(any_graph, prefix=prefix, num_layers=2)
    if prefix:
        assert_kv_selected_by(any_graph, ".*VLLM.*")
        assert_kv_selected_by(any_graph, naming.exact_regex("VLLM"))


def test_wrong_expected_prefix(graphs):
    report = qcheck.check(graphs / "qeff_llama_vllm.onnx", expected_prefix="vllmKvCache")
    assert not report.ok and report.failed == ["prefix"]
    assert _violations(report) == [(
        "prefix", "past_key.0_VLLM",
        "KV buffers carry prefix 'VLLM' but 'vllmKvCache' is expected (e.g. past_key.0_VLLM)")]
    report = qcheck.check(graphs / "qeff_llama_vllm.onnx", expected_prefix=None)
    assert report.failed == ["prefix"]
    assert "carry prefix 'VLLM' but (none) is expected" in report.violations[0].message


def test_json_report_is_stable(graphs):
    report = qcheck.check(graphs / "qeff_llama_cb_vllm.onnx", expected_prefix="VLLM")
    j = json.loads(report.to_json_text())
    assert list(j) == ["schema", "model", "ok", "prefix", "prefixes", "expected_prefix", "num_layers", "summary",
                       "failed", "rules"]
    assert j["schema"] == "qeff-kv.check/1" and j["ok"] is True and j["prefix"] == "VLLM"
    assert j["expected_prefix"] == {"prefix": "VLLM"} and j["num_layers"] == 2
    assert j["summary"] == {"pass": 10, "fail": 0, "skip": 2} and j["failed"] == []
    assert [r["id"] for r in j["rules"]] == RULE_IDS
    assert all(list(r) == ["id", "description", "status", "note", "violations"] for r in j["rules"])
    # Deterministic: the same file gives byte-identical JSON.
    assert qcheck.check(graphs / "qeff_llama_cb_vllm.onnx", expected_prefix="VLLM").to_json_text() == \
        report.to_json_text()


# ------------------------------------------------------------------------------------------------ each rule
def test_small_graph_passes(tmp_path):
    report = _check(tmp_path, kvg.build(3, "VLLM", non_kv_retained=["vision_embeds", "vision_embeds_RetainedState",
                                                                     "image_idx", "image_idx_output"]),
                    expected_prefix="VLLM")
    assert report.ok, report.format_text()
    # a vision-language graph must chain image_idx (issue 10): without it, rule pairing fails
    report = _check(tmp_path, kvg.build(3, "VLLM", non_kv_retained=["vision_embeds", "vision_embeds_RetainedState"]))
    assert report.failed == ["pairing"]


def test_kv_present(tmp_path):
    report = _check(tmp_path, kvg.build(0))
    assert report.failed == ["kv-present"]
    assert _violations(report) == [
        ("kv-present", None, NO_KV)]
    statuses = {r.id: r.status for r in report.rules}
    assert statuses["layers"] == statuses["prefix"] == statuses["regex-exact"] == statuses["inplace"] == "skip"


def test_pairing_unpaired_input_and_output(tmp_path):
    report = _check(tmp_path, kvg.build(2, "P", drop_outputs=["past_value.1_P_RetainedState"],
                                        drop_inputs=["past_key.0_P"]))
    assert report.rule("pairing").status == "fail"
    assert _violations(report)[:2] == [
        ("pairing", "past_value.1_P", "KV input past_value.1_P has no output past_value.1_P_RetainedState"),
        ("pairing", "past_key.0_P_RetainedState", "KV output past_key.0_P_RetainedState has no input past_key.0_P"),
    ]
    assert report.rule("inplace").status == "pass"  # only complete pairs are bound in place


def test_pairing_any_retained_output_needs_its_input(tmp_path):
    report = _check(tmp_path, kvg.build(1, extra_outputs=["foo_RetainedState"]))
    assert report.failed == ["pairing"]
    assert _violations(report) == [("pairing", "foo_RetainedState", "retained output foo_RetainedState has no input foo")]


def test_pair_match_dim_name(tmp_path):
    y = naming.kv_retained_name("past_key", 1)
    report = _check(tmp_path, kvg.build(2, output_dims={y: ["batch_size", 2, "ctx", 4]}))
    assert report.failed == ["pair-match"]
    assert _violations(report) == [
        ("pair-match", "past_key.1", "past_key.1 dim 2 is 'ctx_len' but past_key.1_RetainedState dim 2 is 'ctx'")]


def test_pair_match_dim_value_rank_dtype(tmp_path):
    report = _check(tmp_path, kvg.build(2, output_dims={
        "past_key.0_RetainedState": ["batch_size", 3, "ctx_len", 4],
        "past_value.0_RetainedState": ["batch_size", 2, "ctx_len"]},
        output_dtype={"past_key.1_RetainedState": onnx.TensorProto.FLOAT16}))
    assert report.rule("pair-match").status == "fail"
    assert [v for v in _violations(report) if v[0] == "pair-match"] == [
        ("pair-match", "past_key.0", "past_key.0 dim 1 is 2 but past_key.0_RetainedState dim 1 is 3"),
        ("pair-match", "past_value.0", "past_value.0 has rank 4 but past_value.0_RetainedState has rank 3"),
        ("pair-match", "past_key.1", "past_key.1 is float32 but past_key.1_RetainedState is float16"),
    ]


def test_layers_gap(tmp_path):
    report = _check(tmp_path, kvg.build(layer_ids=[0, 2, 3]))
    assert report.failed == ["layers"]
    assert _violations(report) == [
        ("layers", None, "layer 1 has no KV buffers (layers present: 0, 2, 3; expected 0..3)")]


def test_layers_not_starting_at_zero(tmp_path):
    report = _check(tmp_path, kvg.build(layer_ids=[1, 2]))
    assert [m for _, _, m in _violations(report)] == [
        "layer 0 has no KV buffers (layers present: 1, 2; expected 0..2)"]


def test_layers_key_without_value(tmp_path):
    report = _check(tmp_path, kvg.build(2, stems=["past_key"]))
    assert report.failed == ["layers"]
    assert _violations(report) == [
        ("layers", "past_key.0", "layer 0 has past_key but no past_value (past_key.0 has no companion)"),
        ("layers", "past_key.1", "layer 1 has past_key but no past_value (past_key.1 has no companion)"),
    ]


@pytest.mark.parametrize("group", naming.STEM_GROUPS)
def test_layers_stem_groups_pass(tmp_path, group):
    report = _check(tmp_path, kvg.build(2, "P", stems=group), expected_prefix="P")
    assert report.ok, report.format_text()


def test_prefix_mixed(tmp_path):
    report = _check(tmp_path, kvg.build(3, ["A", "A", "B"]))
    assert report.failed == ["prefix"]
    msgs = [(b, m) for r, b, m in _violations(report)]
    assert msgs == [
        ("past_key.2_B", "past_key.2_B has prefix 'B' but other KV buffers have 'A' (mixed prefixes: 'A', 'B')"),
        ("past_value.2_B", "past_value.2_B has prefix 'B' but other KV buffers have 'A' (mixed prefixes: 'A', 'B')"),
        ("past_key.2_B_RetainedState",
         "past_key.2_B_RetainedState has prefix 'B' but other KV buffers have 'A' (mixed prefixes: 'A', 'B')"),
        ("past_value.2_B_RetainedState",
         "past_value.2_B_RetainedState has prefix 'B' but other KV buffers have 'A' (mixed prefixes: 'A', 'B')"),
    ]
    assert report.rule("regex-exact").status == "skip" and report.rule("regex-substring").status == "skip"


def test_prefix_mixed_against_expected(tmp_path):
    report = _check(tmp_path, kvg.build(2, ["A", "B"]), expected_prefix="B")
    assert {b for _, b, _ in _violations(report)} == {"past_key.0_A", "past_value.0_A", "past_key.0_A_RetainedState",
                                                      "past_value.0_A_RetainedState"}


def test_prefix_malformed_kv_like_name(tmp_path):
    report = _check(tmp_path, kvg.build(1, extra_inputs=["past_key.0_a-b"]))
    assert ("prefix", "past_key.0_a-b",
            "past_key.0_a-b starts like a KV buffer but is not a valid KV name "
            "(<stem>.<layer>[_<prefix>][_RetainedState], prefix [A-Za-z0-9]{1,64})") in _violations(report)
    # the legacy serving regex past_key.* would select it too
    assert ("regex-substring", "past_key.0_a-b", "legacy regexes past_key.* + past_value.* selects the non-KV "
            "buffer past_key.0_a-b") in _violations(report)


def test_regex_exact_catches_leading_zero_layer(tmp_path):
    report = _check(tmp_path, kvg.build(1, extra_inputs=["past_key.01"]))
    assert ("regex-exact", "past_key.01",
            r"exact regex ^(past_key|past_value)\.\d+(_RetainedState)?$ selects the non-KV buffer past_key.01") \
        in _violations(report)


def test_regex_substring_prefix_in_other_name(tmp_path):
    report = _check(tmp_path, kvg.build(2, "VLLM", extra_inputs=["VLLM_mask"]), expected_prefix="VLLM")
    assert report.failed == ["regex-substring"]
    assert _violations(report) == [
        ("regex-substring", "VLLM_mask", "substring regex .*VLLM.* selects the non-KV buffer VLLM_mask")]


def test_regex_legacy_on_unprefixed_graph(tmp_path):
    report = _check(tmp_path, kvg.build(2, extra_inputs=["past_key_scale"]))
    assert report.failed == ["regex-substring"]
    assert report.rule("regex-substring").note == "unprefixed graph: legacy regexes"
    assert _violations(report) == [("regex-substring", "past_key_scale",
                                    "legacy regexes past_key.* + past_value.* selects the non-KV buffer past_key_scale")]


def test_non_kv_retained_prefixed(tmp_path):
    report = _check(tmp_path, kvg.build(1, "VLLM", non_kv_retained=["vision_embeds_VLLM",
                                                                     "vision_embeds_VLLM_RetainedState"]))
    assert report.failed == ["regex-substring", "non-kv-unprefixed"]
    assert [v for v in _violations(report) if v[0] == "non-kv-unprefixed"] == [
        ("non-kv-unprefixed", "vision_embeds_VLLM",
         "non-KV retained buffer vision_embeds_VLLM carries prefix 'VLLM'; vision_embeds buffers are never prefixed"),
        ("non-kv-unprefixed", "vision_embeds_VLLM_RetainedState",
         "non-KV retained buffer vision_embeds_VLLM_RetainedState carries prefix 'VLLM'; vision_embeds buffers are "
         "never prefixed"),
    ]


def test_non_kv_penalty_buffers_are_not_kv(tmp_path):
    report = _check(tmp_path, kvg.build(1, non_kv_retained=["past_repetition_penalty_buffer",
                                                            "past_repetition_penalty_buffer_RetainedState"]))
    assert report.ok, report.format_text()


def test_inplace_second_reader(tmp_path):
    report = _check(tmp_path, kvg.build(2, extra_reader="past_value.1"))
    assert report.failed == ["inplace"]
    assert _violations(report) == [
        ("inplace", "past_value.1", "past_value.1 is read by ReduceSum node 'extra_reader' besides its update")]


def test_onnx_checker_failure(tmp_path):
    m = kvg.build(1)
    m.graph.node.append(onnx.helper.make_node("NotAnOp", ["logits"], ["junk"], name="bad"))
    report = _check(tmp_path, m)
    assert report.failed == ["onnx-checker"]
    (v,) = report.violations
    assert v.rule == "onnx-checker" and v.buffer is None
    assert v.message.startswith("onnx checker: ") and "NotAnOp" in v.message and "\n" not in v.message


def test_checker_reads_external_data_from_model_folder(tmp_path, monkeypatch):
    from test_rewrite import _external_model

    src = _external_model(tmp_path / "m")
    monkeypatch.chdir(tmp_path)  # the checker must not resolve model.data against the working folder
    assert qcheck.check(src).ok


def test_check_model_in_memory_skips_checker(tmp_path):
    import onnx_ir as ir

    report = qcheck.check_model(ir.serde.deserialize_model(kvg.build(2)))
    assert report.ok and report.rule("onnx-checker").status == "skip"


# ------------------------------------------------------------------------------------------------ unreadable
def test_unreadable_raises(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x00garbage" * 7)
    with pytest.raises(GraphReadError, match="not an ONNX model or truncated"):
        qcheck.check(bad)
    with pytest.raises(GraphReadError, match="no such file"):
        qcheck.check(tmp_path / "missing.onnx")


def test_escaping_external_data_raises(tmp_path):
    from test_rewrite import _external_model, _set_location

    src = _external_model(tmp_path / "m")
    _set_location(src, "../model.data")
    with pytest.raises(ExternalDataError, match="escapes the model's folder"):
        qcheck.check(src)


def test_invalid_expected_prefix():
    with pytest.raises(PrefixError, match="contains '-'"):
        qcheck.check("whatever.onnx", expected_prefix="a-b")


# ------------------------------------------------------------------------------------------------ CLI
def test_cli_exit_codes(graphs, tmp_path):
    runner = CliRunner()
    ok = runner.invoke(main, ["check", str(graphs / "qeff_llama_vllm.onnx"), "--kv-cache-prefix", "VLLM"])
    assert ok.exit_code == 0
    assert ok.output.splitlines()[-1] == "OK: 10 passed, 0 failed, 2 skipped"
    bad = runner.invoke(main, ["check", str(graphs / "qeff_llama_vllm.onnx"), "--no-kv-cache-prefix"])
    assert bad.exit_code == 1
    assert bad.output.splitlines()[-1] == "FAILED (prefix): 9 passed, 1 failed, 2 skipped"
    assert "  FAIL  prefix" in bad.output
    assert "- [prefix past_key.0_VLLM] KV buffers carry prefix 'VLLM' but (none) is expected" in bad.output
    garbage = tmp_path / "g.onnx"
    garbage.write_bytes(b"nope")
    unreadable = runner.invoke(main, ["check", str(garbage)])
    assert unreadable.exit_code == 2 and unreadable.stderr.startswith("error: ") and \
        "not an ONNX model or truncated" in unreadable.stderr
    usage = runner.invoke(main, ["check", str(graphs / "qeff_llama_vllm.onnx"), "--kv-cache-prefix", "a b"])
    assert usage.exit_code == 2 and "whitespace" in usage.stderr
    both = runner.invoke(main, ["check", "x.onnx", "--kv-cache-prefix", "A", "--no-kv-cache-prefix"])
    assert both.exit_code == 2
    none = runner.invoke(main, ["check"])
    assert none.exit_code == 2


def test_cli_json(graphs, tmp_path):
    r = CliRunner().invoke(main, ["check", str(graphs / "qeff_llama_default.onnx"), "--json",
                                  "--kv-cache-prefix", "VLLM"])
    assert r.exit_code == 1
    j = json.loads(r.output)
    assert j["failed"] == ["prefix"] and j["ok"] is False
    prefix_rule = j["rules"][RULE_IDS.index("prefix")]
    assert prefix_rule["violations"] == [{"rule": "prefix", "buffer": "past_key.0",
                                          "message": "KV buffers carry prefix (none) but 'VLLM' is expected "
                                                     "(e.g. past_key.0)"}]


def test_cli_several_files(graphs, tmp_path):
    bad = kvg.save(kvg.build(2, extra_reader="past_key.0"), tmp_path / "bad.onnx")
    r = CliRunner().invoke(main, ["check", str(graphs / "qeff_llama_default.onnx"), str(bad), "--json"])
    assert r.exit_code == 1
    j = json.loads(r.output)
    assert [x["ok"] for x in j] == [True, False] and j[1]["failed"] == ["inplace"]


# ------------------------------------------------------------------------------------------------ testing API
def test_assert_helper_lists_failing_rules(tmp_path):
    path = kvg.save(kvg.build(2, "VLLM", extra_inputs=["VLLM_mask"], extra_reader="past_key.0_VLLM"),
                    tmp_path / "m.onnx")
    with pytest.raises(AssertionError) as ei:
        assert_retained_state_graph(path, prefix="VLLM")
    msg = str(ei.value)
    assert "retained-state graph check failed (inplace, regex-substring):" in msg
    assert "[regex-substring] substring regex .*VLLM.* selects the non-KV buffer VLLM_mask" in msg
    assert "[inplace] past_key.0_VLLM is read by ReduceSum node 'extra_reader' besides its update" in msg
    assert_retained_state_graph(path, prefix="VLLM", ignore=["inplace", "regex-substring"])
    with pytest.raises(AssertionError, match=r"\[layers\] graph has 2 layers, expected 3"):
        assert_retained_state_graph(path, ignore=["inplace", "regex-substring"], num_layers=3)
    with pytest.raises(ValueError, match="unknown rule ids"):
        assert_retained_state_graph(path, ignore=["nope"])
    with pytest.raises(AssertionError, match=re.escape("selects non-KV ['VLLM_mask'], misses KV []")):
        assert_kv_selected_by(path, ".*VLLM.*")


def test_pre_commit_hook_file():
    text = (REPO / ".pre-commit-hooks.yaml").read_text()
    assert "- id: qeff-kv-check" in text
    assert "entry: qeff-kv check" in text
    assert re.search(r"^\s+files: \\\.onnx\$$", text, re.M)
    assert "language: python" in text


def test_no_torch_import(graphs, tmp_path):
    """rewrite/check/buffers (library and CLI) work on a host without torch/transformers: none is imported."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from click.testing import CliRunner\n"
        "import qeff_kv.tools.rewrite, qeff_kv.tools.check.rules, qeff_kv.tools.buffers, qeff_kv.tools.testing\n"
        "from qeff_kv_cli.main import main\n"
        f"src = {str(graphs / 'qeff_llama_vllm.onnx')!r}\n"
        "r = CliRunner()\n"
        f"assert r.invoke(main, ['rewrite', src, '-o', {str(tmp_path / 'o.onnx')!r}, '--strip-prefix']).exit_code == 0\n"
        "assert r.invoke(main, ['check', src]).exit_code == 0\n"
        "assert r.invoke(main, ['buffers', src, '--regex', '.*VLLM.*']).exit_code == 0\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ------------------------------------------------------------------------------------------------ sliding windows
def test_sliding_layers_pass_and_are_reported(tmp_path):
    """Layers 0 and 2 are ring buffers (axis 2 'sliding_window'), layer 1 keeps 'ctx_len': every rule passes and
    the report names the sliding layers and the metadata's window."""
    report = _check(tmp_path, kvg.build(3, "VLLM", sliding_layers=[0, 2], sliding_window=6), expected_prefix="VLLM")
    assert report.ok, report.format_text()
    assert (report.sliding_layers, report.sliding_window) == ([0, 2], 6)
    j = report.to_json()
    assert list(j)[-2:] == ["sliding_window", "sliding_layers"]
    assert (j["sliding_window"], j["sliding_layers"]) == (6, [0, 2])
    assert report.format_text().splitlines()[0].endswith(
        ": prefix 'VLLM', 3 layers, sliding-window layers 0, 2 (window 6)")


def test_sliding_axis_without_metadata_passes(tmp_path):
    """A peer graph: the sliding axis, no metadata; the window is unknown, nothing fails."""
    report = _check(tmp_path, kvg.build(2, sliding_layers=[1]))
    assert report.ok, report.format_text()
    j = report.to_json()
    assert (j["sliding_window"], j["sliding_layers"]) == (None, [1])
    assert "sliding-window layers 1 (window unknown)" in report.format_text().splitlines()[0]


def test_json_without_sliding_keeps_its_keys(tmp_path):
    j = _check(tmp_path, kvg.build(2)).to_json()
    assert "sliding_window" not in j and "sliding_layers" not in j


@pytest.mark.parametrize("meta", ["0", "-3", "abc", "6.0", ""])
def test_sliding_window_metadata_must_be_a_positive_int(tmp_path, meta):
    report = _check(tmp_path, kvg.build(2, sliding_layers=[0], sliding_window=meta))
    assert report.failed == ["pair-match"]
    assert _violations(report) == [("pair-match", None, f"graph metadata qeff_kv.sliding_window is {meta!r}; it must "
                                                        "be a positive integer (the sliding window)")]
    assert report.to_json()["sliding_window"] is None


def test_sliding_pair_input_and_output_must_agree(tmp_path):
    report = _check(tmp_path, kvg.build(2, sliding_layers=[0], sliding_window=6,
                                        output_dims={"past_key.0_RetainedState": ["batch_size", 2, "ctx_len", 4]}))
    assert report.failed == ["pair-match"]
    assert _violations(report) == [("pair-match", "past_key.0", "past_key.0 dim 2 is 'sliding_window' but "
                                                                "past_key.0_RetainedState dim 2 is 'ctx_len'")]


def test_sliding_layer_key_and_value_do_not_mix_axes(tmp_path):
    dims = ["batch_size", 2, "ctx_len", 4]
    report = _check(tmp_path, kvg.build(2, sliding_layers=[1], sliding_window=6,
                                        input_dims={"past_value.1": dims},
                                        output_dims={"past_value.1_RetainedState": dims}))
    assert report.failed == ["pair-match"]
    assert _violations(report) == [("pair-match", "past_value.1",
                                    "layer 1 mixes KV axis 2 'ctx_len' (past_value.1) and 'sliding_window' "
                                    "(past_key.1); a layer's buffers hold the same positions")]


def test_static_sliding_size_must_equal_the_window(tmp_path):
    ok = ["batch_size", 2, 6, 4]
    report = _check(tmp_path, kvg.build(2, sliding_layers=[0], sliding_window=6, input_dims={"past_value.0": ok},
                                        output_dims={"past_value.0_RetainedState": ok}))
    assert report.ok, report.format_text()
    bad = ["batch_size", 2, 5, 4]
    report = _check(tmp_path, kvg.build(2, sliding_layers=[0], sliding_window=6, input_dims={"past_value.0": bad},
                                        output_dims={"past_value.0_RetainedState": bad}))
    assert report.failed == ["pair-match"]
    assert _violations(report) == [("pair-match", "past_value.0",
                                    "past_value.0 dim 2 is 5 in sliding-window layer 0, but the graph's sliding "
                                    "window (qeff_kv.sliding_window) is 6")]


def test_cli_check_sliding(tmp_path):
    path = kvg.save(kvg.build(2, sliding_layers=[0], sliding_window=6, ordered_reader="past_key.0"),
                    tmp_path / "m.onnx")
    r = CliRunner().invoke(main, ["check", str(path), "--json"])
    assert r.exit_code == 0, r.output
    j = json.loads(r.output)
    assert (j["ok"], j["sliding_window"], j["sliding_layers"]) == (True, 6, [0])
    r = CliRunner().invoke(main, ["check", str(path)])
    assert r.exit_code == 0 and "sliding-window layers 0 (window 6)" in r.output.splitlines()[0]


# ------------------------------------------------------------------------------------------------ in-place order
@pytest.mark.parametrize("kw", [
    {"ordered_reader": "past_key.0"},
    {"ordered_reader": "past_key.0", "ordered_via_view": True},
    {"ordered_reader": "past_value.1", "sliding_layers": [1], "sliding_window": 6},
    {"ordered_reader": "past_key.0", "ordered_in_function": True},
    {"ordered_reader": "past_key.0", "ordered_in_function": True, "caller_reader": True},
], ids=["concat", "through-view", "sliding", "in-function", "caller-reader"])
def test_inplace_ordered_reader_is_safe(tmp_path, kw):
    """A Concat reading X whose Slice is the ScatterND's updates runs before the update: in-place safe."""
    report = _check(tmp_path, kvg.build(2, **kw))
    assert report.ok, report.format_text()
    assert report.rule("inplace").status == "pass"


def test_inplace_reader_the_update_does_not_depend_on(tmp_path):
    report = _check(tmp_path, kvg.build(2, ordered_reader="past_key.0", extra_reader="past_key.0"))
    assert report.failed == ["inplace"]
    assert _violations(report) == [
        ("inplace", "past_key.0", "past_key.0 is read by ReduceSum node 'extra_reader' besides its update")]


def test_inplace_reader_through_a_view_the_update_does_not_depend_on(tmp_path):
    report = _check(tmp_path, kvg.build(2, ordered_reader="past_key.0", ordered_via_view=True,
                                        view_extra_reader=True))
    assert report.failed == ["inplace"]
    assert _violations(report) == [
        ("inplace", "past_key.0", "past_key.0 is read by ReduceSum node 'view_extra_reader' through Unsqueeze node "
                                  "'ordered_view' besides its update")]


def test_inplace_reader_in_the_caller_of_a_function_update(tmp_path):
    """The update is in a function body; a caller-side reader feeding the call's updates is fine, another is not."""
    report = _check(tmp_path, kvg.build(2, ordered_reader="past_key.0", ordered_in_function=True,
                                        caller_reader=True, extra_reader="past_key.0"))
    assert _violations(report) == [
        ("inplace", "past_key.0", "past_key.0 is read by ReduceSum node 'extra_reader' besides its update")]


def test_inplace_view_returned_by_the_graph_is_refused(tmp_path):
    m = kvg.build(1, ordered_reader="past_key.0")
    m.graph.node.append(onnx.helper.make_node("Identity", ["past_key.0"], ["alias"], name="alias_x"))
    m.graph.output.append(onnx.helper.make_tensor_value_info("alias", onnx.TensorProto.FLOAT, kvg.KV_DIMS))
    report = _check(tmp_path, m)
    assert _violations(report) == [
        ("inplace", "past_key.0", "past_key.0 is read by Identity node 'alias_x' besides its update")]


def test_inplace_ordered_reader_sees_the_old_contents_in_onnxruntime(tmp_path):
    """One OrtValue bound as past_key.0 and past_key.0_RetainedState: onnxruntime's ScatterND updates it in place
    (no copy: the bound buffer holds the update afterwards) and the Concat, which the update depends on, read the
    old contents first."""
    import numpy as np
    import onnxruntime as ort

    for kw in ({}, {"ordered_via_view": True}, {"ordered_in_function": True, "caller_reader": True}):
        path = kvg.save(kvg.build(1, ordered_reader="past_key.0", **kw), tmp_path / "o.onnx")
        assert qcheck.check(path).ok
        sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        rng = np.random.default_rng(0)
        old = rng.standard_normal((1, 2, 8, 4)).astype(np.float32)
        new = rng.standard_normal((1, 2, 8, 4)).astype(np.float32)
        buf = ort.OrtValue.ortvalue_from_numpy(old.copy())
        value = ort.OrtValue.ortvalue_from_numpy(rng.standard_normal((1, 2, 8, 4)).astype(np.float32))
        b = sess.io_binding()
        b.bind_cpu_input("input_ids", np.zeros((1, 1), np.int64))
        b.bind_cpu_input("kv_update", new)
        b.bind_ortvalue_input("past_key.0", buf)
        b.bind_ortvalue_output("past_key.0_RetainedState", buf)
        b.bind_ortvalue_input("past_value.0", value)
        b.bind_ortvalue_output("past_value.0_RetainedState", value)
        b.bind_output("ordered_cat")
        b.bind_output("logits")
        sess.run_with_iobinding(b)
        names = [o.name for o in sess.get_outputs()]
        cat = b.copy_outputs_to_cpu()[names.index("ordered_cat")]
        assert np.array_equal(buf.numpy(), new), kw           # the shared buffer was updated in place
        assert np.array_equal(cat[:, :, :8], old), kw         # the reader saw the contents before the update
        assert np.array_equal(cat[:, :, 8:], new), kw
