"""The output head reads its weight as stored: a tied embedding is one initializer, and no export carries a
transposed copy of the head (the exported weights are the model's parameters, each once)."""

from __future__ import annotations

import pytest

from suite import requires_torch
from qeff_kv.graph import graphio

pytestmark = [requires_torch]

PROMPT = [5, 17, 42, 99, 13, 7, 101, 64, 3, 77, 21]
CTX, CHUNK, NEW = 32, 4, 8
VOCAB, HIDDEN = 256, 64


def _model_dir(root, tied: bool):
    """The tiny seeded Llama of tests/helpers/hf_models.py with vocab 256, tied or not; its float32 parameter bytes
    (as saved: a tied tensor once)."""
    from safetensors import safe_open

    from hf_models import make_model_dir

    out = make_model_dir("llama", root / ("tied" if tied else "untied"), seed=3, vocab_size=VOCAB,
                         tie_word_embeddings=tied)
    with safe_open(str(out / "model.safetensors"), "np") as f:
        nbytes = sum(f.get_tensor(k).size * 4 for k in f.keys())
    return out, nbytes


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    return _model_dir(tmp_path_factory.mktemp("hf"), tied=True)


def _weights(onnx_path):
    model = graphio.load(onnx_path)
    inits = [v for v in model.graph.initializers.values() if v.const_value is not None]
    # a vocabulary table is read by the lookup or the head; gate/up packed into one [HIDDEN, 2 x 128] MatMul weight
    # (the fused target's PackSharedInputMatMulsPass) has the same dims here and only MatMul readers
    vocab_shaped = [v.name for v in inits if sorted(int(d) for d in v.shape) == sorted((VOCAB, HIDDEN))
                    and not all(u.node.op_type == "MatMul" for u in v.uses())]
    return vocab_shaped, sum(v.const_value.nbytes for v in inits), model


@pytest.mark.parametrize("target", ["portable", "onnxruntime-fused"])
def test_tied_embedding_stored_once_and_tokens_exact(tied, target, tmp_path):
    from hf_models import PlainLoop, hf_greedy

    from qeff_kv.export import export_model

    src, param_bytes = tied
    r = export_model(src, tmp_path / "out", ctx_len=CTX, prefill_seq_len=CHUNK, target=target)
    vocab_shaped, weight_bytes, model = _weights(r.onnx_path)
    assert len(vocab_shaped) == 1, vocab_shaped
    assert abs(weight_bytes - param_bytes) <= 0.03 * param_bytes, (weight_bytes, param_bytes)
    # The embedding Gather and the head Gemm(transB=1) read the same initializer.
    readers = {u.node.op_type for u in model.graph.initializers[vocab_shaped[0]].uses()}
    assert readers == {"Gather", "Gemm"}, readers
    assert PlainLoop(r.onnx_path, CTX).greedy(PROMPT, NEW, CHUNK) == hf_greedy(src, PROMPT, NEW)


def test_untied_head_is_not_copied(tmp_path):
    from qeff_kv.export import export_model

    src, param_bytes = _model_dir(tmp_path, tied=False)
    r = export_model(src, tmp_path / "out", ctx_len=CTX, prefill_seq_len=CHUNK, verify=False)
    vocab_shaped, weight_bytes, _model = _weights(r.onnx_path)
    assert len(vocab_shaped) == 2  # the embedding and the head, each once
    assert abs(weight_bytes - param_bytes) <= 0.03 * param_bytes, (weight_bytes, param_bytes)
