"""No graph depends on unwritten cache slots (issue 49): a runtime that does not zero its buffers gets the same tokens.

Every KV buffer of a session is filled with NaN before the first prefill (a runtime that allocates without
zeroing, or one that reuses a buffer); greedy tokens must equal those of the same session kind with zeroed
buffers, and transformers' tokens. Before the portable and onnxruntime targets masked with ``Where`` they added a
large negative bias to the scores, which cannot remove a NaN (``NaN + bias = NaN``, and a softmax weight of 0 times a
NaN value row is NaN): the portable target answered NaN logits (token 0) from the first step, the onnxruntime target
as soon as two sequences of different lengths decoded together. The fused target (GroupQueryAttention) reads only
the filled slots and is checked as it is.

Cases: the bundled Llama (portable, onnxruntime with continuous batching, onnxruntime-fused; two prompts of
different lengths decoding together), the sliding-window families (ring buffers that hold fewer positions than
their slots at the start; Gemma3 mixes ring and full-length layers), and the MLA latent cache (portable, and
onnxruntime with continuous batching).
"""

from __future__ import annotations

import numpy as np
import pytest

from suite import PROMPT_A, PROMPT_B, requires_torch
from families import NEW, PROMPTS, SW

pytestmark = [requires_torch]

#: a second prompt shorter than PROMPT_A: the rows of one step hold different lengths
SHORT = PROMPT_B[:5]
#: two windows of SW less two: the first chunks meet ring slots still unwritten, the ring wraps within the prompt,
#: and the window still reaches keys those chunks computed when decoding starts (a longer prompt lets a 2-layer
#: model's NaN wash out of the window before the last chunk)
LONG = [int(t) for t in np.random.default_rng(11).integers(3, 128, size=2 * SW - 2)]


def _generate(out_dir, prompts, *, nan: bool, **session_args) -> list[list[int]]:
    """Greedy tokens of ``prompts`` decoding together in a fresh session; ``nan``: every KV buffer (and spare)
    filled with NaN before the first prefill."""
    from qeff_kv.runtime import Session

    sess = Session(out_dir, **session_args)
    if nan:
        memory = sess.cache.positional
        buffers = list(memory.arrays.values()) + list(memory.spare_arrays.values())
        assert buffers and all(np.issubdtype(a.dtype, np.floating) for a in buffers)
        for a in buffers:
            a[...] = np.nan
        assert all(np.isnan(a).all() for a in memory.arrays.values())
    return [g.tokens for g in sess.generate(prompts, max_tokens=NEW, stop_tokens=[])]


def _check(out_dir, prompts, want, **session_args) -> None:
    zeroed = _generate(out_dir, prompts, nan=False, **session_args)
    assert zeroed == want
    assert _generate(out_dir, prompts, nan=True, **session_args) == zeroed


@pytest.fixture(scope="module")
def llama_refs(own_graphs):
    from hf_models import hf_greedy

    return [own_graphs.llama_a[:NEW], hf_greedy(own_graphs.llama_hf, SHORT, NEW)]


@pytest.mark.parametrize("graph, session_args", [
    ("qeff_llama_default.onnx", dict(max_sequences=2)),           # portable, lock-step rows
    ("own_llama_ort_cb_vllm.onnx", {}),                           # onnxruntime, continuous batching
    ("own_llama_fused_vllm.onnx", dict(max_sequences=2)),         # onnxruntime-fused, lock-step rows
], ids=["portable", "onnxruntime-cb", "fused"])
def test_nan_in_unwritten_slots_changes_no_token(graph, session_args, own_graphs, llama_refs):
    _check(own_graphs.export(graph).out_dir, [PROMPT_A, SHORT], llama_refs, **session_args)


@pytest.mark.parametrize("name", ["gemma3_sw", "mistral_sw"])
@pytest.mark.parametrize("target", ["portable", "onnxruntime", "onnxruntime-fused"])
def test_sliding_window_rings(name, target, family_exports, family_models):
    from hf_models import hf_greedy

    result = family_exports(name, target)
    _check(result.out_dir, [LONG], [hf_greedy(family_models(name), LONG, NEW)])


@pytest.mark.parametrize("which", ["portable", "cb"])
def test_mla_latent_cache(which, mla_latent_exports, mla_latent_dir):
    from hf_models import hf_greedy

    prompts = [LONG, PROMPTS[1]]                                 # vocabulary 128
    want = [hf_greedy(mla_latent_dir, p, NEW) for p in prompts]
    args = dict(max_sequences=2) if which == "portable" else {}
    _check(mla_latent_exports[which].out_dir, prompts, want, **args)
