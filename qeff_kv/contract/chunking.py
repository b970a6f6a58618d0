"""Prefill chunk plans: how a run of prompt tokens is cut into graph calls. No onnxruntime, no torch.

A chunk holds at most ``chunk`` tokens. Models whose image tokens attend to each other both ways (Gemma3:
``token_type_ids`` in transformers) need every image in one chunk: a chunk then ends before an image run that
would not fit in it, so the run starts the next chunk (``keep_runs_whole``).
"""

from __future__ import annotations

from typing import Sequence

from qeff_kv.errors import RuntimeInputError


def token_runs(tokens: Sequence[int], token: int) -> list[tuple[int, int]]:
    """``(start, length)`` of every maximal run of ``token`` in ``tokens``."""
    runs, i, n = [], 0, len(tokens)
    while i < n:
        if tokens[i] == token:
            j = i
            while j < n and tokens[j] == token:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    return runs


def plan_chunks(tokens: Sequence[int], chunk: int, *, run_token: int | None = None,
                keep_runs_whole: bool = False, error=RuntimeInputError) -> list[tuple[int, int]]:
    """``(offset, count)`` chunks covering ``tokens``; with ``keep_runs_whole`` no run of ``run_token`` is split
    (a run longer than ``chunk`` is refused with ``error``, one line)."""
    if chunk < 1:
        raise error(f"chunk length must be positive, got {chunk}")
    runs = token_runs(tokens, run_token) if keep_runs_whole and run_token is not None else []
    for start, length in runs:
        if length > chunk:
            raise error(f"an image of {length} tokens does not fit in one prefill chunk of {chunk}; its tokens "
                        f"attend to each other both ways, so use a prefill length of {length} or more")
    out, off, n = [], 0, len(tokens)
    while off < n:
        end = min(off + chunk, n)
        for start, length in runs:
            if off < start < end < start + length:   # the run would be split: end before it
                end = start
                break
        out.append((off, end - off))
        off = end
    return out
