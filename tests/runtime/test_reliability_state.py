"""Issue 22, class 4: a state file whose checksum is valid but whose metadata contradicts itself or its tensors is
refused in one line (a checksum proves the bytes, not the invariants). Hand-made ring graphs: no torch."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import save

from qeff_kv.errors import StateFileError
from qeff_kv.runtime import Session, export_state, import_state
from qeff_kv.runtime.memory.state_file import _checksum
from ring_graphs import PROMPT, ring_graph


@pytest.fixture(scope="module")
def ring(tmp_path_factory):
    """A ring graph (window 6) and a 14-token state of it."""
    path = ring_graph(tmp_path_factory.mktemp("ring") / "g")
    s = Session(path, ctx_len=32)
    seq = s.add_sequence()
    s.prefill(seq, PROMPT)
    return path, export_state(s, seq)


def _resealed(state, **meta):
    """``state`` with metadata changed and a valid checksum: the bytes are what they claim to be."""
    md = {**state.metadata, **meta}
    md["checksum"] = _checksum(md, state.tensors)
    return type(state)({k: v.copy() for k, v in state.tensors.items()}, md)


def _refused(path, state, message: str, tmp_path=None):
    fresh = Session(path, ctx_len=32)
    with pytest.raises(StateFileError) as exc:
        import_state(fresh, state)
    assert str(exc.value) == message
    assert fresh.sequences == []   # nothing was loaded
    if tmp_path is not None:       # the same through a file
        f = tmp_path / "s.safetensors"
        f.write_bytes(save(state.tensors, metadata=state.metadata))
        before = f.read_bytes()
        with pytest.raises(StateFileError) as exc:
            fresh.load_state(f)
        assert str(exc.value) == message.replace("state:", f"{f}:", 1)
        assert f.read_bytes() == before


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(extra=st.integers(min_value=2, max_value=2**31 - 1 - 14))
def test_ring_written_beyond_what_the_ring_can_hold_is_refused(ring, extra):
    path, state = ring
    written = 14 + extra
    _refused(path, _resealed(state, ring_written=str(written)),
             f"state: inconsistent state metadata: ring_written {written} with valid length 14: its ring buffers "
             f"(6 slots) hold positions {written - 6}..{written - 1}, the next step needs 9..13")


@pytest.mark.parametrize("written", [2**31, 2**62, 10**30])
def test_absurd_ring_written_is_refused(ring, tmp_path, written):
    path, state = ring
    _refused(path, _resealed(state, ring_written=str(written)),
             f"state: inconsistent state metadata: ring_written {written} is beyond any capacity", tmp_path)


def test_consistent_ring_written_after_a_rewind_still_loads(ring):
    path, _ = ring
    s = Session(path, ctx_len=32)
    [g] = s.generate([PROMPT], max_new_tokens=3, stop_tokens=[])
    s.truncate(g.sequence, g.sequence.length - 1)   # written = length + 1: the rewind rule allows it
    st_ = export_state(s, g.sequence)
    back = import_state(Session(path, ctx_len=32), st_)
    assert (back.length, back.written) == (g.sequence.length, g.sequence.written)


@pytest.mark.parametrize("key,value,message", [
    ("dtype", "float16", "state: inconsistent state metadata: dtype 'float16', its tensors are float32"),
    ("dtype", "int64", "state: inconsistent state metadata: dtype 'int64', its tensors are float32"),
    ("num_layers", "7", "state: inconsistent state metadata: num_layers '7' for a graph of 2 layers"),
])
def test_metadata_that_contradicts_the_tensors_is_refused(ring, tmp_path, key, value, message):
    path, state = ring
    _refused(path, _resealed(state, **{key: value}), message, tmp_path)


def test_tensors_of_another_dtype_with_matching_metadata_are_still_refused(ring):
    path, state = ring
    tensors = {k: v.astype(np.float16) for k, v in state.tensors.items()}
    md = {**state.metadata, "dtype": "float16"}
    md["checksum"] = _checksum(md, tensors)
    fresh = Session(path, ctx_len=32)
    with pytest.raises(StateFileError, match=r"^state: tensor 'past_key.0' is float16, the graph's buffer is float32$"):
        import_state(fresh, type(state)(tensors, md))


@pytest.mark.parametrize("key,value", [("valid_length", "١٤"), ("valid_length", "1_4"), ("valid_length", " 14"),
                                       ("ring_written", "١٤"), ("pending_token", "+3")])
def test_metadata_integers_are_ascii_digits(ring, tmp_path, key, value):
    path, state = ring
    message = ("state: malformed state metadata (ring_written, capacities, sliding_window)" if key == "ring_written"
               else "state: malformed state metadata")
    _refused(path, _resealed(state, **{key: value}), message, tmp_path)
