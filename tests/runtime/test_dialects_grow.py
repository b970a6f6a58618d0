"""Issue 49: the runtime runs a growing past/present graph (mobius-onnx's and optimum's default build: ``present =
Concat(past, new)``) from its fixed buffers, exactly: tokens equal to a plain onnxruntime loop that feeds the graph as
its writers mean (``dialect_loops.greedy_loop``), with the cache verbs; what it cannot feed is refused in one line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dialect_loops import greedy_loop, session_greedy
from growing_graph import growing_decoder
from qeff_kv.contract import naming
from qeff_kv.errors import ContractError, RuntimeInputError
from qeff_kv.runtime.execution.growing import held_lengths
from qeff_kv.runtime.session import Session

PROMPT = [3, 17, 5, 29, 11, 2, 40, 8, 13]
OTHER = [9, 1, 33, 4, 21]
CAPACITY = 32
N = 8

pytestmark = pytest.mark.filterwarnings("ignore:.*grows by concatenation.*:RuntimeWarning")


@pytest.fixture(scope="module")
def grows(tmp_path_factory) -> Path:
    return growing_decoder(tmp_path_factory.mktemp("grows") / "grows.onnx", capacity=CAPACITY)


@pytest.fixture(scope="module")
def ref(grows) -> dict:
    refs = {tuple(p): greedy_loop(grows, p, N, capacity=CAPACITY) for p in (PROMPT, OTHER)}
    assert all(len(set(t)) > 2 for t in refs.values()) and refs[tuple(PROMPT)] != refs[tuple(OTHER)]
    return refs


def test_growing_tokens_equal_a_plain_loop(grows, ref):
    s = Session(grows, ctx_len=CAPACITY)
    assert s.layout.update == "grows" and s.graph.grows
    assert not s.inplace and s.inplace_issues        # a copy of the held past in, the present's new positions back
    assert not s.cache.positional.spare_arrays        # one set of fixed buffers
    assert s.cache.positional.arrays[s.layout.pairs[0].input_name].shape == (1, 2, CAPACITY, 8)
    assert session_greedy(s, PROMPT, N) == ref[tuple(PROMPT)]
    mask = s.binding.feeds.last[naming.ATTENTION_MASK_INPUT]
    assert mask.shape == (1, len(PROMPT) + N - 1) and mask.all()
    assert s.binding.growing.last_runs == [(0, 1, len(PROMPT) + N - 2)]


def test_growing_chunked_prefill_unpadded(grows, ref):
    s = Session(grows, ctx_len=CAPACITY, prefill_seq_len=4)
    widths = []
    run = s._run

    def watch(rows, seq_len, *a, **kw):
        widths.append(seq_len)
        return run(rows, seq_len, *a, **kw)

    s._run = watch
    assert session_greedy(s, PROMPT, N) == ref[tuple(PROMPT)]
    assert widths[:3] == [4, 4, 1]                     # the short chunk runs at its length, never padded


def test_growing_rewind_regenerates(grows, ref):
    s = Session(grows, ctx_len=CAPACITY)
    seq = s.add_sequence()
    assert session_greedy(s, PROMPT, N, seq) == ref[tuple(PROMPT)]
    s.truncate(seq, len(PROMPT) - 3)
    assert session_greedy(s, PROMPT[-3:], N, seq) == ref[tuple(PROMPT)]
    s.truncate(seq, 0)
    assert session_greedy(s, OTHER, N, seq) == ref[tuple(OTHER)]


def test_growing_save_load_continues(grows, ref, tmp_path):
    s = Session(grows, ctx_len=CAPACITY)
    seq = s.add_sequence()
    s.prefill(seq, PROMPT)
    path = s.save_state(seq, tmp_path / "state.kvstate")
    other = Session(grows, ctx_len=CAPACITY)
    loaded = other.load_state(path)
    assert loaded.length == len(PROMPT)
    other.truncate(loaded, len(PROMPT) - 1)
    assert session_greedy(other, PROMPT[-1:], N, loaded) == ref[tuple(PROMPT)]


def test_growing_two_sequences_of_different_lengths(grows, ref):
    """Lock step: a step whose rows hold different lengths runs one run per length (each its rows), exactly."""
    s = Session(grows, ctx_len=CAPACITY, max_sequences=2)
    assert s.lockstep
    a, b = s.add_sequence(), s.add_sequence()
    ta, tb = [int(np.argmax(s.prefill(a, PROMPT)))], [int(np.argmax(s.prefill(b, OTHER)))]
    assert s.binding.growing.last_runs == [(1, 1, 0)]  # b's prefill: its own row
    while len(ta) < N:
        out = s.decode({a: ta[-1], b: tb[-1]})
        ta.append(int(np.argmax(out[a])))
        tb.append(int(np.argmax(out[b])))
    assert ta == ref[tuple(PROMPT)] and tb == ref[tuple(OTHER)]
    assert sorted(s.binding.growing.last_runs) == [(0, 1, len(PROMPT) + N - 2), (1, 1, len(OTHER) + N - 2)]


def test_growing_two_sequences_of_equal_lengths_share_a_run(grows, ref):
    s = Session(grows, ctx_len=CAPACITY, max_sequences=2)
    a, b = s.add_sequence(), s.add_sequence()
    ta, tb = [int(np.argmax(s.prefill(a, PROMPT)))], [int(np.argmax(s.prefill(b, PROMPT)))]
    while len(ta) < N:
        out = s.decode({a: ta[-1], b: tb[-1]})
        ta.append(int(np.argmax(out[a])))
        tb.append(int(np.argmax(out[b])))
    assert ta == tb == ref[tuple(PROMPT)]
    assert s.binding.growing.last_runs == [(0, 2, len(PROMPT) + N - 2)]


def test_growing_capacity_is_kept(grows):
    s = Session(grows, ctx_len=CAPACITY, prefill_seq_len=8)
    seq = s.add_sequence()
    s.prefill(seq, list(range(1, CAPACITY)))          # 31 positions: chunks 8, 8, 8, 7
    s.decode({seq: 1})                                # the last slot
    with pytest.raises(RuntimeInputError, match="exceed the capacity"):
        s.decode({seq: 1})


def test_growing_refusals(grows):
    with pytest.raises(RuntimeInputError) as err:     # the graph's positions axis is symbolic
        Session(grows)
    assert "\n" not in str(err.value) and "--ctx-len" in str(err.value)
    with pytest.raises(ContractError, match="grows by concatenation and inplace=True was asked"):
        Session(grows, ctx_len=CAPACITY, inplace=True)
    with pytest.raises(RuntimeInputError, match="never padded"):
        held_lengths(np.array([[4, 5, -1]]), CAPACITY)
    with pytest.raises(RuntimeInputError, match="capacity of 32 positions"):
        held_lengths(np.array([[31, 32]]), CAPACITY)
    assert held_lengths(np.array([[4, 5], [7, 8]]), CAPACITY).tolist() == [4, 7]
