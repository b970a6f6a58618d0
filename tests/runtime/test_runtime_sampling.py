"""Sampling: greedy, temperature, top-k, top-p, seeds (a function of seed and position)."""

from __future__ import annotations

import numpy as np
import pytest

from qeff_kv.errors import RuntimeInputError
from qeff_kv.runtime import Session
from qeff_kv.runtime.decoding.sampling import SamplingParams, probabilities, sample

from suite import PROMPT_A as A


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


# ------------------------------------------------------------------------------------------ the logits pipeline
from qeff_kv.runtime.decoding.sampling import TokenPicker, log_softmax  # noqa: E402


def test_plain_picker_is_the_fast_path():
    rng = np.random.default_rng(0)
    for seed in range(20):
        logits = rng.normal(size=50).astype(np.float32)
        for params in (SamplingParams(), SamplingParams(temperature=0.9, top_k=10, top_p=0.9, seed=seed)):
            assert TokenPicker(params).pick(logits, seed).token == sample(logits, params, seed)


def test_denormal_temperature_is_greedy():
    logits = np.array([0.1, 3.0, -1.0, 2.9])
    assert SamplingParams(temperature=1e-310, seed=1).greedy
    assert sample(logits, SamplingParams(temperature=1e-310, seed=1), 5) == 1


def test_logit_bias_and_its_bounds():
    logits = np.array([0.0, 5.0, 4.0, 1.0])
    picker = TokenPicker(SamplingParams(logit_bias=((1, -100.0),)))
    assert picker.pick(logits, 0).token == 2
    assert TokenPicker(SamplingParams(logit_bias=((3, 10.0),))).pick(logits, 0).token == 3
    with pytest.raises(RuntimeInputError, match="logit_bias"):
        SamplingParams(logit_bias=((-1, 1.0),))
    with pytest.raises(RuntimeInputError, match="token history"):
        sample(logits, SamplingParams(logit_bias=((1, -100.0),)), 0)


def test_penalties_follow_their_rules():
    logits = np.array([2.0, -1.0, 1.0, 0.5])
    rep = TokenPicker(SamplingParams(repetition_penalty=2.0), prompt=[0, 1])
    assert np.allclose(rep.adjusted(logits), [1.0, -2.0, 1.0, 0.5])   # seen: positive /2, negative *2
    rep.accept(2)
    assert np.allclose(rep.adjusted(logits), [1.0, -2.0, 0.5, 0.5])
    pf = TokenPicker(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), prompt=[3])
    assert np.allclose(pf.adjusted(logits), logits)                   # the prompt does not count
    for t in (0, 0, 2):
        pf.accept(t)
    assert np.allclose(pf.adjusted(logits), [2.0 - 0.5 - 0.5, -1.0, 1.0 - 0.5 - 0.25, 0.5])


def test_min_p_keeps_tokens_near_the_most_likely():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    p = probabilities(logits, SamplingParams(temperature=1.0, min_p=0.5, seed=0))
    assert np.allclose(p, [0.625, 0.375, 0, 0])
    p = probabilities(logits, SamplingParams(temperature=1.0, min_p=0.1, seed=0))
    assert np.count_nonzero(p) == 4 and np.isclose(p.sum(), 1)


def test_logprobs_are_read_after_bias_before_temperature():
    logits = np.array([1.0, 2.0, 0.5, 2.0])
    pick = TokenPicker(SamplingParams(logit_bias=((2, 3.0),))).pick(logits, 0, top_logprobs=3)
    adjusted = np.array([1.0, 2.0, 3.5, 2.0])
    lp = adjusted - np.log(np.exp(adjusted).sum())
    assert pick.token == 2 and np.isclose(pick.logprob, lp[2])
    assert [t for t, _ in pick.top] == [2, 1, 3]                      # ties: lower id first
    hot = TokenPicker(SamplingParams(temperature=1.7, seed=4)).pick(logits, 9, top_logprobs=0)
    assert np.isclose(hot.logprob, log_softmax(logits)[hot.token]) and hot.top == ()
    assert hot.token == sample(logits, SamplingParams(temperature=1.7, seed=4), 9)


def test_allowed_mask_is_one_more_step():
    logits = np.array([1.0, 5.0, 4.0, 3.0])
    allowed = np.array([True, False, False, True])
    picker = TokenPicker(SamplingParams(temperature=1.0, seed=3))
    draws = {picker.pick(logits, pos, allowed=allowed).token for pos in range(200)}
    assert draws == {0, 3}
    assert TokenPicker(SamplingParams()).pick(logits, 0, allowed=allowed).token == 3
    with pytest.raises(RuntimeInputError, match="every token is excluded"):
        TokenPicker(SamplingParams()).pick(logits, 0, allowed=np.zeros(4, dtype=bool))


def test_session_generate_with_penalties_equals_a_step_by_step_picker(graphs):
    s = Session(graphs / "qeff_llama_cb_vllm.onnx", ctx_len=32, prefill_seq_len=8, max_sequences=1)
    params = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.7, logit_bias=((graphs.llama_a[0], -100.0),))
    [g] = s.generate([A], max_new_tokens=10, sampling=params, stop_tokens=[])
    s.remove_sequence(g.sequence)
    assert g.tokens[0] != graphs.llama_a[0] and g.tokens != graphs.llama_a
    picker, seq = TokenPicker(params, A), s.cache.create()
    tok, out = None, []
    logits = s.prefill(seq, A)
    for _ in range(10):
        tok = picker.pick(logits, seq.length).token
        picker.accept(tok)
        out.append(tok)
        logits = s.decode({seq: tok})[seq]
    assert out == g.tokens


def test_top_p_without_a_full_sort_keeps_exactly_the_full_sorts_prefix():
    """probabilities() sorts only the likeliest candidates: the same distribution as sorting the whole vocabulary
    (ties included), bit for bit."""
    rng = np.random.default_rng(1)
    for trial in range(150):
        x = (rng.normal(size=int(rng.integers(2, 3000))) * rng.choice([0.1, 1, 5, 30])).astype(np.float32)
        if trial % 3 == 0:
            x = np.round(x)   # many ties
        top_p = float(rng.choice([0.1, 0.5, 0.9, 0.99, 0.999999]))
        x64 = x.astype(np.float64)
        q = np.exp(x64 - x64.max())
        q /= q.sum()
        order = np.argsort(-q, kind="stable")
        keep = order[:int(np.searchsorted(np.cumsum(q[order]), top_p, side="left")) + 1]
        want = np.where(np.isin(np.arange(q.size), keep), q, 0.0)
        want /= want.sum()
        assert np.array_equal(probabilities(x, SamplingParams(temperature=1.0, top_p=top_p, seed=0)), want), trial
