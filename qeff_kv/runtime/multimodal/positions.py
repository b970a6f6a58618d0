"""``position_ids`` of a run, and the multimodal RoPE offset a sequence carries (Qwen2-VL, Qwen2.5-VL).

A graph takes ``position_ids [rows, seq_len]`` (text positions; ``-1`` marks padding), or, with multimodal RoPE,
``[4, rows, seq_len]``: row 0 the text position (cache slot, mask, logit row), rows 1-3 the (t, h, w) RoPE
positions. A text token at position ``n`` of a sequence has RoPE position ``n + delta`` on rows 1-3, where
``delta`` is fixed by the images before it (:func:`qeff_kv.contract.mrope.prompt_positions`); an image's own tokens take
the rows of its patch grid.

A sequence records one :class:`RopeMark` per image it holds: where the image's tokens are and the ``delta`` of
the text after it. The marks are a memory of their own (:mod:`qeff_kv.runtime.memory.rope_marks`: their refusals,
their part of a state file); their names are re-exported here for the code that writes ``position_ids``.
"""

from __future__ import annotations

import numpy as np

from qeff_kv.runtime.execution.binding import position_shape as shape  # noqa: F401  (re-exported)
from qeff_kv.runtime.memory.rope_marks import (RopeMark, delta, read_state_marks, rewind,  # noqa: F401  (re-exported)
                                rewind_refusal, state_metadata)


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
