"""inference_metadata.yaml for a static-cache graph (``key_cache.{i}`` -> ``updated_key_cache.{i}`` by TensorScatter at
``write_indices``): the workflow form's ``update.kind: indexed_scatter`` group names exactly the graph's ports (every
KV pair, ``write_indices``, ``nonpad_kv_seqlen``), layers numeric, packed layout ``bsh`` on axis 1, capacity the
buffers' axis 1; ``genai_config.json`` is still not written (onnxruntime-genai has no TensorScatter form)."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from qeff_kv import rewrite as rw
from qeff_kv.contract import naming
from qeff_kv.contract.layout import KVLayout, TensorInfo
from qeff_kv.graph import graphio, sidecars
from qeff_kv.graph.sidecars import workflow
from qeff_kv.tools.check import check


def _static_layout(layers: int, capacity=naming.CTX_DIM, prefix: str | None = None,
                   controls=(naming.WRITE_INDICES_INPUT, naming.NONPAD_KV_SEQLEN_INPUT)) -> KVLayout:
    kv = ("batch", capacity, 32)
    ins = [TensorInfo(naming.INPUT_IDS_INPUT, "int64", ("batch", "sequence_len")),
           TensorInfo(naming.POSITION_IDS_INPUT, "int64", ("batch", "sequence_len"))]
    outs = [TensorInfo(naming.LOGITS_OUTPUT, "float32", ("batch", "sequence_len", 256))]
    for i in range(layers):
        for stem in naming.EXPORT_STEMS:
            ins.append(TensorInfo(naming.dialect_name(naming.STATIC_CACHE, stem, i, prefix), "float32", kv))
            outs.append(TensorInfo(naming.dialect_name(naming.STATIC_CACHE, stem, i, prefix, output=True),
                                   "float32", kv))
    ins += [TensorInfo(name, "int64", ("batch",)) for name in controls]
    return KVLayout.from_io(ins, outs)


def _facts(ctx_len: int = 64) -> sidecars.SidecarFacts:
    return sidecars.SidecarFacts(onnx_name="m.onnx", ctx_len=ctx_len, eos_token_ids=[2, 7], bos_token_id=1)


def _pairs(layout: KVLayout) -> list[tuple]:
    return [(p.input_name, p.output_name, sidecars.declared.STEM_ROLES[p.stem], p.layer)
            for p in sorted(layout.pairs, key=lambda p: (p.layer, naming.KV_STEMS.index(p.stem)))]


def _group(doc: dict) -> dict:
    (group,) = doc["pipeline"]["workflow"]["serving"]["state_service"]["groups"].values()
    return group


def _io(layout: KVLayout) -> tuple[list[str], list[str]]:
    return [t.name for t in layout.inputs], [t.name for t in layout.outputs]


@pytest.mark.parametrize("prefix", [None, "VLLM"])
def test_a_static_cache_gets_an_indexed_scatter_workflow_naming_its_ports(tmp_path, prefix):
    layout = _static_layout(12, prefix=prefix)
    assert layout.dialect == naming.STATIC_CACHE
    written = sidecars.write_sidecars(layout, tmp_path, _facts())
    assert [p.name for p in written] == [sidecars.INFERENCE_METADATA_FILE]
    assert "TensorScatter" in sidecars.reasons(layout)[sidecars.GENAI_CONFIG_FILE] or \
        "static-cache" in sidecars.reasons(layout)[sidecars.GENAI_CONFIG_FILE]
    ins, outs = _io(layout)
    got = sidecars.read_declared(tmp_path, ins, outs)
    assert got.form == "pipeline.workflow" and got.update == "indexed_scatter" and got.shared_buffer
    assert [(p.input, p.output, p.role, p.layer) for p in got.pairs] == _pairs(layout)   # layer 10 after layer 2
    assert got.control == {"token_ids": naming.INPUT_IDS_INPUT, "position_ids": naming.POSITION_IDS_INPUT,
                           "logits": naming.LOGITS_OUTPUT, "write_indices": naming.WRITE_INDICES_INPUT,
                           "kv_length": naming.NONPAD_KV_SEQLEN_INPUT}
    doc = yaml.safe_load((tmp_path / sidecars.INFERENCE_METADATA_FILE).read_text())
    decoder = doc["pipeline"]["workflow"]["components"]["decoder"]["ports"]
    assert set(decoder["inputs"]) == set(ins) and set(decoder["outputs"]) == set(outs)
    group = _group(doc)
    assert (group["layout"], group["sequence_axis"], group["aliasing"]) == \
        (workflow.STATIC_LAYOUT, workflow.STATIC_SEQUENCE_AXIS, "required")
    assert group["update"]["write_indices_ports"] == {"decoder": naming.WRITE_INDICES_INPUT}
    assert group["update"]["kv_length_ports"] == {"decoder": naming.NONPAD_KV_SEQLEN_INPUT}
    assert decoder["inputs"][ins[2]]["shape"] == ["batch", 64, 32]
    assert doc["package"]["tokenizer"]["special_tokens"]["eos_token_id"] == [2, 7]


def test_the_capacity_is_the_buffers_axis_1(tmp_path):
    """A graph whose buffers hold 16 positions is declared with capacity 16, whatever the model's context."""
    layout = _static_layout(2, capacity=16)
    sidecars.write_sidecars(layout, tmp_path, _facts(ctx_len=256))
    doc = yaml.safe_load((tmp_path / sidecars.INFERENCE_METADATA_FILE).read_text())
    inputs = doc["pipeline"]["workflow"]["inputs"]
    assert inputs[_group(doc)["update"]["capacity"]]["default"] == 16
    assert doc["model"]["max_sequence_length"] == 16


@pytest.mark.parametrize("controls", [(naming.WRITE_INDICES_INPUT,), (naming.NONPAD_KV_SEQLEN_INPUT,)])
def test_a_static_cache_missing_a_control_input_gets_no_workflow(tmp_path, controls):
    layout = _static_layout(2, controls=controls)
    assert sidecars.INFERENCE_METADATA_FILE in sidecars.reasons(layout)
    assert sidecars.write_sidecars(layout, tmp_path, _facts()) == []


def test_rewrite_to_static_cache_writes_the_workflow_beside_the_converted_graph(own_vllm_graph, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(own_vllm_graph, src)
    man = json.loads((src / "manifest.json").read_text())
    out = tmp_path / "out" / man["onnx"]
    rw.rewrite(src / man["onnx"], out, to="static-cache")
    for graph in (out, src / man["onnx"]):
        if graph.parent == src:
            rw.rewrite(graph, in_place=True, to="static-cache")
        layout = graphio.layout_of(graphio.load(graph))
        assert layout.dialect == naming.STATIC_CACHE and layout.prefix == "VLLM"
        assert not (graph.parent / sidecars.GENAI_CONFIG_FILE).exists()
        ins, outs = _io(layout)
        got = sidecars.read_declared(graph.parent, ins, outs)
        assert got.update == "indexed_scatter"
        assert [(p.input, p.output, p.role, p.layer) for p in got.pairs] == _pairs(layout)
        assert (got.control["write_indices"], got.control["kv_length"]) == \
            (naming.WRITE_INDICES_INPUT, naming.NONPAD_KV_SEQLEN_INPUT)
        doc = yaml.safe_load((graph.parent / sidecars.INFERENCE_METADATA_FILE).read_text())
        assert doc["model"]["max_sequence_length"] == man["ctx_len"]          # the facts survive
        assert doc["package"]["tokenizer"]["special_tokens"]["eos_token_id"] == man["eos_token_id"]
        assert doc["pipeline"]["workflow"]["components"]["decoder"]["implementation"]["artifact"] == graph.name
        report = check(graph, expected_prefix="VLLM")
        assert report.rule("sidecar").status == "pass", report.format_text()
