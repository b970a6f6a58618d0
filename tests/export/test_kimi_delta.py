"""Kimi delta attention's traced step (``qeff_kv/export/modeling/gated_delta.py``) against transformers' own KDA.

The rule over chunks longer than one sub-chunk (150 tokens: three fixed sub-chunk slices, the last partial), from
a carried state, at once and in chunks of 37, equals transformers' chunked and per-token functions; padded
positions leave both states untouched (an idle row bit for bit) and a padded row's output repeats its last valid
one. End-to-end exports of Kimi Linear and Bailing-Hybrid are in test_recurrent_families.py.
"""

from __future__ import annotations

import pytest

from suite import requires_torch

pytestmark = [requires_torch]


def _inputs(seed: int = 0, batch: int = 2, seq: int = 150, heads: int = 3, dim: int = 16):
    import torch

    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, seq, heads, dim, generator=g) for _ in range(3))
    decay = -torch.rand(batch, seq, heads, dim, generator=g) * 0.5     # per-channel log decay
    beta = torch.rand(batch, seq, heads, generator=g)
    state = torch.randn(batch, heads, dim, dim, generator=g) * 0.1
    return q, k, v, decay, beta, state


def _ours(q, k, v, decay, beta, state, chunk: int):
    import torch

    from qeff_kv.export.modeling.gated_delta import kda_rule

    dim = q.shape[-1]
    q, k, v, decay, beta = (x.transpose(1, 2) for x in (q, k, v, decay, beta))
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * dim ** -0.5
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    outs = []
    for a in range(0, q.shape[2], chunk):
        part = slice(a, a + chunk)
        out, state = kda_rule(q[:, :, part], k[:, :, part], v[:, :, part], decay[:, :, part], beta[:, :, part],
                              state, chunk)
        outs.append(out)
    return torch.cat(outs, dim=2).transpose(1, 2), state


@pytest.mark.parametrize("chunk", [150, 37])
def test_kda_rule_equals_transformers_chunked_and_per_token(chunk):
    from transformers.models.kimi_linear import modeling_kimi_linear as kimi

    q, k, v, decay, beta, state = _inputs()
    want, want_state = kimi.chunk_kimi_delta_attention(q, k, v, decay, beta, initial_state=state,
                                                       output_final_state=True, use_qk_l2norm_in_kernel=True)
    token, token_state = kimi.recurrent_kimi_delta_attention(q, k, v, decay, beta, initial_state=state,
                                                             output_final_state=True, use_qk_l2norm_in_kernel=True)
    got, got_state = _ours(q, k, v, decay, beta, state, chunk)
    for ref, ref_state in ((want, want_state), (token, token_state)):
        assert (got - ref).abs().max() < 1e-5 and (got_state - ref_state).abs().max() < 1e-5


def test_padding_leaves_the_states_untouched(family_models):
    """Row 0 has 3 valid tokens of 5, row 1 none (an idle row): row 0's states equal those after its 3 tokens
    alone, row 1's are its input states bit for bit; padded outputs repeat the row's last valid one."""
    import torch
    import transformers

    from qeff_kv.export.modeling.gated_delta import kda_step

    model = transformers.AutoModelForCausalLM.from_pretrained(family_models("kimi_linear"), dtype=torch.float32)
    mixer = model.model.layers[0].self_attn
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 5, 64, generator=gen)
    conv = torch.randn(2, mixer.conv_dim, mixer.conv_kernel_size, generator=gen)
    rec = torch.randn(2, mixer.num_heads, mixer.head_dim, mixer.head_dim, generator=gen) * 0.1
    valid = torch.tensor([[True, True, True, False, False], [False] * 5])
    with torch.no_grad():
        out, new_conv, new_rec = kda_step(mixer, hidden, conv, rec, valid, max_len=5)
        alone, alone_conv, alone_rec = kda_step(mixer, hidden[:1, :3], conv[:1], rec[:1],
                                                torch.ones(1, 3, dtype=torch.bool), max_len=3)
    assert torch.equal(new_conv[1], conv[1]) and torch.equal(new_rec[1], rec[1])
    # row 0 against its valid tokens alone (projections of a different batch round differently: 1e-5)
    assert torch.allclose(new_conv[0], alone_conv[0], atol=1e-5) and torch.allclose(new_rec[0], alone_rec[0], atol=1e-5)
    assert torch.allclose(out[0, :3], alone[0], atol=1e-5)
    assert torch.equal(out[0, 3], out[0, 2]) and torch.equal(out[0, 4], out[0, 2])



@pytest.mark.parametrize("name", ["kimi_linear", "bailing_hybrid"])
def test_the_split_qkv_convolutions_stream(name, family_models, family_exports):
    """The checkpoint keeps ``q_conv1d``/``k_conv1d``/``v_conv1d`` and transformers joins them into ``conv1d``
    (a lone ``Concatenate``): the export streams them (it loaded the whole model before). The family's exact
    cells (test_recurrent_families.py) are those streamed exports."""
    from safetensors import safe_open

    with safe_open(str(family_models(name) / "model.safetensors"), "pt") as f:
        assert any(k.endswith("q_conv1d.weight") for k in f.keys())
    result = family_exports(name, "onnxruntime")
    if isinstance(result, BaseException):
        raise result
    notes = family_exports.notes[(name, "onnxruntime")]
    assert any(n.startswith(f"building tiny-{name} without its weights") for n in notes), notes
    assert not any("loading the whole model" in n or "streaming is not possible" in n for n in notes), notes


def test_float16_stream_keeps_the_float32_modules_in_float32(family_models, tmp_path):
    """transformers keeps Kimi's ``dt_bias`` (and the router) in float32 in a float16 model; the streamed graph's
    initializers keep each parameter's own dtype (all were written in the export dtype, and onnxruntime refused
    the graph: ``Add`` of float and float16 in the forget gate)."""
    import onnx
    import onnxruntime

    from qeff_kv.export import export_model

    notes: list[str] = []
    r = export_model(family_models("kimi_linear"), tmp_path / "fp16", ctx_len=16, prefill_seq_len=4,
                     target="onnxruntime", dtype="float16", progress=notes.append, verify=False)
    assert not any("streaming is not possible" in n for n in notes), notes
    onnxruntime.InferenceSession(str(r.onnx_path), providers=["CPUExecutionProvider"])   # it refused the graph
    graph = onnx.load(str(r.onnx_path), load_external_data=False).graph
    inits = {i.name: i.data_type for i in graph.initializer}
    # the forget gate's first Add: the projection (cast to float32) plus dt_bias
    dt_bias = [inits[n.input[1]] for n in graph.node if n.name.endswith("self_attn/forget_gate/Add")]
    assert len(dt_bias) == 2 and set(dt_bias) == {onnx.TensorProto.FLOAT}
    assert onnx.TensorProto.FLOAT16 in inits.values()
