"""Sampling: greedy, temperature, top-k, top-p, seeds (a function of seed and position)."""

from __future__ import annotations

import numpy as np
import pytest

from qeff_kv.errors import RuntimeInputError
from qeff_kv.runtime import Session
from qeff_kv.runtime.sampling import SamplingParams, probabilities, sample

from conftest import PROMPT_A as A


def test_greedy_is_first_argmax():
    logits = np.array([0.1, 3.0, -1.0, 3.0])
    assert sample(logits, SamplingParams(), 0) == 1


def test_filters():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    p = probabilities(logits, SamplingParams(temperature=1.0, top_k=2, seed=0))
    assert np.allclose(p, [0.625, 0.375, 0, 0])
    p = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.75, seed=0))
    assert np.allclose(p, [0.625, 0.375, 0, 0])  # 0.5 alone is short of 0.75; 0.5 + 0.3 reaches it
    p = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.85, seed=0))
    assert np.count_nonzero(p) == 3
    p = probabilities(logits, SamplingParams(temperature=1.0, seed=0))
    assert np.allclose(p, [0.5, 0.3, 0.15, 0.05])
    hot = probabilities(logits, SamplingParams(temperature=100.0, seed=0))
    assert hot.max() - hot.min() < 0.02


def test_sampling_frequencies_and_determinism():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    params = SamplingParams(temperature=1.0, top_k=3, seed=7)
    draws = [sample(logits, params, pos) for pos in range(4000)]
    freq = np.bincount(draws, minlength=4) / len(draws)
    assert freq[3] == 0
    assert np.allclose(freq[:3], np.array([0.5, 0.3, 0.15]) / 0.95, atol=0.03)
    assert draws == [sample(logits, params, pos) for pos in range(4000)]
    other = [sample(logits, SamplingParams(temperature=1.0, top_k=3, seed=8), pos) for pos in range(200)]
    assert other != draws[:200]


@pytest.mark.parametrize("kw, msg", [
    ({"temperature": -1.0}, "temperature"), ({"top_k": -2}, "top_k"), ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"), ({"seed": -3}, "seed"),
])
def test_bad_params(kw, msg):
    with pytest.raises(RuntimeInputError, match=msg):
        SamplingParams(**kw)


def test_nan_logits_refused():
    with pytest.raises(RuntimeInputError, match="NaN"):
        sample(np.array([np.nan, 1.0]), SamplingParams(), 0)


def test_session_sampling(graphs):
    s = Session(graphs / "qeff_llama_cb_vllm.onnx", ctx_len=32, prefill_seq_len=8, max_sequences=2)
    topk1 = s.generate([A], max_new_tokens=8, sampling=SamplingParams(temperature=0.7, top_k=1, seed=1),
                       stop_tokens=[])[0]
    assert topk1.tokens == graphs.llama_a  # top-k 1 is greedy whatever the temperature
    s.remove_sequence(topk1.sequence)
    p = SamplingParams(temperature=1.5, top_p=0.95, seed=123)
    a, b = s.generate([A, A], max_new_tokens=12, sampling=p, stop_tokens=[])
    assert a.tokens == b.tokens  # same seed, same positions -> same tokens, even in other slots
    assert a.tokens != graphs.llama_a
    s.remove_sequence(a.sequence)
    s.remove_sequence(b.sequence)
    c = s.generate([A], max_new_tokens=12, sampling=SamplingParams(temperature=1.5, top_p=0.95, seed=124),
                   stop_tokens=[])[0]
    assert c.tokens != a.tokens
