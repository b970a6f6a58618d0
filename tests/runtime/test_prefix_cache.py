"""The prefix cache (runtime/prefix_cache.py): where prompt reuse is decided, on real sessions: the lookup rules
(``len(prompt) - 1``, MIN_REUSE, reachable checkpoints), copy versus truncate, LRU eviction, refusals of ring
buffers falling back to a whole prefill, and the listener told what every sequence holds."""

from __future__ import annotations

import numpy as np
import pytest

import _recurrent_graph as rg
from qeff_kv.runtime import Session
from qeff_kv.runtime.memory.prefix_cache import MIN_REUSE, PrefixCache, common_prefix

P = [5, 17, 3, 29, 11, 40, 7, 23, 2, 31]   # 10 tokens


class Recorder:
    """A CacheListener that remembers what each sequence was last said to hold."""

    def __init__(self):
        self.held, self.calls = {}, []

    def holds(self, key, tokens):
        self.calls.append((key, list(tokens)))
        if tokens:
            self.held[key] = list(tokens)
        else:
            self.held.pop(key, None)

    def clear(self):
        self.held.clear()


def _kept(cache: PrefixCache, tokens) -> object:
    seq = cache.fresh()
    cache.session.prefill(seq, tokens)
    cache.release(seq)
    return seq


def _kv(session, seq) -> dict:
    return {k: np.array(v) for k, v in session.export_state(seq, checksum=False).tensors.items()}


@pytest.fixture
def cb(own_cb_graph):
    """A fresh 3-slot continuous-batching session (ctx 64) per test."""
    return Session(own_cb_graph)


def test_common_prefix():
    assert common_prefix([1, 2, 3], (1, 2, 4), 5) == 2
    assert common_prefix([1, 2, 3], [1, 2, 3], 2) == 2
    assert common_prefix([], [1], 3) == 0


def test_lookup_rules_and_longest_prefix_change_nothing(cb):
    cache = PrefixCache(cb)
    a = _kept(cache, P)
    assert MIN_REUSE == 2
    assert cache.lookup(P) == (a, len(P) - 1)                     # the last prompt token is always fed
    assert cache.lookup(P + [9, 9]) == (a, len(P))
    assert cache.lookup(P[:2] + [60]) == (a, 2)                   # MIN_REUSE tokens are enough
    assert cache.lookup([P[0], 60, 61]) == (None, 0)              # one shared token is not worth a slot
    assert cache.lookup(P[:2]) == (None, 0)                       # limit len(prompt) - 1 = 1
    assert cache.longest_prefix(P[:7] + [60]) == 7
    assert (a.length, a.tokens, cache.kept, len(cb.sequences)) == (len(P), P, (a,), 1)   # nothing changed
    assert PrefixCache(cb, reuse=False).lookup(P) == (None, 0)


def test_running_sequences_are_sources_only_when_named(cb):
    cache = PrefixCache(cb)
    run = cb.add_sequence()
    cb.prefill(run, P)
    assert cache.lookup(P + [1]) == (None, 0)
    assert cache.lookup(P + [1], running=[run]) == (run, len(P))
    dst, n = cache.acquire(P[:6] + [1], running=[run])            # a running source stays: copied
    assert (n, dst.length, dst.tokens, run.length) == (6, 6, P[:6], len(P))
    assert dst is not run and cache.reused_tokens == 6


def test_copy_when_the_source_is_longer_truncate_when_it_is_not(cb):
    rec = Recorder()
    cache = PrefixCache(cb, listener=rec)
    a = _kept(cache, P)
    dst, n = cache.acquire(P[:6] + [60, 61])
    assert (n, dst.tokens) == (6, P[:6]) and dst is not a and a in cache and a.length == len(P)
    ref = Session(cb.files.folder)
    r = ref.add_sequence()
    ref.prefill(r, P[:6])
    got, want = _kv(cb, dst), _kv(ref, r)                          # the copied positions: a fresh prefill's
    assert sorted(got) == sorted(want) and all(np.array_equal(got[k], want[k]) for k in got)
    cb.remove_sequence(dst)
    seq, n = cache.acquire(P + [60])                               # the whole kept sequence: continued in place
    assert (seq, n, a in cache, seq.length) == (a, len(P), False, len(P))
    cache.held(seq)
    assert rec.held == {a.id: P}
    cb.prefill(seq, [60])
    cache.release(seq)
    assert rec.held == {a.id: P + [60]} and cache.kept == (a,)
    seq, n = cache.acquire(P[:4] + [70])                           # shorter than the kept one: copied
    assert seq is not a and n == 4


def test_truncate_in_place_when_no_slot_is_free(cb):
    rec = Recorder()
    cache = PrefixCache(cb, listener=rec)
    a = _kept(cache, P)
    busy = [cb.add_sequence(), cb.add_sequence()]                  # the other two slots run requests
    seq, n = cache.acquire(P[:5] + [60])
    assert (seq, n, seq.length, seq.tokens, len(cache)) == (a, 5, 5, P[:5], 0)
    assert rec.held[a.id] == P[:5]                                 # the listener saw the truncation
    assert len(busy) == 2


def test_lru_eviction_and_the_source_is_not_the_victim(cb):
    cache = PrefixCache(cb)
    a = _kept(cache, P)
    b = _kept(cache, [90, 91, 92, 93])
    c = _kept(cache, [80, 81, 82, 83])
    assert cache.kept == (a, b, c) and not cb.cache.free_slots() and cache.available() == 3
    dst, n = cache.acquire(P[:6] + [60])                           # copy from a: a becomes the most recent,
    assert n == 6 and not b.alive and cache.kept == (c, a)          # b (then the oldest) is evicted for the copy
    cache.release(dst)
    assert cache.kept == (c, a, dst)
    e = cache.fresh()                                              # a fresh slot evicts the least recently used
    assert not c.alive and e.slot == c.slot and cache.kept == (a, dst)
    cache.release(e, keep=False)
    assert not e.alive and cache.kept == (a, dst)


def test_keep_forget_evict_and_slot_views(cb):
    rec = Recorder()
    cache = PrefixCache(cb, listener=rec)
    a = _kept(cache, P)
    b = _kept(cache, [90, 91, 92])
    assert cache.in_slot(a.slot) is a and cache.in_slot(2) is None
    assert cache.forget(a) == 0 and cache.kept == (b,) and a.alive
    cache.keep(a, 0)
    assert cache.kept == (a, b)
    assert cache.evict() is a and not a.alive and a.id not in rec.held
    cache.clear()
    assert cache.kept == () and cb.sequences == [] and rec.held == {}


def test_a_recurrent_sequence_is_reused_only_to_a_checkpoint(tmp_path):
    sess = Session(rg.save(tmp_path / "hybrid.onnx"), ctx_len=64, prefill_seq_len=4, max_sequences=3,
                   checkpoint_every=8, max_checkpoints=4)
    cache = PrefixCache(sess)
    prompt = [11, 2, 33, 4, 25, 6, 17, 8, 39, 10, 1, 12, 13, 14]
    a = _kept(cache, prompt)
    points = sess.rewind_points(a)
    other = prompt[:11] + [44, 45]
    n = max(p for p in points if p <= 11)
    assert 0 < n < 11 and cache.lookup(other) == (a, n)          # the checkpoint at or below the common prefix
    seq, got = cache.acquire(other)
    assert got == n and seq.length == n and seq is not a          # copied to the checkpoint
    assert cache.lookup([11, 2, 3, 3]) == (None, 0)               # common prefix 2: no checkpoint above 0


def test_ring_refusals_fall_back_to_a_whole_prefill(tmp_path):
    from ring_graphs import PROMPT, ring_graph

    sess = Session(ring_graph(tmp_path, cb=True), ctx_len=32, max_sequences=2)
    cache = PrefixCache(sess)
    a = _kept(cache, PROMPT)                                       # 14 tokens: the ring holds 8..13 only
    other = PROMPT[:4] + [15, 15]
    dst, n = cache.acquire(other)                                  # the copy of 4 positions is refused
    assert (n, dst.length, dst is a, a in cache, a.length) == (0, 0, False, True, len(PROMPT))
    seq, n = cache.acquire(other)                                  # no free slot: the rewind is refused too
    assert (seq, n, seq.length, len(cache)) == (a, 0, 0, 0)
    assert cache.reused_tokens == 0


def test_lock_step_new_sequences_take_the_lowest_rows(own_fused_graph):
    """A lock-step step runs every row up to the highest one fed, kept rows below included: a new sequence takes
    the lowest slot no sequence in use holds, and the kept sequence there moves to the highest free slot, the same
    sequence with its positions, tokens, pending token and place in the LRU order; it is still found and reused."""
    sess = Session(own_fused_graph, max_sequences=3)
    assert sess.lockstep
    rec = Recorder()
    cache = PrefixCache(sess, listener=rec)
    assert cache.low_rows
    a = _kept(cache, P)
    a.pending, a.pending_emitted = 42, True
    kv_a = _kv(sess, a)
    calls = len(rec.calls)
    new = cache.fresh()                                            # a leaves slot 0 for the highest free slot
    assert new.slot == 0 and a.alive and a.slot == 2 and cache.kept == (a,)
    assert (a.tokens, a.length, a.pending, a.pending_emitted) == (P, len(P), 42, True)
    got = _kv(sess, a)
    assert sorted(got) == sorted(kv_a) and all(np.array_equal(got[k], kv_a[k]) for k in got)
    assert len(rec.calls) == calls and rec.held == {a.id: P}      # the same sequence: nothing to tell
    assert cache.lookup(P + [60]) == (a, len(P))
    sess.prefill(new, [70, 71, 72])
    rows = sess.timings.decode_rows
    sess.decode([(new, 73)])
    assert sess.timings.decode_rows - rows == 1                    # one row, not three
    cache.release(new)                                             # kept in slot 0, the most recently used
    second = cache.fresh()                                         # new moves up to slot 1, keeping its place
    assert (second.slot, new.slot, a.slot, cache.kept) == (0, 1, 2, (a, new))
    third = cache.fresh()                                          # no free slot: the LRU a (slot 2) is
    assert not a.alive and (third.slot, new.slot, cache.kept) == (1, 2, (new,))   # evicted, new moves up


def test_lock_step_moved_sequence_continues_as_before(own_fused_graph):
    """A kept sequence moved to another row continues with the tokens it would have made in place."""
    ref = Session(own_fused_graph, max_sequences=3)
    [want] = ref.generate([P], max_new_tokens=6, stop_tokens=[])
    sess = Session(own_fused_graph, max_sequences=3)
    cache = PrefixCache(sess)
    a = _kept(cache, P)
    cache.fresh()                                                  # a moves from slot 0 to slot 2
    assert a.slot == 2
    seq, n = cache.acquire(P + [want.tokens[0]])
    assert (seq, n) == (a, len(P))
    [got] = sess.generate([(seq, [want.tokens[0]])], max_new_tokens=5, stop_tokens=[])
    assert [want.tokens[0]] + got.tokens == want.tokens


def test_continuous_batching_keeps_kept_sequences_in_place(cb):
    """With batch_index a step runs only the rows fed: nothing moves."""
    cache = PrefixCache(cb)
    assert not cache.low_rows
    a = _kept(cache, P)
    assert cache.fresh().slot == 1 and a.alive and a.slot == 0


def test_lower_moves_a_sequence_in_use_into_the_lowest_open_row(own_fused_graph):
    """``lower``: a sequence in use moves into the lowest slot below it that no other sequence in use holds (a kept
    one there takes its row in exchange), the same sequences with their positions, tokens and pending tokens."""
    sess = Session(own_fused_graph, max_sequences=3)
    cache = PrefixCache(sess)
    a, b, c = cache.fresh(), cache.fresh(), cache.fresh()
    for seq, toks in ((a, P), (b, [90, 91, 92]), (c, [80, 81, 82, 83, 84])):
        sess.prefill(seq, toks)
    c.pending, c.pending_emitted = 7, True
    kv_a, kv_c = _kv(sess, a), _kv(sess, c)
    cache.lower(c)
    assert c.slot == 2                                             # every slot below is in use: c stays
    cache.release(a)                                               # a kept in slot 0, b still in use in slot 1
    cache.lower(c)                                                 # c and a exchange rows
    assert (c.slot, a.slot, b.slot, cache.kept, a.alive) == (0, 2, 1, (a,), True)
    assert (c.tokens, c.pending, c.pending_emitted, a.tokens) == ([80, 81, 82, 83, 84], 7, True, P)
    for seq, want in ((a, kv_a), (c, kv_c)):
        got = _kv(sess, seq)
        assert sorted(got) == sorted(want) and all(np.array_equal(got[k], want[k]) for k in got)
    cache.release(b, keep=False)
    cache.lower(c)
    assert c.slot == 0                                             # already the lowest row


def test_continuous_batching_never_lowers(cb):
    cache = PrefixCache(cb)
    a, b = cache.fresh(), cache.fresh()
    cb.prefill(b, P)
    cache.release(a, keep=False)
    cache.lower(b)
    assert b.slot == 1
