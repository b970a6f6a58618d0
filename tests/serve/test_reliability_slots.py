"""Issue 31, items 1, 6 and 7: slot actions under malformed files, links and injected faults.

A restore whose token ids are malformed leaves no sequence allocated; every failure path of a slot action leaves the
slot as it was (a property test injecting one failure at each step of a restore); a save is one file whose token
ids are under the checksum; restore does not follow symbolic links and its messages name neither the server's
folder nor the file's bytes.

Driven through the scheduler's ``slot_action`` (what ``POST /slots/{id}`` calls) on the tiny continuous-batching
export of conftest.py (3 slots).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qeff_kv.errors import QeffKvError, StateFileError
from qeff_kv.runtime.decoding.sampling import GREEDY
from qeff_kv.serve.engine.engine import Finished, GenerationRequest

PROMPT = (5, 9, 13, 2, 7, 11, 3, 8, 6)


@pytest.fixture(scope="module")
def sched(own_cb_graph):
    from qeff_kv.runtime import Session
    from qeff_kv.serve.engine.scheduler import Scheduler

    engine = Scheduler(Session(own_cb_graph))
    yield engine
    engine.close()


@pytest.fixture
def folder(tmp_path):
    d = tmp_path / "states"
    d.mkdir()
    return d


def _run(sched, prompt=PROMPT, n=4) -> list:
    h = sched.submit(GenerationRequest(f"r{len(prompt)}-{n}", tuple(prompt), n, GREEDY, frozenset()))
    events = list(h.iter_sync(timeout=60))
    assert isinstance(events[-1], Finished) and events[-1].finish_reason == "length", events[-1]
    return events


def _snapshot(sched) -> dict:
    """Per slot: (state, tokens, KV tensors) as the engine thread sees it between two turns."""
    def take(s):
        out = {}
        for seq in s.prefix_cache.kept:
            tensors = s.session.export_state(seq, checksum=False).tensors
            out[seq.slot] = (list(seq.tokens), {k: np.array(v) for k, v in tensors.items()})
        busy = s.busy_slots()
        free = s.session.cache.free_slots()
        return {"kept": out, "busy": busy, "free": free, "lru": [q.slot for q in s.prefix_cache.kept]}
    return sched.run_on_engine(("call", take)).result(timeout=30)


def _same(a: dict, b: dict) -> None:
    assert a["busy"] == b["busy"] and a["free"] == b["free"] and a["lru"] == b["lru"]
    assert sorted(a["kept"]) == sorted(b["kept"])
    for slot, (toks, tensors) in a["kept"].items():
        toks2, tensors2 = b["kept"][slot]
        assert toks == toks2
        assert sorted(tensors) == sorted(tensors2)
        for k in tensors:
            np.testing.assert_array_equal(tensors[k], tensors2[k])


def _erase_all(sched) -> None:
    for i in range(sched.max_sequences):
        sched.slot_action(i, "erase")


def _cached_slot(sched) -> int:
    _erase_all(sched)
    _run(sched)
    snap = _snapshot(sched)
    [slot] = list(snap["kept"])
    return slot


def _saved(sched, folder, name="s.safetensors") -> tuple[int, object]:
    slot = _cached_slot(sched)
    out = sched.slot_action(slot, "save", folder / name)
    assert out["n_saved"] == len(PROMPT) + 3
    return slot, folder / name


def _rewrite(path, edit) -> None:
    """Rewrite a state file with ``edit(metadata)`` applied and a checksum recomputed (a forger's file)."""
    from safetensors.numpy import save

    from qeff_kv.runtime.memory import state_file as state_mod

    s = state_mod.read_state(path)
    meta = dict(s.metadata)
    edit(meta)
    meta["checksum"] = state_mod._checksum(meta, s.tensors)
    path.write_bytes(save(s.tensors, metadata=meta))


# ------------------------------------------------------------------------------------------ item 7: one file, checksum
def test_a_save_is_one_file_with_its_tokens_under_the_checksum(sched, folder):
    from qeff_kv.runtime.memory import state_file as state_mod

    _, path = _saved(sched, folder)
    assert sorted(p.name for p in folder.iterdir()) == ["s.safetensors"]
    meta = state_mod.read_state(path).metadata
    assert json.loads(meta["tokens"])[:len(PROMPT)] == list(PROMPT)
    # editing the token list (and nothing else) breaks the checksum: the file is refused, not trusted
    data = path.read_bytes()
    old = meta["tokens"].encode()
    edited = old.replace(b"[5,", b"[6,", 1)
    assert edited != old and len(edited) == len(old)
    path.write_bytes(data.replace(old, edited))
    with pytest.raises(StateFileError, match="s.safetensors: checksum mismatch"):
        sched.slot_action(1, "restore", path)


def test_a_refused_save_leaves_nothing_behind(sched, folder):
    slot = _cached_slot(sched)
    (folder / "taken").mkdir()
    with pytest.raises(QeffKvError, match="taken") as err:
        sched.slot_action(slot, "save", folder / "taken")
    assert str(folder) not in str(err.value)
    assert sorted(p.name for p in folder.iterdir()) == ["taken"]


# ------------------------------------------------------------------------------------------ item 1: malformed tokens
@pytest.mark.parametrize("tokens", ["[1,2]", "not json", "{}", "[" * 6000 + "]" * 6000, "[-1]", ""])
def test_malformed_token_ids_leave_no_sequence_allocated(sched, folder, tokens):
    slot, path = _saved(sched, folder)
    _rewrite(path, lambda m: m.update(tokens=tokens))
    _erase_all(sched)
    before = _snapshot(sched)
    for target in range(sched.max_sequences):   # one refused restore per slot
        with pytest.raises(StateFileError, match=r"s.safetensors: malformed state metadata \(tokens"):
            sched.slot_action(target, "restore", path)
    _same(before, _snapshot(sched))
    assert len(before["free"]) == sched.max_sequences
    _run(sched, n=2)   # and a new request still runs (before the fix it waited forever)


def test_a_file_without_token_ids_is_refused(sched, folder):
    _, path = _saved(sched, folder)
    _rewrite(path, lambda m: m.pop("tokens"))
    with pytest.raises(StateFileError, match="s.safetensors: holds no token ids"):
        sched.slot_action(0, "restore", path)


# ------------------------------------------------------------------------------------------ item 6: links, leaks
def test_restore_does_not_follow_links_nor_echo_bytes(sched, folder, tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(b"root:x:0:0:root:/root:/bin/bash\n" * 4)
    (folder / "link.safetensors").symlink_to(secret)
    with pytest.raises(StateFileError) as err:
        sched.slot_action(0, "restore", folder / "link.safetensors")
    msg = str(err.value)
    assert msg == "link.safetensors: is a symbolic link; refusing to follow it"
    # a regular file with those bytes: refused without repeating them or a number read from them
    (folder / "plain.safetensors").write_bytes(secret.read_bytes())
    with pytest.raises(StateFileError) as err:
        sched.slot_action(0, "restore", folder / "plain.safetensors")
    msg = str(err.value)
    n = int.from_bytes(secret.read_bytes()[:8], "little")
    assert msg.startswith("plain.safetensors: truncated or not a safetensors file")
    assert "root" not in msg and str(n) not in msg and str(folder) not in msg


def test_restore_refuses_what_is_not_a_regular_file(sched, folder):
    os.mkfifo(folder / "fifo.safetensors")
    with pytest.raises(StateFileError, match=r"^fifo.safetensors: not a regular file$"):
        sched.slot_action(0, "restore", folder / "fifo.safetensors")
    with pytest.raises(StateFileError, match=r"^gone.safetensors: no such state file in the state folder$"):
        sched.slot_action(0, "restore", folder / "gone.safetensors")


def test_a_deeply_nested_header_is_a_one_line_refusal(sched, folder):
    header = b"[" * 6000 + b"]" * 6000
    (folder / "deep.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(StateFileError, match=r"deep.safetensors: truncated or not a safetensors file \(header is"):
        sched.slot_action(0, "restore", folder / "deep.safetensors")


# ------------------------------------------------------------------------------------------ the property
class _Injected(RuntimeError):
    pass


def _once(fn):
    """``fn`` whose first call raises :class:`_Injected` (later calls, e.g. putting the old sequence back, run)."""
    calls = []

    def wrapper(*a, **k):
        calls.append(1)
        if len(calls) == 1:
            raise _Injected("injected")
        return fn(*a, **k)
    return wrapper


def _inject(monkeypatch, sched, step: str) -> None:
    from qeff_kv.runtime.memory import state_file as state_mod
    from qeff_kv.serve.engine import slots as slots_mod

    cache = sched.session.cache
    if step == "read":
        monkeypatch.setattr(slots_mod, "read_regular_file", _once(slots_mod.read_regular_file))
    elif step in ("parse_state", "validate", "import_state"):
        monkeypatch.setattr(state_mod, step, _once(getattr(state_mod, step)))
    elif step == "backup":
        monkeypatch.setattr(sched.session, "export_state", _once(sched.session.export_state))
    elif step == "create":
        monkeypatch.setattr(cache, "create", _once(cache.create))
    elif step == "second_write":   # half the tensors written, then a failure
        real, calls = cache.write, []

        def write(*a, **k):
            calls.append(1)
            if len(calls) == 2:
                raise _Injected("injected")
            return real(*a, **k)
        monkeypatch.setattr(cache, "write", write)


STEPS = ["read", "parse_state", "validate", "backup", "create", "import_state", "second_write"]


@settings(max_examples=14, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(step=st.sampled_from(STEPS), occupied=st.booleans(), other=st.integers(0, 2))
def test_every_failing_restore_leaves_the_slot_as_it_was(sched, folder, monkeypatch, step, occupied, other):
    slot, path = _saved(sched, folder, "p.safetensors")
    occupied = occupied or step == "backup"   # a backup is taken of an occupied slot only
    if not occupied:
        sched.slot_action(slot, "erase")
    target = slot if occupied else other
    before = _snapshot(sched)
    with monkeypatch.context() as m:
        _inject(m, sched, step)
        with pytest.raises((_Injected, QeffKvError)):
            sched.slot_action(target, "restore", path)
    _same(before, _snapshot(sched))
    # and the same restore without a fault works
    out = sched.slot_action(target, "restore", path)
    assert out["n_restored"] == len(PROMPT) + 3
    assert _snapshot(sched)["kept"][target][0][:len(PROMPT)] == list(PROMPT)


SAVE_STEPS = ["export_state", "fsync", "write"]


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(step=st.sampled_from(SAVE_STEPS), existing=st.booleans())
def test_every_failing_save_leaves_the_slot_and_the_folder_as_they_were(sched, folder, monkeypatch, step, existing):
    from qeff_kv.support import fsutil
    from qeff_kv.runtime.memory import state_file as state_mod

    slot, path = _saved(sched, folder, "q.safetensors")
    if not existing:
        path.unlink()
    files = {p.name: p.read_bytes() for p in folder.iterdir()}
    _run(sched, PROMPT[:5] + (40, 41), n=2)   # another sequence, so that the save would write other bytes
    target = [s for s, (toks, _) in _snapshot(sched)["kept"].items() if toks[:7] == [*PROMPT[:5], 40, 41]][0]
    before = _snapshot(sched)
    with monkeypatch.context() as m:
        if step == "export_state":
            m.setattr(state_mod, "export_state", _once(state_mod.export_state))
        elif step == "fsync":
            m.setattr(fsutil, "_fsync", _once(fsutil._fsync))
        else:
            m.setattr(fsutil, "write_bytes", _once(fsutil.write_bytes))
        with pytest.raises((_Injected, QeffKvError)):
            sched.slot_action(target, "save", path)
    _same(before, _snapshot(sched))
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == files   # no half pair, no temporary file
