"""Which view of a stand-in a traced constant is (:mod:`.stream`): the exporter's folded parameter table holds
the skeleton's stand-ins themselves or views of them (``Transpose(W)`` folded into a MatMul weight, GPT-OSS's
``sinks.reshape(1, -1, 1, 1)``); each is read back from the checkpoint as that view of its tensor. A stand-in of
``shape`` is ``base[S0, ..., S(n-2), 1].expand(shape)`` (its last axis has stride 0), so a view's strides tell
which of the parameter's axes it shows."""

from __future__ import annotations

import numpy as np


class NotAView(Exception):
    """The folded tensor is not a permutation (or a reshape by axes of size 1) of its parameter."""


def permutation(t, shape: tuple) -> tuple | None:
    """The axes of the stand-in of ``shape`` that ``t`` (a view of it) shows, in order (None: in place);
    refuses another view."""
    import torch

    strides = torch.empty(shape[:-1] + (1,) if shape else (), device="meta").expand(shape).stride()
    if t.storage_offset() != 0 or t.dim() != len(shape):
        raise NotAView(f"a folded weight of shape {tuple(t.shape)} is not a view of its parameter {shape}")
    perm, free = [], list(range(len(shape)))
    for size, stride in zip(t.shape, t.stride()):
        match = next((j for j in free if shape[j] == size and (strides[j] == stride or size == 1)), None)
        if match is None:
            raise NotAView(f"a folded weight of shape {tuple(t.shape)} is not a permutation of {shape}")
        perm.append(match)
        free.remove(match)
    return None if perm == sorted(perm) else tuple(perm)


def view_of(t, shape: tuple) -> tuple:
    """``(perm, reshaped)``: the axes of the stand-in of ``shape`` that ``t`` shows (:func:`permutation`) and,
    where ``t`` also adds or drops axes of size 1, ``t``'s shape, with ``perm`` over the parameter's axes of size
    > 1 (else None). A parameter whose last axis has size 1 (its stride is that of a real axis) is refused."""
    if t.dim() == len(shape):
        return permutation(t, shape), None
    kept = tuple(d for d in shape if d != 1)
    if t.storage_offset() != 0 or t.numel() != int(np.prod(shape)) or (shape and shape[-1] == 1 and kept):
        raise NotAView(f"a folded weight of shape {tuple(t.shape)} is not a view of its parameter {shape}")
    return permutation(t.squeeze(), kept), tuple(t.shape)


def sliced_view(t, shape: tuple) -> tuple | None:
    """``((start, stop) per axis)`` where the folded tensor ``t`` is a cut of the stand-in of ``shape``
    (``parameter[a0:b0, a1:b1, ...]``: the axes in order, step 1; InternVL's vision position table is folded as
    ``[:, :1]`` and ``[:, 1:]``); None where it is not one (or is the whole parameter). The last axis must be whole:
    a stand-in holds one element per row, so a cut along it cannot be told from another."""
    import numpy as np

    shape = tuple(int(d) for d in shape)
    if not shape or t.dim() != len(shape) or int(t.shape[-1]) != shape[-1] \
            or (t.storage_offset() == 0 and tuple(t.shape) == shape):
        return None
    base = shape[:-1] + (1,)
    strides = tuple(int(np.prod(base[i + 1:], dtype=np.int64)) for i in range(len(shape) - 1)) + (0,)
    if any(n > 1 and s != strides[i] for i, (n, s) in enumerate(zip(t.shape, t.stride()))) \
            or t.storage_offset() >= int(np.prod(base, dtype=np.int64)):
        return None
    starts = np.unravel_index(t.storage_offset(), base)
    cut = tuple((int(a), int(a) + int(n)) for a, n in zip(starts, t.shape))
    return cut if all(b <= d for (_a, b), d in zip(cut, shape)) else None


def row_view(t, shape: tuple) -> tuple | None:
    """``(offset, other shape, other strides, column axis)`` where ``t`` shows the stand-in of ``shape`` ``(..., C)``
    as a strided choice of its rows with the last axis whole at ``column axis`` (MLA's per-head halves of
    ``kv_b_proj``: ``weight.view(H, n + v, r)[:, :n]``, maybe transposed): row ``offset + sum(i_k * stride_k)`` over the
    other axes. None where ``t`` is not such a view (no single whole, stride-0 axis of size ``C``, or a broadcast)."""
    shape = tuple(int(d) for d in shape)
    if not shape or shape[-1] == 1:
        return None
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    cols = [j for j, (n, s) in enumerate(zip(t.shape, t.stride())) if n == shape[-1] and s == 0]
    if len(cols) != 1:
        return None
    col = cols[0]
    other = [(int(n), int(s)) for j, (n, s) in enumerate(zip(t.shape, t.stride())) if j != col]
    if any(s == 0 and n > 1 for n, s in other):
        return None
    last = t.storage_offset() + sum((n - 1) * s for n, s in other)
    if t.storage_offset() < 0 or last >= rows or any(s < 0 for _n, s in other):
        return None
    return int(t.storage_offset()), tuple(n for n, _s in other), tuple(s for _n, s in other), col


def read_rows(arr: np.ndarray, view: tuple) -> np.ndarray:
    """The :func:`row_view` ``view`` of the checkpoint tensor ``arr``."""
    offset, other, strides, col = view
    index = offset + sum(np.arange(n).reshape([-1 if k == i else 1 for k in range(len(other))]) * s
                         for i, (n, s) in enumerate(zip(other, strides))) if other else np.array(offset)
    picked = arr.reshape(-1, arr.shape[-1])[np.asarray(index).reshape(-1)].reshape(tuple(other) + (arr.shape[-1],))
    return np.ascontiguousarray(np.moveaxis(picked, -1, col))
