"""Issue 22, class 5: a setting that would do nothing is refused in one line (never silently ignored, never
recorded as done); nothing is written at the destination."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import _kv_graphs as kg
from suite import requires_torch
from qeff_kv.tools.compile_config import specializations
from qeff_kv.errors import ExportError, RuntimeInputError
from qeff_kv.runtime import Session
from cli_checks import cli, one_error, tree
from ring_graphs import ring_graph

_QUICK = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def ring(tmp_path_factory):
    return ring_graph(tmp_path_factory.mktemp("ring") / "g")   # window 6 in its metadata


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return kg.save(kg.build(2), tmp_path_factory.mktemp("plain") / "model.onnx")


# ---------------------------------------------------------------------------------------- compile-config, ring
@_QUICK
@given(prefill=st.integers(min_value=7, max_value=4096))
def test_compile_config_refuses_a_prefill_chunk_longer_than_the_ring(ring, tmp_path, prefill):
    before = tree(tmp_path)
    line = one_error(cli("compile-config", ring, "-o", tmp_path / "cfg", "--prefill-seq-len", prefill,
                         "--ctx-len", max(prefill, 64)))
    assert line == (f"error: prefill_seq_len {prefill} is larger than the sliding window 6 of {ring}'s ring buffers: "
                    "a prefill chunk must fit in the ring; give --prefill-seq-len 6 or less")
    assert tree(tmp_path) == before


@_QUICK
@given(ctx=st.integers(min_value=1, max_value=5))
def test_compile_config_refuses_a_context_below_the_window(ring, tmp_path, ctx):
    before = tree(tmp_path)
    line = one_error(cli("compile-config", ring, "-o", tmp_path / "cfg", "--prefill-seq-len", 1, "--ctx-len", ctx))
    assert line == (f"error: ctx_len {ctx} is smaller than the sliding window 6 of {ring}'s ring buffers; give "
                    "--ctx-len 6 or more")
    assert tree(tmp_path) == before


def test_compile_config_within_the_window_still_writes(ring, tmp_path):
    res = cli("compile-config", ring, "-o", tmp_path / "cfg", "--prefill-seq-len", 6, "--ctx-len", 6)
    assert res.exit_code == 0, res.output
    spec = json.loads((tmp_path / "cfg" / "specializations.json").read_text())["specializations"]
    assert spec[0]["seq_len"] == "6" and spec[0]["sliding_window"] == "6"


# ---------------------------------------------------------------------------------------- CCL below the prefill
@_QUICK
@given(smallest=st.integers(min_value=1, max_value=31))
def test_ccl_values_below_the_prefill_length_are_refused(tmp_path, smallest):
    from qeff_kv.export import export_model

    want = (f"--ccl value {smallest} is smaller than prefill_seq_len 32: its prefill specialization could not hold a "
            "32-token chunk; give values of 32 or more")
    with pytest.raises(ExportError) as exc:   # refused before anything is loaded or traced
        export_model(None, tmp_path / "out", ctx_len=128, prefill_seq_len=32, ccl=[smallest, 128])
    assert str(exc.value) == want
    with pytest.raises(RuntimeInputError) as exc:
        specializations(32, 128, ccl=[smallest, 128])
    assert str(exc.value) == want
    line = one_error(cli("export", "-o", tmp_path / "out", "--ctx-len", 128, "--prefill-seq-len", 32,
                         "--ccl", f"{smallest},128"))
    assert line == f"error: {want}"
    assert list(tmp_path.iterdir()) == []


def test_ccl_auto_leaves_out_values_below_the_prefill_length():
    from qeff_kv.contract.ccl import auto_ccl, parse_ccl

    assert auto_ccl(4096, 1000) == (1024, 2048, 4096)
    assert parse_ccl("auto", 4096, prefill_seq_len=600) == (1024, 2048, 4096)
    assert parse_ccl("auto", 4096) == (512, 1024, 2048, 4096)


# ---------------------------------------------------------------------------------------- export options
@pytest.mark.parametrize("kwargs,flags,message", [
    (dict(image_size=448), ["--image-size", "448"], "--image-size is for vision-language models; this is a text decoder"),
    (dict(sliding_cache="ring"), ["--sliding-cache", "ring"],
     "--sliding-cache ring is for models with sliding-window layers; this one has none"),
    (dict(sliding_cache="full"), ["--sliding-cache", "full"],
     "--sliding-cache full is for models with sliding-window layers; this one has none"),
])
def test_export_options_for_another_kind_of_model_are_refused(tmp_path, kwargs, flags, message):
    from qeff_kv.export import export_model

    with pytest.raises(ExportError) as exc:   # the bundled Llama: a text decoder without sliding layers
        export_model(None, tmp_path / "out", ctx_len=64, prefill_seq_len=8, **kwargs)
    assert str(exc.value) == message
    assert one_error(cli("export", "-o", tmp_path / "out", "--ctx-len", 64, "--prefill-seq-len", 8, *flags)) \
        == f"error: {message}"
    assert list(tmp_path.iterdir()) == []


@requires_torch
def test_int4_with_a_block_larger_than_every_matrix_quantizes_nothing_and_is_refused(own_graphs):
    from qeff_kv.export.weights.quantize import WeightScheme, quantize_graph

    float_graph = own_graphs / "own_llama_ort_cb_vllm.onnx"
    model = onnx.load(str(float_graph))
    inits = {t.name: t for t in model.graph.initializer}
    largest = max(int(inits[n.input[1]].dims[0]) for n in model.graph.node
                  if n.op_type == "MatMul" and n.input[1] in inits and len(inits[n.input[1]].dims) == 2)
    with pytest.raises(ExportError) as exc:
        quantize_graph(float_graph, WeightScheme("int4", 1048576, 4))
    assert str(exc.value) == (f"--weights int4 --block-size 1048576 quantizes no weight matrix: the largest has "
                              f"{largest} input features, fewer than one block; use a smaller --block-size")


# ---------------------------------------------------------------------------------------- buffers / generate
def test_buffers_sliding_window_on_a_graph_without_rings_is_refused(plain):
    line = one_error(cli("buffers", plain, "--sliding-window", 6))
    assert line == (f"error: {plain} has no sliding-window KV buffers (axis 'sliding_window'); --sliding-window does "
                    "not apply")


def test_image_token_id_on_a_text_graph_is_refused(ring, tmp_path):
    with pytest.raises(RuntimeInputError) as exc:
        Session(ring, ctx_len=32, image_token_id=5)
    assert str(exc.value) == "image_token_id applies to vision-language graphs; model.onnx is a text decoder"
    assert one_error(cli("generate", ring, "--ctx-len", 32, "--prompt-ids", "1,2", "--image-token-id", 5)) == \
        "error: image_token_id applies to vision-language graphs; model.onnx is a text decoder"


def test_select_without_save_state_is_refused(ring, tmp_path):
    before = tree(tmp_path)
    line = one_error(cli("generate", ring, "--ctx-len", 32, "--prompt-ids", "1,2", "--select", ".*"))
    assert line == "error: --select chooses the buffers --save-state writes; give --save-state FILE too"
    assert tree(tmp_path) == before
    res = cli("generate", ring, "--ctx-len", 32, "--prompt-ids", "1,2", "--max-new-tokens", 1,
              "--select", r"past_(key|value)\.\d+", "--save-state", tmp_path / "s.safetensors")
    assert res.exit_code == 0, res.output
    assert (tmp_path / "s.safetensors").is_file()
