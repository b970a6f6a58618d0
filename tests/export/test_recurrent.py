"""Recurrent and hybrid exports (contract section 12): the Mamba2-mixer families of tests/helpers/families.py run by the
runtime on prompts longer than three prefill chunks with padding in the last one, continuous batching by
``batch_index``, names and prefix, ``check``/``buffers``/``compile-config`` on the recurrent buffers, refusals.

The exports are the family matrix's (``family_exports``, shared with tests/export/test_families.py) plus one
continuous-batching Bamba export with a prefix for this module.
"""

from __future__ import annotations

import json

import pytest

from suite import requires_torch
from families import CHUNK, CTX, FAMILIES, NEW

#: longer than three chunks of CHUNK, the last chunk padded (14 = 3 * 4 + 2, 18 = 4 * 4 + 2)
LONG = [[5, 17, 42, 99, 13, 7, 101, 64, 3, 77, 21, 8, 9, 55],
        [100, 3, 3, 60, 9, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 4, 5, 6]]
EXACT = ["mamba2", "bamba", "granitemoehybrid", "falcon_h1"]


@pytest.fixture(scope="session")
def long_refs(family_models):
    from hf_models import hf_greedy_whole

    cache: dict = {}

    def get(name: str) -> list[list[int]]:
        if name not in cache:
            cache[name] = [hf_greedy_whole(family_models(name), p, NEW) for p in LONG]
        return cache[name]

    return get


@pytest.fixture(scope="module")
def bamba_cb(family_models, tmp_path_factory):
    from qeff_kv.export import export_model

    return export_model(family_models("bamba"), tmp_path_factory.mktemp("rec") / "bamba-cb", ctx_len=CTX,
                        prefill_seq_len=CHUNK, target="onnxruntime", continuous_batching=True, full_batch_size=2,
                        kv_cache_prefix="VLLM")


# ------------------------------------------------------------------------------------------- no torch needed
def test_recurrent_facts_from_the_config():
    """Which layers run the mixer and which attend, and the state geometry, come from config.json."""
    from qeff_kv.export.facts.family import ModelFacts

    def facts(**cfg):
        return ModelFacts.from_config({"architectures": ["X"], **cfg}).recurrent

    bamba = facts(model_type="bamba", num_hidden_layers=3, hidden_size=64, attn_layer_indices=[1], mamba_n_heads=4,
                  mamba_d_head=32, mamba_d_state=8, mamba_n_groups=2, mamba_d_conv=4, mamba_expand=2,
                  time_step_limit=[0.0, {"__float__": "Infinity"}])
    assert (bamba.mixer_layers, bamba.attention_layers) == ((0, 2), (1,))
    assert (bamba.conv_shape, bamba.recurrent_shape) == ((128 + 2 * 2 * 8, 4), (4, 32, 8))
    assert bamba.time_step_limit == (0.0, float("inf"))
    falcon = facts(model_type="falcon_h1", num_hidden_layers=2, hidden_size=64, mamba_d_state=8,
                   ssm_in_multiplier=0.7, ssm_multipliers=[1, 1, 1, 1, 1], mamba_rms_norm=False)
    assert falcon.mixer_layers == falcon.attention_layers == (0, 1)
    assert falcon.in_multiplier == 0.7 and falcon.projection_multipliers and not falcon.gated_norm
    mamba2 = facts(model_type="mamba2", num_hidden_layers=2, hidden_size=64, state_size=8, num_heads=4, head_dim=32)
    assert (mamba2.mixer_layers, mamba2.attention_layers) == ((0, 1), ())
    assert facts(model_type="llama", num_hidden_layers=2) is None


def test_speculative_tokens_refused_up_front(tmp_path):
    """Rejected drafts cannot be rewound out of a recurrent state: refused from config.json, nothing loaded."""
    from qeff_kv.errors import ExportError
    from qeff_kv.export import export_model

    src = tmp_path / "tiny-bamba"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({
        "architectures": ["BambaForCausalLM"], "model_type": "bamba", "num_hidden_layers": 2, "hidden_size": 64,
        "vocab_size": 128, "attn_layer_indices": [1], "mamba_d_state": 8, "mamba_n_heads": 4, "mamba_d_head": 32}))
    (src / "model.safetensors").write_bytes(b"")   # never read: the refusal comes first
    with pytest.raises(ExportError) as exc:
        export_model(src, tmp_path / "out", ctx_len=32, prefill_seq_len=4, speculative_tokens=2)
    assert str(exc.value) == ("--speculative-tokens with BambaForCausalLM's recurrent state: rejected drafts "
                              "cannot be rewound out of a state every token overwrites")
    assert not (tmp_path / "out").exists()


def test_check_refuses_a_position_axis_on_a_recurrent_buffer(tmp_path):
    import _kv_graphs as kvg
    import onnx

    from qeff_kv.tools.check import check

    path = tmp_path / "bad.onnx"
    onnx.save(kvg.build(1, stems=["conv_state", "recurrent_state"],
                        input_dims={"conv_state.0": ["batch_size", 8, "ctx_len"]},
                        output_dims={"conv_state.0_RetainedState": ["batch_size", 8, "ctx_len"]}), path)
    report = check(path)
    assert report.failed == ["pair-match"]
    assert [(v.buffer, v.message) for v in report.violations] == [
        ("conv_state.0", "conv_state.0 dim 2 is 'ctx_len'; a recurrent state has no position axis (only axis 0, "
                         "the batch, is dynamic)")]


def test_check_recurrent_state_needs_its_conv_state(tmp_path):
    """A recurrent state without its convolution state is a missing half; a convolution state alone (LFM2's short
    convolution) is complete."""
    import _kv_graphs as kvg
    import onnx

    from qeff_kv.tools.check import check

    onnx.save(kvg.build(1, stems=["recurrent_state"]), tmp_path / "half.onnx")
    report = check(tmp_path / "half.onnx")
    assert report.failed == ["layers"]
    assert [(v.buffer, v.message) for v in report.violations] == [
        ("recurrent_state.0", "layer 0 has recurrent_state but no conv_state (recurrent_state.0 has no companion)")]
    onnx.save(kvg.build(2, stems=["conv_state"]), tmp_path / "short_conv.onnx")
    assert check(tmp_path / "short_conv.onnx").ok


# --------------------------------------------------------------------------------------------- the exports


@requires_torch
@pytest.mark.parametrize("name", EXACT)
def test_session_exact_on_long_prompts(name, family_exports, long_refs):
    """The runtime prefills in chunks (state carried across them, padding in the last) and decodes with
    transformers' greedy tokens (whole-sequence reference)."""
    from qeff_kv.runtime import Session

    assert FAMILIES[name].recurrent
    result = family_exports(name, "onnxruntime")
    if isinstance(result, BaseException):
        raise result
    assert result.manifest["verification"]["prompt_len"] > 3 * CHUNK
    refs = long_refs(name)
    assert len(set(refs[0])) > 1 or len(set(refs[1])) > 1
    s = Session(result.out_dir)
    assert s.inplace
    for prompt, ref in zip(LONG, refs):
        [g] = s.generate([prompt], max_new_tokens=NEW)
        assert g.tokens == ref
        s.remove_sequence(g.sequence)   # the next prompt reuses the slot: its state starts from zero


@requires_torch
def test_falcon_h1_layers_keep_both_kinds(family_exports):
    """A parallel-hybrid layer records a positional and a recurrent entry; the graph retains both."""
    from qeff_kv.graph import graphio

    result = family_exports("falcon_h1", "portable")
    spec = graphio.layout_of(graphio.load(result.onnx_path)).state_spec
    assert [(s.layer, s.kind) for s in spec.layers] == [(0, "full"), (0, "recurrent"), (1, "full"),
                                                       (1, "recurrent")]
    assert spec.recurrent(0).shapes == ((128 + 2 * 2 * 8, 4), (4, 32, 8))
    assert result.manifest["recurrent"]["mixer_layers"] == [0, 1]


@requires_torch
def test_cb_names_check_buffers_compile_config(bamba_cb, long_refs, tmp_path):
    """Continuous batching by batch_index: two sequences at different lengths decode together, each exact; the
    names are the peer's with the prefix; check passes; buffers and compile-config carry the recurrent pairs."""
    from qeff_kv.graph import graphio
    from qeff_kv.tools.buffers import buffers_report
    from qeff_kv.tools.compile_from_graph import write_compile_config_for_graph
    from qeff_kv.tools.check import check
    from qeff_kv.runtime import Session

    graph = graphio.load(bamba_cb.onnx_path)
    ins = [v.name for v in graph.graph.inputs]
    outs = [v.name for v in graph.graph.outputs]
    assert ins == ["input_ids", "position_ids", "conv_state.0_VLLM", "recurrent_state.0_VLLM", "past_key.1_VLLM",
                   "past_value.1_VLLM", "conv_state.2_VLLM", "recurrent_state.2_VLLM", "batch_index"]
    assert outs == ["logits", "conv_state.0_VLLM_RetainedState", "recurrent_state.0_VLLM_RetainedState",
                    "past_key.1_VLLM_RetainedState", "past_value.1_VLLM_RetainedState",
                    "conv_state.2_VLLM_RetainedState", "recurrent_state.2_VLLM_RetainedState"]
    conv = next(v for v in graph.graph.inputs if v.name == "conv_state.0_VLLM")
    assert [d if isinstance(d, int) else str(d) for d in conv.shape] == ["full_batch_size", 160, 4]
    report = check(bamba_cb.onnx_path, expected_prefix="VLLM")
    assert report.ok, report.format_text()

    s = Session(bamba_cb.out_dir)
    assert s.max_sequences == 2 and s.inplace
    a, b = s.generate(LONG, max_new_tokens=NEW)
    assert [a.tokens, b.tokens] == long_refs("bamba")

    state = 2 * (160 * 4 + 4 * 32 * 8) * 4
    for ctx in (64, 4096):
        rep = buffers_report(bamba_cb.onnx_path, ctx_len=ctx).to_json()
        assert rep["recurrent_bytes_per_sequence"] == state
        assert rep["bytes_per_sequence"] == state + 2 * 2 * ctx * 16 * 4
    write_compile_config_for_graph(bamba_cb.onnx_path, tmp_path / "cc", prefill_seq_len=CHUNK, ctx_len=CTX,
                                   full_batch_size=2)
    io = (tmp_path / "cc" / "custom_io.yaml").read_text()
    for name in ("conv_state.0_VLLM", "conv_state.0_VLLM_RetainedState", "recurrent_state.2_VLLM",
                 "recurrent_state.2_VLLM_RetainedState"):
        assert f" - IOName: {name}\n" in io


@requires_torch
def test_rewinds_of_recurrent_sequences(family_exports, long_refs):
    """Truncate to 0 restarts from a zero state (tokens exact again); a rewind into the middle where no checkpoint
    of the recurrent state is kept is refused in one line naming where it can return to (checkpoints: the runtime's
    tests/runtime/test_recurrent_runtime.py and tests/runtime/test_recurrent_export_runtime.py)."""
    from qeff_kv.errors import RewindError
    from qeff_kv.runtime import Session

    s = Session(family_exports("bamba", "onnxruntime").out_dir)
    [g] = s.generate([LONG[0]], max_new_tokens=NEW)
    seq = g.sequence
    points = s.rewind_points(seq)   # 0, the prompt's end and one before it, the length
    assert points == [0, len(LONG[0]) - 1, len(LONG[0]), seq.length]
    with pytest.raises(RewindError) as exc:
        s.truncate(seq, 5)
    assert str(exc.value) == (f"cannot rewind sequence {seq.id} to 5 positions: its recurrent state has no checkpoint "
                              f"there; it can return to 0, {points[1]}, {points[2]} or {seq.length}")
    s.truncate(seq, 0)
    [again] = s.generate([(seq, LONG[0])], max_new_tokens=NEW)
    assert again.tokens == long_refs("bamba")[0]


@requires_torch
def test_padding_leaves_the_states_untouched(bamba_cb):
    """A row that is all padding (position -1) gets its states back bit for bit; the other row's change."""
    import numpy as np
    import onnxruntime as ort

    from qeff_kv.graph import graphio

    layout = graphio.layout_of(graphio.load(bamba_cb.onnx_path))
    sess = ort.InferenceSession(str(bamba_cb.onnx_path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    feeds = {p.input_name: rng.standard_normal([2 if not isinstance(d, int) else d for d in p.input.shape]
                                               if p.stem in ("conv_state", "recurrent_state")
                                               else [2, p.input.shape[1], CTX, p.input.shape[3]]).astype(np.float32)
             for p in layout.pairs}
    feeds.update(input_ids=np.array([[7, 7], [9, 0]]), position_ids=np.array([[-1, -1], [20, -1]]),
                 batch_index=np.array([[0], [1]]))
    out = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    states = [p for p in layout.pairs if p.stem in ("conv_state", "recurrent_state")]
    assert len(states) == 4
    for p in states:
        np.testing.assert_array_equal(out[p.output_name][0], feeds[p.input_name][0])
        assert not np.array_equal(out[p.output_name][1], feeds[p.input_name][1])
