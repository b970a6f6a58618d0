"""Slot actions (``POST /slots/{id}?action=save|restore|erase``, llama.cpp's names), run on the engine thread.

A *slot* is one sequence slot of the session: an index on the KV batch axis, ``0 .. max_sequences - 1``
(``GET /slots`` lists them: ``free``, ``busy`` (a request runs in it) or ``cached`` (a finished request's
sequence, kept for prompt reuse)).

* ``save``: the cached sequence of the slot to a state file (``session.save_state``) plus ``NAME.tokens.json``
  beside it with its token ids (state files hold the KV only). A busy or free slot is refused.
* ``restore``: a state file into the slot (its cached sequence, if any, is dropped; a busy slot is refused); the
  restored sequence becomes a cached sequence, so the next prompt sharing its tokens starts from it. Without
  the token file the sequence cannot be matched to a prompt (its tokens are unknown) and is dropped again.
* ``erase``: drop the slot's cached sequence.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from .. import fsutil
from ..errors import RuntimeInputError, StateFileError

ACTIONS = ("save", "restore", "erase")


def tokens_path(path: Path) -> Path:
    return path.with_name(path.name + ".tokens.json")


def _occupant(sched, slot: int):
    for a in sched._prefilling + sched._running:
        if a.seq.slot == slot:
            raise RuntimeInputError(f"slot {slot} is busy (a request is running in it)")
    for s in sched._kept.values():
        if s.slot == slot:
            return s
    return None


def run(sched, slot: int, action: str, path: Path | None) -> dict:
    if action not in ACTIONS:
        raise RuntimeInputError(f"action must be one of {', '.join(ACTIONS)}, got {action!r}")
    if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < sched.max_sequences:
        raise RuntimeInputError(f"slot id must be in [0, {sched.max_sequences}), got {slot!r}")
    session = sched.session
    seq = _occupant(sched, slot)
    t0 = time.perf_counter()
    if action == "erase":
        n = 0
        if seq is not None:
            n = seq.length
            del sched._kept[seq.id]
            session.remove_sequence(seq)
        return {"id_slot": slot, "n_erased": n}
    if path is None:
        raise RuntimeInputError(f"action {action} needs a filename")
    if action == "save":
        if seq is None:
            raise RuntimeInputError(f"slot {slot} holds no sequence to save")
        session.save_state(seq, path)
        fsutil.write_json(tokens_path(path), {"tokens": list(seq.tokens)})
        return {"id_slot": slot, "filename": path.name, "n_saved": seq.length, "n_written": path.stat().st_size,
                "timings": {"save_ms": round((time.perf_counter() - t0) * 1e3, 3)}}
    # restore
    if not path.is_file():
        raise StateFileError(f"{path.name}: no such state file in the state folder")
    if seq is not None:
        del sched._kept[seq.id]
        session.remove_sequence(seq)
    target = session.cache.create(slot=slot)
    try:
        session.load_state(path, seq=target)
    except Exception:
        session.remove_sequence(target)
        raise
    tokens = _read_tokens(tokens_path(path), target.length)
    if tokens is None:
        session.remove_sequence(target)
        raise StateFileError(f"{path.name}: no token file {tokens_path(path).name} beside it (saved by another tool?); "
                             "without its token ids the sequence cannot serve a prompt")
    target.tokens = tokens
    sched._kept[target.id] = target
    return {"id_slot": slot, "filename": path.name, "n_restored": target.length, "n_read": path.stat().st_size,
            "timings": {"restore_ms": round((time.perf_counter() - t0) * 1e3, 3)}}


def _read_tokens(path: Path, n: int) -> list[int] | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        tokens = data["tokens"]
    except (OSError, ValueError, KeyError, TypeError):
        raise StateFileError(f"{path.name}: not a token file") from None
    if not isinstance(tokens, list) or len(tokens) != n or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens):
        raise StateFileError(f"{path.name}: does not hold the {n} token ids of the state")
    return tokens
