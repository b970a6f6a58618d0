"""One conformance suite for every memory kind of the runtime (qeff_kv/runtime/memory/), run against the memory
interface (:class:`qeff_kv.runtime.memory.base.Memory`) and the hybrid that composes them: full, ring, latent and
indexed (DSA's indexer keys beside the pair) positional buffers, a recurrent state with its checkpoints, and the session's hybrid of positional (full + ring),
RoPE marks and recurrent memories.

Each kind is built directly (numpy buffers of small random shapes, no graph) inside a
:class:`~qeff_kv.runtime.memory.hybrid.HybridMemory` that holds its sequence table; a run of the graph is simulated
by writing random data where the graph would (position ``p`` in slot ``p``, a ring's slot ``p % C``, a recurrent
row overwritten at every token, checkpoints where the policy says). What is checked: the interface's facts (buffers,
bindings, bytes), create/clear/destroy, that every truncate and copy a memory allows gives exactly what the next
step would read at that length, that a relocation (into a free slot, an exchange) leaves every sequence reading what it
read, that every refusal is the first memory's (its type, its line) and leaves every memory
untouched (all bytes compared), state round trips through ``state_write``/``state_check``/``state_read``, and that a
hand-off moves the valid bytes and cuts each buffer as its slicing spec says.

Adding a memory kind: add a builder to ``KINDS`` (and, if its buffers are written otherwise than the kinds here, a
branch to :func:`feed` and :func:`view`); every test below then runs on it.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from qeff_kv.errors import RewindError, RuntimeInputError, StateFileError
from qeff_kv.contract.layout import KVPair, TensorInfo
from qeff_kv.runtime.memory import (CheckpointPolicy, HybridMemory, Memory, PositionalMemory, RecurrentMemory,
                                    RopeMarks)
from qeff_kv.contract import statespec
from qeff_kv.runtime.memory import registry
from qeff_kv.runtime.memory.rope_marks import RopeMark
from qeff_kv.runtime.memory.ring import RingSpec

SLOTS, CTX, WINDOW, RING = 3, 16, 4, 5
POLICY = CheckpointPolicy(every=4, keep=3)
LENGTH = 13   # positions fed to the sequence under test: past the ring, past several checkpoints


def _pair(stem: str, layer: int, shape: tuple, dtype: str = "float32", recurrent: bool = False) -> KVPair:
    name = f"{stem}.{layer}"
    return KVPair(stem, layer, None, TensorInfo(name, dtype, ("batch",) + shape),
                  TensorInfo(name + "_RetainedState", dtype, ("batch",) + shape), recurrent)


FULL = [_pair("past_key", 0, (2, "ctx_len", 4)), _pair("past_value", 0, (2, "ctx_len", 4))]
RINGED = [_pair("past_key", 1, (2, "sliding_window", 4)), _pair("past_value", 1, (2, "sliding_window", 4))]
LATENT = [_pair("compressed_kv", 0, (1, "ctx_len", 8)), _pair("k_pe", 0, (1, "ctx_len", 4), "float16")]
#: DeepSeek sparse attention: the pair plus the indexer's keys, of their own width
INDEXED = [_pair("past_key", 0, (1, "ctx_len", 8)), _pair("past_value", 0, (1, "ctx_len", 4)),
           _pair("index_key", 0, (1, "ctx_len", 6))]
STATES = [_pair("conv_state", 2, (6, 3), recurrent=True), _pair("recurrent_state", 2, (2, 4, 4), recurrent=True)]
RINGS = RingSpec(WINDOW, {p.input_name: RING for p in RINGED})


def _table(*memories: Memory) -> HybridMemory:
    return HybridMemory(list(memories), max_sequences=SLOTS, ctx_len=CTX)


KINDS = {
    "full": lambda: _table(PositionalMemory(FULL, max_sequences=SLOTS, ctx_len=CTX)),
    "ring": lambda: _table(PositionalMemory(FULL + RINGED, max_sequences=SLOTS, ctx_len=CTX, rings=RINGS)),
    "latent": lambda: _table(PositionalMemory(LATENT, max_sequences=SLOTS, ctx_len=CTX, double_buffer=True)),
    "indexed": lambda: _table(PositionalMemory(INDEXED, max_sequences=SLOTS, ctx_len=CTX)),
    "recurrent": lambda: _table(RecurrentMemory(STATES, max_sequences=SLOTS, policy=POLICY)),
    "hybrid": lambda: HybridMemory.open({"full": FULL + RINGED, "recurrent": STATES},
                                        registry.Settings(SLOTS, CTX, rings=RINGS, checkpoints=POLICY)),
}


@pytest.fixture(params=list(KINDS))
def kind(request) -> str:
    return request.param


@pytest.fixture
def mem(kind) -> HybridMemory:
    return KINDS[kind]()


# ------------------------------------------------------------------------------------------------ a simulated run
def feed(h: HybridMemory, seq, k: int, rng: np.random.Generator, seen: dict | None = None) -> None:
    """Feed ``k`` tokens to ``seq`` as the graph would; ``seen``: length -> :func:`view` after each token."""
    for _ in range(k):
        p = seq.length
        for m in h.memories:
            if isinstance(m, PositionalMemory):
                for name, a in m.arrays.items():
                    slot = p % m.capacities[name] if name in m.rings.capacities else p
                    a[seq.slot, :, slot, :] = rng.standard_normal(a.shape[1:2] + a.shape[3:])
                m.wrote(seq, p + 1)
            elif isinstance(m, RecurrentMemory):
                for a in m.arrays.values():
                    a[seq.slot] = rng.standard_normal(a.shape[1:])
        seq.length += 1
        seq.tokens.append(int(rng.integers(0, 100)))
        for m in h.memories:
            if isinstance(m, RecurrentMemory) and m.due(seq.length):
                m.snapshot(seq, seq.length)
        if seen is not None:
            seen[seq.length] = view(h, seq)
            seen[seq.length]["state"] = state_of(h, seq)


def view(h: HybridMemory, seq) -> dict:
    """What the next step of ``seq`` reads: every full-length buffer's positions ``[0, length)``, a ring's window
    ``[length - W + 1, length)`` (from its slots), a recurrent row, the RoPE marks."""
    out: dict = {"marks": list(seq.rope_marks), "tokens": list(seq.tokens)}
    for m in h.memories:
        if isinstance(m, PositionalMemory):
            for name, a in m.arrays.items():
                cap = m.rings.capacities.get(name)
                lo = 0 if cap is None else max(0, seq.length - m.rings.window + 1)
                slots = np.arange(lo, seq.length) % (cap or CTX)
                out[name] = a[seq.slot][:, slots, :].copy()
        elif isinstance(m, RecurrentMemory):
            out.update({name: a[seq.slot].copy() for name, a in m.arrays.items()})
    return out


def state_of(h: HybridMemory, seq) -> dict:
    """``seq``'s state as :meth:`~HybridMemory.state_write` gives it, but for a ring's slots outside the window and
    ``ring_floor`` (a copy takes the window only: :func:`view` checks it) and the RoPE marks (:func:`view` has
    them)."""
    tensors, meta = h.state_write(seq)
    rings = {n for m in h.memories if isinstance(m, PositionalMemory) for n in m.rings.capacities}
    return {"meta": {k: v for k, v in meta.items() if k not in ("rope_marks", "ring_floor")},
            **{n: t for n, t in tensors.items() if n not in rings}}


def same(a: dict, b: dict, state: bool = False) -> bool:
    """``a`` and ``b`` hold the same (with ``state``: also the same state, bookkeeping included)."""
    if not state:
        a, b = ({k: v for k, v in d.items() if k != "state"} for d in (a, b))
    return a.keys() == b.keys() and all(
        same(a[k], b[k], True) if isinstance(a[k], dict) else
        np.array_equal(a[k], b[k]) if isinstance(a[k], np.ndarray) else a[k] == b[k] for k in a)


def everything(h: HybridMemory) -> tuple:
    """Every byte and every record the memories and the table hold."""
    buffers = {(i, n, side): a.tobytes() for i, m in enumerate(h.memories)
               for side, arrays in (("cur", m.arrays), ("spare", m.spare_arrays)) for n, a in arrays.items()}
    books = [(s.id, p, n, a.tobytes()) for m in h.memories if isinstance(m, RecurrentMemory)
             for s in h.sequences for p, ck in m.checkpoints(s).items() for n, a in ck.items()]
    seqs = [(s.id, s.slot, s.length, list(s.tokens), s.pending, s.pending_emitted, s.written, s.floor,
             list(s.rope_marks)) for s in h.sequences]
    return buffers, books, seqs


def _filled(h: HybridMemory, rng, marks: bool = True, seen: dict | None = None):
    seq = h.create()
    feed(h, seq, LENGTH, rng, seen)
    if marks and any(isinstance(m, RopeMarks) for m in h.memories):
        seq.rope_marks = [RopeMark(2, 5, -1)]   # an image at positions [2, 5)
        if seen is not None:
            for n in seen:
                seen[n]["marks"] = [m for m in seq.rope_marks if m.end <= n]
    return seq


def _first_refusal(h: HybridMemory, ask):
    for m in h.memories:
        why = ask(m)
        if why is not None:
            return m, why
    return None, None


# ------------------------------------------------------------------------------------------------ the interface
def test_every_memory_is_the_interface_and_counts_its_buffers(mem):
    assert mem.memories and all(isinstance(m, Memory) for m in mem.memories)
    names = [n for m in mem.memories for n in m.names]
    assert len(names) == len(set(names))
    assert [b[0] for b in mem.bindings()] == names
    for m in mem.memories:
        assert m.names == list(m.shapes) == list(m.arrays) == list(m.values)
        assert m.capacity == sum(a.nbytes for a in m.arrays.values()) == m.bytes_per_sequence * SLOTS
        assert all(v.data_ptr() == m.arrays[n].ctypes.data for n, v in m.values.items())   # bound, not copied
        assert set(m.spare_arrays) == (set(m.names) if m.double_buffer else set())
        assert m.used([]) == 0
    assert mem.memory_capacity == mem.bytes_per_sequence * SLOTS
    assert mem.memory()["capacity"] == mem.memory_capacity and mem.memory()["used"] == 0


def test_every_kind_of_the_state_spec_has_a_memory_and_a_builder_here():
    """The registry (qeff_kv/runtime/memory/registry.py) holds every kind the state spec names, each memory is
    the one this suite builds for that kind, and the hybrid's order is positional, RoPE marks, recurrent."""
    assert set(registry.MEMORY_OF) == set(statespec.KINDS) <= set(KINDS)
    for kind, cls in registry.MEMORY_OF.items():
        assert kind in cls.kinds and {type(m) for m in KINDS[kind]().memories} == {cls}
    cache = HybridMemory.open({"full": FULL}, registry.Settings(SLOTS, CTX))
    assert [type(m) for m in cache.memories] == [PositionalMemory, RopeMarks, RecurrentMemory]
    with pytest.raises(RuntimeInputError, match=r"^no memory of the runtime holds state kind 'sink' \(held: full, "
                                                r"ring, latent, indexed, recurrent\)$"):
        registry.memory_of("sink")


def test_swap_exchanges_the_two_sets_of_a_double_buffered_memory():
    h = KINDS["latent"]()
    [m] = h.memories
    before = {n: (m.arrays[n], m.spare_arrays[n]) for n in m.names}
    h.swap()
    assert all(m.arrays[n] is b and m.spare_arrays[n] is a for n, (a, b) in before.items())
    assert [spare for _, _, spare in h.bindings()] == [m.spare_values[n] for n in m.names]


def test_create_starts_empty_in_a_used_slot_and_destroy_frees_it(mem):
    rng = np.random.default_rng(0)
    seq = _filled(mem, rng)
    assert mem.memory_used > 0
    slot = seq.slot
    mem.destroy(seq)
    assert not seq.alive and slot in mem.free_slots() and mem.memory_used == 0
    with pytest.raises(RuntimeInputError, match="does not exist"):
        mem.truncate(seq, 0)
    new = mem.create(slot)
    assert (new.length, new.tokens, new.written, new.floor, new.rope_marks) == (0, [], 0, 0, [])
    for m in mem.memories:
        if isinstance(m, RecurrentMemory):   # a recurrent row is the state itself: zeros again, no checkpoints
            assert all(not a[slot].any() for a in m.arrays.values()) and m.positions(new) == []
    assert mem.valid_bytes(new) == sum(a.nbytes for a in mem.state_write(new)[0].values())


def test_clear_is_a_truncate_to_zero(mem):
    rng = np.random.default_rng(1)
    seq = _filled(mem, rng)
    mem.reset(seq)
    assert (seq.length, seq.tokens, seq.written, seq.floor, seq.rope_marks, seq.pending) == (0, [], 0, 0, [], None)
    assert mem.memory_used == 0 and mem.rewind_points(seq) in (None, [0])
    seen: dict = {}
    feed(mem, seq, 3, rng, seen)   # and it continues like a new sequence
    assert same(view(mem, seq), seen[3])


# ------------------------------------------------------------------------------------------------ verbs
def test_every_truncate_is_exact_or_refused_with_nothing_changed(kind):
    for n in range(LENGTH + 1):
        h = KINDS[kind]()
        rng = np.random.default_rng(2)
        seen: dict = {}
        seq = _filled(h, rng, seen=seen)
        other = h.create()
        feed(h, other, 3, rng)
        m, why = _first_refusal(h, lambda m: m.truncate_refusal(seq, n)) if 0 < n < LENGTH else (None, None)
        if why is not None:
            before = everything(h)
            with pytest.raises(m.refusal_error) as err:
                h.truncate(seq, n)
            assert str(err.value) == why and "\n" not in why
            assert everything(h) == before, f"a refused truncate to {n} changed a memory"
            continue
        h.truncate(seq, n)
        assert seq.length == n and (n == 0 or same(view(h, seq), seen[n]))
        points = h.rewind_points(seq)
        assert points is None or n in points


def test_every_copy_is_exact_or_refused_with_nothing_changed(kind):
    for n in range(LENGTH + 1):
        h = KINDS[kind]()
        rng = np.random.default_rng(3)
        seen: dict = {}
        src = _filled(h, rng, seen=seen)
        dst = h.create()
        feed(h, dst, 4, rng)
        src_view = view(h, src)
        m, why = _first_refusal(h, lambda m: m.copy_refusal(src, n)) if n else (None, None)
        if why is not None:
            before = everything(h)
            with pytest.raises(m.refusal_error) as err:
                h.copy(src, dst, n)
            assert str(err.value) == why and "\n" not in why
            assert everything(h) == before, f"a refused copy of {n} changed a memory"
            continue
        h.copy(src, dst, n)
        assert (dst.length, dst.pending) == (n, None) and same(view(h, src), src_view)
        assert n == 0 or same(dict(view(h, dst), state=state_of(h, dst)), seen[n], state=True)


def test_every_relocation_keeps_every_sequence_or_is_refused_with_nothing_changed(kind):
    """``relocate``: into a free slot, then an exchange with the sequence holding the target slot; each sequence is
    the same object and its next step reads what it read before (its state, bookkeeping and checkpoints included);
    a memory that cannot move its rows (double-buffered) refuses in one line and nothing changes."""
    h = KINDS[kind]()
    rng = np.random.default_rng(11)
    a = _filled(h, rng)
    b = h.create()
    feed(h, b, 6, rng)
    b.pending, b.pending_emitted = 9, True
    before = {s.id: dict(view(h, s), state=state_of(h, s)) for s in (a, b)}
    m, why = _first_refusal(h, lambda m: m.relocate_refusal())
    if why is not None:
        snapshot = everything(h)
        with pytest.raises(m.refusal_error) as err:
            h.relocate(a, 2)
        assert str(err.value) == why and "\n" not in why and everything(h) == snapshot
        return
    assert h.relocate(a, 2) is None and (a.slot, b.slot) == (2, 1)          # into the free slot
    assert h.relocate(a, 1) is b and (a.slot, b.slot) == (1, 2)             # an exchange with b
    assert h.relocate(a, 1) is None and h.free_slots() == [0]               # where it is: nothing to do
    for s in (a, b):
        assert same(dict(view(h, s), state=state_of(h, s)), before[s.id], state=True), f"sequence {s.id} moved wrong"
    assert (b.pending, b.pending_emitted) == (9, True)
    feed(h, a, 1, rng)                                                      # the next step writes its new row
    assert a.length == LENGTH + 1 and same(view(h, b), before[b.id])
    with pytest.raises(RuntimeInputError, match="slot must be an int"):
        h.relocate(a, SLOTS)


def test_refusals_are_those_of_each_kind(kind):
    """The suite above meets a refusal of each kind that has one, raised as that kind says."""
    h = KINDS[kind]()
    seq = _filled(h, np.random.default_rng(4))
    got = {type(m).__name__: m.refusal_error for n in range(1, LENGTH) for m in h.memories
           if m.truncate_refusal(seq, n) is not None or m.copy_refusal(seq, n) is not None}
    want = {"full": {}, "latent": {}, "indexed": {},
            "ring": {"PositionalMemory": RuntimeInputError},
            "recurrent": {"RecurrentMemory": RewindError},
            "hybrid": {"PositionalMemory": RuntimeInputError, "RopeMarks": RuntimeInputError,
                       "RecurrentMemory": RewindError}}[kind]
    assert got == want


def test_the_ring_rule_is_one_rule_for_truncate_and_copy():
    h = KINDS["ring"]()
    seq = _filled(h, np.random.default_rng(5))
    [m] = h.memories
    verdicts = [(m.truncate_refusal(seq, n) is None, m.copy_refusal(seq, n) is None) for n in range(1, LENGTH)]
    assert all(a == b for a, b in verdicts) and {a for a, _ in verdicts} == {True, False}


def test_bad_verbs_are_refused_before_any_memory_is_asked(mem):
    seq = _filled(mem, np.random.default_rng(6))
    before = everything(mem)
    for call, msg in ((lambda: mem.truncate(seq, LENGTH + 1), "cannot truncate"),
                      (lambda: mem.truncate(seq, -1), "non-negative int"),
                      (lambda: mem.copy(seq, seq, 1), "into itself"),
                      (lambda: mem.copy(seq, mem.create(), LENGTH + 1), "it holds")):
        with pytest.raises(RuntimeInputError, match=msg):
            call()
    mem.destroy(mem.sequences[-1])
    assert everything(mem) == before


# ------------------------------------------------------------------------------------------------ states
def test_state_round_trip(mem):
    rng = np.random.default_rng(7)
    seq = _filled(mem, rng)
    tensors, meta = mem.state_write(seq)
    assert all(isinstance(v, str) for v in meta.values())
    parts = mem.state_check(meta, seq.length, "s")
    assert sorted(tensors) == sorted(mem.state_expected(parts))
    declared = {n: list(t.shape) for n, t in tensors.items()}
    mem.state_check_tensors(tensors, declared, parts, "s")
    back = mem.create()
    feed(mem, back, 2, rng)   # stale data in its row
    mem.state_read(back, tensors, parts)
    back.length, back.tokens = seq.length, list(seq.tokens)
    assert same(view(mem, back), view(mem, seq))
    again, meta2 = mem.state_write(back)
    assert meta2 == meta and again.keys() == tensors.keys()
    assert all(np.array_equal(again[n], tensors[n]) for n in tensors)
    assert mem.rewind_points(back) == mem.rewind_points(seq)


def test_a_state_tensor_of_another_shape_is_refused_naming_it(mem):
    seq = _filled(mem, np.random.default_rng(8))
    tensors, meta = mem.state_write(seq)
    parts = mem.state_check(meta, seq.length, "s")
    name = next(iter(tensors))
    bad = dict(tensors, **{name: tensors[name][..., :1]})
    with pytest.raises(StateFileError, match=f"s: .*tensor '{name}' has shape"):
        mem.state_check_tensors(bad, {n: list(t.shape) for n, t in bad.items()}, parts, "s")


# ------------------------------------------------------------------------------------------------ hand-off
def test_a_hand_off_moves_the_valid_bytes_cut_as_its_slicing_spec_says(mem):
    seq = _filled(mem, np.random.default_rng(9))
    tensors, _ = mem.state_write(seq)
    assert mem.valid_bytes(seq) == sum(a.nbytes for a in tensors.values())
    specs = mem.slicing_specs()
    assert list(specs) == [n for m in mem.memories for n in m.names]
    for m in mem.memories:
        for name in m.names:
            dims, full, moved = specs[name], m.shapes[name], tensors[name]
            assert len(dims) == len(full) and dims[0] == "batch_index" and moved.shape[0] == 1
            for axis, d in enumerate(dims[1:], start=1):   # an axis moved whole, or positions from ctx_start
                assert moved.shape[axis] == full[axis] if d == 0 else d == "ctx_start" and moved.shape[axis] <= full[axis]


# ------------------------------------------------------------------------------------------------ in a session
@pytest.mark.parametrize("graph", ["ring", "hybrid"])
def test_a_sessions_hand_off_is_what_its_memories_say(graph, tmp_path):
    """On a real graph (the synthetic ring graph of test_runtime_ring, the hybrid graph of _recurrent_graph), the
    session's cache is this hybrid; a transfer moves exactly the memories' valid bytes, cut as their specs say, and
    the decode side's rows equal the prefill side's."""
    import _recurrent_graph as rg
    from ring_graphs import PROMPT, ring_graph

    from qeff_kv.runtime import Session
    from qeff_kv.serve.cluster import transfer

    path = ring_graph(tmp_path / "ring") if graph == "ring" else rg.save(tmp_path / "hybrid.onnx")
    kw = {"ctx_len": 32} if graph == "ring" else {"ctx_len": 32, "prefill_seq_len": 4, "checkpoint_every": 4}
    s = Session(path, max_sequences=2, **kw) if graph == "hybrid" else Session(path, **kw)
    assert isinstance(s.cache, HybridMemory) and [type(m) for m in s.cache.memories] == \
        [PositionalMemory, RopeMarks, RecurrentMemory]
    seq = s.add_sequence()
    s.prefill(seq, list(PROMPT) if graph == "ring" else [5, 17, 3, 40, 22, 9, 31, 8, 1, 2])
    t = transfer.extract(s, seq)
    assert t.nbytes == s.cache.valid_bytes(seq) == transfer.valid_bytes(s, seq) > 0
    dims = s.cache.slicing_specs()
    specs = {re.escape(n): d for n, d in dims.items()}
    got = {e["Name"].strip("^$"): e["DimSpecs"] for e in t.slicing.get("Specs", [])}
    assert got == ({} if graph == "ring" else specs)
    target = Session(path, **kw)
    back = transfer.install(target, t)
    assert same(view(target.cache, back), view(s.cache, seq))
