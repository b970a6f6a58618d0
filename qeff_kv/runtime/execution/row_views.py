"""Row views of the KV buffers: ``OrtValue`` objects over rows of each buffer, sharing its memory, on the session's
device; what the binding binds in lock step (:mod:`qeff_kv.runtime.decoding.lockstep`: a prefill through one row, a
decode step through the first ``k`` rows)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from qeff_kv.errors import RuntimeInputError
from qeff_kv.runtime.execution import device as device_mod


class RowViews:
    """``OrtValue`` views of each KV buffer's rows: batch-1 views of one row (a prefill) and views of the first
    ``k`` rows (a decode step of the rows in use), each made once."""

    def __init__(self, arrays: dict[str, np.ndarray], device=None, graph_view=None):
        self.arrays = arrays
        self.device = device or device_mod.CPU
        #: ``(name, rows view) -> the view in the graph's shape`` (a static cache's packed rank-3 buffer)
        self.graph_view = graph_view or (lambda name, view: view)
        self._views: dict[tuple[int, int], dict[str, ort.OrtValue]] = {}

    def row(self, slot: int) -> dict[str, ort.OrtValue]:
        """Row ``slot`` of every buffer, as a batch-1 buffer."""
        return self._span(slot, slot + 1)

    def first(self, rows: int) -> dict[str, ort.OrtValue]:
        """Rows ``0 .. rows-1`` of every buffer, as a batch-``rows`` buffer."""
        return self._span(0, rows)

    def span_of(self, views: dict[str, ort.OrtValue]) -> tuple[int, int]:
        """``(start, stop)``: the rows ``views`` (made here) are of."""
        for span, made in self._views.items():
            if made is views:
                return span
        raise RuntimeInputError("KV views not made by these row views")

    def _span(self, start: int, stop: int) -> dict[str, ort.OrtValue]:
        if (start, stop) not in self._views:
            views = {}
            for name, arr in self.arrays.items():
                view = arr[start:stop]
                if not view.flags["C_CONTIGUOUS"]:  # pragma: no cover - rows of a C-ordered array are contiguous
                    raise RuntimeInputError(f"KV buffer {name!r} rows {start}..{stop - 1} are not contiguous")
                views[name] = self.device.wrap(self.graph_view(name, view))
            self._views[(start, stop)] = views
        return self._views[(start, stop)]
