"""Dense-family details beyond the family matrix (tests/export/test_families.py proves tokens and ``check`` on every
family and target):

* Cohere's and Granite's exported logits equal transformers' logits (not only their argmax): Cohere multiplies
  by ``logit_scale``, Granite divides by ``logits_scaling``;
* GPT-J is refused up front on onnxruntime-fused;
* longrope: exact up to ``original_max_position_embeddings``, refused beyond it; the graph follows
  transformers' per-forward-pass choice of factors on both sides of the threshold;
* the measured ``rotate_half`` kind, and the repeat_interleave symbolic that keeps later negative dims.

Models and exports are the session's shared family fixtures (tests/conftest.py).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from suite import requires_torch
from families import CHUNK, CTX, FAMILIES, PROMPTS, TARGETS, Family, make_family_dir

pytestmark = [requires_torch]

LOGITS = [("cohere", t) for t in TARGETS] + [("granite", "portable"), ("granite", "onnxruntime-fused")]


@pytest.fixture
def family_dir(family_models):
    return family_models


@pytest.fixture
def exported(family_exports):
    def get(name: str, target: str):
        r = family_exports(name, target)
        if isinstance(r, BaseException):
            raise r
        return r

    return get


def _hf(path):
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                             attn_implementation="eager").eval()


def test_gptj_is_refused_up_front_on_the_fused_target(family_dir, tmp_path):
    from qeff_kv.errors import ExportError
    from qeff_kv.export import export_model

    with pytest.raises(ExportError) as info:
        export_model(family_dir("gptj"), tmp_path / "o", ctx_len=CTX, prefill_seq_len=CHUNK,
                     target="onnxruntime-fused")
    msg = str(info.value)
    assert msg.startswith("--target onnxruntime-fused cannot express GPTJForCausalLM's attention") and "\n" not in msg
    assert not (tmp_path / "o" / "manifest.json").exists()


@pytest.mark.parametrize("name,target", LOGITS, ids=[f"{n}-{t}" for n, t in LOGITS])
def test_logits_equal_transformers(name, target, family_dir, exported):
    """Cohere multiplies its logits by ``logit_scale``, Granite divides by ``logits_scaling``: the exported
    logits are transformers' logits after the padded prompt and after each teacher-forced decode step."""
    import torch

    from hf_models import PlainLoop

    model = _hf(family_dir(name))
    loop = PlainLoop(exported(name, target).onnx_path, CTX)
    prompt = PROMPTS[0]
    got = [loop.prefill(prompt, CHUNK)[0, -1]]
    ids = list(prompt)
    for _ in range(3):
        tok = int(got[-1].argmax())
        got.append(loop.step(np.array([[tok]]), np.array([[len(ids)]]))[0, -1])
        ids.append(tok)
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0, len(prompt) - 1:].double().numpy()
    assert len(want) == len(got) == 4
    scale = float(np.abs(want).max())
    tol = 1e-3 * max(1.0, scale)
    diff = max(float(np.abs(g.astype(np.float64) - w).max()) for g, w in zip(got, want))
    assert diff <= tol, (diff, tol)
    if name == "cohere":  # logit_scale 1/16: unscaled logits would be 16x too large
        assert scale * 15 > 100 * tol


# --- longrope ---------------------------------------------------------------------------------------------

def _longrope_16(monkeypatch, root):
    """phi3_longrope with its factors switching after 16 positions (a capacity of 32 crosses it)."""
    base = FAMILIES["phi3_longrope"]
    kw = dict(base.kwargs, original_max_position_embeddings=16,
              rope_parameters=dict(base.kwargs["rope_parameters"], original_max_position_embeddings=16))
    monkeypatch.setitem(FAMILIES, "phi3_longrope_16", Family(base.config_class, base.model_class, kw))
    return make_family_dir("phi3_longrope_16", root)


def test_longrope_beyond_the_threshold_is_refused_before_loading(monkeypatch, tmp_path):
    from qeff_kv.errors import ExportError
    from qeff_kv.export import export_model

    d = _longrope_16(monkeypatch, tmp_path)
    (d / "model.safetensors").write_bytes(b"not read: the refusal comes first")
    with pytest.raises(ExportError, match=r"^this model uses longrope RoPE scaling, whose factors switch once a "
                                          r"sequence is longer than original_max_position_embeddings 16 .*"
                                          r"export with --ctx-len 16 or less$"):
        export_model(d, tmp_path / "o", ctx_len=CTX, prefill_seq_len=CHUNK)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("target", ["portable", "onnxruntime-fused"])
def test_longrope_graph_follows_transformers_per_forward_pass_across_the_threshold(target, monkeypatch, tmp_path):
    """transformers picks the short or long factors per forward pass from ``max(position_ids) + 1`` (its
    ``generate`` then also recomputes the cache at the crossing, hence the refusal). With the refusal lifted,
    the graph computes exactly what the PyTorch model computes over the same chunks and decode steps, on both
    sides of the threshold."""
    import torch
    import transformers

    from hf_models import PlainLoop
    from qeff_kv.export import export_model
    from qeff_kv.export.facts import family

    d = _longrope_16(monkeypatch, tmp_path)
    monkeypatch.setattr(family, "longrope_threshold", lambda text, model_type: None)
    r = export_model(d, tmp_path / "o", ctx_len=CTX, prefill_seq_len=CHUNK, target=target)
    model = _hf(d)
    prompt = [int(x) for x in np.random.default_rng(1).integers(3, 128, 14)]  # last chunk: positions 12-13

    def pytorch(chunk: int) -> list[np.ndarray]:
        from qeff_kv.export import transformers_adapter as hf

        cache = transformers.DynamicCache(config=model.config)
        out, pos = [], 0
        with torch.no_grad():
            while pos < len(prompt):
                part = prompt[pos:pos + chunk]
                logits = model(torch.tensor([part]), position_ids=torch.arange(pos, pos + len(part))[None],
                               **hf.with_cache(model, cache)).logits[0, -1]
                pos += len(part)
            out.append(logits.numpy())
            for _ in range(4):                                  # positions 14..17: crosses 16
                logits = model(torch.tensor([[int(out[-1].argmax())]]), position_ids=torch.tensor([[pos]]),
                               **hf.with_cache(model, cache)).logits[0, -1]
                out.append(logits.numpy())
                pos += 1
        return out

    want = pytorch(CHUNK)
    loop = PlainLoop(r.onnx_path, CTX)
    got = [loop.prefill(prompt, CHUNK)[0, -1]]
    for i in range(4):
        got.append(loop.step(np.array([[int(want[i].argmax())]]), np.array([[len(prompt) + i]]))[0, -1])
    tol = 1e-3 * max(1.0, max(float(np.abs(w).max()) for w in want))
    assert max(float(np.abs(g - w).max()) for g, w in zip(got, want)) <= tol
    # the long factors matter: at the last steps the short ones would give other logits
    monkeypatch.setattr(model.model.rotary_emb, "long_inv_freq", model.model.rotary_emb.original_inv_freq,
                        raising=False)
    short_only = pytorch(CHUNK)
    assert max(float(np.abs(a - b).max()) for a, b in zip(short_only[-2:], want[-2:])) > 100 * tol


# --- interleaved RoPE and repeat_interleave ----------------------------------------------------------------

def test_rotate_half_kind_is_measured_from_the_modeling_code():
    from transformers.models.cohere import modeling_cohere
    from transformers.models.glm import modeling_glm
    from transformers.models.llama import modeling_llama

    from qeff_kv.export.modeling import rope

    assert rope.rotate_half_kind(modeling_llama.rotate_half) == "split-half"
    assert rope.rotate_half_kind(modeling_cohere.rotate_half) == "interleaved"
    assert rope.rotate_half_kind(modeling_glm.rotate_half) == "interleaved"
    assert rope.rotate_half_kind(lambda x: x) is None
    assert rope.rotate_half_kind(lambda x, y: x) is None


def test_repeat_interleave_keeps_later_negative_dims(tmp_path):
    """torch's own symbolic turns a later ``stack(dim=-1)`` into ``stack(dim=2)`` (a shared constant edited in
    place); under :func:`export_symbolics` the exported graph computes what torch computes."""
    import onnxruntime as ort
    import torch

    from qeff_kv.export.modeling import graph_ops

    class M(torch.nn.Module):
        def forward(self, x, f):
            c = f.repeat_interleave(2, dim=-1)                                   # GLM
            r = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)  # interleaved rotate_half
            return x * c + r * torch.repeat_interleave(f, 2, dim=-1)            # Cohere

    x, f = torch.randn(1, 2, 3, 8), torch.randn(1, 1, 3, 4)
    path = tmp_path / "m.onnx"
    with graph_ops.export_symbolics(), torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(M(), (x, f), str(path), dynamo=False, opset_version=17, input_names=["x", "f"],
                          dynamic_axes={"x": {2: "s"}, "f": {2: "s"}})
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for s in (3, 5):
        x, f = torch.randn(1, 2, s, 8), torch.randn(1, 1, s, 4)
        got = sess.run(None, {"x": x.numpy(), "f": f.numpy()})[0]
        np.testing.assert_allclose(got, M()(x, f).numpy(), rtol=1e-6, atol=1e-6)
