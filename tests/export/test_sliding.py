"""Sliding-window layers (contract section 7, issue 9): ring buffers of exactly ``window`` slots on the portable
and onnxruntime targets, full-length buffers with the window in attention on the fused target or with
``--sliding-cache full``; names, dims, metadata and manifest as specified; parity on prompts several windows long.

The tiny models are the ``*_sw`` families of tests/helpers/families.py (window SW=6, ctx_len CTX=32, chunks of 4).
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from suite import requires_torch
from families import CHUNK, CTX, NEW, SW

pytestmark = [requires_torch]

#: a prompt of four windows; with NEW tokens it spans five; its chunks of 4 straddle the wrap at 6, 12, 18
LONG = [int(t) for t in np.random.default_rng(7).integers(3, 128, size=4 * SW)]


def _kv_dims(path) -> dict[str, list]:
    m = onnx.load(str(path), load_external_data=False)
    dims = {}
    for vi in list(m.graph.input) + list(m.graph.output):
        if vi.name.startswith("past_"):
            dims[vi.name] = [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]
    return dims


def test_ring_buffers_hold_exactly_the_window(family_exports):
    """Gemma3 5:1 on the portable target: the 5 sliding layers' pairs are [batch, heads, 'sliding_window',
    head_dim] in and out, the global layer keeps 'ctx_len'; the metadata and manifest say so."""
    result = family_exports("gemma3_sw", "portable")
    dims = _kv_dims(result.onnx_path)
    for i in range(6):
        for stem in ("past_key", "past_value"):
            axis = "sliding_window" if i < 5 else "ctx_len"
            assert dims[f"{stem}.{i}"] == ["batch_size", 2, axis, 16]
            assert dims[f"{stem}.{i}_RetainedState"] == ["batch_size", 2, axis, 16]
    meta = {p.key: p.value for p in onnx.load(str(result.onnx_path), load_external_data=False).metadata_props}
    assert meta["qeff_kv.sliding_window"] == str(SW)
    assert meta["qeff_kv.sliding_cache"] == "ring"
    man = result.manifest
    assert (man["sliding_window"], man["sliding_layers"], man["sliding_cache"]) == (SW, [0, 1, 2, 3, 4], "ring")


def test_fused_target_keeps_full_buffers_with_the_window_in_gqa(family_exports):
    result = family_exports("gemma3_sw", "onnxruntime-fused")
    assert set(d[2] for d in _kv_dims(result.onnx_path).values()) == {"ctx_len"}
    assert result.manifest["sliding_cache"] == "full"
    m = onnx.load(str(result.onnx_path), load_external_data=False)
    windows = []
    for n in m.graph.node:
        if n.op_type == "GroupQueryAttention":
            attrs = {a.name: a.i for a in n.attribute if a.type == onnx.AttributeProto.INT}
            windows.append(attrs.get("local_window_size", -1))
    # onnxruntime's local_window_size is the window itself (W keys: p - W + 1 .. p), on the sliding layers only
    assert windows == [SW] * 5 + [-1]


@pytest.mark.parametrize("name", ["gemma3_sw", "mistral_sw", "gpt_oss_sw"])
@pytest.mark.parametrize("target", ["portable", "onnxruntime", "onnxruntime-fused"])
def test_long_prompt_parity(name, target, family_exports, family_models):
    """A prompt four windows long (chunks straddling every wrap), then NEW greedy tokens: transformers' tokens."""
    from hf_models import PlainLoop, hf_greedy

    result = family_exports(name, target)
    want = hf_greedy(family_models(name), LONG, NEW)
    assert PlainLoop(result.onnx_path, CTX).greedy(LONG, NEW, CHUNK) == want


@pytest.fixture(scope="module")
def gemma3_full(family_models, tmp_path_factory):
    from qeff_kv.export import export_model

    return export_model(family_models("gemma3_sw"), tmp_path_factory.mktemp("full") / "o", ctx_len=CTX,
                        prefill_seq_len=CHUNK, sliding_cache="full")


def test_sliding_cache_full_keeps_ctx_len_buffers_and_the_window_in_the_mask(gemma3_full, family_models):
    from hf_models import PlainLoop, hf_greedy

    assert set(d[2] for d in _kv_dims(gemma3_full.onnx_path).values()) == {"ctx_len"}
    assert gemma3_full.manifest["sliding_cache"] == "full"
    assert gemma3_full.manifest["options"]["sliding_cache"] == "full"
    want = hf_greedy(family_models("gemma3_sw"), LONG, NEW)
    assert PlainLoop(gemma3_full.onnx_path, CTX).greedy(LONG, NEW, CHUNK) == want


def test_verification_catches_a_missing_window(family_models, tmp_path, monkeypatch):
    """The probe is longer than the window: a graph that forgot the window is refused, nothing written."""
    from qeff_kv.errors import VerificationError
    from qeff_kv.export import export_model
    from qeff_kv.export.facts.family import ModelFacts

    monkeypatch.setattr(ModelFacts, "windowed_layers", lambda self, options: ())
    with pytest.raises(VerificationError, match="^verification failed after "):
        export_model(family_models("gemma3_sw"), tmp_path / "o", ctx_len=CTX, prefill_seq_len=CHUNK,
                     sliding_cache="full")
    assert not (tmp_path / "o" / "manifest.json").exists()


def test_prefix_and_rewrite_keep_the_sliding_axes(family_exports, tmp_path):
    """`--kv-cache-prefix` on a ring graph renames the KV values only; dims (sliding_window / ctx_len) are kept,
    and stripping the prefix again gives back the original I/O exactly."""
    from qeff_kv.tools.rewrite import rewrite

    src = family_exports("gemma2_sw", "onnxruntime").onnx_path
    before = _kv_dims(src)
    rewrite(src, tmp_path / "p.onnx", prefix="VLLM")
    prefixed = _kv_dims(tmp_path / "p.onnx")
    assert prefixed == {n.replace(".0", ".0_VLLM").replace(".1", ".1_VLLM"): d for n, d in before.items()}
    assert prefixed["past_key.0_VLLM"][2] == "sliding_window" and prefixed["past_key.1_VLLM"][2] == "ctx_len"
    rewrite(tmp_path / "p.onnx", tmp_path / "b.onnx", strip=True)
    assert _kv_dims(tmp_path / "b.onnx") == before


def test_manifest_records_the_sliding_facts_for_every_target(family_exports):
    for target, cache in (("portable", "ring"), ("onnxruntime", "ring"), ("onnxruntime-fused", "full")):
        man = json.loads((family_exports("gemma2_sw", target).manifest_path).read_text())
        assert (man["sliding_window"], man["sliding_layers"], man["sliding_cache"]) == (SW, [0], cache)
