"""Compute context length (CCL, contract section 9): which ``comp_ctx_lengths`` the session feeds.

A graph with the optional int64 1-D input ``comp_ctx_lengths`` (ours with ``export --ccl``, or the peer's)
attends over the first ``L = len(comp_ctx_lengths)`` cache slots only; its contents do not matter (the session
feeds ones, as the peer's runner does). Every position a step touches must be ``< L``, else the new token's
own key would be cut off. The allowed lengths are the export's list (manifest ``"ccl"``) when there is one,
otherwise the powers of two below the capacity; the capacity itself is always the last one. A step runs at
the smallest allowed ``L`` that holds ``max(position) + 1`` over its rows, so ``L`` steps up as sequences grow.
"""

from __future__ import annotations

import bisect

import numpy as np
import onnxruntime as ort

from qeff_kv.contract import naming

INPUT = naming.CCL_INPUT


def allowed_lengths(capacity: int, listed=None) -> list[int]:
    """The lengths a session with this ``capacity`` may feed: the listed ones up to the capacity (else powers
    of two below it), then the capacity."""
    if listed:
        vals = sorted({int(v) for v in listed if isinstance(v, int) and not isinstance(v, bool) and 0 < v < capacity})
    else:
        vals, v = [], 1
        while v < capacity:
            vals.append(v)
            v *= 2
    return vals + [int(capacity)]


class CCLFeeder:
    """Picks ``L`` for a step and keeps one preallocated ``comp_ctx_lengths`` OrtValue per length."""

    def __init__(self, capacity: int, listed=None):
        self.lengths = allowed_lengths(capacity, listed)
        self._values: dict[int, ort.OrtValue] = {}
        self._arrays: dict[int, np.ndarray] = {}

    def length_for(self, needed: int) -> int:
        """The smallest allowed length ``>= needed`` (positions ``[0, needed)`` must be attended)."""
        i = bisect.bisect_left(self.lengths, int(needed))
        return self.lengths[min(i, len(self.lengths) - 1)]

    def value(self, length: int) -> ort.OrtValue:
        v = self._values.get(length)
        if v is None:
            self._arrays[length] = np.ones(length, dtype=np.int64)
            v = self._values[length] = ort.OrtValue.ortvalue_from_numpy(self._arrays[length])
        return v
