"""The KV dialects read by name (issue 49): past/present (growing or shared buffer) and the static cache, beside
retained state; what ``check``, ``buffers`` and ``rewrite`` make of each."""

from __future__ import annotations

import re
import shutil

import dialect_loops
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import yaml
from onnx import TensorProto, helper

import _kv_graphs as kvg
from suite import REPO
from qeff_kv.contract import naming
from qeff_kv.contract.layout import NO_KV, KVLayout, TensorInfo
from qeff_kv.errors import ContractError
from qeff_kv.graph import graphio
from qeff_kv.tools import buffers, check, rewrite

DIALECTS = naming.DIALECTS


# ------------------------------------------------------------------------------------------------ names
@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize("prefix", [None, "VLLM", "P2"])
def test_every_name_parses_back_to_itself(dialect, prefix):
    for stem in naming.DIALECT_STEMS[dialect]:
        for layer in (0, 2, 10, 31):
            for output in (False, True):
                name = naming.dialect_name(dialect, stem, layer, prefix, output=output)
                parsed = naming.parse_any_kv_name(name)
                assert parsed == naming.KVName(stem, layer, prefix, output, dialect)
                assert parsed.name == name
                assert naming.dialect_of(name) == dialect


def test_names_as_the_peers_write_them():
    assert naming.dialect_name(naming.PAST_PRESENT, "past_key", 3) == "past_key_values.3.key"
    assert naming.dialect_name(naming.PAST_PRESENT, "past_value", 3, output=True) == "present.3.value"
    assert naming.dialect_name(naming.STATIC_CACHE, "past_key", 12) == "key_cache.12"
    assert naming.dialect_name(naming.STATIC_CACHE, "past_value", 12, "VLLM", output=True) == \
        "updated_value_cache.12_VLLM"
    assert naming.KVName("past_key", 4, "VLLM").in_dialect(naming.PAST_PRESENT).output == "present.4.key_VLLM"
    with pytest.raises(ValueError, match="no name for 'compressed_kv'"):
        naming.dialect_name(naming.STATIC_CACHE, "compressed_kv", 0)


@pytest.mark.parametrize("name", ["present.01.key", "past_key_values.1.keys", "key_cache.1_a-b", "updated_key_cache",
                                  "present.1.key_RetainedStateX", "cache_key.1", "present.1.value_é"])
def test_malformed_names_are_not_kv(name):
    assert naming.parse_any_kv_name(name) is None


@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize("prefix", [None, "VLLM"])
def test_each_dialects_regex_selects_its_names_only(dialect, prefix):
    mine = [naming.dialect_name(dialect, s, i, prefix, output=o) for s in naming.EXPORT_STEMS for i in (0, 11)
            for o in (False, True)]
    others = [naming.dialect_name(d, s, 1, prefix, output=o) for d in DIALECTS if d != dialect
              for s in naming.EXPORT_STEMS for o in (False, True)]
    rx = naming.canonical_regexes(prefix, dialect=dialect)
    assert naming.select(rx["exact"], mine + others + ["logits", "input_ids"]) == mine
    if prefix is None:
        assert all(any(re.fullmatch(r, n) for r in rx["legacy"]) for n in mine)
        legacy_hits = [n for n in others if any(re.fullmatch(r, n) for r in rx["legacy"])]
        # vLLM-QAIC's legacy past_key.* also takes past_key_values.* (one more reason to prefix a graph)
        expected = [n for n in others if n.startswith("past_key_values.")] if dialect == naming.RETAINED_STATE else []
        assert legacy_hits == expected


# ------------------------------------------------------------------------------------------------ layouts
def _io(dialect, layers=2, *, prefix=None, in_axis="ctx_len", out_axis="ctx_len", packed=False):
    shape_in = ["batch", in_axis, 32] if packed else ["batch", 2, in_axis, 16]
    shape_out = ["batch", out_axis, 32] if packed else ["batch", 2, out_axis, 16]
    ins = [TensorInfo("input_ids", "int64", ("batch", "seq")), TensorInfo("position_ids", "int64", ("batch", "seq"))]
    outs = [TensorInfo("logits", "float32", ("batch", "seq", 256))]
    for i in range(layers):
        for stem in naming.EXPORT_STEMS:
            ins.append(TensorInfo(naming.dialect_name(dialect, stem, i, prefix), "float32", tuple(shape_in)))
            outs.append(TensorInfo(naming.dialect_name(dialect, stem, i, prefix, output=True), "float32",
                                   tuple(shape_out)))
    return ins, outs


def test_shared_past_present_pairs_like_retained_state():
    lay = KVLayout.from_io(*_io(naming.PAST_PRESENT, 12, prefix="VLLM")).require_valid()
    assert (lay.dialect, lay.update, lay.num_layers, lay.prefix) == (naming.PAST_PRESENT, "shared-buffer", 12, "VLLM")
    assert lay.pair("past_key", 10).output_name == "present.10.key_VLLM"
    assert set(lay.state_kinds.values()) == {"full"}


def test_growing_past_present_is_told_apart():
    lay = KVLayout.from_io(*_io(naming.PAST_PRESENT, in_axis="past_sequence_len",
                                out_axis="past_sequence_len + sequence_len"))
    assert (lay.update, lay.grows) == ("grows", True)


def test_static_cache_is_positional_on_axis_1_not_recurrent():
    lay = KVLayout.from_io(*_io(naming.STATIC_CACHE, in_axis=64, out_axis=64, packed=True)).require_valid()
    p = lay.pair("past_value", 1)
    assert (p.packed, p.seq_axis, p.axis2, p.recurrent) == (True, 1, 64, False)
    assert p.view_shape(p.input.shape) == ("batch", 1, 64, 32)
    assert lay.update == "indexed-scatter"
    assert set(lay.state_kinds.values()) == {"full"}
    assert p.capacity() == 64 and p.bytes_per_sequence() == 64 * 32 * 4


def test_one_graph_speaks_one_dialect():
    ins, outs = _io(naming.PAST_PRESENT)
    ins2, outs2 = _io(naming.RETAINED_STATE, 1)
    lay = KVLayout.from_io(ins + ins2[2:], outs + outs2[1:])
    with pytest.raises(ContractError, match=r"KV buffers mix dialects \(past-present, retained-state\)"):
        lay.require_valid()


def test_pairs_a_sidecar_declares_on_names_no_dialect_spells():
    ins = [TensorInfo("ids", "int64", ("b", "s"))] + [
        TensorInfo(f"kv_in_{r}{i}", "float32", ("b", 2, "ctx", 16)) for i in range(11) for r in "kv"]
    outs = [TensorInfo(f"kv_out_{r}{i}", "float32", ("b", 2, "ctx", 16)) for i in range(11) for r in "kv"]
    declared = [(f"kv_in_{r}{i}", f"kv_out_{r}{i}", naming.STEM_OF_ROLE["key" if r == "k" else "value"], i)
                for i in range(11) for r in "kv"]
    lay = KVLayout.from_io(ins, outs, declared=declared, source="inference_metadata.yaml").require_valid()
    assert (lay.source, lay.dialect, lay.update, lay.num_layers) == ("inference_metadata.yaml", None, "declared", 11)
    assert lay.pair("past_value", 10).input_name == "kv_in_v10"
    bad = KVLayout.from_io(ins, outs, declared=declared + [("kv_in_k11", "kv_out_k11", "past_key", 11)],
                           source="genai_config.json")
    with pytest.raises(ContractError, match="genai_config.json names port 'kv_in_k11', which the graph does not have"):
        bad.require_valid()


# ------------------------------------------------------------------------------------------------ graphs
def _static_graph(layers=2, capacity=8, hd=4, prefix=None) -> onnx.ModelProto:
    """A static-cache graph as mobius writes its cache update: TensorScatter(cache, new, write_indices) straight
    into the updated cache; the logits read the updated caches up to nonpad_kv_seqlen."""
    ins = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", hd]),
           helper.make_tensor_value_info(naming.WRITE_INDICES_INPUT, TensorProto.INT64, ["batch"])]
    outs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", hd])]
    nodes, acc = [], "x"
    for i in range(layers):
        for stem in naming.EXPORT_STEMS:
            x, y = (naming.dialect_name(naming.STATIC_CACHE, stem, i, prefix, output=o) for o in (False, True))
            ins.append(helper.make_tensor_value_info(x, TensorProto.FLOAT, ["batch", capacity, hd]))
            outs.append(helper.make_tensor_value_info(y, TensorProto.FLOAT, ["batch", capacity, hd]))
            nodes.append(helper.make_node("TensorScatter", [x, "x", naming.WRITE_INDICES_INPUT], [y], axis=-2))
            nodes.append(helper.make_node("ReduceSum", [y], [f"s_{x}"], keepdims=1, noop_with_empty_axes=0))
            nodes.append(helper.make_node("Add", [acc, f"s_{x}"], [f"a_{x}"]))
            acc = f"a_{x}"
    nodes.append(helper.make_node("Identity", [acc], ["logits"]))
    graph = helper.make_graph(nodes, "static", ins, outs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24)], ir_version=10)


def test_static_cache_graph_checks_clean_and_updates_in_place(tmp_path):
    path = kvg.save(_static_graph(3), tmp_path / "static.onnx")
    rep = check.check(path)
    assert rep.ok, rep.format_text()
    assert (rep.dialect, rep.update, rep.num_layers) == (naming.STATIC_CACHE, "indexed-scatter", 3)
    assert rep.rule("inplace").status == "pass" and rep.rule("inplace").note is None   # not "replaced whole"
    assert "static-cache dialect (indexed-scatter; pairs from names)" in rep.format_text().splitlines()[0]
    # onnxruntime runs it: the scatter writes the new rows at write_indices
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = {i.name: np.zeros((1, 8, 4), np.float32) for i in sess.get_inputs() if "cache" in i.name}
    out = sess.run(["updated_key_cache.0"], {**feeds, "x": np.ones((1, 2, 4), np.float32),
                                            naming.WRITE_INDICES_INPUT: np.array([5], np.int64)})[0]
    assert out[0, :, 0].tolist() == [0, 0, 0, 0, 0, 1, 1, 0]


def test_growing_past_present_graph_fails_pair_match_as_not_retained_state(tmp_path):
    g = kvg.build(2)
    for v in list(g.graph.input) + list(g.graph.output):
        parsed = naming.parse_kv_name(v.name)
        if parsed is not None:
            v.type.tensor_type.shape.dim[2].dim_param = "past_sequence_len + sequence_len" if parsed.retained \
                else "past_sequence_len"
    _rename(g, naming.PAST_PRESENT)
    rep = check.check_model(graphio.load(kvg.save(g, tmp_path / "grow.onnx")))
    assert rep.failed == ["pair-match"]
    (v,) = rep.rule("pair-match").violations
    assert v.buffer == "present.0.key" and "not retained-state (past/present by concatenation" in v.message
    assert rep.rule("inplace").status == "skip"


def _rename(g: onnx.ModelProto, dialect: str) -> None:
    """Every KV name of ``g`` (and every node reference to it) in ``dialect``."""
    new = {}
    for v in list(g.graph.input) + list(g.graph.output):
        parsed = naming.parse_kv_name(v.name)
        if parsed is not None:
            new[v.name] = parsed.in_dialect(dialect).name
            v.name = new[v.name]
    for node in g.graph.node:
        node.input[:] = [new.get(n, n) for n in node.input]
        node.output[:] = [new.get(n, n) for n in node.output]


@pytest.mark.parametrize("dialect", [naming.PAST_PRESENT, naming.STATIC_CACHE])
def test_rewrite_sets_the_prefix_in_the_graphs_own_dialect(tmp_path, dialect):
    if dialect == naming.STATIC_CACHE:
        src = kvg.save(_static_graph(2), tmp_path / "in.onnx")
    else:
        g = kvg.build(2)
        _rename(g, dialect)
        src = kvg.save(g, tmp_path / "in.onnx")
    res = rewrite.rewrite(src, tmp_path / "out.onnx", prefix="VLLM")
    assert sorted(b for _, b in res.renamed) == sorted(
        naming.dialect_name(dialect, s, i, "VLLM", output=o) for s in naming.EXPORT_STEMS for i in range(2)
        for o in (False, True))
    rep = check.check(tmp_path / "out.onnx", expected_prefix="VLLM")
    assert rep.ok, rep.format_text()
    back = rewrite.rewrite(tmp_path / "out.onnx", tmp_path / "back.onnx", strip=True)
    assert sorted(back.renamed) == sorted((b, a) for a, b in res.renamed)


def test_buffers_refuses_a_graph_whose_kv_it_cannot_name(tmp_path):
    g = kvg.build(2)
    new = {}
    for v in list(g.graph.input) + list(g.graph.output):
        if naming.parse_kv_name(v.name) is not None:
            new[v.name] = v.name.replace("past_", "cache_")
            v.name = new[v.name]
    for node in g.graph.node:
        node.input[:] = [new.get(n, n) for n in node.input]
        node.output[:] = [new.get(n, n) for n in node.output]
    path = kvg.save(g, tmp_path / "unknown.onnx")
    with pytest.raises(ContractError) as exc:
        buffers.buffers_report(path)
    assert str(exc.value) == f"{path}: {NO_KV}"


def test_another_writers_sidecar_follows_a_rename_and_leaves_with_a_conversion(tmp_path):
    """mobius' model.io-form inference_metadata.yaml beside a static-cache graph: `check` reads it, a prefix rewrite
    renames exactly the ports it names (in place), and a conversion in place removes it (it would name ports the
    converted graph no longer has)."""
    path = dialect_loops.static_cache_graph(tmp_path / "model.onnx", layers=2, capacity=64, kv_heads=2,
                                            head_dim=16, q_heads=4)
    shutil.copy(REPO / "fixtures" / "sidecars" / "mobius-0.1.0-static.yaml", tmp_path / "inference_metadata.yaml")
    rep = check.check(path)
    assert rep.rule("sidecar").status == "pass" and rep.rule("sidecar").note == "checked: inference_metadata.yaml"
    rewrite.rewrite(path, in_place=True, prefix="VLLM")
    doc = yaml.safe_load((tmp_path / "inference_metadata.yaml").read_text())
    sc = doc["model"]["io"]["static_cache"]
    assert sc["key_cache_inputs"] == ["key_cache.0_VLLM", "key_cache.1_VLLM"]
    assert sc["value_cache_outputs"] == ["updated_value_cache.0_VLLM", "updated_value_cache.1_VLLM"]
    assert sc["write_indices_input"] == naming.WRITE_INDICES_INPUT   # not a KV buffer: as it was
    rep = check.check(path, expected_prefix="VLLM")
    assert rep.ok and rep.rule("sidecar").status == "pass", rep.format_text()
    rewrite.rewrite(path, in_place=True, to="retained-state")
    assert not (tmp_path / "inference_metadata.yaml").exists()
    assert check.check(path).rule("sidecar").status == "skip"
