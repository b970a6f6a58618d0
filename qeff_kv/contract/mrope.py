"""Multimodal RoPE positions (Qwen2-VL, Qwen2.5-VL), in numpy: what transformers' ``get_rope_index`` computes,
for the runtime and for verification. No torch.

A language graph of such a model takes ``position_ids [4, batch, seq_len]``: row 0 is the text position (the
cache slot, the mask, the logit row), rows 1-3 the (temporal, height, width) RoPE positions. Text tokens get
the same value on all three rows, counting on from where the previous run ended; an image of grid ``(t, h, w)``
patches merged ``m x m`` takes ``t * (h/m) * (w/m)`` tokens whose rows are ``start + (ti, hi, wi)`` over the grid
in row-major order, and the text after it continues at ``start + max(h, w) / m``. After the prompt, a token at
text position ``n`` has RoPE position ``n + delta`` on every row, ``delta = max(prompt rows) + 1 - len(prompt)``.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from qeff_kv.contract.chunking import token_runs
from qeff_kv.errors import RuntimeInputError


def vision_rows(start: int, grid: Sequence[int], merge: int) -> np.ndarray:
    """``[3, t * (h/m) * (w/m)]``: the RoPE rows of one image's tokens starting at ``start``."""
    t, h, w = int(grid[0]), int(grid[1]) // merge, int(grid[2]) // merge
    tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
    return np.stack([tt.reshape(-1), hh.reshape(-1), ww.reshape(-1)]).astype(np.int64) + start


def prompt_positions(tokens: Sequence[int], image_token: int, grids: Sequence[Sequence[int]],
                     merge: int) -> tuple[np.ndarray, int]:
    """``(rows [3, len(tokens)], delta)`` for a prompt whose image-token runs are the images of ``grids``, in
    order. A run whose length is not its image's token count is refused in one line."""
    runs = token_runs(tokens, image_token)
    if len(runs) != len(grids):
        raise RuntimeInputError(f"the prompt has {len(runs)} images (runs of image token {image_token}) but "
                                f"{len(grids)} image grids were given")
    parts, pos, at = [], 0, 0
    for (start, length), grid in zip(runs, grids):
        if start > at:
            n = start - at
            parts.append(np.tile(np.arange(pos, pos + n, dtype=np.int64), (3, 1)))
            pos += n
        rows = vision_rows(pos, grid, merge)
        if rows.shape[1] != length:
            raise RuntimeInputError(f"an image of grid {list(grid)} takes {rows.shape[1]} tokens but the prompt has "
                                    f"{length} image token(s) there")
        parts.append(rows)
        pos += max(int(grid[1]), int(grid[2])) // merge
        at = start + length
    if at < len(tokens):
        n = len(tokens) - at
        parts.append(np.tile(np.arange(pos, pos + n, dtype=np.int64), (3, 1)))
    rows = np.concatenate(parts, axis=1) if parts else np.zeros((3, 0), np.int64)
    delta = int(rows.max()) + 1 - len(tokens) if len(tokens) else 0
    return rows, delta


def graph_positions(text: Sequence[int], rows: np.ndarray) -> np.ndarray:
    """``position_ids [4, 1, S]`` for one sequence's chunk: text positions (-1 for padding) over its RoPE rows
    (padding rows repeat nothing: they are 0 and never read)."""
    text = np.asarray(text, dtype=np.int64)
    out = np.zeros((4, 1, len(text)), dtype=np.int64)
    out[0, 0] = text
    out[1:, 0, :rows.shape[1]] = rows
    return out


def image_marks(tokens: Sequence[int], image_token: int, grids: Sequence[Sequence[int]],
                merge: int) -> list[tuple[int, int, int]]:
    """``(start, end, delta)`` of each image-token run of ``tokens`` (the images of ``grids``, in order): the text
    token at index ``i >= end`` has RoPE position ``i + delta`` (until the next image)."""
    out, pos, at = [], 0, 0
    for (start, length), grid in zip(token_runs(tokens, image_token), grids):
        pos += start - at + max(int(grid[1]), int(grid[2])) // merge
        at = start + length
        out.append((start, at, pos - at))
    return out
