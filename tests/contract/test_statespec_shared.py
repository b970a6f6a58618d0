"""Layers without state of their own in the state spec (qeff_kv/contract/statespec.py): a shared-KV layer (Gemma 4's
``num_kv_shared_layers``) attends over an earlier layer's keys/values and keeps no buffer. The spec records it
(``StateSpec.shared``, a ``"shared"`` entry in ``qeff_kv.state_spec``), ``check`` accepts the layer numbers it
leaves out (and ``check``/``buffers`` name them), and a record that contradicts the buffers is one line."""

from __future__ import annotations

import json

import onnx

import _kv_graphs
from qeff_kv.contract import naming, statespec
from qeff_kv.graph import graphio
from qeff_kv.tools.buffers import buffers_report, format_buffer_table
from qeff_kv.tools.check import check

KV = ((2, 16), (2, 16))


def test_shared_layers_round_trip_through_json_beside_the_layers_that_keep_state():
    spec = statespec.for_export([KV, KV, None, None], window=6, ring_layers=[0], sliding_layers=[0, 2],
                                shared=[(3, 1), (2, 0)])
    assert [(s.layer, s.kind) for s in spec.layers] == [(0, "ring"), (1, "full")]
    assert spec.shared == ((2, 0), (3, 1))
    assert (spec.source_of(2), spec.source_of(3), spec.source_of(1)) == (0, 1, None)
    assert spec.layer(2) is None and spec.layer(3) is None
    raw = json.loads(spec.dumps())
    assert [(d["layer"], d["kind"]) for d in raw] == [(0, "ring"), (1, "full"), (2, "shared"), (3, "shared")]
    assert raw[2] == {"layer": 2, "kind": "shared", "source": 0}
    assert statespec.StateSpec.loads(spec.dumps()) == spec
    # without shared layers the JSON is what it always was
    plain = statespec.for_export([KV, KV], window=None, ring_layers=[])
    assert all(d["kind"] == "full" for d in json.loads(plain.dumps())) and plain.shared == ()


def test_a_shared_record_that_contradicts_the_buffers_is_a_mismatch():
    pairs = [(stem, layer, ("batch", 2, "ctx_len", 16), None) for layer in (0, 2) for stem in naming.EXPORT_STEMS]
    layers = statespec.derive(pairs).layers
    ok = statespec.StateSpec(layers, shared=((1, 0),))
    assert statespec.mismatch(ok, pairs) is None
    assert statespec.mismatch(statespec.StateSpec(layers, shared=((2, 0),)), pairs) == (
        "graph metadata qeff_kv.state_spec: layer 2 is shared (reads layer 0) but has KV buffers")
    assert statespec.mismatch(statespec.StateSpec(layers, shared=((1, 3),)), pairs) == (
        "graph metadata qeff_kv.state_spec: layer 1 reads layer 3's keys/values, but layer 3 keeps none")
    bad = json.dumps([{"layer": 1, "kind": "shared"}])
    assert statespec.problem({naming.STATE_SPEC_META: bad}, pairs) == (
        "graph metadata qeff_kv.state_spec: malformed shared layer entry ('source')")


def _gap_graph(tmp_path, shared):
    """Layers 0 and 2 keep KV buffers; layer 1 keeps none (``shared``: the spec's record of it)."""
    proto = _kv_graphs.build(layer_ids=[0, 2])
    lay = graphio.layout_of(graphio.load(_kv_graphs.save(proto, tmp_path / "plain.onnx")))
    spec = statespec.StateSpec(lay.state_spec.layers, shared=shared)
    onnx.helper.set_model_props(proto, {naming.STATE_SPEC_META: spec.dumps()})
    return _kv_graphs.save(proto, tmp_path / f"gap{len(shared)}.onnx")


def test_check_accepts_a_layer_the_spec_records_as_shared(tmp_path):
    report = check(_gap_graph(tmp_path, ((1, 0),)))
    assert report.ok, report.format_text()
    assert report.format_text().splitlines()[0].endswith(", 2 layers, shared-KV layers 1 (no buffers)")
    assert report.to_json()["shared_layers"] == [{"layer": 1, "source": 0}]
    lay = graphio.layout_of(graphio.load(tmp_path / "gap1.onnx"))
    assert lay.state_spec.shared == ((1, 0),) and lay.num_layers == 2
    assert ("shared-KV layers (no buffers; each reads an earlier layer's keys/values): 1 reads 0"
            in format_buffer_table(lay).splitlines())
    assert buffers_report(tmp_path / "gap1.onnx").to_json()["shared_layers"] == [{"layer": 1, "source": 0}]


def test_check_still_fails_a_gap_nothing_records(tmp_path):
    report = check(_gap_graph(tmp_path, ()))
    assert report.failed == ["layers"]
    rule = next(r for r in report.rules if r.id == "layers")
    assert [v.message for v in rule.violations] == [
        "layer 1 has no KV buffers (layers present: 0, 2; expected 0..2)"]
