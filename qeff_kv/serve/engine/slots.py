"""Slot actions (``POST /slots/{id}?action=save|restore|erase``, llama.cpp's names), run on the engine thread.

A *slot* is one sequence slot of the session: an index on the KV batch axis, ``0 .. max_sequences - 1``
(``GET /slots`` lists them: ``free``, ``busy`` (a request runs in it) or ``cached`` (a finished request's
sequence, kept for prompt reuse)).

* ``save``: the cached sequence of the slot to one state file (``session.save_state``, written to a temporary name
  and renamed into place); its token ids are in the file's metadata, under its checksum. A busy or free slot is
  refused.
* ``restore``: a state file into the slot (its cached sequence, if any, is replaced; a busy slot is refused); the
  restored sequence becomes a cached sequence, so the next prompt sharing its tokens starts from it. A file without
  its token ids (saved by another tool) cannot be matched to a prompt and is refused. The file is opened without
  following a symbolic link and must be a regular file in the state folder.
* ``erase``: drop the slot's cached sequence.

A sequence of a LoRA adapter is saved only where the runtime's state files record the adapter (a restored
sequence then runs with it, and prompt reuse keys it by its adapter); elsewhere its save is refused in one line.

:func:`run` takes what it reads and holds nothing (the scheduler calls it on its thread): the session, the slots
requests run in, and the :class:`~qeff_kv.runtime.memory.prefix_cache.PrefixCache` that says the slot's occupant
(``in_slot``, ``evict``, ``forget``, ``keep``).

Every failure leaves the slot as it was (a restore that fails after the slot's cached sequence was dropped puts it
back), and no error message names a server path or repeats a file's bytes.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from qeff_kv.errors import QeffKvError, RuntimeInputError, StateFileError
from qeff_kv.support.fsutil import read_regular_file
from qeff_kv.runtime.memory import state_file as state_mod

ACTIONS = ("save", "restore", "erase")
#: a state file larger than this is refused before it is read (a state of the largest context is far smaller)
MAX_STATE_BYTES = 64 << 30


def _occupant(prefix_cache, busy: set[int], slot: int):
    """The kept sequence in ``slot`` (None: the slot is free); a busy slot is refused."""
    if slot in busy:
        raise RuntimeInputError(f"slot {slot} is busy (a request is running in it)")
    return prefix_cache.in_slot(slot)


def run(session, prefix_cache, busy: set[int], slot: int, action: str, path: Path | None) -> dict:
    """``action`` on ``slot`` of ``session`` (``busy``: the slots requests run in; ``prefix_cache``: the kept
    sequences); its answer."""
    if action not in ACTIONS:
        raise RuntimeInputError(f"action must be one of {', '.join(ACTIONS)}, got {action!r}")
    if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < session.max_sequences:
        raise RuntimeInputError(f"slot id must be in [0, {session.max_sequences}), got {slot!r}")
    seq = _occupant(prefix_cache, busy, slot)
    t0 = time.perf_counter()
    if action == "erase":
        n = 0
        if seq is not None:
            n = seq.length
            prefix_cache.evict(seq)
        return {"id_slot": slot, "n_erased": n}
    if path is None:
        raise RuntimeInputError(f"action {action} needs a filename")
    try:
        if action == "save":
            out = _save(session, slot, seq, path)
        else:
            out = _restore(session, prefix_cache, slot, seq, path)
    except (QeffKvError, OSError) as exc:
        raise StateFileError(_scrub(str(exc), path)) from None
    key = "save_ms" if action == "save" else "restore_ms"
    return {**out, "timings": {key: round((time.perf_counter() - t0) * 1e3, 3)}}


def _scrub(message: str, path: Path) -> str:
    """``message`` without the server's folder names (a client knows its file by name)."""
    folder = str(path.parent)
    message = message.replace(str(path), path.name).replace(folder + os.sep, "")
    return message.replace(folder, "the state folder")


def _save(session, slot: int, seq, path: Path) -> dict:
    if seq is None:
        raise RuntimeInputError(f"slot {slot} holds no sequence to save")
    if any(t < 0 for t in seq.tokens):
        raise RuntimeInputError(f"slot {slot} holds a sequence whose token ids are unknown; it cannot be saved")
    # one file, staged and renamed (a refused save leaves nothing behind); a LoRA adapter's sequence records its
    # adapter, and restores only where that adapter is loaded (runtime/memory/state_file.py)
    session.save_state(seq, path)
    return {"id_slot": slot, "filename": path.name, "n_saved": seq.length, "n_written": path.stat().st_size}


def read_state_file(path: Path) -> tuple[state_mod.KVState, int]:
    """The state file ``path`` (no symbolic link, a regular file), parsed, and its size; errors name the file
    only."""
    try:
        data = read_regular_file(path, limit=MAX_STATE_BYTES)
    except FileNotFoundError:
        raise StateFileError(f"{path.name}: no such state file in the state folder") from None
    except OSError as exc:
        raise StateFileError(str(exc)) from None
    state = state_mod.parse_state(data, path.name)
    if "tokens" not in state.metadata:
        raise StateFileError(f"{path.name}: holds no token ids (saved by another tool?); without them the "
                             "sequence cannot serve a prompt")
    return state, len(data)


def _restore(session, prefix_cache, slot: int, seq, path: Path) -> dict:
    state, size = read_state_file(path)
    state_mod.validate(session, state, path.name)   # everything checked before the slot is touched
    backup = session.export_state(seq, checksum=False) if seq is not None else None
    place = 0
    if seq is not None:
        place = prefix_cache.forget(seq)
        prefix_cache.remove(seq)
    target = None
    try:
        target = session.cache.create(slot=slot)
        state_mod.import_state(session, state, seq=target, where=path.name)
    except BaseException:
        if target is not None and target.alive:
            session.remove_sequence(target)
        if backup is not None:   # the slot as it was
            _put_back(session, prefix_cache, slot, backup, place)
        raise
    prefix_cache.keep(target)
    return {"id_slot": slot, "filename": path.name, "n_restored": target.length, "n_read": size}


def _put_back(session, prefix_cache, slot: int, backup, place: int) -> None:
    """The slot's cached sequence again, from its in-memory copy, at its place in the LRU order."""
    seq = session.cache.create(slot=slot)
    session.import_state(backup, seq=seq)
    prefix_cache.keep(seq, place)
