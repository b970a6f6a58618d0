"""Lock-step batching: several sequences in a graph without ``batch_index`` (the onnxruntime-fused target).

Such a graph updates KV row ``b`` for input row ``b``: its KV batch axis must equal the input batch. The session
allocates ``max_sequences`` rows and

* **prefills** one sequence at a time through *row views* (:class:`~qeff_kv.runtime.execution.row_views.RowViews`): ``OrtValue`` objects over row ``slot`` of each
  buffer (``array[slot:slot + 1]``, contiguous, sharing memory), bound as the graph's batch-1 KV in place;
* **decodes** the rows in use in one step: rows ``0 .. k-1``, ``k - 1`` the highest slot with a token to decode,
  bound as the graph's batch-``k`` KV through a view of the first ``k`` rows (contiguous too; new sequences take
  the lowest free slot, so ``k`` follows the number of running sequences, and a step of one sequence in slot 0
  costs what a one-sequence graph's step costs). Rows with a token get it at their next position; the other rows
  below ``k`` (idle sequences, empty slots) get token 0 at their own next position, a write past their valid
  length that the next real token overwrites before anything reads it. Each row keeps its last slot for that
  write, so the usable capacity is ``ctx_len - 1``. Rows from ``k`` on are not run: not a byte of them changes.

Decoding ``N`` sequences together reads the weights once per step instead of ``N`` times: on a CPU, where a
decode step is bound by memory bandwidth, aggregate tokens/s grows with ``N``. It needs an in-place safe graph
(the row views are the buffers themselves) without ring buffers (an idle row's write would land in a slot a ring
still holds).
"""

from __future__ import annotations

import numpy as np


def refusal(*, inplace: bool, rings, batch_dim, images: bool = False, recurrent: bool = False) -> str | None:
    """Why a graph without ``batch_index`` cannot run several sequences in lock step, or ``None``."""
    if recurrent:
        return ("the graph keeps recurrent state (an idle row's token would change its state); export it with "
                "continuous batching for several sequences")
    if images:
        return ("it is a vision-language graph (one image buffer and image_idx for the whole batch); export it "
                "with continuous batching for several sequences")
    if isinstance(batch_dim, int):
        return f"the graph fixes its KV batch to {batch_dim}"
    if not inplace:
        return ("the buffers are not bound in place (inplace=False, or the graph is not in-place safe); lock-step "
                "batching binds rows of the buffers in place")
    if rings is not None:
        return "the graph has sliding-window ring buffers (an idle row's write would land in a slot the ring holds)"
    return None


def step_rows(slots) -> int:
    """The rows a decode step feeding sequences in ``slots`` runs: every row up to the highest of them."""
    return max(slots) + 1


def fill_rows(ids: np.ndarray, pos: np.ndarray, fed: dict[int, tuple[int, int]], lengths: dict[int, int]) -> None:
    """Write one decode step for each of the step's rows (``ids.shape[0]``, the first rows of the buffers):
    ``fed[slot] = (token, position)``; any other row gets token 0 at ``lengths.get(slot, 0)``, its next free
    position (never beyond the reserved last slot)."""
    ids[:, :] = 0
    pos[:, :] = -1
    for slot in range(ids.shape[0]):
        tok, p = fed.get(slot, (0, lengths.get(slot, 0)))
        ids[slot, 0] = tok
        pos[slot, 0] = p
