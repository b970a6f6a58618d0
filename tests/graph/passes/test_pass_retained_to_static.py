"""RetainedToStaticPass (issue 49): our portable and onnxruntime retained-state exports converted to the static-cache
dialect (``rewrite --to static-cache``) decode the same greedy tokens, give the same logits and cache rows for a
padded batch, pass ``check`` (in-place rule included), keep the prefix, round-trip back to retained state; what
cannot be converted exactly is refused in one line with nothing changed."""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest

import _recurrent_graph
import dialect_loops
from cli_checks import cli, one_error
from ring_graphs import ring_graph
from suite import OWN_CTX_LEN, OWN_PREFILL, PROMPT_A, PROMPT_B, requires_torch
from qeff_kv.contract import naming
from qeff_kv.errors import DialectError
from qeff_kv.graph import graphio
from qeff_kv.graph.passes import RetainedToStaticPass
from qeff_kv.graph.passes.dialects.to_dialect import conversion_pass
from qeff_kv.runtime import Session
from qeff_kv.tools.check import check

pytestmark = requires_torch
PROMPTS = [PROMPT_A, PROMPT_B, [3], [9, 200, 41]]
N = 10   # prefill + 9 decode steps


def _io(model) -> list[str]:
    return [v.name for v in list(model.graph.inputs) + list(model.graph.outputs)]


def _convert(src, dst, to: str = naming.STATIC_CACHE):
    return dialect_loops.convert(src, dst, to)


@pytest.fixture(scope="module")
def ort_graph(tmp_path_factory):
    """The bundled default exported with --target onnxruntime (no continuous batching)."""
    from qeff_kv.export import export_model

    res = export_model(None, tmp_path_factory.mktemp("ort") / "export", ctx_len=OWN_CTX_LEN,
                       prefill_seq_len=OWN_PREFILL, verify=False, target="onnxruntime")
    return res.onnx_path


def _same_tokens(src, dst) -> list[list[int]]:
    out = []
    for prompt in PROMPTS:
        want = dialect_loops.greedy_loop(src, prompt, N, capacity=OWN_CTX_LEN)
        assert dialect_loops.greedy_loop(dst, prompt, N, capacity=OWN_CTX_LEN) == want, prompt
        out.append(want)
    return out


def test_portable_same_tokens_and_check(own_graphs, tmp_path):
    src = own_graphs / "qeff_llama_default.onnx"
    model = _convert(src, tmp_path / "static.onnx")
    names = _io(model)
    assert "key_cache.0" in names and "updated_value_cache.1" in names
    assert naming.WRITE_INDICES_INPUT in names and naming.NONPAD_KV_SEQLEN_INPUT in names
    assert naming.POSITION_IDS_INPUT in names and not any("RetainedState" in n for n in names)
    layout = graphio.layout_of(model)
    assert (layout.dialect, layout.update) == (naming.STATIC_CACHE, "indexed-scatter")
    assert tuple(layout.pairs[0].input.shape)[1:] == ("ctx_len", 32)
    writers = {v.name: v.producer().op_type for v in model.graph.outputs if v.name.startswith("updated_")}
    assert set(writers.values()) == {"TensorScatter"} and len(writers) == 4
    tokens = _same_tokens(src, tmp_path / "static.onnx")
    assert tokens[0][:8] == own_graphs.llama_a
    report = check(tmp_path / "static.onnx")
    assert report.ok, report


def test_onnxruntime_target_same_tokens(ort_graph, tmp_path):
    _convert(ort_graph, tmp_path / "static.onnx")
    _same_tokens(ort_graph, tmp_path / "static.onnx")
    assert check(tmp_path / "static.onnx").ok


def _step(sess, feeds):
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


def test_padded_batch_same_logits_and_rows(own_graphs, tmp_path):
    """Two rows, one padded: the static graph (write_indices, nonpad_kv_seqlen) and the retained graph (position
    -1 for padding) give the same logits and the same cache rows before nonpad_kv_seqlen, prefill then decode."""
    src = own_graphs / "qeff_llama_default.onnx"
    _convert(src, tmp_path / "static.onnx")
    r = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
    s = ort.InferenceSession(str(tmp_path / "static.onnx"), providers=["CPUExecutionProvider"])
    r_state = {i.name: np.zeros((2, 2, OWN_CTX_LEN, 16), np.float32) for i in r.get_inputs() if "past" in i.name}
    s_state = {i.name: np.zeros((2, OWN_CTX_LEN, 32), np.float32) for i in s.get_inputs() if "cache" in i.name}
    ids = np.array([[5, 17, 42, 0, 0], [250, 3, 88, 19, 160]], np.int64)
    held, start = np.array([3, 5]), np.array([0, 0])
    for step in range(3):
        n = ids.shape[1]
        pos = start[:, None] + np.arange(n)[None, :]
        r_out = _step(r, {**r_state, "input_ids": ids, "position_ids": np.where(pos < held[:, None], pos, -1)})
        s_out = _step(s, {**s_state, "input_ids": ids, "position_ids": pos, "write_indices": start,
                          "nonpad_kv_seqlen": held})
        np.testing.assert_allclose(s_out["logits"], r_out["logits"], rtol=1e-5, atol=1e-5)
        for name in r_state:
            parsed = naming.parse_any_kv_name(name)
            static = parsed.in_dialect(naming.STATIC_CACHE)
            r_state[name], s_state[static.name] = r_out[parsed.output], s_out[static.output]
            for b in range(2):
                rows = s_state[static.name][b, :held[b]].reshape(held[b], 2, 16).transpose(1, 0, 2)
                np.testing.assert_allclose(rows, r_state[name][b, :, :held[b]], rtol=1e-5, atol=1e-6)
        ids = np.argmax(r_out["logits"][:, -1], axis=-1)[:, None].astype(np.int64)
        start, held = held.copy(), held + 1


def test_round_trip_static_and_back(own_graphs, tmp_path):
    src = own_graphs / "qeff_llama_default.onnx"
    _convert(src, tmp_path / "static.onnx")
    back = _convert(tmp_path / "static.onnx", tmp_path / "back.onnx", naming.RETAINED_STATE)
    assert _io(back) == _io(graphio.load(src))
    _same_tokens(src, tmp_path / "back.onnx")
    assert check(tmp_path / "static.onnx").ok and check(tmp_path / "back.onnx").ok


def test_prefix_kept(own_graphs, tmp_path):
    src = own_graphs / "qeff_llama_vllm.onnx"
    model = _convert(src, tmp_path / "static.onnx")
    assert graphio.layout_of(model).prefixes == ["VLLM"]
    assert "key_cache.0_VLLM" in _io(model) and "updated_value_cache.1_VLLM" in _io(model)
    assert check(tmp_path / "static.onnx", expected_prefix="VLLM").ok
    assert (dialect_loops.greedy_loop(tmp_path / "static.onnx", PROMPT_A, N, capacity=OWN_CTX_LEN)
            == dialect_loops.greedy_loop(src, PROMPT_A, N, capacity=OWN_CTX_LEN))


def test_shared_past_present_to_static(own_graphs, tmp_path):
    src = own_graphs / "qeff_llama_default.onnx"
    _convert(src, tmp_path / "pp.onnx", "shared-past-present")
    model = graphio.load(tmp_path / "pp.onnx")
    assert isinstance(conversion_pass(model, naming.STATIC_CACHE), RetainedToStaticPass)
    _convert(tmp_path / "pp.onnx", tmp_path / "static.onnx")
    assert (dialect_loops.greedy_loop(tmp_path / "static.onnx", PROMPT_B, N, capacity=OWN_CTX_LEN)
            == dialect_loops.greedy_loop(src, PROMPT_B, N, capacity=OWN_CTX_LEN))
    assert check(tmp_path / "static.onnx").ok


def _refused(model, *needles) -> None:
    names = _io(model)
    with pytest.raises(DialectError) as exc:
        conversion_pass(model, naming.STATIC_CACHE)
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith(f"cannot convert to {naming.STATIC_CACHE}: "), msg
    for n in needles:
        assert n in msg, msg
    with pytest.raises(DialectError):
        RetainedToStaticPass()(model)
    assert _io(model) == names


def test_refusals_real_graphs(own_graphs, tmp_path):
    _refused(graphio.load(own_graphs / "own_llama_fused_vllm.onnx"), "GroupQueryAttention")
    _refused(graphio.load(own_graphs / "qeff_llama_cb_default.onnx"), "continuous batching")
    static = dialect_loops.static_cache_graph(tmp_path / "s.onnx", capacity=16)
    _convert(static, tmp_path / "r.onnx", naming.RETAINED_STATE)
    _refused(graphio.load(tmp_path / "r.onnx"), "not a qeff-kv export")


def _as_ours(model):
    model.metadata_props[naming.TARGET_META] = "portable"
    return model


def test_refusals_by_kind(own_graphs, tmp_path):
    _refused(_as_ours(graphio.load(ring_graph(tmp_path / "ring"))), "sliding-window")
    _refused(_as_ours(graphio.load(_recurrent_graph.save(tmp_path / "rec.onnx", cb=False))), "recurrent")
    for key, needle in ((naming.MLA_META, "MLA latent"), (naming.VISION_META, "vision-language"),
                        (naming.SLIDING_WINDOW_META, "sliding-window")):
        model = graphio.load(own_graphs / "qeff_llama_default.onnx")
        model.metadata_props[key] = "{}" if key != naming.SLIDING_WINDOW_META else "4"
        _refused(model, needle)


def test_refusals_by_structure(own_graphs):
    model = graphio.load(own_graphs / "qeff_llama_default.onnx")
    scatter = next(n for n in model.graph if n.op_type == "ScatterND")
    scatter.attributes["reduction"] = ir.AttrString("reduction", "add")
    _refused(model, "is not written by one ScatterND")
    model = graphio.load(own_graphs / "qeff_llama_default.onnx")
    model.opset_imports[""] = 13
    _refused(model, "opset 13")


def test_cli_exit_codes(own_graphs, tmp_path):
    res = cli("rewrite", own_graphs / "qeff_llama_vllm.onnx", "-o", tmp_path / "s.onnx", "--to", "static-cache")
    assert res.exit_code == 0, res.output
    assert cli("check", tmp_path / "s.onnx", "--kv-cache-prefix", "VLLM").exit_code == 0
    one_error(cli("rewrite", own_graphs / "own_llama_fused_vllm.onnx", "-o", tmp_path / "x.onnx", "--to",
                  "static-cache"), "GroupQueryAttention")
    assert not (tmp_path / "x.onnx").exists()


def test_export_folder_sidecars_follow_the_static_graph(own_graphs, tmp_path):
    """Beside the static graph: inference_metadata.yaml written anew for it (an indexed_scatter group naming its
    ports; check's sidecar rule passes), genai_config.json not (it has no TensorScatter form)."""
    src = own_graphs.export("qeff_llama_default.onnx").onnx_path
    assert (src.parent / "genai_config.json").is_file()
    res = cli("rewrite", src, "-o", tmp_path / "out" / "static.onnx", "--to", "static-cache")
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["inference_metadata.yaml", "static.onnx"]
    res = cli("check", tmp_path / "out" / "static.onnx", "--json")
    assert res.exit_code == 0, res.output
    assert {r["id"]: r["status"] for r in json.loads(res.stdout)["rules"]}["sidecar"] == "pass"


def test_a_capacity_fixes_the_static_buffers(own_graphs, tmp_path):
    """--to static-cache --capacity N: the packed buffers hold N positions as mobius writes them (a static axis),
    the tokens are the symbolic graph's, and the runtime takes its capacity from the graph (no --ctx-len)."""
    src = own_graphs.export("qeff_llama_default.onnx").onnx_path
    res = cli("rewrite", src, "-o", tmp_path / "fixed.onnx", "--to", "static-cache", "--capacity", str(OWN_CTX_LEN))
    assert res.exit_code == 0, res.output
    layout = graphio.layout_of(graphio.load(tmp_path / "fixed.onnx"))
    assert {(p.input.shape[1], p.output.shape[1]) for p in layout.pairs} == {(OWN_CTX_LEN, OWN_CTX_LEN)}
    assert check(tmp_path / "fixed.onnx").ok
    want = dialect_loops.greedy_loop(src, PROMPT_A, 8, capacity=OWN_CTX_LEN)
    assert dialect_loops.greedy_loop(tmp_path / "fixed.onnx", PROMPT_A, 8, capacity=OWN_CTX_LEN) == want
    assert Session(tmp_path / "fixed.onnx").generate([PROMPT_A], max_tokens=8, stop_tokens=[])[0].tokens == want
    # a retained graph keeps its symbolic axis: a capacity there is refused in one line
    res = cli("rewrite", src, "-o", tmp_path / "r.onnx", "--to", "shared-past-present", "--capacity", "64")
    one_error(res, "cannot convert to shared-past-present: a capacity applies to a growing graph or to a conversion "
                   "to static-cache; this graph's positions axis stays symbolic (bound at run time)")
