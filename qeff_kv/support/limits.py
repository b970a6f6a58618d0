"""Limits checked before anything is allocated or written: integer ranges and memory requests.

* :data:`MAX_DIM`: the largest context length, prefill length or batch size accepted anywhere (int32, what
  accelerator compilers and onnxruntime's kernels index with). Larger values are refused with one line
  instead of overflowing 64-bit shapes or landing in ``specializations.json``.
* :func:`kv_buffer_bytes` / :func:`require_memory`: a buffer that would not fit in the memory available now is
  refused with its size in one line, before numpy, onnxruntime or torch try (and fail with a traceback).
"""

from __future__ import annotations

import os
from typing import Iterable

import numpy as np

from qeff_kv.errors import MemoryLimitError, QeffKvError, RuntimeInputError

#: Largest ctx_len / prefill_seq_len / batch size / full_batch_size accepted (2**31 - 1).
MAX_DIM = 2**31 - 1
#: Largest token id, seed or other 64-bit integer fed to a graph.
MAX_INT64 = 2**63 - 1


def positive_int(label: str, value, *, maximum: int = MAX_DIM, minimum: int = 1,
                 error: type[QeffKvError] = RuntimeInputError) -> int:
    """``value`` as an int in ``[minimum, maximum]``; a typed one-line error otherwise (bools are refused)."""
    kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise error(f"{label} must be {kind}, got {value!r}")
    if value > maximum:
        raise error(f"{label} {value} is larger than the largest supported value {maximum}")
    return int(value)


def human_bytes(n: int) -> str:
    for unit, size in (("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


#: the memory available, in GB (10**9 bytes), instead of what this machine reports (tests and rehearsals of the
#: memory refusals: a tiny model made "too big"); every memory check reads it through :func:`available_memory`
MEMORY_ENV = "QEFF_KV_MEMORY_AVAILABLE_GB"


def available_memory() -> int | None:
    """Bytes of memory available now (``MemAvailable``), or ``None`` where it cannot be known; ``$``
    :data:`MEMORY_ENV` (GB) where it is set."""
    fake = os.environ.get(MEMORY_ENV, "").strip()
    if fake:
        try:
            gb = float(fake)
        except ValueError:
            gb = -1.0
        if not 0 <= gb < 1e12:
            raise RuntimeInputError(f"{MEMORY_ENV}={fake!r} is not a number of GB (e.g. 12.5); unset it to use "
                                    "the memory this machine reports")
        return int(gb * 1e9)
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def kv_buffer_bytes(shapes: Iterable[tuple[int, int, int]], *, ctx_len: int, batch: int, itemsize: int,
                    copies: int = 1) -> int:
    """Bytes of KV buffers ``[batch, heads, ctx_len, head_dim]`` for every ``(heads, head_dim)`` in ``shapes``
    (``copies`` sets of them), in exact integer arithmetic (no 64-bit overflow)."""
    per_position = sum(int(h) * int(d) for h, d in shapes) * int(itemsize)
    return per_position * int(ctx_len) * int(batch) * int(copies)


def require_memory(nbytes: int, what: str, *, error: type[QeffKvError] = MemoryLimitError) -> None:
    """Refuse (one line, with the size) a request of ``nbytes`` that does not fit in the memory available now.

    A request above 2**63 bytes is refused wherever memory cannot be measured.
    """
    avail = available_memory()
    if nbytes > MAX_INT64 or (avail is not None and nbytes > avail):
        have = f"; {human_bytes(avail)} is available" if avail is not None else ""
        raise error(f"{what} need {human_bytes(nbytes)} ({nbytes} bytes){have}: it does not fit in this "
                    "machine's memory; use a smaller ctx_len or fewer sequences")
