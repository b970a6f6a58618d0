"""Retained outputs declared with dims the exporter made up (issue 42): one rule for every ``check`` rule and every
state kind (:mod:`qeff_kv.graph.madeup_dims`). A made-up dim the graph's scatter and shape inference leave open is
unknown: it takes the paired input's batch axis or fixed size, and fails only against another named axis; a real
mismatch (two sizes, two names, a size and a name) still fails in one line.

The case of the issue, built here: the peer's Qwen3.5 dense layout, a hybrid whose recurrent states are named
``past_key.{i}``/``past_value.{i}`` with fixed input dims and no position axis, TorchScript's
``Reshape<name>_dim_<k>`` on their retained outputs (``tests/helpers/_recurrent_graph.py``'s hybrid, its layer-1 states
renamed and their outputs reshaped); it checks, strips to the plain names, checks again and runs to the tokens of
the hybrid it was made from.
"""

from __future__ import annotations

import onnx
import pytest
from click.testing import CliRunner

import _kv_graphs as kvg
import _recurrent_graph as rg
from qeff_kv.tools import check as qcheck
from qeff_kv.graph import graphio
from qeff_kv.contract import naming
from qeff_kv.tools.buffers import buffers_report
from qeff_kv.runtime import Session
from qeff_kv_cli.main import main

PROMPT = [5, 17, 3, 40, 22, 9, 31]
KEY, VALUE = "past_key.1_VLLM_RetainedState", "past_value.1_VLLM_RetainedState"


def dense_hybrid(path, declare: dict[str, dict] | None = None):
    """The hybrid with the peer's dense naming and prefix ``VLLM``: ``past_key.0``/``past_value.0`` attention KV,
    layer 1's conv state ``past_key.1_VLLM`` ``[full_batch_size, 6, 3]`` and recurrent state ``past_value.1_VLLM``
    ``[full_batch_size, 2, 4, 3]``, their retained outputs reshaped and declared with made-up dims (``declare``:
    output name -> axes declared otherwise)."""
    m = rg.build()
    names = {"past_key.0": "past_key.0_VLLM", "past_value.0": "past_value.0_VLLM",
             "conv_state.1": "past_key.1_VLLM", "recurrent_state.1": "past_value.1_VLLM"}
    names.update({naming.retained_name(a): naming.retained_name(b) for a, b in list(names.items())})
    for n in m.graph.node:
        n.input[:] = [names.get(x, x) for x in n.input]
        n.output[:] = [names.get(x, x) for x in n.output]
    for v in list(m.graph.input) + list(m.graph.output):
        v.name = names.get(v.name, v.name)
    for out in (KEY, VALUE):
        kvg.torchscript_output(m.graph, out, (declare or {}).get(out))
    onnx.save(m, str(path))
    return path


def test_recurrent_past_key_with_made_up_output_dims_checks(tmp_path):
    path = dense_hybrid(tmp_path / "dense.onnx")
    layout = graphio.layout_of(graphio.load(path))
    # neither the scatter nor shape inference matches them: every axis is the input's word
    assert layout.made_up == {KEY: (0, 1, 2), VALUE: (0, 1, 2, 3)}
    assert layout.output(KEY).shape == ("full_batch_size", rg.C, rg.K)
    assert layout.output(VALUE).shape == ("full_batch_size", rg.H, rg.DH, rg.S)
    report = qcheck.check(path, expected_prefix="VLLM")
    assert report.ok, report.format_text()
    assert report.rule("pair-match").note == (
        f"dims of {KEY} (axes 0, 1, 2), {VALUE} (axes 0, 1, 2, 3) declared with names the exporter made up; "
        "taken as the input's")
    assert [(p["input"], p["state"]) for p in buffers_report(path).to_json()["pairs"]] == [
        ("past_key.0_VLLM", "full"), ("past_value.0_VLLM", "full"),
        ("past_key.1_VLLM", "recurrent"), ("past_value.1_VLLM", "recurrent")]


@pytest.mark.parametrize("declare, messages", [
    ({KEY: {1: 7}}, ["past_key.1_VLLM dim 1 is 6 but past_key.1_VLLM_RetainedState dim 1 is 7"]),
    ({VALUE: {0: "batch_size"}},
     ["past_value.1_VLLM dim 0 is 'full_batch_size' but past_value.1_VLLM_RetainedState dim 0 is 'batch_size'"]),
    ({KEY: {2: "seq_len"}},
     ["past_key.1_VLLM dim 2 is 3 but past_key.1_VLLM_RetainedState dim 2 is 'seq_len'",
      "past_key.1_VLLM_RetainedState dim 2 is 'seq_len'; a recurrent state has no position axis (only axis 0, the "
      "batch, is dynamic)"]),
], ids=["two-sizes", "two-names", "size-and-name"])
def test_a_real_mismatch_beside_made_up_dims_still_fails(tmp_path, declare, messages):
    report = qcheck.check(dense_hybrid(tmp_path / "bad.onnx", declare))
    assert report.failed == ["pair-match"]
    assert [v.message for v in report.rule("pair-match").violations] == messages
    assert report.rule("pair-match").note is None


def test_cli_check_strip_round_trip_and_the_runtime(tmp_path):
    """``check --kv-cache-prefix VLLM`` passes, ``rewrite --strip-prefix`` gives the plain names (the made-up dims
    keep the exported name), ``check --no-kv-cache-prefix`` passes, and the session runs it to the tokens of the
    hybrid it was made from, its past_key.1/past_value.1 kept as recurrent state."""
    src = dense_hybrid(tmp_path / "dense.onnx")
    run = CliRunner().invoke
    r = run(main, ["check", str(src), "--kv-cache-prefix", "VLLM"])
    assert r.exit_code == 0, r.output
    assert r.output.splitlines()[-1] == "OK: 10 passed, 0 failed, 2 skipped"
    stripped = tmp_path / "stripped.onnx"
    r = run(main, ["rewrite", str(src), "-o", str(stripped), "--strip-prefix"])
    assert r.exit_code == 0, r.output
    ins, outs = kvg.io_signature(stripped)
    assert [n for n, _, _ in ins] == [n.replace("_VLLM", "") for n, _, _ in kvg.io_signature(src)[0]]
    assert dict((n, d) for n, _, d in outs)["past_key.1_RetainedState"] == [
        f"Reshape{KEY}_dim_{k}" for k in range(3)]
    r = run(main, ["check", str(stripped), "--no-kv-cache-prefix"])
    assert r.exit_code == 0, r.output

    want = Session(rg.save(tmp_path / "hybrid.onnx"), ctx_len=32, prefill_seq_len=4)
    [w] = want.generate([PROMPT], max_new_tokens=10, stop_tokens=[])
    s = Session(stripped, ctx_len=32, prefill_seq_len=4)
    assert sorted(s.cache.recurrent.shapes) == ["past_key.1", "past_value.1"]
    [g] = s.generate([PROMPT], max_new_tokens=10, stop_tokens=[])
    assert g.tokens == w.tokens and len(set(w.tokens)) > 1


def test_the_cli_names_a_real_mismatch(tmp_path):
    r = CliRunner().invoke(main, ["check", str(dense_hybrid(tmp_path / "bad.onnx", {KEY: {1: 7}})),
                                  "--kv-cache-prefix", "VLLM"])
    assert r.exit_code == 1
    assert "- [pair-match past_key.1_VLLM] past_key.1_VLLM dim 1 is 6 but past_key.1_VLLM_RetainedState dim 1 is 7" \
        in r.output
    assert r.output.splitlines()[-1] == "FAILED (pair-match): 9 passed, 1 failed, 2 skipped"


# ------------------------------------------------------------------------------------------------ every state kind
REC_AS_KV = {"past_key.0": ["batch_size", 8, 4], "past_value.0": ["batch_size", 2, 4, 8],
             "past_key.1": ["batch_size", 8, 4], "past_value.1": ["batch_size", 2, 4, 8]}
KINDS = {   # kind -> (build arguments, the kind buffers reports for layer 0)
    "full": ({}, "full"),
    "ring": ({"sliding_layers": [0, 1], "sliding_window": 8}, "ring"),
    "latent": ({"stems": naming.LATENT_STEMS}, "latent"),
    "recurrent": ({"stems": ["conv_state", "recurrent_state"]}, "recurrent"),
    "recurrent-as-kv": ({"input_dims": REC_AS_KV,
                         "output_dims": {naming.retained_name(n): d for n, d in REC_AS_KV.items()}}, "recurrent"),
}


def _kind_graph(tmp_path, kind: str, declare: dict[int, object] | None = None):
    """Two layers of ``kind``; every retained output reshaped and declared with made-up dims, but for a named
    position axis of its input (``ctx_len``, ``sliding_window``), kept; ``declare`` overrides axes of the first."""
    kw, _ = KINDS[kind]
    m = kvg.build(2, **kw)
    ins = {v.name: v for v in m.graph.input}
    for j, out in enumerate([v.name for v in m.graph.output if naming.parse_kv_name(v.name) is not None]):
        dims = ins[naming.retained_source(out)].type.tensor_type.shape.dim
        keep = {k: d.dim_param for k, d in enumerate(dims) if k > 0 and d.dim_param}
        kvg.torchscript_output(m.graph, out, {**keep, **(declare if j == 0 and declare else {})})
    return kvg.save(m, tmp_path / f"{kind}.onnx")


@pytest.mark.parametrize("kind", KINDS)
def test_made_up_dims_take_the_inputs_fixed_sizes_for_every_kind(tmp_path, kind):
    path = _kind_graph(tmp_path, kind)
    layout = graphio.layout_of(graphio.load(path))
    assert all(p.output.shape == p.input.shape for p in layout.pairs)
    assert all(layout.made_up[p.output_name] for p in layout.pairs)
    assert {p["state"] for p in buffers_report(path).to_json()["pairs"]} == {KINDS[kind][1]}
    report = qcheck.check(path)
    assert report.rule("pair-match").status == "pass", report.format_text()
    assert report.rule("pair-match").note.endswith("declared with names the exporter made up; taken as the input's")
    assert report.failed in ([], ["inplace"])   # a reshaped attention output is not updated in place


@pytest.mark.parametrize("kind", KINDS)
def test_a_size_that_differs_still_fails_for_every_kind(tmp_path, kind):
    path = _kind_graph(tmp_path, kind, {1: 3})
    report, first = qcheck.check(path), graphio.layout_of(graphio.load(path)).pairs[0]
    assert [v.message for v in report.rule("pair-match").violations] == [
        f"{first.input_name} dim 1 is {first.input.shape[1]} but {first.output_name} dim 1 is 3"]


@pytest.mark.parametrize("kind", ["full", "ring", "latent"])
def test_a_made_up_position_axis_still_fails(tmp_path, kind):
    """Against a named axis of the input (a size each run chooses) only the graph can tie the output: unchanged."""
    path = _kind_graph(tmp_path, kind, {2: "Reshapex_RetainedState_dim_2"})
    report, first = qcheck.check(path), graphio.layout_of(graphio.load(path)).pairs[0]
    assert [v.message for v in report.rule("pair-match").violations] == [
        f"{first.input_name} dim 2 is {first.input.shape[2]!r} but {first.output_name} dim 2 is "
        "'Reshapex_RetainedState_dim_2', a dim the exporter made up that neither the graph's scatter nor shape "
        "inference matches"]
