"""``Session`` is composed, not mixed (issue 38): its binding and generation loop are objects with their own state
and a reference to the session they serve, and each public method of the session keeps its name and signature while
it calls them; its cache verbs are one hop to the cache (the hybrid) or to the state-file module (issue 48)."""

from __future__ import annotations

import inspect

import numpy as np

from qeff_kv.runtime import Session
from qeff_kv.runtime.memory import state_file
from qeff_kv.runtime.memory.hybrid import HybridMemory
from qeff_kv.runtime.decoding.decode_loop import GenerationLoop
from qeff_kv.runtime.execution.binding import GraphBinding
from ring_graphs import PROMPT, ring_graph

#: the session's public methods each collaborator answers
DELEGATED = {
    HybridMemory: ("truncate", "rewind_points", "reusable", "memory", "copy", "relocate"),
    GenerationLoop: ("stream", "generate", "warm_up"),
    GraphBinding: ("kv_data_pointers", "bound_output_pointers"),
}


def test_session_has_no_mixins_and_its_verbs_keep_the_collaborators_signatures():
    assert Session.__mro__ == (Session, object)
    for collaborator, names in DELEGATED.items():
        for name in names:
            ours, theirs = inspect.signature(getattr(Session, name)), inspect.signature(getattr(collaborator, name))
            if collaborator is HybridMemory:   # the hybrid also takes a sequence's id; the session's verbs say Sequence
                assert list(ours.parameters) == list(theirs.parameters), name
            else:
                assert ours == theirs, name
    for name in ("export_state", "import_state", "save_state", "load_state"):   # the state file's, less the session
        ours, theirs = inspect.signature(getattr(Session, name)), inspect.signature(getattr(state_file, name))
        assert list(ours.parameters)[1:] == list(theirs.parameters)[1:len(ours.parameters)], name


def test_the_session_reaches_its_cache_in_one_hop(tmp_path):
    """No middle object between the session and its cache: each verb calls the hybrid (a spy on it sees the call)."""
    s = Session(ring_graph(tmp_path), ctx_len=32)
    calls = []
    for verb in ("create", "truncate", "reusable", "destroy"):
        real = getattr(s.cache, verb)
        setattr(s.cache, verb, lambda *a, _real=real, _verb=verb, **k: calls.append(_verb) or _real(*a, **k))
    a = s.add_sequence()
    s.prefill(a, PROMPT[:4])
    assert s.reusable(a, 3) == 3
    s.truncate(a, 2)
    s.remove_sequence(a)
    assert calls == ["create", "reusable", "truncate", "destroy"]
    assert not hasattr(s, "cache_verbs")


def test_each_collaborator_serves_its_session(tmp_path):
    s = Session(ring_graph(tmp_path), ctx_len=32)
    assert (s.binding.session, s.generation.session) == (s, s)
    [g] = s.generate([PROMPT], max_new_tokens=3, stop_tokens=[])
    assert s.binding.bound == (1, 1, 1)   # the last step: one row, one token
    assert s.kv_data_pointers() == {n: a.__array_interface__["data"][0] for n, a in s.cache.positional.arrays.items()}
    assert s.describe()["ring_capacities"] == {"past_key.0": 6, "past_value.0": 6}
    assert s.memory() == s.cache.memory() and s.sequences == [g.sequence]


def test_the_weights_fingerprint_is_computed_once_per_session(tmp_path, monkeypatch):
    """The state files' last model check (the weights' fibers) is the state-file module's, kept per session."""
    from qeff_kv.runtime import weight_fibers

    calls = []
    real = weight_fibers.fingerprint
    monkeypatch.setattr(weight_fibers, "fingerprint", lambda model: calls.append(1) or real(model))
    s = Session(ring_graph(tmp_path), ctx_len=32)
    [g] = s.generate([PROMPT], max_new_tokens=2, stop_tokens=[])
    first = s.export_state(g.sequence)
    second = s.export_state(g.sequence)
    assert len(calls) == 1
    assert first.metadata["weights_fibers"] == second.metadata["weights_fibers"] == state_file.weights_fibers(s)
    held, tokens = s.cache.positional.read(g.sequence, "past_key.1"), list(g.sequence.tokens)
    s.remove_sequence(g.sequence)
    seq = s.import_state(first)
    assert seq.tokens == tokens and np.array_equal(s.cache.positional.read(seq, "past_key.1"), held)
    assert len(calls) == 1
