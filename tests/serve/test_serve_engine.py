"""The serving engine without HTTP: the Scheduler's batching, chunked prefill between decode steps, prompt reuse
(truncate in place, copy into a free slot), the hand-off admission (a KVState), lock step on the fused target;
and the frontend's text pieces (incremental detokenizer, stop strings)."""

from __future__ import annotations

import random
import threading
import time

import pytest

from qeff_kv.errors import QueueFullError, RuntimeInputError
from qeff_kv.runtime import SamplingParams, Session
from qeff_kv.serve.engine.engine import Finished, GenerationRequest, TokenOut
from qeff_kv.serve.engine.scheduler import Scheduler
from qeff_kv.serve.http.text import Detokenizer, StopMatcher


def _req(i, prompt, n, **kw):
    return GenerationRequest(str(i), tuple(prompt), n, kw.pop("sampling", SamplingParams()),
                             kw.pop("stops", frozenset()), **kw)


def _run(handle, timeout=60):
    evs = list(handle.iter_sync(timeout=timeout))
    assert isinstance(evs[-1], Finished) and all(isinstance(e, TokenOut) for e in evs[:-1])
    return [e.token for e in evs[:-1]], evs[-1]


def _alone(path, prompt, n, **kw):
    s = Session(path, max_sequences=1)
    [g] = s.generate([list(prompt)], max_new_tokens=n, stop_tokens=[], **kw)
    return g.tokens


class Spy:
    """Records the session calls the engine makes (``("prefill", n_tokens)`` / ``("decode", n_sequences)``)."""

    def __init__(self, session):
        self.calls = []
        self._prefill, self._decode = session.prefill, session.decode
        session.prefill, session.decode = self.prefill, self.decode

    def prefill(self, seq, tokens, *a, **kw):
        self.calls.append(("prefill", len(tokens), seq.id))
        return self._prefill(seq, tokens, *a, **kw)

    def decode(self, feeds):
        self.calls.append(("decode", len(feeds), None))
        time.sleep(0.002)   # the short stream keeps running while the test thread submits the long prompt
        return self._decode(feeds)


def _until_decoding(spy, timeout: float = 30) -> None:
    """Wait until the engine has made a decode step (the stream submitted first is running)."""
    deadline = time.monotonic() + timeout
    while not any(c[0] == "decode" for c in spy.calls) and time.monotonic() < deadline:
        time.sleep(0.001)


def test_running_streams_advance_between_prefill_chunks(own_cb_graph):
    session = Session(own_cb_graph)
    spy = Spy(session)
    sched = Scheduler(session, reuse_prompts=False, prefill_chunk=8)
    try:
        short = sched.submit(_req(0, [5, 6, 7], 50))
        _until_decoding(spy)
        long_prompt = [random.Random(1).randrange(3, 256) for _ in range(40)]
        long = sched.submit(_req(1, long_prompt, 4))
        a, fa = _run(short)
        b, fb = _run(long)
    finally:
        sched.close()
    assert a == _alone(own_cb_graph, [5, 6, 7], 50) and fa.finish_reason == "length"
    assert b == _alone(own_cb_graph, long_prompt, 4)
    short_id = spy.calls[0][2]
    chunks = [i for i, c in enumerate(spy.calls) if c[0] == "prefill" and c[2] != short_id]
    assert len(chunks) == 5   # 40 tokens in chunks of 8, one per engine turn
    assert all(spy.calls[i][1] <= session.prefill_seq_len for i in chunks)
    # between two chunks of the long prompt, a decode step for the running stream
    for i, j in zip(chunks, chunks[1:]):
        assert any(c[0] == "decode" for c in spy.calls[i + 1:j]), spy.calls


def test_a_prompt_scored_position_by_position_lets_running_streams_step(own_cb_graph):
    """Issue 52: prompt logprobs on a graph returning its last row only, one graph run per position: while a
    stream runs, a turn feeds the scored prompt budget / prefill length positions (16 / 8 = 2), then the stream
    steps; both give the tokens they give alone."""
    from qeff_kv.serve.engine.engine import PromptLogprobs

    session = Session(own_cb_graph)
    spy = Spy(session)
    sched = Scheduler(session, reuse_prompts=False, prefill_chunk=16)
    try:
        short = sched.submit(_req(0, [5, 6, 7], 60))
        _until_decoding(spy)
        prompt = [random.Random(2).randrange(3, 256) for _ in range(20)]
        scored = sched.submit(_req(1, prompt, 2, prompt_logprobs=1))
        events = list(scored.iter_sync(timeout=60))
        a, _ = _run(short)
    finally:
        sched.close()
    assert a == _alone(own_cb_graph, [5, 6, 7], 60)
    assert [e.token for e in events if isinstance(e, TokenOut)] == _alone(own_cb_graph, prompt, 2)
    assert sum(len(e.entries) for e in events if isinstance(e, PromptLogprobs)) == len(prompt)
    short_id = spy.calls[0][2]
    fed = [i for i, c in enumerate(spy.calls) if c[0] == "prefill" and c[2] != short_id]
    assert len(fed) == len(prompt) and all(spy.calls[i][1] == 1 for i in fed)   # one position per run
    groups, run = [], 0   # the scored prompt's runs between two decode steps
    for c in spy.calls[fed[0]:fed[-1] + 1]:
        if c[0] == "decode":
            groups, run = groups + [run], 0
        elif c[2] != short_id:
            run += 1
    assert groups + [run] == [2] * 10, spy.calls


def test_prompt_logprobs_with_images_are_refused_before_anything_runs(own_cb_graph):
    """The one prompt scoring cannot take (issue 52): one with images, whose image rows are fed in one call."""
    session = Session(own_cb_graph)
    sched = Scheduler(session, reuse_prompts=False)
    try:
        with pytest.raises(RuntimeInputError, match=r"^prompt logprobs are not computed for a prompt with images$"):
            sched.submit(_req(0, [5, 6, 7], 1, prompt_logprobs=1, images=object()))
        assert session.timings.prefill_runs == 0
    finally:
        sched.close()


def test_a_turn_feeds_its_budget_to_several_prompts_in_whole_prefill_lengths(own_cb_graph):
    """A turn's prompt tokens go to the oldest prefilling request and what is left to the next: two short prompts
    finish in one turn (both rows decode from the next step on); a prompt cut by the budget is cut at whole
    prefill lengths (8 here), so its graph runs are generate's. The default budget is 512 tokens (whole prefill
    lengths). Every request's tokens equal the prompt's alone."""
    session = Session(own_cb_graph)
    assert session.prefill_seq_len == 8
    assert Scheduler(session).prefill_chunk == 512 and Scheduler(session, prefill_chunk="auto").prefill_chunk == 8
    spy = Spy(session)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (5, 6, 30)]
    sched = Scheduler(session, prefill_chunk=20, reuse_prompts=False)
    hold = threading.Event()
    try:
        sched.run_on_engine(("call", lambda _: hold.wait(30)))   # the engine waits until all three are queued
        handles = [sched.submit(_req(i, p, 4)) for i, p in enumerate(prompts)]
        hold.set()
        got = [_run(h)[0] for h in handles]
    finally:
        sched.close()
    assert got == [_alone(own_cb_graph, p, 4) for p in prompts]
    calls = [c[:2] for c in spy.calls]
    # turn 1: 5 + 6 + 8 (9 left: one whole prefill length), then one decode step of the two finished prompts
    assert calls[:4] == [("prefill", 5), ("prefill", 6), ("prefill", 8), ("decode", 2)], calls
    assert [n for kind, n in calls if kind == "prefill"] == [5, 6, 8, 16, 6], calls   # turns 2 and 3: 16, then 6


def test_prefill_chunk_smaller_than_the_prefill_length(own_cb_graph):
    session = Session(own_cb_graph)
    spy = Spy(session)
    sched = Scheduler(session, prefill_chunk=3)
    prompt = [random.Random(2).randrange(3, 256) for _ in range(17)]
    try:
        toks, _ = _run(sched.submit(_req(0, prompt, 5)))
    finally:
        sched.close()
    assert [c[1] for c in spy.calls if c[0] == "prefill"] == [3, 3, 3, 3, 3, 2]
    assert toks == _alone(own_cb_graph, prompt, 5)
    with pytest.raises(RuntimeInputError, match="prefill_chunk must be a positive int or 'auto'"):
        Scheduler(session, prefill_chunk=0)


def test_auto_prefill_chunk_follows_the_decode_step(own_cb_graph):
    """``prefill_chunk="auto"``: while a stream runs, a turn's chunk costs about one decode step (here prefill is made
    at least 5 ms a token and decode 2 ms more a step, so chunks well below the prefill length of 8); nothing changes
    in the tokens."""
    session = Session(own_cb_graph)
    spy = Spy(session)   # decode: +2 ms
    real_prefill = spy._prefill

    def slow_prefill(seq, tokens, *a, **kw):
        time.sleep(0.005 * len(tokens))
        return real_prefill(seq, tokens, *a, **kw)

    spy._prefill = slow_prefill
    sched = Scheduler(session, prefill_chunk="auto", reuse_prompts=False)
    long_prompt = [random.Random(4).randrange(3, 256) for _ in range(30)]
    try:
        short = sched.submit(_req(0, [5, 6, 7], 50))
        deadline = time.monotonic() + 30
        while sum(c[0] == "decode" for c in spy.calls) < 3 and time.monotonic() < deadline:
            time.sleep(0.001)
        long = sched.submit(_req(1, long_prompt, 4))
        a, _ = _run(short)
        b, _ = _run(long)
    finally:
        sched.close()
    short_id = spy.calls[0][2]
    sizes = [c[1] for c in spy.calls if c[0] == "prefill" and c[2] != short_id]
    assert sum(sizes) == 30 and max(sizes) <= session.prefill_seq_len
    assert max(sizes[:4]) < session.prefill_seq_len, sizes    # while the short stream runs
    assert a == _alone(own_cb_graph, [5, 6, 7], 50) and b == _alone(own_cb_graph, long_prompt, 4)
    with pytest.raises(RuntimeInputError, match="positive int or 'auto'"):
        Scheduler(session, prefill_chunk="fast")


def test_queue_bound_and_bad_requests(own_cb_graph):
    sched = Scheduler(Session(own_cb_graph), max_queue=0)
    try:   # max_queue 0: the free slots still take requests (issue 31); one more than they hold is refused
        held = [sched.submit(_req(i, [5], 50)) for i in range(sched.max_sequences)]
        with pytest.raises(QueueFullError, match="queue is full"):
            sched.submit(_req(9, [5], 1))
        for h in held:
            _run(h)
    finally:
        sched.close()
    sched = Scheduler(Session(own_cb_graph))
    try:
        with pytest.raises(RuntimeInputError, match="65 tokens; the context holds 64"):
            sched.submit(_req(0, [5] * 65, 1))
        with pytest.raises(RuntimeInputError, match="max_tokens must be an int >= 1"):
            sched.submit(_req(0, [5], 0))
        with pytest.raises(RuntimeInputError, match="outside the vocabulary"):
            sched.submit(_req(0, [5, 256], 1))
        # a request that would pass the context ends at it, with "length"
        toks, fin = _run(sched.submit(_req(1, [5] * 60, 50)))
        assert (len(toks), fin.finish_reason) == (5, "length")
    finally:
        sched.close()


def test_reuse_truncate_and_copy(own_cb_graph):
    session = Session(own_cb_graph)
    sched = Scheduler(session)
    base = [9, 8, 7, 6, 5, 4, 3, 20, 21, 22, 23, 24]
    try:
        t1, f1 = _run(sched.submit(_req(0, base, 6)))
        assert f1.cached_tokens == 0
        # shares 10 tokens with the kept sequence (which holds 17): copied into a free slot, the source stays
        other = base[:10] + [50, 51, 52]
        t2, f2 = _run(sched.submit(_req(1, other, 6)))
        assert f2.cached_tokens == 10 and t2 == _alone(own_cb_graph, other, 6)
        assert sched.stats()["sequences_cached"] == 2
        # the whole first prompt again: its kept sequence is reused (all but the last prompt token)
        t3, f3 = _run(sched.submit(_req(2, base, 6)))
        assert f3.cached_tokens == len(base) - 1 and t3 == t1
        assert sched.stats()["prompt_tokens_reused"] == 10 + len(base) - 1
    finally:
        sched.close()


def test_reuse_copies_from_a_running_sequence(own_cb_graph):
    session = Session(own_cb_graph)
    spy = Spy(session)   # 2 ms per decode step: the first request is still running when the second arrives
    sched = Scheduler(session)
    shared = [9, 8, 7, 6, 5, 4, 3, 20, 21, 22]
    try:
        first = sched.submit(_req(0, shared + [30], 40))
        deadline = time.monotonic() + 30
        while not any(c[0] == "decode" for c in spy.calls) and time.monotonic() < deadline:
            time.sleep(0.001)
        t2, f2 = _run(sched.submit(_req(1, shared + [31, 32], 6)))
        t1, f1 = _run(first)
    finally:
        sched.close()
    assert f2.cached_tokens == len(shared) and t2 == _alone(own_cb_graph, shared + [31, 32], 6)
    assert f1.completion_tokens == 40 and t1 == _alone(own_cb_graph, shared + [30], 40)


def _reuse_after_a_kept_prompt(graph, session):
    """A 10-token request, then one sharing its first 6 tokens, on a scheduler over ``session``; returns
    ``(tokens, Finished, stats)`` of the second and the 6-token-prefix prompt it ran."""
    sched = Scheduler(session)
    base = [9, 8, 7, 6, 5, 4, 3, 20, 21, 22]
    other = base[:6] + [60, 61]
    try:
        _run(sched.submit(_req(0, base, 4)))
        t, f = _run(sched.submit(_req(1, other, 5)))
        return t, f, sched.stats(), other
    finally:
        sched.close()


def test_reuse_without_copy_truncates_in_place(own_cb_graph, monkeypatch):
    session = Session(own_cb_graph)
    monkeypatch.setattr(session, "copy", None, raising=False)   # a session without the copy verb
    t, f, stats, other = _reuse_after_a_kept_prompt(own_cb_graph, session)
    assert f.cached_tokens == 6 and t == _alone(own_cb_graph, other, 5)
    assert stats["sequences_cached"] == 1   # the same slot, continued


def test_refused_rewind_prefills_from_scratch(own_cb_graph, monkeypatch):
    """A session that refuses the rewind (as ring-buffer graphs do past their window) loses the reuse, not the
    request."""
    session = Session(own_cb_graph)
    monkeypatch.setattr(session, "copy", None, raising=False)   # a session without the copy verb
    real = session.truncate

    def refusing(seq, n):
        if n:
            raise RuntimeInputError("cannot rewind: its sliding-window layers hold positions 4..9 only")
        real(seq, n)

    session.truncate = refusing
    t, f, _, other = _reuse_after_a_kept_prompt(own_cb_graph, session)
    assert f.cached_tokens == 0 and t == _alone(own_cb_graph, other, 5)


def test_state_admission_continues_a_handed_off_sequence(own_cb_graph):
    prompt = [5, 17, 42, 99, 130, 7]
    pre = Session(own_cb_graph, max_sequences=1)
    [g] = pre.generate([prompt], max_new_tokens=0)
    state = pre.export_state(g.sequence)
    sched = Scheduler(Session(own_cb_graph))
    try:
        toks, fin = _run(sched.submit(_req(0, prompt, 8, state=state)))
    finally:
        sched.close()
    assert toks == _alone(own_cb_graph, prompt, 8)
    assert (fin.finish_reason, fin.prompt_tokens, fin.completion_tokens) == ("length", len(prompt), 8)


def test_lockstep_fused_concurrent_equals_alone(own_fused_graph):
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randrange(1, 20))] for _ in range(6)]
    sched = Scheduler(Session(own_fused_graph, max_sequences=3), reuse_prompts=False)
    try:
        handles = [sched.submit(_req(i, p, 7)) for i, p in enumerate(prompts)]
        got = [_run(h)[0] for h in handles]
    finally:
        sched.close()
    assert got == [_alone(own_fused_graph, p, 7) for p in prompts]


def test_cancel_waiting_and_close(own_cb_graph):
    sched = Scheduler(Session(own_cb_graph))
    h = [sched.submit(_req(i, [5, 6], 40)) for i in range(5)]
    h[4].cancel()
    sched.close()
    finishes = [_run(x)[1].finish_reason for x in h]
    assert finishes[4] == "cancelled"
    assert all(f in ("length", "cancelled") for f in finishes)


# ------------------------------------------------------------------------------------------ text
def test_detokenizer_streams_multibyte_text_whole(own_cb_graph):
    from qeff_kv.runtime.text.tokenizer import load_tokenizer

    tok = load_tokenizer(own_cb_graph, required=True)
    text = "naïve café — 東京 🚀 ok"
    ids = tok.encode(text, add_special_tokens=False).ids
    d = Detokenizer(tok)
    pieces = [d.add(t) for t in ids] + [d.flush()]
    assert "".join(pieces) == tok.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)


@pytest.mark.parametrize("chunks,stops,want,stopped", [
    (["hel", "lo E", "N", "D! more"], ["END"], "hello ", True),
    (["ab", "c"], ["abd"], "abc", False),                # a held prefix that turned out not to be a stop string
    (["x\n", "\ny"], ["\n\n", "zz"], "x", True),
    (["one two"], [], "one two", False),
    (["aXb", "Y"], ["XbY", "b"], "aX", True),            # the earliest match wins
])
def test_stop_matcher(chunks, stops, want, stopped):
    m = StopMatcher(stops)
    out = "".join(m.feed(c) for c in chunks) + m.flush()
    assert (out, m.stopped) == (want, stopped)


def test_stop_matcher_never_shows_part_of_a_stop_string():
    m = StopMatcher(["STOP"])
    assert m.feed("abc S") == "abc "
    assert m.feed("T") == ""
    assert m.feed("O") == ""
    assert m.feed("P tail") == "" and m.stopped


def test_lockstep_a_long_stream_moves_down_when_a_lower_one_finishes(own_fused_graph):
    """Lock step runs every row up to the highest one fed: when the request in slot 0 finishes (kept, prompt reuse
    on), the long one above it moves down (the kept one moves up to a free slot), so the rest of its steps run one
    row; its tokens stay those of the prompt alone."""
    session = Session(own_fused_graph, max_sequences=3)
    sched = Scheduler(session)
    long_prompt, short_prompt = [11, 12, 13, 14, 15, 16], [21, 22, 23]
    try:
        short = sched.submit(_req(0, short_prompt, 2))
        long = sched.submit(_req(1, long_prompt, 24))
        got_short, got_long = _run(short)[0], _run(long)[0]
        tm = session.timings
        kept = sched.run_on_engine(("call", lambda s: sorted((k.slot, tuple(k.tokens))
                                                             for k in s.prefix_cache.kept))).result(10)
    finally:
        sched.close()
    assert got_long == _alone(own_fused_graph, long_prompt, 24)
    assert got_short == _alone(own_fused_graph, short_prompt, 2)
    assert tm.decode_rows <= tm.decode_steps + 2                   # not two rows for every step of the long one
    assert [t[:len(long_prompt)] for _, t in kept].count(tuple(long_prompt)) == 1 and len(kept) == 2
