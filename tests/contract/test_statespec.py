"""The per-layer state spec (qeff_kv/contract/statespec.py): written by the exporter into ``qeff_kv.state_spec``, derived
from names and shapes for graphs without it, read by the layout (check, buffers, compile-config, the runtime's
rings), and checked against the graph's buffers."""

from __future__ import annotations

import json

import onnx
import pytest

import _kv_graphs
from suite import requires_torch
from qeff_kv.graph import graphio
from qeff_kv.contract import naming, statespec
from qeff_kv.tools.check import check
from qeff_kv.errors import ContractError


def _layout(path):
    return graphio.layout_of(graphio.load(path))


def test_kinds_map_positions_to_slots():
    full, ring = statespec.KINDS["full"], statespec.KINDS["ring"]
    assert [full.slot(p, 8) for p in (0, 7)] == [0, 7] and full.held(5, 8) == (0, 5)
    assert [ring.slot(p, 6) for p in (0, 5, 6, 13)] == [0, 5, 0, 1]
    assert ring.held(4, 6) == (0, 4) and ring.held(13, 6) == (7, 13)
    assert (full.dim, ring.dim) == (naming.CTX_DIM, naming.SLIDING_DIM)


def test_export_spec_round_trips_through_json():
    spec = statespec.for_export([((2, 16), (2, 16)), ((1, 8), (1, 4))], window=6, ring_layers=[0],
                                sliding_layers=[0])
    assert [(s.kind, s.capacity, s.window) for s in spec.layers] == [("ring", 6, 6), ("full", None, None)]
    assert spec.layers[1].shapes == ((1, "ctx_len", 8), (1, "ctx_len", 4))
    assert spec.layers[1].capacity_at(32) == 32 and spec.layers[0].capacity_at(32) == 6
    assert statespec.StateSpec.loads(spec.dumps()) == spec
    assert spec.ring_layers == (0,) and spec.has_ring


def test_malformed_spec_is_one_line():
    with pytest.raises(ContractError, match=r"^graph metadata qeff_kv.state_spec is not JSON$"):
        statespec.StateSpec.loads("{")
    with pytest.raises(ContractError,
                       match=r"layer 0 has unknown kind 'paged' \(known: full, ring, latent, indexed, recurrent\)$"):
        statespec.StateSpec.loads(json.dumps([{"layer": 0, "kind": "paged", "stems": [], "shapes": []}]))


def test_derived_spec_of_a_hybrid_graph_keeps_recurrent_state_apart():
    """A parallel-hybrid layer (attention and a Mamba2 mixer side by side, Falcon-H1) has two entries; a recurrent
    entry has no position axis and cannot be sliced; a recorded spec missing it is a mismatch."""
    pairs = [("past_key", 0, ("batch", 2, "ctx_len", 8), None), ("past_value", 0, ("batch", 2, "ctx_len", 8), None),
             ("conv_state", 0, ("batch", 48, 4), None), ("recurrent_state", 0, ("batch", 4, 8, 16), None),
             ("conv_state", 1, ("batch", 48, 4), None), ("recurrent_state", 1, ("batch", 4, 8, 16), None)]
    spec = statespec.derive(pairs)
    assert [(s.layer, s.kind) for s in spec.layers] == [(0, "full"), (0, "recurrent"), (1, "recurrent")]
    assert spec.layer(0).stems == ("past_key", "past_value") and spec.layer(1) is None
    rec = spec.recurrent(1)
    assert rec.stems == ("conv_state", "recurrent_state") and rec.position_axis is None
    assert rec.shapes == ((48, 4), (4, 8, 16)) and not rec.state_kind.sliceable
    assert spec.recurrent_layers == (0, 1) and spec.has_recurrent and not spec.has_ring
    assert statespec.StateSpec.loads(spec.dumps()) == spec
    assert statespec.mismatch(spec, pairs) is None
    partial = statespec.StateSpec(spec.layers[:2])
    assert statespec.mismatch(partial, pairs) == (
        "graph metadata qeff_kv.state_spec describes layers [0, '0 (recurrent)'], the graph's KV buffers are of "
        "layers [0, '0 (recurrent)', '1 (recurrent)']")
    with pytest.raises(ContractError, match="^a recurrent state has no position slots$"):
        rec.state_kind.slot(3, 8)


def test_derived_spec_of_a_graph_without_one(tmp_path):
    path = _kv_graphs.save(_kv_graphs.build(3, sliding_layers=[1], sliding_window=4), tmp_path / "g.onnx")
    lay = _layout(path)
    assert naming.STATE_SPEC_META not in lay.metadata
    spec = lay.state_spec
    assert [(s.layer, s.kind, s.stems) for s in spec.layers] == [
        (0, "full", ("past_key", "past_value")), (1, "ring", ("past_key", "past_value")),
        (2, "full", ("past_key", "past_value"))]
    assert spec.layer(1).window == 4 and lay.has_sliding and lay.sliding_layers == [1]


def test_check_refuses_a_spec_that_contradicts_the_buffers(tmp_path):
    proto = _kv_graphs.build(2)
    lay = graphio.layout_of(graphio.load(_kv_graphs.save(proto, tmp_path / "ok.onnx")))
    wrong = [dict(s.to_json(), kind="ring") if s.layer == 1 else s.to_json() for s in lay.state_spec.layers]
    onnx.helper.set_model_props(proto, {naming.STATE_SPEC_META: json.dumps(wrong)})
    report = check(_kv_graphs.save(proto, tmp_path / "bad.onnx"))
    assert report.failed == ["pair-match"]
    pm = next(r for r in report.rules if r.id == "pair-match")
    assert any(v.message == "graph metadata qeff_kv.state_spec: layer 1 is ring, its buffers are full"
               for v in pm.violations)
    # the layout ignores a recorded spec that does not describe the buffers: the runtime sees no ring
    assert not graphio.layout_of(graphio.load(tmp_path / "bad.onnx")).has_sliding


@requires_torch
def test_every_export_records_its_spec_and_it_matches_the_buffers(own_graphs):
    for name in ("qeff_llama_vllm.onnx", "qeff_llama_cb_default.onnx", "own_llama_fused_vllm.onnx"):
        lay = _layout(own_graphs / name)
        recorded = statespec.StateSpec.loads(lay.metadata[naming.STATE_SPEC_META])
        assert statespec.problem(lay.metadata, lay.state_pairs) is None
        assert recorded == lay.state_spec
        assert [s.kind for s in recorded.layers] == ["full"] * lay.num_layers
        assert all(s.stems == naming.EXPORT_STEMS and s.position_axis == 2 for s in recorded.layers)
        assert check(own_graphs / name).ok


def test_latent_kind_derived_and_checked(tmp_path):
    """MLA's latent pair: derived as ``latent`` from a graph without a spec; a recorded spec that calls it ``full``
    does not describe the graph."""
    path = _kv_graphs.save(_kv_graphs.build(2, stems=("compressed_kv", "k_pe")), tmp_path / "g.onnx")
    lay = _layout(path)
    assert [(s.layer, s.kind, s.stems) for s in lay.state_spec.layers] == [
        (0, "latent", ("compressed_kv", "k_pe")), (1, "latent", ("compressed_kv", "k_pe"))]
    assert lay.state_spec.latent_layers == (0, 1)
    kind = statespec.KINDS["latent"]
    assert (kind.slot(7, 32), kind.held(9, 32), kind.dim) == (7, (0, 9), "ctx_len")
    wrong = statespec.StateSpec(tuple(statespec.LayerState(i, "full", ("compressed_kv", "k_pe"),
                                                           ((1, "ctx_len", 4), (1, "ctx_len", 4))) for i in range(2)))
    assert statespec.mismatch(wrong, lay.state_pairs) == (
        "graph metadata qeff_kv.state_spec: layer 0 is full, its buffers are latent")


def test_indexed_kind_derived_and_checked(tmp_path):
    """DeepSeek sparse attention: a layer whose buffers include the indexer's ``index_key`` is ``indexed`` (its pair
    and the indexer keys, all full-length); a recorded spec that calls it ``full`` does not describe the graph."""
    path = _kv_graphs.save(_kv_graphs.build(2, stems=naming.INDEXED_STEMS), tmp_path / "g.onnx")
    lay = _layout(path)
    assert [(s.layer, s.kind, s.stems) for s in lay.state_spec.layers] == [
        (0, "indexed", naming.INDEXED_STEMS), (1, "indexed", naming.INDEXED_STEMS)]
    assert lay.state_spec.indexed_layers == (0, 1)
    kind = statespec.KINDS["indexed"]
    assert (kind.slot(7, 32), kind.held(9, 32), kind.dim, kind.sliceable) == (7, (0, 9), "ctx_len", True)
    wrong = statespec.StateSpec(tuple(statespec.LayerState(i, "full", naming.INDEXED_STEMS,
                                                           ((1, "ctx_len", 4),) * 3) for i in range(2)))
    assert statespec.mismatch(wrong, lay.state_pairs) == (
        "graph metadata qeff_kv.state_spec: layer 0 is full, its buffers are indexed")
    spec = statespec.for_export([((1, 8), (1, 4), (1, 16)), ((1, 8), (1, 4))], window=None, ring_layers=(),
                                indexed_layers=(0,))
    assert [(s.kind, s.stems, s.shapes) for s in spec.layers] == [
        ("indexed", ("past_key", "past_value", "index_key"),
         ((1, "ctx_len", 8), (1, "ctx_len", 4), (1, "ctx_len", 16))),
        ("full", ("past_key", "past_value"), ((1, "ctx_len", 8), (1, "ctx_len", 4)))]
    assert statespec.StateSpec.loads(spec.dumps()) == spec
    assert check(path).ok


def test_check_index_key_rules(tmp_path):
    """``check``'s pair-match rule on indexer keys: they share their layer's ctx axis and come with its cache."""
    def graph(name, **kw):
        return _kv_graphs.save(_kv_graphs.build(2, stems=naming.INDEXED_STEMS, **kw), tmp_path / name)

    skewed = [1, 1, "ctx_len2", 4]
    skew = check(graph("skew.onnx", input_dims={"index_key.1": skewed},
                       output_dims={"index_key.1_RetainedState": skewed}))
    pm = next(r for r in skew.rules if r.id == "pair-match")
    assert pm.status == "fail"
    assert any("index_key.1 dim 2 is 'ctx_len2' but past_key.1 dim 2 is 'ctx_len'; the indexer's keys share their "
               "layer's ctx axis" in v.message for v in pm.violations), pm.violations
    alone = check(graph("alone.onnx", drop_inputs=["past_key.0", "past_value.0"],
                        drop_outputs=["past_key.0_RetainedState", "past_value.0_RetainedState"]))
    assert not alone.ok
    assert any("index_key.0 has no past_key.0" in v.message for r in alone.rules for v in r.violations), \
        alone.format_text()
