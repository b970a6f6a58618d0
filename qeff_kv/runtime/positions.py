"""``position_ids`` of a run, and the multimodal RoPE offset a sequence carries (Qwen2-VL, Qwen2.5-VL).

A graph takes ``position_ids [rows, seq_len]`` (text positions; ``-1`` marks padding), or, with multimodal RoPE,
``[4, rows, seq_len]``: row 0 the text position (cache slot, mask, logit row), rows 1-3 the (t, h, w) RoPE
positions. A text token at position ``n`` of a sequence has RoPE position ``n + delta`` on rows 1-3, where
``delta`` is fixed by the images before it (:func:`qeff_kv.mrope.prompt_positions`); an image's own tokens take
the rows of its patch grid.

A sequence records one :class:`RopeMark` per image it holds: where the image's tokens are and the ``delta`` of
the text after it. A rewind keeps the marks of the images before the new length; a rewind into an image is
refused (the text after a cut image has no RoPE position transformers would agree on).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from ..errors import StateFileError


def shape(mrope: bool, rows: int, seq_len: int) -> tuple[int, ...]:
    return (4, rows, seq_len) if mrope else (rows, seq_len)


def clear(pos: np.ndarray) -> None:
    """Every column padding: text position -1 (RoPE rows 0, never read)."""
    if pos.ndim == 3:
        pos[0].fill(-1)
        pos[1:].fill(0)
    else:
        pos.fill(-1)


def write(pos: np.ndarray, row: int, start: int, count: int, rope: np.ndarray | None = None,
          delta: int = 0) -> None:
    """Row ``row`` holds positions ``[start, start + count)``; with multimodal RoPE, RoPE rows ``rope``
    (``[3, count]``) or the text positions plus ``delta``."""
    if pos.ndim == 2:   # the decode step's path: no array made for one position
        if count == 1:
            pos[row, 0] = start
        else:
            pos[row, :count] = np.arange(start, start + count, dtype=np.int64)
        return
    text = np.arange(start, start + count, dtype=np.int64)
    pos[0, row, :count] = text
    pos[1:, row, :count] = rope if rope is not None else text + delta


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
