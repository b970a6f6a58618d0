"""A new memory kind is one module plus the conformance suite (issue 48): a toy memory class registered for a toy
state kind (``@holds``, in its own module: here, this file) is built through the registry into the hybrid and into a
session's cache, passes the conformance suite's facts, and no other module is edited for it."""

from __future__ import annotations

import numpy as np
import pytest

import test_memory_conformance as conformance
from qeff_kv.runtime import Session
from qeff_kv.runtime.memory import registry
from qeff_kv.runtime.memory.hybrid import HybridMemory
from qeff_kv.runtime.memory.positional import PositionalMemory
from ring_graphs import PROMPT, ring_graph

TOY = [conformance._pair("toy_key", 0, (1, "ctx_len", 2)), conformance._pair("toy_value", 0, (1, "ctx_len", 2))]


@pytest.fixture
def toy(monkeypatch):
    """The toy kind, registered for this test only (the registry's tables are restored after it)."""
    monkeypatch.setattr(registry, "MEMORY_OF", dict(registry.MEMORY_OF))
    monkeypatch.setattr(registry, "ORDER", dict(registry.ORDER))

    @registry.holds("toy", order=3, role="toy")
    class ToyMemory(PositionalMemory):
        """A toy kind: full-length buffers of its own, after the recurrent memory in the hybrid's order."""

    monkeypatch.setitem(conformance.KINDS, "toy", lambda: HybridMemory.open(
        {"full": conformance.FULL, "toy": TOY}, registry.Settings(conformance.SLOTS, conformance.CTX)))
    return ToyMemory


def test_the_toy_kind_is_built_through_the_registry(toy):
    assert registry.memory_of("toy") is toy
    h = conformance.KINDS["toy"]()
    assert [type(m).__name__ for m in h.memories] == ["PositionalMemory", "RopeMarks", "RecurrentMemory", "ToyMemory"]
    assert isinstance(h.toy, toy) and h.toy.names == ["toy_key.0", "toy_value.0"]
    need, words = toy.need(TOY, registry.Settings(conformance.SLOTS, conformance.CTX))
    assert need == h.toy.capacity and "2 buffers" in words   # it reports its own bytes


@pytest.mark.parametrize("fact", [
    "test_every_memory_is_the_interface_and_counts_its_buffers", "test_create_starts_empty_in_a_used_slot_and_destroy_frees_it",
    "test_clear_is_a_truncate_to_zero", "test_bad_verbs_are_refused_before_any_memory_is_asked",
    "test_state_round_trip", "test_a_state_tensor_of_another_shape_is_refused_naming_it",
    "test_a_hand_off_moves_the_valid_bytes_cut_as_its_slicing_spec_says"])
def test_the_toy_kind_passes_the_conformance_facts(toy, fact):
    getattr(conformance, fact)(conformance.KINDS["toy"]())


@pytest.mark.parametrize("fact", ["test_every_truncate_is_exact_or_refused_with_nothing_changed",
                                  "test_every_copy_is_exact_or_refused_with_nothing_changed",
                                  "test_every_relocation_keeps_every_sequence_or_is_refused_with_nothing_changed"])
def test_the_toy_kind_passes_the_verbs_facts(toy, fact):
    getattr(conformance, fact)("toy")


def test_a_sessions_cache_holds_the_toy_memory_without_an_edit_elsewhere(toy, tmp_path):
    """The session builds its cache from the registry: the toy memory is there (no pairs of its kind in this graph)
    and every verb and state of the session passes through it."""
    s = Session(ring_graph(tmp_path), ctx_len=32)
    assert isinstance(s.cache.toy, toy) and s.cache.toy.names == []
    [g] = s.generate([PROMPT], max_tokens=3, stop_tokens=[])
    state = s.export_state(g.sequence)
    held = s.cache.positional.read(g.sequence, "past_key.1")
    s.truncate(g.sequence, 0)
    s.remove_sequence(g.sequence)
    back = s.import_state(state)
    assert np.array_equal(s.cache.positional.read(back, "past_key.1"), held)
