"""``--kv-cache-dtype int8`` (``int4``): the fused target's int8 (packed int4) cache exact to the transformers model
with the same cache quantization emulated, its scales named by the contract, and the one-line refusals of what it
cannot do."""

import json

import numpy as np
import onnx
import pytest

from families import NEW, PROMPTS
from suite import requires_torch

from qeff_kv.errors import ExportError
from qeff_kv.export import export_model
from qeff_kv.export.options import ExportOptions

pytestmark = requires_torch


def _scales(onnx_path, layers: int) -> list:
    import torch

    from qeff_kv.contract import naming

    inits = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(onnx_path).graph.initializer}
    return [tuple(torch.from_numpy(inits[naming.kv_scale_name(stem, i)].copy())
                  for stem in ("past_key", "past_value")) for i in range(layers)]


def _hf_greedy_emulated(model_dir, scales, prompt, bits: int = 8) -> tuple[list[int], np.ndarray]:
    """transformers' greedy tokens with every cache write quantized then dequantized (the int8, ``bits=4``: int4,
    cache's reference), and its logits after the prompt."""
    from hf_models import hf_greedy, load_causal_lm
    from qeff_kv.export.modeling import kv_quant
    import torch

    with kv_quant.emulated_cache(scales, bits):
        tokens = hf_greedy(model_dir, prompt, NEW)
        with torch.no_grad():
            logits = load_causal_lm(model_dir)(torch.tensor([prompt]), use_cache=True).logits[0, -1].numpy()
    return tokens, logits


def test_int8_cache_exact_to_emulated_reference(int8_kv_export, family_models):
    from hf_models import load_causal_lm
    from qeff_kv.runtime.session import Session
    import torch

    res = int8_kv_export
    assert res.manifest["verification"]["status"] == "passed"
    assert res.manifest["verification"]["max_abs_diff"] < 1e-4
    assert res.manifest["kv_cache"]["dtype"] == "int8" and res.manifest["kv_cache"]["margin"] == 1.25
    graph = onnx.load(res.onnx_path)
    kv = [i for i in graph.graph.input if i.name.startswith("past_")]
    assert kv and all(i.type.tensor_type.elem_type == onnx.TensorProto.INT8 for i in kv)
    scales = _scales(res.onnx_path, 2)
    assert all(tuple(s.shape) == (1, 2, 1, 16) and bool((s > 0).all()) for pair in scales for s in pair)
    session = Session(res.onnx_path)
    float_model = load_causal_lm(family_models("llama"))
    seen = set()
    for prompt in PROMPTS:
        want, want_logits = _hf_greedy_emulated(family_models("llama"), scales, prompt)
        got = session.generate([prompt], max_tokens=NEW)[0]
        assert got.tokens == want
        seen.add(tuple(got.tokens))
        session.remove_sequence(got.sequence)
        seq = session.add_sequence()
        logits = session.prefill(seq, prompt)
        session.remove_sequence(seq)
        assert np.abs(logits - want_logits).max() < 1e-4   # exact to the emulated cache ...
        with torch.no_grad():
            plain = float_model(torch.tensor([prompt])).logits[0, -1].numpy()
        assert np.abs(logits - plain).max() > 1e-3         # ... and really an int8 cache, not the float one
    assert len(seen) == 2 and all(len(set(t)) > 1 for t in seen)   # greedy tokens that vary


def test_int8_cache_check_and_buffers(int8_kv_export):
    from qeff_kv.graph import graphio
    from qeff_kv.tools.buffers import format_buffer_table
    from qeff_kv.tools.check.rules import check

    report = check(int8_kv_export.onnx_path)
    assert report.ok and report.to_json()["kv_cache_dtype"] == "int8"
    assert report.format_text().splitlines()[0].endswith("2 layers, KV cache int8")
    table = format_buffer_table(graphio.layout_of(graphio.load(int8_kv_export.onnx_path)), ctx_len=32)
    # 2 layers x key and value x 2 heads x 16 channels x 1 byte
    assert "KV bytes per token (one sequence, all layers): 128" in table


def test_int4_cache_exact_to_emulated_reference(int4_kv_export, int8_kv_export, family_models):
    """GroupQueryAttention's packed 4-bit cache (uint8 ``[.., head_dim / 2]``): exact to transformers with the int4
    cache emulated, greedy tokens included, and really int4 (not the int8 cache's logits); check and buffers name it
    and count half of int8's bytes."""
    from qeff_kv.graph import graphio
    from qeff_kv.runtime.session import Session
    from qeff_kv.tools.buffers import format_buffer_table
    from qeff_kv.tools.check.rules import check

    res = int4_kv_export
    assert res.manifest["verification"]["status"] == "passed"
    assert res.manifest["verification"]["max_abs_diff"] < 1e-4
    assert res.manifest["kv_cache"]["dtype"] == "int4"
    assert res.manifest["kv_cache"]["rounding"] == "half to even, saturated to [-8, 7]"
    kv = [i for i in onnx.load(res.onnx_path).graph.input if i.name.startswith("past_")]
    assert kv and all(i.type.tensor_type.elem_type == onnx.TensorProto.UINT8 for i in kv)
    assert all(i.type.tensor_type.shape.dim[3].dim_value == 8 for i in kv)   # head_dim 16, two per byte
    scales = _scales(res.onnx_path, 2)
    int8_scales = _scales(int8_kv_export.onnx_path, 2)
    # the int4 range: the same calibrated absmax over 7 instead of 127
    assert all(np.allclose(a.numpy() * 7, b.numpy() * 127, rtol=1e-5) for p, q in zip(scales, int8_scales)
               for a, b in zip(p, q))
    session, int8_session = Session(res.onnx_path), Session(int8_kv_export.onnx_path)
    seen = set()
    for prompt in PROMPTS:
        want, want_logits = _hf_greedy_emulated(family_models("llama"), scales, prompt, bits=4)
        got = session.generate([prompt], max_tokens=NEW)[0]
        assert got.tokens == want
        seen.add(tuple(got.tokens))
        session.remove_sequence(got.sequence)
        logits = [_prefill_logits(s, prompt) for s in (session, int8_session)]
        assert np.abs(logits[0] - want_logits).max() < 1e-4   # exact to the emulated int4 cache ...
        assert np.abs(logits[0] - logits[1]).max() > 1e-3     # ... and not the int8 one
    assert len(seen) == 2 and all(len(set(t)) > 1 for t in seen)
    report = check(res.onnx_path)
    assert report.ok and report.to_json()["kv_cache_dtype"] == "int4"
    assert report.format_text().splitlines()[0].endswith("2 layers, KV cache int4")
    table = format_buffer_table(graphio.layout_of(graphio.load(res.onnx_path)), ctx_len=32)
    # 2 layers x key and value x 2 heads x 16 channels x half a byte: half of the int8 cache's 128
    assert "KV bytes per token (one sequence, all layers): 64" in table


def _prefill_logits(session, prompt):
    seq = session.add_sequence()
    logits = session.prefill(seq, prompt)
    session.remove_sequence(seq)
    return logits


@pytest.mark.parametrize("target", ["portable", "onnxruntime"])
def test_int8_cache_scatter_targets_exact_to_emulated_reference(family_models, tmp_path, target):
    """The ScatterND targets: the chunk quantized before the scatter, the buffer dequantized where attention reads
    it, with the same static scales: exact to the same emulated reference."""
    from families import CHUNK, CTX
    from qeff_kv.runtime.session import Session

    res = export_model(family_models("llama"), tmp_path / target, ctx_len=CTX, prefill_seq_len=CHUNK, target=target,
                       kv_cache_dtype="int8")
    assert res.manifest["verification"]["status"] == "passed"
    assert res.manifest["verification"]["max_abs_diff"] < 1e-4
    kv = [i for i in onnx.load(res.onnx_path).graph.input if i.name.startswith("past_")]
    assert kv and all(i.type.tensor_type.elem_type == onnx.TensorProto.INT8 for i in kv)
    scales = _scales(res.onnx_path, 2)
    session = Session(res.onnx_path)
    for prompt in PROMPTS:
        got = session.generate([prompt], max_tokens=NEW)[0]
        assert got.tokens == _hf_greedy_emulated(family_models("llama"), scales, prompt)[0]
        session.remove_sequence(got.sequence)


@pytest.mark.parametrize("kw, message", [
    (dict(kv_cache_dtype="int4", target="portable"),
     "--kv-cache-dtype int4 needs --target onnxruntime-fused (GroupQueryAttention's packed 4-bit cache; ONNX's "
     "ScatterND on the portable target has no int4 type); use --target onnxruntime-fused, or --kv-cache-dtype int8"),
    (dict(kv_cache_dtype="int4", target="onnxruntime"),
     "--kv-cache-dtype int4 needs --target onnxruntime-fused (GroupQueryAttention's packed 4-bit cache; ONNX's "
     "ScatterND on the onnxruntime target has no int4 type); use --target onnxruntime-fused, or --kv-cache-dtype int8"),
    (dict(kv_cache_dtype="int4", dtype="float16"),
     "--kv-cache-dtype int4 is verified with --dtype float32 only; use --dtype float32"),
    (dict(kv_cache_dtype="float16"), "--kv-cache-dtype float16 differs from --dtype float32: a float cache is kept "
                                     "in the export dtype; use --dtype float16, or --kv-cache-dtype int8"),
    (dict(kv_cache_dtype="int3"), "kv_cache_dtype must be one of float32, float16, int8, int4, got 'int3'"),
    (dict(dtype="float16"), "--kv-cache-dtype int8 is verified with --dtype float32 only; use --dtype float32"),
    (dict(family="mistral_sw", target="portable"),
     "--kv-cache-dtype int8 cannot be used with MistralForCausalLM's sliding-window ring buffers (only layers that keep "
     "a plain key/value cache of their own hold it in int8 here); export without it"),
    (dict(family="gemma4_text_shared"),
     "--kv-cache-dtype int8 cannot be used with Gemma4ForCausalLM's shared-KV layers (only layers that keep a plain "
     "key/value cache of their own hold it in int8 here); export without it"),
])
def test_int8_cache_refusals(family_models, tmp_path, kw, message):
    options = dict(target="onnxruntime-fused", kv_cache_dtype="int8")
    options.update(kw)
    family = options.pop("family", "llama")
    with pytest.raises(ExportError) as err:
        export_model(family_models(family), tmp_path / "out", ctx_len=32, prefill_seq_len=4, **options)
    assert str(err.value) == message
    assert not (tmp_path / "out").exists()


def test_int8_cache_options_hash():
    """Naming the export dtype is the default graph (same hash); int8 is another graph."""
    base = ExportOptions(target="onnxruntime-fused").to_json()
    assert ExportOptions(target="onnxruntime-fused", kv_cache_dtype="float32").to_json() == base
    int8 = ExportOptions(target="onnxruntime-fused", kv_cache_dtype="int8").to_json()
    assert int8["kv_cache_dtype"] == "int8" and json.dumps(int8) != json.dumps(base)


def test_int4_weights_with_int8_cache_exact_to_emulated_reference(family_models, tmp_path):
    """int4 weights' reference runs the probe in one pass; with an int8 cache that pass must write (and read back)
    a cache too, or its reference is the float cache's and the graph differs by the cache's quantization noise."""
    from families import CHUNK, CTX

    out = export_model(family_models("llama"), tmp_path / "i4k8", ctx_len=CTX, prefill_seq_len=CHUNK,
                       target="onnxruntime-fused", weights="int4", kv_cache_dtype="int8")
    ver = json.loads((out.out_dir / "manifest.json").read_text())["verification"]
    assert ver["status"] == "passed" and ver["max_abs_diff"] < 1e-4, ver
