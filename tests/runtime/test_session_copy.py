"""``Session.copy(src, dst, n)`` (llama.cpp's ``seq_cp``): fork a shared prompt into another sequence in place.

Property: prefill a prompt into ``src``, copy its first ``n`` positions into ``dst`` (which held other tokens),
then let both diverge with their own continuations, decoded together: each gets exactly the tokens of its own
text run alone in a fresh sequence (greedy and seeded sampling). On a continuous-batching graph, a
continuous-batching graph with CCL, the lock-step (fused) graph, and a continuous-batching graph with
sliding-window ring buffers, where a copy the rings cannot serve is refused in one line and changes nothing.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from suite import OWN_CTX_LEN, OWN_PREFILL, requires_torch

pytestmark = [requires_torch]

SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
JUNK = [9, 9, 9]   # dst's own tokens before the copy: dropped by it


@pytest.fixture(scope="module")
def sessions(own_graphs, own_cb_graph, own_fused_graph, family_models, tmp_path_factory):
    """kind -> Session, made once: every example leaves no sequence behind."""
    from families import CHUNK, CTX
    from qeff_kv.export import export_model
    from qeff_kv.runtime import Session

    root = tmp_path_factory.mktemp("copy")
    made: dict = {}

    def get(kind: str):
        if kind not in made:
            if kind == "cb":
                made[kind] = Session(own_cb_graph)
            elif kind == "lockstep":
                made[kind] = Session(own_fused_graph, max_sequences=2)
                assert made[kind].lockstep
            elif kind == "ccl":
                res = export_model(None, root / "ccl", ctx_len=OWN_CTX_LEN, prefill_seq_len=OWN_PREFILL,
                                   ccl=[16, 32, 64], continuous_batching=True, full_batch_size=2, verify=False)
                made[kind] = Session(res.out_dir)
                assert made[kind].ccl is not None
            elif kind == "ring":
                res = export_model(family_models("gemma2_sw"), root / "ring", ctx_len=CTX, prefill_seq_len=CHUNK,
                                   target="onnxruntime", continuous_batching=True, full_batch_size=2, verify=False)
                made[kind] = Session(res.out_dir)
                assert made[kind].rings
        return made[kind]

    return get


def _alone(sess, tokens, new, sampling):
    [g] = sess.generate([tokens], max_new_tokens=new, sampling=sampling, stop_tokens=[])
    sess.remove_sequence(g.sequence)
    return g.tokens


def _sampling(seed):
    from qeff_kv.runtime import GREEDY, SamplingParams

    return GREEDY if seed is None else SamplingParams(temperature=0.9, top_k=40, seed=seed)


def _fork(sess, prompt, n, suffix_a, suffix_b, new, sampling):
    """Tokens of src (prompt + suffix_a) and dst (prompt[:n] + suffix_b), forked by copy, decoded together."""
    src, dst = sess.add_sequence(), sess.add_sequence()
    try:
        sess.prefill(dst, JUNK)
        sess.prefill(src, prompt)
        sess.copy(src, dst, n)
        assert (dst.length, dst.tokens, dst.pending, dst.written) == (n, prompt[:n], None, n)
        assert (src.length, src.tokens) == (len(prompt), prompt)
        a, b = sess.generate([(src, suffix_a), (dst, suffix_b)], max_new_tokens=new, sampling=sampling,
                             stop_tokens=[])
        return a.tokens, b.tokens
    finally:
        for s in (src, dst):
            if s.alive:
                sess.remove_sequence(s)


def _check_fork(sess, prompt, cut, suffix_a, suffix_b, new, seed):
    n = max(1, min(cut, len(prompt)))
    sampling = _sampling(seed)
    got = _fork(sess, prompt, n, suffix_a, suffix_b, new, sampling)
    want = (_alone(sess, prompt + suffix_a, new, sampling), _alone(sess, prompt[:n] + suffix_b, new, sampling))
    assert got == want
    assert sess.sequences == []


tokens = st.lists(st.integers(3, 120), min_size=1, max_size=6)
seeds = st.one_of(st.none(), st.integers(0, 2**31))


@pytest.mark.parametrize("kind", ["cb", "lockstep", "ccl"])
@SETTINGS
@given(prompt=st.lists(st.integers(3, 250), min_size=1, max_size=20), cut=st.integers(1, 20), suffix_a=tokens,
       suffix_b=tokens, new=st.integers(1, 6), seed=seeds)
def test_copy_then_diverge_equals_each_run_alone(sessions, kind, prompt, cut, suffix_a, suffix_b, new, seed):
    _check_fork(sessions(kind), prompt, cut, suffix_a, suffix_b, new, seed)


@SETTINGS
@given(prompt=st.lists(st.integers(3, 120), min_size=1, max_size=16), cut=st.integers(1, 16), suffix_a=tokens,
       suffix_b=tokens, new=st.integers(1, 6), seed=seeds)
def test_ring_copy_exact_where_the_ring_holds_the_window_else_refused(sessions, prompt, cut, suffix_a, suffix_b,
                                                                      new, seed):
    from families import SW
    from qeff_kv.errors import RuntimeInputError

    sess = sessions("ring")
    n = max(1, min(cut, len(prompt)))
    lowest = max(0, len(prompt) - SW)          # the ring holds positions lowest..len-1
    if lowest <= max(0, n - SW + 1):
        _check_fork(sess, prompt, cut, suffix_a, suffix_b, new, seed)
        return
    src, dst = sess.add_sequence(), sess.add_sequence()
    sess.prefill(src, prompt)
    sess.prefill(dst, JUNK)
    with pytest.raises(RuntimeInputError) as exc:
        sess.copy(src, dst, n)
    assert str(exc.value) == (
        f"cannot copy the first {n} positions of sequence {src.id}: its sliding-window layers (window {SW}) hold "
        f"positions {lowest}..{len(prompt) - 1} only; copy {lowest + SW - 1} or more positions (up to "
        f"{len(prompt)}), or prefill the tokens into the new sequence")
    assert (dst.length, dst.tokens) == (3, JUNK)
    sess.remove_sequence(src)
    sess.remove_sequence(dst)


def test_copy_refusals(sessions):
    from qeff_kv.errors import RuntimeInputError

    sess = sessions("cb")
    a, b = sess.add_sequence(), sess.add_sequence()
    try:
        sess.prefill(a, [5, 6, 7, 8])
        for args, msg in [((a, a, 2), f"cannot copy sequence {a.id} into itself; give another sequence"),
                          ((a, b, 5), f"cannot copy 5 positions of sequence {a.id}: it holds 4"),
                          ((a, b, -1), "copy length must be a non-negative int, got -1"),
                          ((a, b, True), "copy length must be a non-negative int, got True"),
                          ((a, 999, 1), "sequence 999 does not exist (destroyed or from another session)")]:
            with pytest.raises(RuntimeInputError) as exc:
                sess.copy(*args)
            assert str(exc.value) == msg
        assert b.length == 0
        sess.prefill(b, [3])
        sess.copy(a, b, 0)                       # n = 0 empties dst, like a reset
        assert (b.length, b.tokens, b.written, b.pending) == (0, [], 0, None)
    finally:
        sess.remove_sequence(a)
        sess.remove_sequence(b)
