"""RoPE marks: a memory without buffers, for multimodal RoPE (Qwen2-VL, Qwen2.5-VL).

A text token at position ``n`` of a sequence has RoPE position ``n + delta`` on the rows 1-3 of ``position_ids``,
where ``delta`` is fixed by the images before it (:func:`qeff_kv.contract.mrope.prompt_positions`); an image's own tokens take
the rows of its patch grid. A sequence records one :class:`RopeMark` per image it holds (``seq.rope_marks``): where
the image's tokens are and the ``delta`` of the text after it.

It fits the memory interface (:mod:`.base`) as a memory with no buffers whose refusals and state metadata are its
own: a truncate or copy keeps the marks of the images before the new length, one that would cut an image is refused
(the text after a cut image has no RoPE position transformers would agree on), and a state carries the marks as the
metadata ``rope_marks`` (JSON ``[[start, end, delta], ...]``, absent when there are none). The session writes
``position_ids`` from :func:`delta` (:mod:`qeff_kv.runtime.multimodal.positions`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from qeff_kv.errors import StateFileError
from qeff_kv.runtime.memory.base import Memory
from qeff_kv.runtime.memory.registry import holds


@dataclass(frozen=True)
class RopeMark:
    """An image at positions ``[start, end)`` of a sequence; text after it has RoPE position ``n + delta``."""

    start: int
    end: int
    delta: int


def delta(marks: list[RopeMark]) -> int:
    """The RoPE offset of the next text token."""
    return marks[-1].delta if marks else 0


def rewind_refusal(marks: list[RopeMark], n: int) -> str | None:
    """Why a sequence with ``marks`` cannot be cut at ``n`` (an image would be cut), or ``None``."""
    for m in marks:
        if m.start < n < m.end:
            return (f"cannot rewind to {n}: an image holds positions [{m.start}, {m.end}) and its multimodal RoPE "
                    f"rows would be cut; rewind to {m.start} or to {m.end} or later")
    return None


def rewind(marks: list[RopeMark], n: int) -> list[RopeMark]:
    """The marks of the images wholly before position ``n``."""
    return [m for m in marks if m.end <= n]


def state_metadata(marks: list[RopeMark]) -> dict[str, str]:
    return {"rope_marks": json.dumps([[m.start, m.end, m.delta] for m in marks])} if marks else {}


def read_state_marks(meta: dict[str, str], n: int, where: str) -> list[RopeMark]:
    raw = meta.get("rope_marks")
    if raw is None:
        return []
    try:
        marks = [RopeMark(int(a), int(b), int(d)) for a, b, d in json.loads(raw)]
    except (ValueError, TypeError, RecursionError):
        raise StateFileError(f"{where}: malformed state metadata (rope_marks)") from None
    if any(not 0 <= m.start < m.end <= n for m in marks):
        raise StateFileError(f"{where}: malformed state metadata (rope_marks outside the valid length {n})")
    return marks


@holds(order=1, role="marks")
class RopeMarks(Memory):
    """The memory of every sequence's ``rope_marks`` (empty for a graph without multimodal RoPE: every verb then
    passes)."""

    def __init__(self):
        self.shapes, self.dtypes, self.arrays, self.values = {}, {}, {}, {}
        self.spare_arrays, self.spare_values = {}, {}

    @classmethod
    def build(cls, pairs, settings) -> "RopeMarks":
        return cls()

    def write(self, seq, name, data) -> None:
        raise KeyError(name)   # no buffers

    def clear(self, seq) -> None:
        seq.rope_marks = []

    def truncate_refusal(self, seq, n: int) -> str | None:
        return rewind_refusal(seq.rope_marks, int(n))

    def copy_refusal(self, src, n: int) -> str | None:
        return rewind_refusal(src.rope_marks, int(n))

    def truncate(self, seq, n: int) -> None:
        seq.rope_marks = rewind(seq.rope_marks, int(n))

    def copy(self, src, dst, n: int) -> None:
        dst.rope_marks = rewind(src.rope_marks, int(n))

    def used(self, seqs) -> int:
        return 0

    @property
    def bytes_per_sequence(self) -> int:
        return 0

    def valid_bytes(self, seq) -> int:
        return 0

    def state_write(self, seq, select=None):
        return {}, state_metadata(seq.rope_marks)

    def state_check(self, meta, n, where) -> list[RopeMark]:
        return read_state_marks(meta, n, where)

    def state_expected(self, part) -> dict:
        return {}

    def state_read(self, seq, tensors, part: list[RopeMark]) -> dict:
        seq.rope_marks = list(part)
        return {}
