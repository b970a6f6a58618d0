"""An export writes genai_config.json and inference_metadata.yaml naming its real graph ports, and a rewrite keeps
them in step with the new names (shared session exports of tests/conftest.py)."""

from __future__ import annotations

import json
import shutil

from qeff_kv import rewrite as rw
from qeff_kv.contract import naming
from qeff_kv.graph import graphio, sidecars


def _pairs(layout):
    return [(p.input_name, p.output_name, p.layer)
            for p in sorted(layout.pairs, key=lambda p: (p.layer, naming.KV_STEMS.index(p.stem)))]


def _check_folder(folder):
    man = json.loads((folder / "manifest.json").read_text())
    layout = graphio.layout_of(graphio.load(folder / man["onnx"]))
    ins, outs = [t.name for t in layout.inputs], [t.name for t in layout.outputs]
    got = sidecars.read_declared(folder, ins, outs)
    assert got.form == "pipeline.workflow"
    assert [(p.input, p.output, p.layer) for p in got.pairs] == _pairs(layout)
    return man, layout, ins, outs


def test_export_writes_sidecars_naming_the_graph(own_fused_graph, tmp_path):
    folder = tmp_path / "x"
    shutil.copytree(own_fused_graph, folder)
    man, layout, ins, outs = _check_folder(folder)
    assert layout.prefix == "VLLM" and all(p.input.endswith("_VLLM") for p in
                                           sidecars.read_declared(folder, ins, outs).pairs)
    doc = json.loads((folder / sidecars.GENAI_CONFIG_FILE).read_text())
    assert doc["model"]["context_length"] == man["ctx_len"]
    assert doc["model"]["decoder"]["filename"] == man["onnx"]
    assert doc["model"]["decoder"]["inputs"]["past_key_names"] == "past_key.%d_VLLM"
    (folder / sidecars.INFERENCE_METADATA_FILE).unlink()
    got = sidecars.read_declared(folder, ins, outs)
    assert got.form == "genai_config" and [(p.input, p.output, p.layer) for p in got.pairs] == _pairs(layout)


def test_continuous_batching_export_gets_no_sidecars(own_cb_graph, own_fused_graph):
    assert not any((own_cb_graph / n).exists() for n in sidecars.SIDECAR_FILES)
    said = json.loads((own_cb_graph / "manifest.json").read_text())["sidecars"]
    assert said["written"] == [] and set(said["not_written"]) == set(sidecars.SIDECAR_FILES)
    assert all("'batch_index'" in why for why in said["not_written"].values())
    said = json.loads((own_fused_graph / "manifest.json").read_text())["sidecars"]
    assert said == {"written": [sidecars.GENAI_CONFIG_FILE, sidecars.INFERENCE_METADATA_FILE], "not_written": {}}


def test_rewrite_keeps_sidecars_in_step(own_vllm_graph, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(own_vllm_graph, src)
    onnx_name = json.loads((src / "manifest.json").read_text())["onnx"]
    out = tmp_path / "out" / onnx_name
    rw.rewrite(src / onnx_name, out, strip=True)
    layout = graphio.layout_of(graphio.load(out))
    ins, outs = [t.name for t in layout.inputs], [t.name for t in layout.outputs]
    assert layout.prefix is None
    got = sidecars.read_declared(out.parent, ins, outs)
    assert [(p.input, p.output, p.layer) for p in got.pairs] == _pairs(layout)
    (out.parent / sidecars.INFERENCE_METADATA_FILE).unlink()
    got = sidecars.read_declared(out.parent, ins, outs)
    assert got.form == "genai_config" and got.pairs[0].input == "past_key.0"
    # in place: the folder's own sidecars follow the new prefix
    rw.rewrite(src / onnx_name, prefix="Abc", in_place=True)
    layout = graphio.layout_of(graphio.load(src / onnx_name))
    got = sidecars.read_declared(src, [t.name for t in layout.inputs], [t.name for t in layout.outputs])
    assert got.pairs[0].input == "past_key.0_Abc"
    assert "KV prefix: Abc" in (src / sidecars.INFERENCE_METADATA_FILE).read_text()


def test_a_conversion_keeps_only_the_sidecars_that_can_describe_it(own_vllm_graph, tmp_path):
    """rewrite --to shared-past-present: both sidecars follow with the new names (still a shared buffer); --to
    static-cache: genai_config.json has no TensorScatter form, so an in-place conversion removes it rather than leave
    a file naming ports the graph no longer has; inference_metadata.yaml is regenerated as an indexed_scatter group
    (tests/graph/test_sidecars_static.py checks what it says)."""
    src = tmp_path / "src"
    shutil.copytree(own_vllm_graph, src)
    onnx_name = json.loads((src / "manifest.json").read_text())["onnx"]
    out = tmp_path / "out" / onnx_name
    rw.rewrite(src / onnx_name, out, to="shared-past-present")
    layout = graphio.layout_of(graphio.load(out))
    assert layout.dialect == naming.PAST_PRESENT and layout.prefix == "VLLM"
    doc = json.loads((out.parent / sidecars.GENAI_CONFIG_FILE).read_text())
    names = doc["model"]["decoder"]
    assert (names["inputs"]["past_key_names"], names["outputs"]["present_value_names"]) == \
        ("past_key_values.%d.key_VLLM", "present.%d.value_VLLM")
    assert doc["search"]["past_present_share_buffer"] is True
    ins, outs = [t.name for t in layout.inputs], [t.name for t in layout.outputs]
    got = sidecars.read_declared(out.parent, ins, outs)
    assert got.form == "pipeline.workflow" and [(p.input, p.output, p.layer) for p in got.pairs] == _pairs(layout)
    rw.rewrite(src / onnx_name, in_place=True, to="shared-past-present")
    assert json.loads((src / sidecars.GENAI_CONFIG_FILE).read_text()) == doc
    rw.rewrite(src / onnx_name, in_place=True, to="static-cache")
    assert not (src / sidecars.GENAI_CONFIG_FILE).exists()
    static = graphio.layout_of(graphio.load(src / onnx_name))
    got = sidecars.read_declared(src, [t.name for t in static.inputs], [t.name for t in static.outputs])
    assert got.update == "indexed_scatter" and [(p.input, p.output, p.layer) for p in got.pairs] == _pairs(static)
