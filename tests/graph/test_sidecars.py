"""The runtime sidecars (qeff_kv/graph/sidecars): what we write names the graph's real ports, and what we read
(ours, mobius-onnx 0.1.0's model.io form, the workflow form) gives the right KV pairs in numeric layer order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from qeff_kv.contract import naming
from qeff_kv.contract.layout import KVLayout, TensorInfo
from qeff_kv.errors import QeffKvError, SidecarError
from qeff_kv.graph import sidecars
from qeff_kv.graph.sidecars import genai_config, inference_metadata, workflow

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "sidecars"


def _layout(layers: int, prefix: str | None = None) -> KVLayout:
    kv = ["batch_size", 2, naming.CTX_DIM, 16]
    ins = [TensorInfo("input_ids", "int64", ("batch_size", "seq_len")),
           TensorInfo("position_ids", "int64", ("batch_size", "seq_len"))]
    outs = [TensorInfo("logits", "float32", ("batch_size", 1, 256))]
    for i in range(layers):
        for stem in naming.EXPORT_STEMS:
            name = naming.kv_input_name(stem, i, prefix)
            ins.append(TensorInfo(name, "float32", tuple(kv)))
            outs.append(TensorInfo(naming.retained_name(name), "float32", tuple(kv)))
    return KVLayout.from_io(ins, outs)


def _facts(layers: int) -> sidecars.SidecarFacts:
    return sidecars.SidecarFacts(onnx_name="m.onnx", ctx_len=64, vocab_size=256, eos_token_ids=[2], bos_token_id=1,
                                 model_type="llama", num_attention_heads=4, n_kv_heads=2, head_dim=16,
                                 hidden_size=64, num_layers=layers)


def _graph_pairs(layout: KVLayout) -> list[tuple]:
    return [(p.input_name, p.output_name, sidecars.declared.STEM_ROLES[p.stem], p.layer)
            for p in sorted(layout.pairs, key=lambda p: (p.layer, naming.KV_STEMS.index(p.stem)))]


def _io(layout: KVLayout) -> tuple[list[str], list[str]]:
    return [t.name for t in layout.inputs], [t.name for t in layout.outputs]


@pytest.mark.parametrize("prefix", [None, "VLLM"])
def test_written_sidecars_read_back_as_the_graph_pairs(tmp_path, prefix):
    layout = _layout(12, prefix)
    written = sidecars.write_sidecars(layout, tmp_path, _facts(12))
    assert sorted(p.name for p in written) == sorted(sidecars.SIDECAR_FILES)
    ins, outs = _io(layout)
    got = sidecars.read_declared(tmp_path, ins, outs)
    assert got.form == "pipeline.workflow" and got.shared_buffer
    assert [(p.input, p.output, p.role, p.layer) for p in got.pairs] == _graph_pairs(layout)
    assert got.control == {"token_ids": "input_ids", "position_ids": "position_ids", "logits": "logits"}
    (tmp_path / sidecars.INFERENCE_METADATA_FILE).unlink()
    got = sidecars.read_declared(tmp_path, ins, outs)
    assert got.form == "genai_config" and got.update == "shared_buffer"
    assert [(p.input, p.output, p.role, p.layer) for p in got.pairs] == _graph_pairs(layout)


def test_genai_config_names_our_buffers_as_patterns(tmp_path):
    doc = genai_config.build(_layout(2, "VLLM"), _facts(2))
    dec = doc["model"]["decoder"]
    assert dec["inputs"]["past_key_names"] == "past_key.%d_VLLM"
    assert dec["outputs"]["present_value_names"] == naming.retained_name("past_value.%d_VLLM")
    assert doc["search"] == {"max_length": 64, "past_present_share_buffer": True}
    assert doc["model"]["context_length"] == 64 and doc["model"]["eos_token_id"] == [2]
    assert (dec["num_hidden_layers"], dec["head_size"], dec["num_key_value_heads"]) == (2, 16, 2)


def test_workflow_yaml_names_every_port_and_states_its_version(tmp_path):
    layout = _layout(3, "VLLM")
    sidecars.write_sidecars(layout, tmp_path, _facts(3))
    text = (tmp_path / sidecars.INFERENCE_METADATA_FILE).read_text()
    doc = yaml.safe_load(text)
    assert doc["schema_version"] == workflow.SCHEMA_VERSION
    assert "KV prefix: VLLM" in text.splitlines()[1]
    wf = doc["pipeline"]["workflow"]
    ports = wf["components"]["decoder"]["ports"]
    assert sorted(ports["inputs"]) == sorted(t.name for t in layout.inputs)
    assert sorted(ports["outputs"]) == sorted(t.name for t in layout.outputs)
    group = wf["serving"]["state_service"]["groups"]["kv_full"]
    assert (group["kind"], group["aliasing"], group["layout"], group["sequence_axis"]) == \
        ("full_attention", "required", "head_major_bnsh", 2)
    assert doc["package"]["tokenizer"]["special_tokens"]["eos_token_id"] == [2]
    assert wf["state"]["past_key.0002"]["contract"]["shape"] == ["batch", 2, 64, 16]


def test_mobius_static_cache_form_pairs_each_layer():
    doc = inference_metadata.load(FIXTURES / "mobius-0.1.0-static.yaml")
    got = inference_metadata.read(doc)
    assert got.form == "model.io" and got.update == "indexed_scatter"
    assert [(p.input, p.output, p.role, p.layer) for p in got.pairs] == [
        ("key_cache.0", "updated_key_cache.0", "key", 0), ("value_cache.0", "updated_value_cache.0", "value", 0),
        ("key_cache.1", "updated_key_cache.1", "key", 1), ("value_cache.1", "updated_value_cache.1", "value", 1)]
    assert got.control["write_indices"] == "write_indices" and got.control["kv_length"] == "nonpad_kv_seqlen"


def test_mobius_default_form_pairs_by_position():
    got = inference_metadata.read(inference_metadata.load(FIXTURES / "mobius-0.1.0-default.yaml"))
    assert got.update == "append" and not got.shared_buffer
    assert [(p.input, p.output, p.role, p.layer) for p in got.pairs] == [
        ("past_key_values.0.key", "present.0.key", "key", 0), ("past_key_values.0.value", "present.0.value", "value", 0),
        ("past_key_values.1.key", "present.1.key", "key", 1), ("past_key_values.1.value", "present.1.value", "value", 1)]
    assert got.control == {"token_ids": "input_ids", "position_ids": "position_ids",
                           "attention_mask": "attention_mask", "logits": "logits"}


def test_eleven_layers_are_read_in_numeric_order():
    n = 12
    static = {"key_cache_inputs": [f"key_cache.{i}" for i in range(n)],
              "key_cache_outputs": [f"updated_key_cache.{i}" for i in range(n)],
              "value_cache_inputs": [f"value_cache.{i}" for i in range(n)],
              "value_cache_outputs": [f"updated_value_cache.{i}" for i in range(n)]}
    got = inference_metadata.read({"model": {"io": {"static_cache": static}}})
    assert [p.layer for p in got.pairs if p.role == "key"] == list(range(n))
    assert all(p.input.split(".")[1] == p.output.split(".")[1] == str(p.layer) for p in got.pairs)
    # workflow form: alias labels that string-sort 10 before 2, each with its layer
    aliases = {f"kv.layer{i}.{r}": {"input": f"{r}_cache.{i}", "output": f"updated_{r}_cache.{i}", "role": r,
                                     "layer": i} for i in range(n) for r in ("key", "value")}
    aliases = dict(sorted(aliases.items()))
    doc = {"pipeline": {"workflow": {"serving": {"state_service": {"groups": {"g": {"ports": {"d": aliases}}}}}}}}
    got = inference_metadata.read(doc)
    assert [(p.layer, p.role) for p in got.pairs] == [(i, r) for i in range(n) for r in ("key", "value")]
    assert all(p.input == f"{p.role}_cache.{p.layer}" for p in got.pairs)


def test_a_port_the_graph_lacks_is_a_typed_one_line_error(tmp_path):
    layout = _layout(2)
    sidecars.write_sidecars(layout, tmp_path, _facts(2))
    ins, outs = _io(layout)
    with pytest.raises(SidecarError, match=r"past_value\.1.*lacks") as err:
        sidecars.read_declared(tmp_path, [n for n in ins if n != "past_value.1"], outs)
    assert isinstance(err.value, QeffKvError) and "\n" not in str(err.value)


def test_a_sidecar_pairing_layers_otherwise_than_the_graph_is_refused(tmp_path):
    layout = _layout(3)
    ins, outs = _io(layout)
    doc = genai_config.build(layout, _facts(3))
    doc["model"]["decoder"]["outputs"]["present_key_names"] = "past_value.%d_RetainedState"
    (tmp_path / sidecars.GENAI_CONFIG_FILE).write_text(json.dumps(doc))
    with pytest.raises(SidecarError, match="but the graph pairs .past_key.0. with .past_key.0_RetainedState."):
        sidecars.read_declared(tmp_path, ins, outs)
    # a string-sorted list read by position swaps layer 2 and 10: the declared layer disagrees with the graph
    names = sorted(f"past_key.{i}" for i in range(11))
    outs = [naming.retained_name(n) for n in names]
    by_position = [sidecars.DeclaredPair(n, o, "key", k) for k, (n, o) in enumerate(zip(names, outs))]
    with pytest.raises(SidecarError, match=r"past_key\.10.*as layer 2"):
        sidecars.declared.check_against(sidecars.Declared("model.io", by_position), names, outs, source="x.yaml")
    # read by our reader, the same list pairs by the name's layer: numeric order, every layer right
    got = inference_metadata.read({"model": {"io": {"kv_inputs": names, "kv_outputs": outs}}})
    assert [p.input for p in got.pairs] == [f"past_key.{i}" for i in range(11)]


def test_no_sidecar_reads_as_none(tmp_path):
    assert sidecars.read_declared(tmp_path, [], []) is None


def test_a_graph_with_other_inputs_gets_no_sidecars(tmp_path):
    layout = _layout(1)
    layout = KVLayout.from_io(layout.inputs + [TensorInfo("batch_index", "int64", ("batch_size", 1))], layout.outputs)
    assert set(sidecars.reasons(layout)) == set(sidecars.SIDECAR_FILES)
    assert sidecars.write_sidecars(layout, tmp_path, _facts(1)) == []


def test_a_layers_recurrent_cells_are_one_state_each():
    """A hybrid layer's conv_state and recurrent_state (no key/value role) are two cells of one layer, not one
    declared twice; the same cell twice still is."""
    from qeff_kv.graph.sidecars.declared import Declared, DeclaredPair, check_against

    cells = [DeclaredPair(f"{stem}.0", f"{stem}.0_RetainedState", None, 0, "recurrent")
             for stem in ("conv_state", "recurrent_state")]
    names = [p.input for p in cells], [p.output for p in cells]
    assert len(check_against(Declared("pipeline.workflow", list(cells)), *names, source="x.yaml").pairs) == 2
    with pytest.raises(SidecarError, match="layer 0 state declared twice"):
        check_against(Declared("pipeline.workflow", cells + cells[:1]), *names, source="x.yaml")
