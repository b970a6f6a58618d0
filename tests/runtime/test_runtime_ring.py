"""The runtime's sliding-window bookkeeping (issue 9, item 3) on tiny hand-made ring graphs: no exporter, no torch.

The graph (``ring_graph``) writes, for every token at position ``p``, the key ``[token, p]`` and the value
``[-token, -p]`` into each layer's buffer: layer 0 a ring (axis ``sliding_window``, slot ``p % C``), layer 1 a
full-length cache (axis ``ctx_len``, slot ``p``) unless ``global_layer=False``. Padding rows (``position_ids =
-1``) repeat their row's last valid token and position, as our exports do. Logits are zeros (greedy picks 0).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from qeff_kv.errors import RuntimeInputError, StateFileError
from qeff_kv.runtime import Session, export_state, import_state, read_state
from qeff_kv.runtime.memory import registry
from qeff_kv.runtime.memory.positional import buffer_bytes
from qeff_kv.runtime.memory.state_file import _checksum
from ring_graphs import PROMPT, V, ring_graph


def _ring(s, seq, name="past_key.0"):
    return s.cache.positional.arrays[name][seq.slot, 0]


def _expected_ring(tokens, capacity, written=None):
    """Ring contents after writing ``tokens`` at positions 0.. (keys [token, p] at slot p % C)."""
    out = np.zeros((capacity, 2), np.float32)
    for p, t in enumerate(tokens[:written]):
        out[p % capacity] = (t, p)
    return out


def _fed_positions(s):
    """Record the position_ids fed to every run of ``s``."""
    fed = []
    run = s._run

    def spy(rows, seq_len, *a, **k):
        fed.append(s.binding.small[s.binding.bound]["position_ids"][0].tolist())
        return run(rows, seq_len, *a, **k)

    s._run = spy
    return fed


# ============================================================================================ allocation
def test_each_buffer_is_allocated_at_its_own_capacity(tmp_path):
    s = Session(ring_graph(tmp_path), ctx_len=32)
    assert s.inplace, s.inplace_issues
    assert (s.sliding_window, s.rings.capacities) == (6, {"past_key.0": 6, "past_value.0": 6})
    c = s.cache
    assert {k: a.shape for k, a in c.positional.arrays.items()} == {
        "past_key.0": (1, 1, 6, 2), "past_value.0": (1, 1, 6, 2),
        "past_key.1": (1, 1, 32, 2), "past_value.1": (1, 1, 32, 2)}
    slot = 1 * 2 * 4                                      # heads x head_dim x float32
    assert c.bytes_per_position == 4 * slot
    assert c.bytes_per_sequence == 2 * 6 * slot + 2 * 32 * slot
    assert c.memory_capacity == c.bytes_per_sequence
    assert buffer_bytes(s.layout.pairs, max_sequences=1, ctx_len=32, rings=s.rings) == c.memory_capacity
    assert registry.require_memory({"full": s.layout.pairs}, registry.Settings(1, 32, rings=s.rings)) == c.memory_capacity
    seq = s.add_sequence()
    s.prefill(seq, PROMPT[:4])
    assert c.memory_used == 2 * 4 * slot + 2 * 4 * slot
    s.prefill(seq, PROMPT[4:])
    assert c.memory_used == 2 * 6 * slot + 2 * 14 * slot    # the ring holds 6 of the 14 positions
    assert s.describe()["sliding_window"] == 6 and s.describe()["ring_capacities"]["past_value.0"] == 6


def test_window_from_metadata_manifest_argument_or_static_axis(tmp_path):
    meta = Session(ring_graph(tmp_path / "a"), ctx_len=32)
    man = Session(ring_graph(tmp_path / "b", window=None, cache=None,
                             manifest={"sliding_window": 6, "ctx_len": 32}))
    arg = Session(ring_graph(tmp_path / "c", window=None, cache=None), ctx_len=32, sliding_window=6)
    static = Session(ring_graph(tmp_path / "d", window=None, cache=None, ring_dim=6), ctx_len=32)
    for s in (meta, man, arg, static):
        assert s.sliding_window == 6 and s.cache.positional.arrays["past_key.0"].shape == (1, 1, 6, 2)
    # a static ring larger than the recorded window: its own capacity, the window from the metadata
    big = Session(ring_graph(tmp_path / "e", ring_dim=8), ctx_len=32)
    assert (big.sliding_window, big.rings.capacity, big.cache.positional.arrays["past_key.0"].shape) == (6, 8, (1, 1, 8, 2))


def test_ring_graph_without_a_window_is_refused_in_one_line(tmp_path):
    path = ring_graph(tmp_path, window=None, cache=None)
    with pytest.raises(RuntimeInputError) as err:
        Session(path, ctx_len=32)
    assert str(err.value) == ("graph has sliding-window KV buffers (axis 'sliding_window'); give --sliding-window N")


@pytest.mark.parametrize("kw, match", [
    (dict(sliding_window=8), r"^the graph records sliding window 6; 8 was requested$"),
    (dict(sliding_window=0), r"^sliding_window must be a positive integer, got 0$"),
])
def test_contradicting_or_bad_window_is_refused(tmp_path, kw, match):
    with pytest.raises(RuntimeInputError, match=match):
        Session(ring_graph(tmp_path), ctx_len=32, **kw)


def test_window_for_a_graph_without_rings_is_refused_and_small_ring_refused(tmp_path):
    with pytest.raises(RuntimeInputError, match=r"has no sliding-window KV buffers"):
        Session(ring_graph(tmp_path / "a", window=None, cache=None, ring_layer=False), ctx_len=32, sliding_window=6)
    with pytest.raises(RuntimeInputError, match=r"holds 4 slots, fewer than the sliding window 6"):
        Session(ring_graph(tmp_path / "b", ring_dim=4), ctx_len=32)
    with pytest.raises(RuntimeInputError, match=r"metadata records sliding window 6, its manifest 8"):
        Session(ring_graph(tmp_path / "c", manifest={"sliding_window": 8, "ctx_len": 32}))


def test_all_ring_graph_takes_ctx_len_from_the_caller(tmp_path):
    path = ring_graph(tmp_path, global_layer=False)
    with pytest.raises(RuntimeInputError, match=r"give it \(--ctx-len N\)"):
        Session(path)
    s = Session(path, ctx_len=20)
    assert s.ctx_len == 20 and s.cache.positional.arrays["past_key.0"].shape == (1, 1, 6, 2)
    [g] = s.generate([PROMPT], max_new_tokens=6, stop_tokens=[])      # positions up to 19: ctx_len is the limit
    assert g.sequence.length == 19 and g.sequence.written == 19
    with pytest.raises(RuntimeInputError, match=r"capacity is ctx_len=20"):
        s.generate([(g.sequence, [1, 2])], max_new_tokens=1, stop_tokens=[])


# ============================================================================================ chunks
def test_prefill_chunks_are_capped_at_the_ring_capacity(tmp_path):
    s = Session(ring_graph(tmp_path), ctx_len=32, prefill_seq_len=16)
    assert s.prefill_seq_len == 6
    fed = _fed_positions(s)
    seq = s.add_sequence()
    s.prefill(seq, PROMPT)
    assert fed == [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11], [12, 13, -1, -1, -1, -1]]   # ours: padded
    assert np.array_equal(_ring(s, seq), _expected_ring(PROMPT, 6))
    assert np.array_equal(s.cache.positional.arrays["past_value.1"][0, 0, :14], -np.array([[t, p] for p, t in enumerate(PROMPT)]))
    assert seq.written == 14
    # decoding across the wrap keeps writing slot p % C
    fed.clear()
    [g] = s.generate([(seq, [7])], max_new_tokens=3, stop_tokens=[])
    assert fed == [[14, -1, -1, -1, -1, -1], [15], [16]]   # a one-token prefill chunk, then decode steps
    assert np.array_equal(_ring(s, seq), _expected_ring(PROMPT + [7] + g.tokens[:2], 6))
    assert seq.written == seq.length == 17


def test_peer_ring_graph_runs_unpadded_chunks_that_never_wrap_the_ring(tmp_path):
    """Another exporter's rings (no qeff_kv.sliding_cache): chunks fill the ring up to its last slot (5), then every
    token goes alone (the peer's GPT-OSS graph is exact only so: test_peer_round2.py)."""
    s = Session(ring_graph(tmp_path, cache=None), ctx_len=32, prefill_seq_len=4)
    fed = _fed_positions(s)
    seq = s.add_sequence()
    s.prefill(seq, PROMPT[:10])
    assert fed == [[0, 1, 2, 3], [4, 5], [6], [7], [8], [9]]
    assert np.array_equal(_ring(s, seq), _expected_ring(PROMPT[:10], 6))


def test_peer_ring_graph_with_a_fixed_seq_len_is_refused_at_open(tmp_path):
    """Past its ring such a graph must take one token per run, which a fixed seq_len of 4 cannot: one line."""
    with pytest.raises(RuntimeInputError, match=r"^the graph fixes seq_len=4 and has another exporter's "
                                                r"sliding-window rings, which are exact only fed one token at a time "
                                                r"past the ring$"):
        Session(ring_graph(tmp_path, cache=None, seq_len=4), ctx_len=32)


def test_fixed_seq_len_above_the_ring_capacity_is_refused_at_open(tmp_path):
    with pytest.raises(RuntimeInputError, match=r"^the graph fixes seq_len=8, more than its smallest sliding-window "
                                                r"ring \(6 slots\); a chunk must hold at most 6 tokens$"):
        Session(ring_graph(tmp_path / "a", seq_len=8), ctx_len=32)
    s = Session(ring_graph(tmp_path / "b", seq_len=6), ctx_len=32)
    assert s.prefill_seq_len == 6


# ============================================================================================ rewind
def test_truncate_within_the_window_and_refused_beyond_it(tmp_path):
    s = Session(ring_graph(tmp_path), ctx_len=32)
    seq = s.add_sequence()
    s.prefill(seq, PROMPT)                         # written 14: the ring holds positions 8..13
    s.truncate(seq, 14)                            # to length: a no-op
    with pytest.raises(RuntimeInputError) as err:
        s.truncate(seq, 12)
    assert str(err.value) == ("cannot rewind sequence 0 to 12 positions: its sliding-window layers (window 6) hold "
                              "positions 8..13 only; it can be rewound to 13 or more, or reset to 0")
    assert (seq.length, seq.written, len(seq.tokens)) == (14, 14, 14)   # a refused rewind changes nothing
    s.truncate(seq, 13)                            # 14 - 6 <= 13 - 6 + 1: exact
    assert (seq.length, seq.written) == (13, 14)
    with pytest.raises(RuntimeInputError) as err:
        s.truncate(seq, 12)
    assert str(err.value) == ("cannot rewind sequence 0 to 12 positions: its sliding-window layers (window 6) hold "
                              "positions 8..13 only; it can only be reset to 0")
    # re-feeding position 13 continues exactly
    s.prefill(seq, [PROMPT[13]])
    assert np.array_equal(_ring(s, seq), _expected_ring(PROMPT, 6)) and seq.written == 14
    s.truncate(seq, 0)                             # a reset always works
    assert (seq.length, seq.written) == (0, 0)
    s.prefill(seq, PROMPT[:5])                     # written 5 <= C: anything can be rewound
    s.truncate(seq, 1)
    assert (seq.length, seq.written) == (1, 5)
    s.cache.reset(seq)
    assert seq.written == 0


def test_truncate_rule_on_continuous_batching_sequences(tmp_path):
    s = Session(ring_graph(tmp_path, cb=True), ctx_len=32, max_sequences=2)
    a, b = s.generate([PROMPT, PROMPT[:3]], max_new_tokens=4, stop_tokens=[])
    assert (a.sequence.written, b.sequence.written) == (17, 6)
    assert np.array_equal(_ring(s, b.sequence), _expected_ring(PROMPT[:3] + b.tokens, 6, 6))
    s.truncate(b.sequence, 1)
    with pytest.raises(RuntimeInputError, match=r"^cannot rewind sequence 0 to 10 positions: .* hold positions "
                                                r"11\.\.16 only; it can be rewound to 16 or more, or reset to 0$"):
        s.truncate(a.sequence, 10)


# ============================================================================================ states
def test_state_round_trip_restores_written_and_ring(tmp_path):
    path = ring_graph(tmp_path / "g")
    s = Session(path, ctx_len=32)
    [g] = s.generate([PROMPT], max_new_tokens=3, stop_tokens=[])
    seq = g.sequence
    s.truncate(seq, seq.length - 1)                # written 16, length 15
    f = s.save_state(seq, tmp_path / "s.safetensors")
    st = read_state(f)
    assert st.tensors["past_key.0"].shape == (1, 1, 6, 2) and st.tensors["past_key.1"].shape == (1, 1, 15, 2)
    assert (st.metadata["ring_written"], st.metadata["sliding_window"]) == ("16", "6")
    assert json.loads(st.metadata["capacities"]) == {"past_key.0": 6, "past_value.0": 6}
    t = Session(path, ctx_len=32)
    back = t.load_state(f)
    assert (back.length, back.written, back.pending) == (15, 16, None)
    for name in s.cache.positional.arrays:
        cap = s.cache.positional.capacities[name]
        assert np.array_equal(t.cache.positional.arrays[name][0, :, :min(cap, 15)], s.cache.positional.arrays[name][0, :, :min(cap, 15)])
    with pytest.raises(RuntimeInputError, match=r"it can only be reset to 0$"):
        t.truncate(back, 14)                       # the same rule as in the session that saved it
    # a short sequence saves only the slots it wrote; the in-memory hand-off carries the same
    s.truncate(seq, 0)
    s.prefill(seq, PROMPT[:4])
    st = export_state(s, seq)
    assert st.tensors["past_value.0"].shape == (1, 1, 4, 2) and st.metadata["ring_written"] == "4"
    u = Session(path, ctx_len=32)
    moved = import_state(u, st)
    assert moved.written == 4 and np.array_equal(_ring(u, moved), _expected_ring(PROMPT[:4], 6))


def test_state_checksum_covers_the_ring_metadata(tmp_path):
    path = ring_graph(tmp_path)
    s = Session(path, ctx_len=32)
    seq = s.add_sequence()
    s.prefill(seq, PROMPT)
    st = export_state(s, seq)
    st.metadata["ring_written"] = "15"
    with pytest.raises(StateFileError, match=r"checksum mismatch"):
        import_state(Session(path, ctx_len=32), st)


def test_state_from_a_graph_with_another_window_or_capacity_is_refused(tmp_path):
    s6 = Session(ring_graph(tmp_path / "w6"), ctx_len=32)
    seq = s6.add_sequence()
    s6.prefill(seq, PROMPT)
    f = s6.save_state(seq, tmp_path / "s6.safetensors")
    with pytest.raises(StateFileError) as err:
        Session(ring_graph(tmp_path / "w8", window=8), ctx_len=32).load_state(f)
    assert str(err.value) == f"{f}: state was saved from a graph with sliding window 6; this session's is 8"
    other = Session(ring_graph(tmp_path / "c8", ring_dim=8), ctx_len=32)
    with pytest.raises(StateFileError, match=r"ring capacities 2 buffers of 6 slots; this session's are 2 buffers "
                                             r"of 8 slots$"):
        other.load_state(f)
    assert other.sequences == []                   # nothing created on refusal


def test_full_length_state_loads_into_ring_buffers_by_position(tmp_path):
    """Stretch: a state of a full-length graph with the same window (the fused target's layout) fills the ring
    exactly; a ring state goes into such a graph's full-length buffers by position, rewinds there are bounded
    by the positions it brought, and a full-length graph without a window refuses it in one line."""
    full = Session(ring_graph(tmp_path / "full", ring_dim="ctx_len", cache="full"), ctx_len=32)
    assert not full.rings and full.sliding_window == 6
    seq = full.add_sequence()
    full.prefill(seq, PROMPT)
    f = full.save_state(seq, tmp_path / "full.safetensors")
    assert read_state(f).metadata["capacities"] == "{}"
    ring = Session(ring_graph(tmp_path / "ring"), ctx_len=32)
    got = ring.load_state(f)
    assert (got.length, got.written, got.floor) == (14, 14, 0)
    assert np.array_equal(_ring(ring, got), _expected_ring(PROMPT, 6))
    assert np.array_equal(_ring(ring, got, "past_value.1")[:14], _ring(full, seq, "past_value.1")[:14])
    # ring -> full-length: positions 8..13 at their own slots, the rest zeros never read
    g = ring.save_state(got, tmp_path / "ring.safetensors")
    fused = Session(ring_graph(tmp_path / "full2", ring_dim="ctx_len", cache="full"), ctx_len=32)
    back = fused.load_state(g)
    assert (back.length, back.written, back.floor) == (14, 14, 8)
    want = np.zeros((14, 2), np.float32)
    want[8:] = [(PROMPT[p], p) for p in range(8, 14)]
    assert np.array_equal(_ring(fused, back)[:14], want)
    assert np.array_equal(_ring(fused, back, "past_key.1")[:14], _ring(full, seq, "past_key.1")[:14])
    with pytest.raises(RuntimeInputError) as err:
        fused.truncate(back, 12)
    assert str(err.value) == ("cannot rewind sequence 0 to 12 positions: its sliding-window layers (window 6) hold "
                              "positions 8..13 only; it can be rewound to 13 or more, or reset to 0")
    fused.truncate(back, 13)
    h = fused.save_state(back, tmp_path / "fused.safetensors")
    assert read_state(h).metadata["ring_floor"] == "8"
    again = Session(ring_graph(tmp_path / "full3", ring_dim="ctx_len", cache="full"), ctx_len=32).load_state(h)
    assert (again.length, again.floor) == (13, 8)
    fused.truncate(back, 0)
    assert (back.floor, back.written) == (0, 0)
    plain = Session(ring_graph(tmp_path / "plain", ring_dim="ctx_len", window=None, cache=None), ctx_len=32)
    with pytest.raises(StateFileError) as err:
        plain.load_state(g)
    assert str(err.value) == (f"{g}: state holds sliding-window ring buffers (2 buffers of 6 slots); this "
                              "session's buffers are full-length and it records no sliding window")


def test_state_without_ring_metadata_is_a_full_length_state(tmp_path):
    """Files written before the ring keys existed: full-length states (written = valid length)."""
    plain = Session(ring_graph(tmp_path / "plain", ring_dim="ctx_len", window=None, cache=None), ctx_len=32)
    seq = plain.add_sequence()
    plain.prefill(seq, PROMPT[:9])
    st = export_state(plain, seq)
    for key in ("ring_written", "capacities", "sliding_window"):
        del st.metadata[key]
    st.metadata["checksum"] = _checksum(st.metadata, st.tensors)
    again = import_state(Session(plain.files.onnx_path, ctx_len=32), st)
    assert (again.length, again.written) == (9, 9)
    ring = import_state(Session(ring_graph(tmp_path / "ring"), ctx_len=32), st)
    assert ring.written == 9


# ============================================================================================ CLI
def test_generate_cli_takes_the_window(tmp_path):
    from qeff_kv_cli.main import main

    path = ring_graph(tmp_path, window=None, cache=None)
    ok = CliRunner().invoke(main, ["generate", str(path), "--prompt-ids", ",".join(map(str, PROMPT)),
                                   "--ctx-len", "32", "--sliding-window", "6", "--max-new-tokens", "3", "--json"])
    assert ok.exit_code == 0, ok.output
    out = json.loads(ok.stdout.strip().splitlines()[-1])
    assert out["sliding_window"] == 6 and out["prefill_seq_len"] == 6 and out["sequences"][0]["tokens"] == [0, 0, 0]
    bad = CliRunner().invoke(main, ["generate", str(path), "--prompt-ids", "1,2", "--ctx-len", "32"])
    assert bad.exit_code == 2
    assert "give --sliding-window N" in bad.output
