"""Prompt logprobs (issues 41, 52): ``/v1/completions`` with ``echo`` + ``logprobs`` scores every prompt token,
as lm-evaluation-harness's loglikelihood requests need, on any export: a speculative-decoding graph's rows of logits
(``--speculative-tokens K``: a ``num_logits_to_keep`` input, one run per chunk), or a plain graph's last row fed
position by position (one run per token). Through the official ``openai`` client, on both exports: each prompt
token's logprob equal to transformers' ``log_softmax`` on the same weights (the prompt longer than a prefill chunk,
so chunk boundaries are crossed), the first one null (as vLLM), the top alternatives the reference's best;
``max_tokens: 0``; streamed equal to not streamed; the one-line refusals for ``n > 1`` and for ``max_tokens: 0``
without ``echo``; :func:`~qeff_kv.runtime.decoding.prompt_rows.prefill_rows` leaves the cache a plain prefill
leaves, writes nothing when refused, and gives the same values on both graphs (a property test).
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from qeff_kv.errors import RuntimeInputError  # noqa: E402
from serve_helpers import LiveServer, chat_export  # noqa: E402

PROMPT_IDS = [int(t) for t in np.random.RandomState(41).randint(3, 250, 19)]   # 19 tokens: chunks of 8, 8, 3


def _text(srv, token: int) -> str:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(srv.folder / "tokenizer.json")).decode([token], skip_special_tokens=False)


def _serve(folder):
    from qeff_kv.serve.config import ServeConfig
    from qeff_kv.serve.server import build_engine, check_config, text_facts

    config = ServeConfig(export_dir=str(folder))
    check_config(config)
    srv = LiveServer(build_engine(config), text_facts(config), max_n=2)
    srv.folder = folder
    return srv


@pytest.fixture(scope="module")
def spec_export(tmp_path_factory):
    from qeff_kv.export import export_model

    return export_model(None, tmp_path_factory.mktemp("plp") / "spec", ctx_len=64, prefill_seq_len=8, verify=False,
                        kv_cache_prefix="VLLM", continuous_batching=True, full_batch_size=3, speculative_tokens=4)


@pytest.fixture(scope="module")
def served(spec_export, tmp_path_factory):
    srv = _serve(chat_export(spec_export.out_dir, tmp_path_factory.mktemp("plp-served") / "tiny-spec"))
    srv.client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def plain(own_cb_graph, tmp_path_factory):
    """The export a user serves: the last row's logits only (no --speculative-tokens)."""
    srv = _serve(chat_export(own_cb_graph, tmp_path_factory.mktemp("plp-plain") / "plain"))
    srv.client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reference(own_graphs):
    """transformers' log_softmax of every position, on the bundled weights: ``[n, vocab]`` (row i scores token
    i + 1)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(own_graphs.llama_hf, attn_implementation="eager")
    with torch.no_grad():
        logits = model.eval()(torch.tensor([PROMPT_IDS])).logits[0].double()
    return torch.log_softmax(logits, -1).numpy()


@pytest.mark.parametrize("export", ["served", "plain"])
def test_prompt_logprobs_equal_transformers(export, request, reference):
    served = request.getfixturevalue(export)
    out = served.client.completions.create(model=served.folder.name, prompt=PROMPT_IDS, echo=True, logprobs=2,
                                           max_tokens=1, temperature=0)
    lp = out.choices[0].logprobs
    n = len(PROMPT_IDS)
    assert len(lp.token_logprobs) == n + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = [reference[i - 1, PROMPT_IDS[i]] for i in range(1, n)]
    np.testing.assert_allclose(lp.token_logprobs[1:n], want, atol=2e-4)
    for i in range(1, n):   # the two alternatives: the reference's two best (keyed by text, as OpenAI's shape is)
        best = np.argsort(reference[i - 1])[::-1][:2]
        want_top = {_text(served, int(t)): reference[i - 1, t] for t in best}
        assert lp.top_logprobs[i].keys() == want_top.keys()
        np.testing.assert_allclose([lp.top_logprobs[i][k] for k in want_top], list(want_top.values()), atol=2e-4)
    # the generated token is the reference's greedy pick after the whole prompt, scored after it
    assert lp.token_logprobs[n] is not None
    assert out.usage.prompt_tokens == n and out.usage.completion_tokens == 1
    assert lp.tokens[:n] == [_text(served, t) for t in PROMPT_IDS]


def test_max_tokens_0_scores_the_prompt_only(served, reference):
    out = served.client.completions.create(model="tiny-spec", prompt=PROMPT_IDS, echo=True, logprobs=0,
                                           max_tokens=0)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(PROMPT_IDS) and out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 0
    np.testing.assert_allclose(lp.token_logprobs[1:], [reference[i - 1, PROMPT_IDS[i]]
                                                       for i in range(1, len(PROMPT_IDS))], atol=2e-4)
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])


def test_echo_alone_with_max_tokens_0(served):
    out = served.client.completions.create(model="tiny-spec", prompt="hello there", echo=True, max_tokens=0)
    assert out.choices[0].text == "hello there" and out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 0


def test_streamed_equals_not_streamed(served):
    kw = dict(model="tiny-spec", prompt=PROMPT_IDS, echo=True, logprobs=1, max_tokens=3, temperature=0)
    whole = served.client.completions.create(**kw).choices[0].logprobs
    tokens, values = [], []
    for chunk in served.client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                values += c.logprobs.token_logprobs
    assert tokens == whole.tokens and values == whole.token_logprobs


def test_refusals(served):
    c = served.client
    with pytest.raises(openai.BadRequestError, match=r"prompt logprobs go with one choice \(n = 1\)"):
        c.completions.create(model="tiny-spec", prompt=PROMPT_IDS, echo=True, logprobs=1, max_tokens=1, n=2)
    with pytest.raises(openai.BadRequestError, match=r"max_tokens 0 goes with echo"):
        c.completions.create(model="tiny-spec", prompt=PROMPT_IDS, max_tokens=0)


def test_a_plain_export_scores_as_the_speculative_one(served, plain):
    """Issue 52: the export a user serves scores prompts (it answered 400 "export it with --speculative-tokens K");
    the values and the generated token are those of the all-rows graph, streamed as not."""
    kw = dict(prompt=PROMPT_IDS, echo=True, logprobs=3, max_tokens=2, temperature=0)
    rows = served.client.completions.create(model="tiny-spec", **kw).choices[0]
    one_by_one = plain.client.completions.create(model="plain", **kw).choices[0]
    assert one_by_one.logprobs.tokens == rows.logprobs.tokens and one_by_one.text == rows.text
    assert one_by_one.logprobs.token_logprobs[0] is None
    np.testing.assert_allclose(one_by_one.logprobs.token_logprobs[1:], rows.logprobs.token_logprobs[1:], atol=2e-4)
    for a, b in zip(one_by_one.logprobs.top_logprobs[1:], rows.logprobs.top_logprobs[1:]):
        assert a.keys() == b.keys()
    streamed = []
    for chunk in plain.client.completions.create(model="plain", stream=True, **kw):
        streamed += [v for c in chunk.choices if c.logprobs is not None for v in c.logprobs.token_logprobs]
    assert streamed == one_by_one.logprobs.token_logprobs
    # logprobs without echo, and echo without logprobs, still work there
    assert plain.client.completions.create(model="plain", prompt="ab", logprobs=1, max_tokens=1).choices[0].logprobs
    assert plain.client.completions.create(model="plain", prompt="ab", echo=True, max_tokens=1).choices[0].text[:2] \
        == "ab"


def test_prefill_rows_leaves_the_cache_of_a_plain_prefill(spec_export):
    from qeff_kv.runtime import open_session
    from qeff_kv.runtime.decoding.prompt_rows import prefill_rows

    s = open_session(spec_export.out_dir)
    a, b = s.add_sequence(), s.add_sequence()
    rows = prefill_rows(s, a, PROMPT_IDS)
    last = s.prefill(b, PROMPT_IDS)
    assert rows.shape == (len(PROMPT_IDS), s.vocab_size)
    np.testing.assert_allclose(rows[-1], last, atol=1e-5)
    np.testing.assert_allclose(s.decode({a: 5})[a], s.decode({b: 5})[b], atol=1e-5)


def test_prefill_rows_on_a_lock_step_session(tmp_path, reference):
    """A graph without batch_index serving several sequences (lock step): the prompt's row of the buffers."""
    from qeff_kv.export import export_model
    from qeff_kv.runtime import open_session
    from qeff_kv.runtime.decoding.prompt_rows import log_softmax, prefill_rows

    out = export_model(None, tmp_path / "spec1", ctx_len=64, prefill_seq_len=8, verify=False, speculative_tokens=2)
    s = open_session(out.out_dir, max_sequences=2)
    assert s.lockstep
    other, seq = s.add_sequence(), s.add_sequence()
    s.prefill(other, PROMPT_IDS[:5])
    rows = prefill_rows(s, seq, PROMPT_IDS)
    np.testing.assert_allclose(log_softmax(rows), reference, atol=2e-4)
    # the other sequence's row is intact: its next step scores as transformers does on its 6 tokens
    np.testing.assert_allclose(log_softmax(s.decode({other: PROMPT_IDS[5]})[other][None])[0], reference[5],
                               atol=2e-4)


def test_prefill_rows_on_a_plain_graph_feeds_position_by_position(own_cb_graph, reference):
    """A graph returning its last row only: one graph run per position, the values transformers' (top ids too),
    and the cache a plain prefill leaves (the next steps equal)."""
    from qeff_kv.runtime import open_session
    from qeff_kv.runtime.decoding.prompt_rows import chunked, log_softmax, prefill_rows

    s = open_session(own_cb_graph)
    assert not chunked(s)
    a, b = s.add_sequence(), s.add_sequence()
    runs = s.timings.prefill_runs
    rows = prefill_rows(s, a, PROMPT_IDS)
    assert s.timings.prefill_runs - runs == len(PROMPT_IDS) and rows.shape == (len(PROMPT_IDS), s.vocab_size)
    np.testing.assert_allclose(log_softmax(rows), reference, atol=2e-4)
    assert list(np.argmax(rows, axis=-1)) == list(np.argmax(reference, axis=-1))
    last = s.prefill(b, PROMPT_IDS)
    np.testing.assert_allclose(rows[-1], last, atol=1e-5)
    assert s.cache.get(a).length == s.cache.get(b).length == len(PROMPT_IDS)
    np.testing.assert_allclose(s.decode({a: 5})[a], s.decode({b: 5})[b], atol=1e-5)


def test_prefill_rows_writes_nothing_when_refused(own_cb_graph):
    """A token outside the vocabulary late in the prompt: refused in one line before the first position is fed."""
    from qeff_kv.runtime import open_session
    from qeff_kv.runtime.decoding.prompt_rows import prefill_rows

    s = open_session(own_cb_graph)
    seq = s.add_sequence()
    runs = s.timings.prefill_runs
    with pytest.raises(RuntimeInputError) as err:
        prefill_rows(s, seq, PROMPT_IDS[:5] + [s.vocab_size])
    assert "\n" not in str(err.value) and s.cache.get(seq).length == 0 and s.timings.prefill_runs == runs


@pytest.fixture(scope="module")
def both_sessions(spec_export, own_cb_graph):
    from qeff_kv.runtime import open_session

    return open_session(spec_export.out_dir), open_session(own_cb_graph)


@given(st.lists(st.integers(0, 255), min_size=1, max_size=30), st.integers(0, 20))
@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
def test_chunked_and_position_by_position_scoring_agree(both_sessions, prompt, cached):
    """Property: on any prompt, after any already-cached prefix, the all-rows graph's chunks and the plain graph's
    positions give the same logits (to float rounding) and the same best tokens, and leave the same length."""
    from qeff_kv.runtime.decoding.prompt_rows import chunked, prefill_rows

    spec, plain = both_sessions
    assert chunked(spec) and not chunked(plain)
    outs = []
    for s in (spec, plain):
        seq = s.add_sequence()
        try:
            if cached:
                s.prefill(seq, [7 + i % 50 for i in range(cached)])
            outs.append(prefill_rows(s, seq, prompt))
            assert s.cache.get(seq).length == cached + len(prompt)
        finally:
            s.remove_sequence(seq)
    np.testing.assert_allclose(outs[0], outs[1], atol=2e-4)
    ranked = np.sort(outs[0], -1)
    clear = ranked[:, -1] - ranked[:, -2] > 1e-3   # a near tie may rank either first
    assert (np.argmax(outs[0], -1) == np.argmax(outs[1], -1))[clear].all()
