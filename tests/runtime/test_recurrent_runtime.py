"""Runtime memory for state that cannot be sliced (llama.cpp's recurrent/hybrid memory split), on the synthetic
hybrid graph of ``tests/helpers/_recurrent_graph.py`` (an attention KV pair on layer 0, ``conv_state.1`` /
``recurrent_state.1`` on layer 1): checkpoints where the policy says, rewinds to a checkpoint equal to a fresh run
to that point (tokens and state bytes), one-line refusals elsewhere that change nothing in either memory, copy then
diverge, state files, the hand-off, and ``memory()``.

A *fresh run to position p* replays the same calls (chunks are cut by position, so the chunking is the same):
``prefill(prompt[:p], checkpoint=False)`` for a checkpoint inside the prompt, ``prefill(prompt)`` at its end, and
the prompt then one decode step per generated token beyond it.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import _recurrent_graph as rg
from qeff_kv.errors import RewindError, RuntimeInputError, StateFileError
from qeff_kv.runtime import Session
from qeff_kv.runtime.memory import state_file as state_mod

SETTINGS = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                          HealthCheck.function_scoped_fixture])
EVERY, KEEP, CTX, CHUNK = 8, 4, 64, 4
#: one checkpoint: conv_state [C, K] + recurrent_state [H, Dh, S], float32
CKPT_BYTES = (rg.C * rg.K + rg.H * rg.DH * rg.S) * 4
tokens = st.integers(0, rg.VOCAB - 1)


@pytest.fixture(scope="module")
def hybrid_graph(tmp_path_factory):
    return rg.save(tmp_path_factory.mktemp("hybrid") / "hybrid.onnx")


@pytest.fixture(scope="module")
def short_conv_graph(tmp_path_factory):
    return rg.save(tmp_path_factory.mktemp("shortconv") / "shortconv.onnx", short_conv=True)


def _session(graph, **kw):
    kw = {"ctx_len": CTX, "prefill_seq_len": CHUNK, "max_sequences": 3, "checkpoint_every": EVERY,
          "max_checkpoints": KEEP, **kw}
    return Session(graph, **kw)


@pytest.fixture(scope="module")
def sess(hybrid_graph):
    return _session(hybrid_graph)


@pytest.fixture(autouse=True)
def _clean(request):
    yield
    if "sess" in request.fixturenames:
        _clear(request.getfixturevalue("sess"))


def _clear(s):
    for q in s.sequences:
        s.remove_sequence(q)


def _state(s, seq):
    """``seq``'s recurrent rows and its KV positions ``[0, length)``, as bytes per buffer."""
    rec = {n: a[seq.slot].tobytes() for n, a in s.cache.recurrent.arrays.items()}
    kv = {n: a[seq.slot, :, :seq.length].tobytes() for n, a in s.cache.positional.arrays.items()}
    return rec, kv


def _fresh_to(s, prompt, generated, p):
    """A fresh sequence holding positions [0, p) of prompt + generated, by the same calls."""
    ref = s.add_sequence()
    if p < len(prompt):
        s.prefill(ref, prompt[:p], checkpoint=False)
        return ref
    s.prefill(ref, prompt)
    for t in generated[:p - len(prompt)]:
        s.decode({ref: t})
    return ref


def _generate(s, prompt, n):
    [g] = s.generate([list(prompt)], max_new_tokens=n, stop_tokens=[])
    return g


# ------------------------------------------------------------------------------------------------- the graph
def test_the_graph_carries_history_and_ignores_padding(sess):
    """The test graph is a real test: a prompt prefilled in padded chunks holds the state of feeding its tokens one
    by one, and a wrong recurrent state gives other tokens."""
    prompt = [5, 17, 3, 40, 22, 9, 31]   # 7 tokens: chunks 4 + 3 (padded to 4)
    a = sess.add_sequence()
    sess.prefill(a, prompt, checkpoint=False)
    b = sess.add_sequence()
    sess.prefill(b, prompt[:1])
    for t in prompt[1:]:
        sess.decode({b: t})
    for name, arr in sess.cache.recurrent.arrays.items():
        np.testing.assert_allclose(arr[a.slot], arr[b.slot], rtol=1e-5, atol=1e-5, err_msg=name)
    sess.remove_sequence(a), sess.remove_sequence(b)
    g = _generate(sess, prompt, 12)
    assert len(set(g.tokens)) > 3            # greedy tokens vary
    seq = sess.add_sequence()
    sess.prefill(seq, prompt[:-1])
    sess.cache.recurrent.arrays["recurrent_state.1"][seq.slot] *= -1.0   # a wrong state
    [h] = sess.generate([(seq, prompt[-1:])], max_new_tokens=12, stop_tokens=[])
    assert h.tokens != g.tokens


def test_prompt_rows_feed_a_recurrent_graph_position_by_position(sess):
    """Issue 52: prompt logprobs on a recurrent graph (its last row only), one position per run: row i the logits
    a plain prefill of the first i + 1 tokens gives, and the state and checkpoints a plain prefill leaves."""
    from qeff_kv.runtime.decoding.prompt_rows import prefill_rows

    prompt = [5, 17, 3, 40, 22, 9, 31, 8, 2, 11, 46]   # 11 tokens: checkpoints 8, 10, 11
    a, b = sess.add_sequence(), sess.add_sequence()
    rows = prefill_rows(sess, a, prompt)
    np.testing.assert_allclose(rows[-1], sess.prefill(b, prompt), rtol=1e-5, atol=1e-5)
    assert sess.cache.recurrent.positions(a) == sess.cache.recurrent.positions(b) == [8, 10, 11]
    for name, arr in sess.cache.recurrent.arrays.items():
        np.testing.assert_allclose(arr[a.slot], arr[b.slot], rtol=1e-5, atol=1e-5, err_msg=name)
    for i in (0, 3, 7):
        c = sess.add_sequence()
        np.testing.assert_allclose(rows[i], sess.prefill(c, prompt[:i + 1], checkpoint=False), rtol=1e-5,
                                   atol=1e-5)
        sess.remove_sequence(c)


# ------------------------------------------------------------------------------------------------- checkpoints
def test_checkpoints_where_the_policy_says_and_memory_reports_them(sess):
    prompt = list(range(3, 14))   # 11 tokens
    g = _generate(sess, prompt, 6)   # positions up to 11 + 5 = 16
    seq = g.sequence
    assert seq.length == 16
    # every 8 positions; the prompt's end and one token before it
    assert sess.rewind_points(seq) == [0, 8, 10, 11, 16]
    assert sess.cache.recurrent.positions(seq) == [8, 10, 11, 16]
    mem = sess.memory()
    assert mem["checkpoint_bytes"] == CKPT_BYTES == sess.cache.recurrent.bytes_per_sequence
    assert mem["checkpoints"] == 4 and mem["checkpoints_bytes"] == 4 * CKPT_BYTES
    assert mem["per_sequence"][seq.id] == {"positions": [8, 10, 11, 16], "bytes": 4 * CKPT_BYTES}
    assert mem["recurrent_capacity"] == 3 * CKPT_BYTES
    assert mem["capacity"] == mem["positional_capacity"] + mem["recurrent_capacity"]
    assert mem["checkpoint_every"] == EVERY and mem["max_checkpoints"] == KEEP
    # at most KEEP per sequence: the lowest goes first
    sess.generate([seq], max_new_tokens=8, stop_tokens=[])   # the pending token first: 8 steps
    assert seq.length == 24 and sess.cache.recurrent.positions(seq) == [10, 11, 16, 24]
    sess.remove_sequence(seq)
    assert sess.memory()["checkpoints_bytes"] == 0


def test_no_checkpoints_means_rewind_to_zero_only(hybrid_graph):
    s = _session(hybrid_graph, max_checkpoints=0, max_sequences=1)
    g = _generate(s, [4, 5, 6, 7, 8, 9, 10, 11, 12], 9)
    assert s.rewind_points(g.sequence) == [0, 17] and s.memory()["checkpoints"] == 0
    with pytest.raises(RewindError) as e:
        s.truncate(g.sequence, 9)
    assert str(e.value) == ("cannot rewind sequence 0 to 9 positions: its recurrent state has no checkpoint there; "
                            "it can return to 0 or 17")
    s.truncate(g.sequence, 0)
    assert not s.cache.recurrent.arrays["conv_state.1"][g.sequence.slot].any()   # a reset zeroes the state


@SETTINGS
@given(prompt=st.lists(tokens, min_size=2, max_size=21), new=st.integers(1, 20), pick=st.integers(0, 99),
       more=st.lists(tokens, min_size=1, max_size=5))
def test_rewind_to_a_checkpoint_equals_a_fresh_run(sess, prompt, new, pick, more):
    _clear(sess)
    g = _generate(sess, prompt, new)
    seq = g.sequence
    generated = seq.tokens[len(prompt):]
    points = [q for q in sess.cache.recurrent.positions(seq) if q < seq.length]   # a prompt >= 2: len - 1 at least
    p = points[pick % len(points)]
    sess.truncate(seq, p)
    assert seq.length == p and seq.tokens == (prompt + generated)[:p] and seq.pending is None
    assert all(q <= p for q in sess.cache.recurrent.positions(seq))
    ref = _fresh_to(sess, prompt, generated, p)
    assert _state(sess, seq) == _state(sess, ref)          # bytes, both memories
    [a, b] = sess.generate([(seq, more), (ref, more)], max_new_tokens=5, stop_tokens=[])
    assert a.tokens == b.tokens


def test_rewind_elsewhere_is_refused_and_changes_nothing(sess):
    prompt = [7, 1, 30, 2, 44, 5, 16, 8, 9, 28, 11, 12, 13]   # 13 tokens
    g = _generate(sess, prompt, 4)
    seq = g.sequence
    before = (_state(sess, seq), seq.length, list(seq.tokens), seq.pending, sess.cache.recurrent.positions(seq),
              {p: {n: a.tobytes() for n, a in ck.items()} for p, ck in sess.cache.recurrent.checkpoints(seq).items()})
    with pytest.raises(RewindError) as e:
        sess.truncate(seq, 9)
    assert isinstance(e.value, RuntimeInputError)
    assert str(e.value) == ("cannot rewind sequence %d to 9 positions: its recurrent state has no checkpoint there; "
                            "it can return to 0, 8, 12, 13 or 16" % seq.id)
    after = (_state(sess, seq), seq.length, list(seq.tokens), seq.pending, sess.cache.recurrent.positions(seq),
             {p: {n: a.tobytes() for n, a in ck.items()} for p, ck in sess.cache.recurrent.checkpoints(seq).items()})
    assert after == before   # neither the attention KV's length nor the recurrent state moved
    # and the sequence goes on as if nothing happened
    [cont] = sess.generate([seq], max_new_tokens=4, stop_tokens=[])
    ref = _generate(sess, prompt, 8)
    assert g.tokens + cont.tokens == ref.tokens


# ------------------------------------------------------------------------------------------------- copy
@SETTINGS
@given(prompt=st.lists(tokens, min_size=3, max_size=20), a=st.lists(tokens, min_size=1, max_size=4),
       b=st.lists(tokens, min_size=1, max_size=4), pick=st.integers(0, 99))
def test_copy_then_diverge_equals_independent_runs(sess, prompt, a, b, pick):
    _clear(sess)
    src = sess.add_sequence()
    sess.prefill(src, prompt)
    points = sess.rewind_points(src)
    n = points[pick % len(points)]
    dst = sess.add_sequence()
    sess.prefill(dst, [9, 9, 9])   # its own tokens: dropped by the copy
    sess.copy(src, dst, n)
    assert dst.length == n and dst.tokens == prompt[:n]
    assert sess.cache.recurrent.positions(dst) == [q for q in sess.cache.recurrent.positions(src) if q <= n]
    ref = sess.add_sequence()
    if n:
        sess.prefill(ref, prompt[:n], checkpoint=n == len(prompt))
    assert _state(sess, dst) == _state(sess, ref)
    sess.remove_sequence(ref)
    # diverge, decoded together; each equals its own text run alone (same calls)
    got = sess.generate([(src, b), (dst, a)], max_new_tokens=4, stop_tokens=[])
    for seq_, text, head in ((got[0], b, prompt), (got[1], a, prompt[:n])):
        alone = sess.add_sequence()
        if head:
            sess.prefill(alone, head, checkpoint=len(head) == len(prompt))
        [r] = sess.generate([(alone, text)], max_new_tokens=4, stop_tokens=[])
        assert seq_.tokens == r.tokens
        sess.remove_sequence(alone)
    sess.remove_sequence(src), sess.remove_sequence(dst)


def test_copy_without_a_checkpoint_is_refused_and_changes_nothing(sess):
    src = sess.add_sequence()
    sess.prefill(src, list(range(10, 22)))    # 12: checkpoints 8, 11, 12
    dst = sess.add_sequence()
    sess.prefill(dst, [1, 2, 3])
    before = _state(sess, dst), dst.length, sess.cache.recurrent.positions(dst)
    with pytest.raises(RewindError) as e:
        sess.copy(src, dst, 5)
    assert str(e.value) == ("cannot copy 5 positions of sequence %d: its recurrent state has no checkpoint there; "
                            "it can be copied at 0, 8, 11 or 12 positions" % src.id)
    assert (_state(sess, dst), dst.length, sess.cache.recurrent.positions(dst)) == before


# ------------------------------------------------------------------------------------------------- state files
def test_state_file_round_trip_carries_state_and_checkpoints(sess, hybrid_graph, tmp_path):
    prompt = [3, 14, 15, 9, 26, 5, 35, 8, 9, 7]
    g = _generate(sess, prompt, 5)
    path = sess.save_state(g.sequence, tmp_path / "s.safetensors")
    raw = state_mod.read_state(path)
    assert raw.tensors["conv_state.1"].shape == (1, rg.C, rg.K)              # whole, never cut by position
    assert raw.tensors["recurrent_state.1"].shape == (1, rg.H, rg.DH, rg.S)
    assert raw.tensors["past_key.0"].shape == (1, 1, g.sequence.length, rg.D)
    assert raw.metadata["recurrent_checkpoints"] == "[8,9,10]"
    assert raw.tensors["checkpoint.9.recurrent_state.1"].shape == (1, rg.H, rg.DH, rg.S)
    other = _session(hybrid_graph, max_sequences=1)
    seq = other.load_state(path)
    assert _state(other, seq) == _state(sess, g.sequence)
    assert other.cache.recurrent.positions(seq) == [8, 9, 10] and seq.pending == g.sequence.pending
    [a] = other.generate([seq], max_new_tokens=5, stop_tokens=[])
    [b] = sess.generate([g.sequence], max_new_tokens=5, stop_tokens=[])
    assert a.tokens == b.tokens
    other.truncate(seq, 9)   # its checkpoints came along
    sess.truncate(g.sequence, 9)
    assert _state(other, seq) == _state(sess, g.sequence)


def test_state_of_another_shape_or_graph_is_refused(sess, short_conv_graph, tmp_path):
    g = _generate(sess, [4, 8, 15, 16, 23, 42], 2)
    state = sess.export_state(g.sequence, checksum=False)
    bad = state_mod.KVState(dict(state.tensors), dict(state.metadata))
    bad.tensors["conv_state.1"] = bad.tensors["conv_state.1"][:, :, :2].copy()
    bad.metadata["shapes"] = json.dumps({k: list(v.shape) for k, v in bad.tensors.items()}, sort_keys=True)
    bad.metadata["checksum"] = state_mod._identity(bad.metadata, bad.tensors)
    with pytest.raises(StateFileError, match=r"^state: recurrent tensor 'conv_state.1' has shape \[1, 6, 2\], "
                                             r"expected \[1, 6, 3\]$"):
        sess.import_state(bad)
    path = sess.save_state(g.sequence, tmp_path / "s.safetensors")
    other = _session(short_conv_graph, max_sequences=1)
    with pytest.raises(StateFileError, match="saved from a graph with another KV contract"):
        other.load_state(path)
    assert sess.sequences == [g.sequence] and other.sequences == []


# ------------------------------------------------------------------------------------------------- hand-off
def test_handoff_equals_a_single_host(sess, hybrid_graph):
    from qeff_kv.runtime import SamplingParams
    from qeff_kv.serve.cluster import transfer

    prompt = [11, 2, 33, 4, 25, 6, 17, 8, 39, 10, 1]
    pre = transfer.Prefiller(_session(hybrid_graph, max_sequences=2))
    t = pre.run("r1", prompt, SamplingParams())
    assert t.slicing["Specs"] == [
        {"Name": r"^past_key\.0$", "DimSpecs": ["batch_index", 0, "ctx_start", 0]},
        {"Name": r"^past_value\.0$", "DimSpecs": ["batch_index", 0, "ctx_start", 0]},
        {"Name": r"^conv_state\.1$", "DimSpecs": ["batch_index", 0, 0]},
        {"Name": r"^recurrent_state\.1$", "DimSpecs": ["batch_index", 0, 0, 0]}]
    assert t.state.tensors["past_key.0"].shape[2] == len(prompt)             # position axis cut to n
    assert t.state.tensors["recurrent_state.1"].shape == (1, rg.H, rg.DH, rg.S)   # whole
    assert t.nbytes == transfer.valid_bytes(pre.session, pre.session.sequences[0])
    seq = transfer.install(sess, t)
    [a] = sess.generate([seq], max_new_tokens=8, stop_tokens=[])
    ref = _generate(sess, prompt, 8)
    assert a.tokens == ref.tokens
    assert sess.cache.recurrent.positions(seq) == sess.cache.recurrent.positions(ref.sequence) == [8, 10, 11, 16]


def test_double_buffered_session_and_short_conv_layer(hybrid_graph, short_conv_graph):
    """A session with separate output buffers (inplace=False) swaps the recurrent states too; a layer that keeps
    ``conv_state`` alone is recurrent memory all the same."""
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    a = _session(hybrid_graph, inplace=False, max_sequences=1)
    b = _session(hybrid_graph, max_sequences=1)
    ga, gb = _generate(a, prompt, 10), _generate(b, prompt, 10)
    assert not a.inplace and ga.tokens == gb.tokens
    a.truncate(ga.sequence, 16), b.truncate(gb.sequence, 16)
    assert _state(a, ga.sequence) == _state(b, gb.sequence)
    c = _session(short_conv_graph, max_sequences=1)
    assert list(c.cache.recurrent.shapes) == ["conv_state.1"]
    gc = _generate(c, prompt, 10)
    c.truncate(gc.sequence, 10)
    ref = _session(short_conv_graph, max_sequences=1)
    r = ref.add_sequence()
    ref.prefill(r, prompt)
    assert _state(c, gc.sequence) == _state(ref, r)


# ------------------------------------------------------------------------------------------------- prompt reuse
def test_scheduler_reuses_the_longest_prefix_that_ends_at_a_checkpoint(hybrid_graph):
    """The server's prompt reuse on a hybrid graph: the longest common prefix that ends at a checkpoint of the kept
    sequence (or at its whole length); with none, the prompt is prefilled from scratch. Tokens equal a fresh
    session's."""
    from qeff_kv.runtime import SamplingParams
    from qeff_kv.serve.engine.engine import Finished, GenerationRequest, TokenOut
    from qeff_kv.serve.engine.scheduler import Scheduler

    def run(sched, i, prompt, n):
        h = sched.submit(GenerationRequest(str(i), tuple(prompt), n, SamplingParams(), frozenset()))
        evs = list(h.iter_sync(timeout=60))
        assert isinstance(evs[-1], Finished) and all(isinstance(e, TokenOut) for e in evs[:-1])
        return [e.token for e in evs[:-1]], evs[-1]

    def alone(prompt, n):
        return _generate(_session(hybrid_graph, max_sequences=1), prompt, n).tokens

    base = [9, 8, 7, 6, 5, 4, 3, 20, 21, 22, 23, 24, 25]   # 13 tokens, fed in chunks of 4
    session = _session(hybrid_graph)
    sched = Scheduler(session)
    try:
        t0, f0 = run(sched, 0, base, 6)       # kept: 18 positions, checkpoints 8, 12, 13, 16
        assert f0.cached_tokens == 0 and t0 == alone(base, 6)
        [kept] = session.sequences
        assert session.rewind_points(kept) == [0, 8, 12, 13, 16, 18]
        # shares 11 tokens: the checkpoint at 8 is the longest reusable prefix (copied into a free slot)
        other = base[:11] + [40, 41]
        t1, f1 = run(sched, 1, other, 5)
        assert f1.cached_tokens == 8 and t1 == alone(other, 5)
        # the same prompt again: all but its last token, from the checkpoint one before the prompt's end
        t2, f2 = run(sched, 2, base, 6)
        assert f2.cached_tokens == len(base) - 1 and t2 == t0
        # the whole conversation so far plus a new turn: the kept sequence's whole length
        convo = base + t0[:-1] + [30, 31]
        t3, f3 = run(sched, 3, convo, 4)
        assert f3.cached_tokens == len(base) + 5 and t3 == alone(convo, 4)
        # 6 shared tokens and no checkpoint at or below them but 0: from scratch
        fresh = base[:6] + [1, 2, 3]
        t4, f4 = run(sched, 4, fresh, 4)
        assert f4.cached_tokens == 0 and t4 == alone(fresh, 4)
    finally:
        sched.close()


# ------------------------------------------------------------------------------------------------- CLI
def test_generate_cli_checkpoint_options(hybrid_graph, tmp_path):
    from click.testing import CliRunner

    from qeff_kv_cli.main import main

    def run(*args):
        return CliRunner().invoke(main, ["generate", str(hybrid_graph), "--prompt-ids", "5,6,7,8,9,10,11",
                                         "--ctx-len", CTX, "--prefill-seq-len", CHUNK, "--max-new-tokens", 12,
                                         "--json", *map(str, args)])

    r = run("--checkpoint-every", 4, "--max-checkpoints", 3)
    assert r.exit_code == 0, r.output
    out = json.loads([line for line in r.stdout.splitlines() if line.strip()][-1])
    mem = out["memory"]
    assert (mem["checkpoint_every"], mem["max_checkpoints"]) == (4, 3)
    assert mem["per_sequence"]["0"] == {"positions": [8, 12, 16], "bytes": 3 * CKPT_BYTES}
    assert out["sequences"][0]["tokens"] == _generate(_session(hybrid_graph, max_sequences=1), [5, 6, 7, 8, 9, 10, 11],
                                                      12).tokens
    r = run("--max-checkpoints", -1)
    assert r.exit_code == 2 and "--max-checkpoints" in r.output


# ------------------------------------------------------------------------------------------------- other layouts
@pytest.mark.parametrize("variant", [{"attention": False}, {"cb": False}, {"cb": False, "attention": False}],
                         ids=["recurrent-only", "no-batch-index", "recurrent-only-no-batch-index"])
def test_other_layouts_rewind_and_round_trip(variant, tmp_path):
    """A recurrent-only graph (Mamba2-style: no position axis anywhere, ctx_len from the caller) and graphs without
    ``batch_index``: a rewind to a checkpoint equals a fresh run, a state file round trip continues exactly."""
    graph = rg.save(tmp_path / "g.onnx", **variant)
    s = _session(graph, max_sequences=1)
    assert s.recurrent and s.continuous_batching == variant.get("cb", True)
    assert (list(s.cache.positional.arrays) == []) == (variant.get("attention") is False)
    prompt = [7, 3, 40, 12, 5, 30, 2, 11, 9, 21, 14]
    g = _generate(s, prompt, 9)                 # 11 + 8 = 19 positions: checkpoints 8, 10, 11, 16
    assert s.rewind_points(g.sequence) == [0, 8, 10, 11, 16, 19]
    path = s.save_state(g.sequence, tmp_path / "s.safetensors")
    generated = g.sequence.tokens[len(prompt):]
    s.truncate(g.sequence, 16)
    snap = _state(s, g.sequence)
    s.remove_sequence(g.sequence)
    ref = _fresh_to(s, prompt, generated, 16)
    assert _state(s, ref) == snap
    s.remove_sequence(ref)
    other = _session(graph, max_sequences=1)
    seq = other.load_state(path)
    [a] = other.generate([seq], max_new_tokens=4, stop_tokens=[])
    assert g.tokens + a.tokens == _generate(s, prompt, 13).tokens


def test_lock_step_is_refused_with_recurrent_state(tmp_path):
    graph = rg.save(tmp_path / "g.onnx", cb=False)
    with pytest.raises(RuntimeInputError, match=r"max_sequences=2 needs lock-step batching, which is not possible: "
                                                r"the graph keeps recurrent state \(an idle row's token would change "
                                                r"its state\)"):
        _session(graph, max_sequences=2)


def test_serve_config_sets_the_checkpoints(hybrid_graph):
    from qeff_kv.serve.config import ServeConfig
    from qeff_kv.serve.engine.session_from_config import open_session

    config = ServeConfig(str(hybrid_graph), ctx_len=CTX, prefill_seq_len=CHUNK, max_sequences=2, checkpoint_every=5,
                         max_checkpoints=2)
    s = open_session(config.engine, config.served_model())
    assert (s.cache.recurrent.policy.every, s.cache.recurrent.policy.keep) == (5, 2)
    g = _generate(s, [1, 2, 3, 4, 5, 6, 7], 5)
    assert s.rewind_points(g.sequence) == [0, 7, 10, 11]
    assert s.describe()["checkpoint_every"] == 5


def test_a_pair_with_another_recurrent_geometry_is_refused(hybrid_graph, tmp_path):
    """The KV contract of a recurrent graph includes each state's shape: a disaggregated pair of exports whose
    states differ (here another conv kernel) is refused at start-up, and so is a state file between them."""
    import onnx

    from qeff_kv.serve.cluster.transfer import facts, pair_refusal

    m = rg.build()
    for vi in list(m.graph.input) + list(m.graph.output):
        if vi.name.startswith("conv_state.1"):
            vi.type.tensor_type.shape.dim[2].dim_value = rg.K + 1
    other_path = tmp_path / "k4.onnx"
    onnx.save(m, str(other_path))
    a, b = _session(hybrid_graph, max_sequences=1), _session(other_path, max_sequences=1)
    assert a.kv_fingerprint != b.kv_fingerprint
    assert "different KV contracts" in pair_refusal(facts(a), facts(b))
    g = _generate(a, [1, 2, 3], 1)
    with pytest.raises(StateFileError, match="saved from a graph with another KV contract"):
        b.import_state(a.export_state(g.sequence))


def test_speculative_decoding_is_refused_on_recurrent_state(hybrid_graph):
    from qeff_kv.runtime.decoding.speculative import PromptLookup, SpeculativeDecoder

    s = _session(hybrid_graph, max_sequences=1)
    s.speculative, s.speculative_tokens = True, 4   # as a recurrent graph with num_logits_to_keep would be
    with pytest.raises(RuntimeInputError, match="a recurrent state can do only to a checkpoint"):
        SpeculativeDecoder(s, PromptLookup())
