"""Property: whatever the history of creates, prefills, shared decode steps, truncates and destroys, each live
sequence computes exactly what a fresh session computes from its tokens (stale data is never read).

Runs on our own graphs and on the peer's (``graphs``)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qeff_kv.runtime import Session

CTX = 16
ops = st.lists(st.one_of(
    st.tuples(st.just("new"), st.lists(st.integers(3, 255), min_size=1, max_size=6)),
    st.tuples(st.just("step"), st.integers(1, 255)),
    st.tuples(st.just("truncate"), st.integers(0, 2), st.integers(0, 15)),
    st.tuples(st.just("destroy"), st.integers(0, 2)),
    st.tuples(st.just("extend"), st.integers(0, 2), st.lists(st.integers(3, 255), min_size=1, max_size=5)),
), min_size=1, max_size=12)


@pytest.fixture(scope="module")
def sessions(graphs):
    cb = Session(graphs / "qeff_llama_cb_vllm.onnx", ctx_len=CTX, prefill_seq_len=4, max_sequences=3)
    ref = Session(graphs / "qeff_llama_vllm.onnx", ctx_len=CTX, prefill_seq_len=CTX)
    return cb, ref


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops)
def test_history_independence(sessions, program):
    cb, ref = sessions
    for s in list(cb.sequences):
        cb.remove_sequence(s)
    history: dict[int, list[int]] = {}
    for op in program:
        live = cb.sequences
        if op[0] == "new" and cb.cache.free_slots():
            seq = cb.add_sequence()
            cb.prefill(seq, op[1])
            history[seq.id] = list(op[1])
        elif op[0] == "step":
            feeds = {s: (op[1] + s.id) % 250 + 3 for s in live if 0 < s.length < CTX}  # decode continues
            cb.decode(feeds)
            for s, t in feeds.items():
                history[s.id].append(t)
        elif op[0] == "truncate" and live:
            s = live[op[1] % len(live)]
            n = min(op[2], s.length)
            cb.truncate(s, n)
            del history[s.id][n:]
        elif op[0] == "destroy" and live:
            s = live[op[1] % len(live)]
            cb.remove_sequence(s)
            del history[s.id]
        elif op[0] == "extend" and live:
            s = live[op[1] % len(live)]
            if s.length + len(op[2]) <= CTX:
                cb.prefill(s, op[2])
                history[s.id].extend(op[2])
    for s in cb.sequences:
        assert s.tokens == history[s.id]
        if s.length >= CTX or s.length == 0:  # decode continues a sequence; an empty one is prefilled
            continue
        got = cb.decode({s: 7})[s]
        for old in list(ref.sequences):
            ref.remove_sequence(old)
        want = ref.prefill(ref.add_sequence(), history[s.id] + [7])
        assert np.allclose(got, want, atol=1e-4), (program, s.id)
        assert int(np.argmax(got)) == int(np.argmax(want))
