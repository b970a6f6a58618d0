"""The one token budget and stop rule (qeff_kv/runtime/decoding/stopping.py, issue 38): the budget from the context's
room against what was asked, the stop rule's order (a stop token before the budget, eos as a stop token), a
speculative run cut at the budget and at a stop token (:func:`accept` with :func:`draft_limit`), and the engine's
budget for a request that asks for nothing (``max_tokens=None``: what the context leaves, the tokens of
``generate(on_capacity="stop")``)."""

from __future__ import annotations

import numpy as np
import pytest

from qeff_kv.runtime import SamplingParams, Session
from qeff_kv.runtime.decoding.speculative import accept
from qeff_kv.runtime.decoding.stopping import (CAPACITY, LENGTH, STOP, check_stop, context_room, draft_limit,
                                               token_budget)
from qeff_kv.serve.engine.engine import Finished, GenerationRequest, TokenOut
from qeff_kv.serve.engine.scheduler import Scheduler

GREEDY = SamplingParams().resolved()


def test_context_room_counts_the_last_token_as_never_fed():
    # 16 positions, a 10-token prompt: the first new token comes from the prompt's logits, each later one needs
    # the one before fed: 10 + n - 1 <= 16
    assert context_room(16, 10) == 7
    assert context_room(16, 16) == 1        # a prompt filling the context still gives one token
    assert context_room(16, 17) == 0


@pytest.mark.parametrize("asked, room, least, want", [
    (5, 7, 0, 5),        # the ask fits
    (9, 7, 0, 7),        # the room cuts it
    (None, 7, 0, 7),     # nothing asked: what the context leaves
    (0, 7, 0, 0),        # max_tokens 0 (echo with prompt logprobs): nothing generated
    (0, 7, 1, 1),        # a handed-off sequence shows its pending token whatever it asked
    (4, -2, 0, 0),       # never below 0
])
def test_token_budget(asked, room, least, want):
    assert token_budget(asked, room, least) == want


def test_stop_token_ends_before_the_budget_is_read():
    eos = frozenset({2})
    assert check_stop(7, 1, 4, eos) is None
    assert check_stop(2, 1, 4, eos) == STOP                 # eos: a stop token like any other
    assert check_stop(2, 4, 4, eos) == STOP                 # the last budgeted token is eos: "stop", not "length"
    assert check_stop(7, 4, 4, eos) == LENGTH
    assert check_stop(2, 4, 4, frozenset()) == LENGTH      # ignore_eos: no stop tokens
    assert check_stop(None, 0, 0, eos) == LENGTH            # a budget of 0 ends it before any token


def test_capacity_is_a_budget_cut_below_what_was_asked():
    assert check_stop(7, 3, 3, (), asked=8) == CAPACITY
    assert check_stop(7, 8, 8, (), asked=8) == LENGTH
    assert check_stop(7, 3, 3, ()) == LENGTH                # the server (no ask given) says "length"
    assert check_stop(2, 3, 3, {2}, asked=8) == STOP


def _rows(picks, vocab=16):
    """Logits whose greedy pick at row i is ``picks[i]``."""
    rows = np.zeros((len(picks), vocab), dtype=np.float32)
    rows[np.arange(len(picks)), picks] = 5.0
    return rows


def test_budget_reached_inside_a_speculative_run():
    """Three tokens left: at most two drafts, so an all-accepted run gives exactly three tokens and the rule ends
    it there (the run never crosses the budget)."""
    budget, generated = 10, 7
    k = draft_limit(budget - generated)
    assert k == 2
    drafts = [4, 5, 6, 8][:k]
    run = accept(_rows([4, 5, 9]), drafts, GREEDY, base=0)
    assert run == [4, 5, 9]
    ends = [check_stop(t, generated + i + 1, budget, ()) for i, t in enumerate(run)]
    assert ends == [None, None, LENGTH]


def test_stop_token_ends_a_speculative_run_at_once():
    run = accept(_rows([4, 2, 6, 7]), [4, 2, 6], GREEDY, base=0, stops={2})
    assert run == [4, 2]                                    # the accepted draft after the stop token is dropped
    assert [check_stop(t, i + 1, 10, {2}) for i, t in enumerate(run)] == [None, STOP]


def test_engine_budget_without_an_ask_is_what_the_context_leaves(own_cb_graph):
    """``max_tokens=None``: the request runs to the end of the context, and its tokens are those of
    ``generate(on_capacity="stop")`` (the same budget, decided the same way)."""
    session = Session(own_cb_graph)
    prompt = [5, 6, 7] * 8
    sched = Scheduler(session, reuse_prompts=False)
    try:
        evs = list(sched.submit(GenerationRequest("0", tuple(prompt), None, SamplingParams(), frozenset()))
                   .iter_sync(timeout=120))
    finally:
        sched.close()
    ref = Session(own_cb_graph, max_sequences=1)
    [g] = ref.generate([prompt], max_new_tokens=ref.ctx_len, stop_tokens=[], on_capacity="stop")
    tokens = [e.token for e in evs if isinstance(e, TokenOut)]
    assert len(tokens) == context_room(session.ctx_len, len(prompt)) == len(g.tokens)
    assert tokens == g.tokens and g.finish_reason == CAPACITY
    assert isinstance(evs[-1], Finished) and evs[-1].finish_reason == LENGTH
