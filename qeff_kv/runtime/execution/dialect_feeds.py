"""The control inputs a KV dialect's graph takes beside ``input_ids`` and ``position_ids`` (``docs/naming.md``
"Dialects"), derived on every run from the ``position_ids`` the session already wrote, and bound by
:meth:`~qeff_kv.runtime.execution.binding.GraphBinding.run` just before the graph runs.

* **retained state** (ours, the peer's) and a **shared-buffer past/present** graph without ``attention_mask``:
  nothing (:class:`DialectFeeds`);
* a **static cache** (mobius-onnx ``--static-cache``, ``TensorScatter`` at ``write_indices``): per row,
  ``write_indices`` = the first position of the row's tokens in this step (the slot its first token goes to; the
  graph writes the row's ``seq_len`` columns from there, so a row's positions must be consecutive from its first
  column and end within the capacity) and ``nonpad_kv_seqlen`` = 1 + the row's last valid position (the positions
  it holds after the step; padding ``-1`` ignored);
* ``attention_mask`` (onnxruntime-genai's past/present graphs): ``[rows, the most positions a row holds after the
  step]``, 1 where the slot is below that row's held length.

A dialect whose padding the graph could not mask exactly (a static cache: ``TensorScatter`` writes every column and
its causal attention is aligned to ``nonpad_kv_seqlen``) says so in :attr:`DialectFeeds.pads`; its short prefill
chunks then run unpadded.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from qeff_kv.contract import naming
from qeff_kv.errors import ContractError, RuntimeInputError
from qeff_kv.runtime.execution import device as device_mod

#: the control inputs, by dialect, that this module feeds
CONTROL_INPUTS: dict[str, tuple[str, ...]] = {
    naming.RETAINED_STATE: (),
    naming.PAST_PRESENT: (naming.ATTENTION_MASK_INPUT,),
    naming.STATIC_CACHE: (naming.WRITE_INDICES_INPUT, naming.NONPAD_KV_SEQLEN_INPUT, naming.ATTENTION_MASK_INPUT),
}


def row_spans(position_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(first, held)`` per row of ``position_ids`` (``[rows, seq_len]``, or ``[4, rows, seq_len]``: its text row):
    the row's first valid position and 1 + its last (``-1`` is padding). A row without a valid position is refused
    (a write at slot 0 would overwrite the row's first position)."""
    text = position_ids[0] if position_ids.ndim == 3 else position_ids
    valid = text >= 0
    if not valid.any(axis=1).all():
        raise RuntimeInputError("a step row has no valid position; a static cache would write its padding at slot 0")
    first = np.where(valid, text, np.iinfo(np.int64).max).min(axis=1)
    held = np.where(valid, text, -1).max(axis=1) + 1
    return first, held


class DialectFeeds:
    """Retained state: no control input; short chunks of another exporter's graph may be padded (``-1``)."""

    names: tuple[str, ...] = ()

    def __init__(self, *, pads: bool = True):
        self.pads = pads

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(self.names)})"

    def with_device(self, device) -> "DialectFeeds":
        """The feeds a session on ``device`` runs with (their buffers there)."""
        return self

    def feed(self, io, position_ids: np.ndarray) -> None:
        """Bind this run's control inputs, derived from ``position_ids`` (already written)."""


class ControlFeeds(DialectFeeds):
    """Feeds the control inputs ``dtypes`` names (a subset of :data:`CONTROL_INPUTS` of the graph's dialect) for
    buffers of ``capacity`` slots; one buffer per name and shape, bound when it changes, written every run."""

    def __init__(self, dtypes: dict[str, np.dtype], capacity: int, *, pads: bool, device=None):
        super().__init__(pads=pads)
        self.names = tuple(dtypes)
        self.dtypes = dtypes
        self.capacity = int(capacity)
        self.device = device or device_mod.CPU
        self._buffers: dict[tuple[str, tuple[int, ...]], tuple[np.ndarray, ort.OrtValue]] = {}
        self._bound: dict[str, ort.OrtValue] = {}
        #: what the last run was fed (name -> its buffer)
        self.last: dict[str, np.ndarray] = {}

    def with_device(self, device) -> "ControlFeeds":
        """The same feeds with buffers on ``device`` (the session's)."""
        return ControlFeeds(self.dtypes, self.capacity, pads=self.pads, device=device)

    def _buffer(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        key = (name, shape)
        if key not in self._buffers:
            self._buffers[key] = self.device.buffer(shape, self.dtypes[name])
        return self._buffers[key][0]

    def _bind(self, io, name: str, shape: tuple[int, ...]) -> None:
        value = self._buffers[(name, shape)][1]
        if self._bound.get(name) is not value:   # a staged device's executor binds every input again itself
            io.bind_ortvalue_input(name, value)
            self._bound[name] = value

    def feed(self, io, position_ids: np.ndarray) -> None:
        first, held = row_spans(position_ids)
        rows, width = len(first), position_ids.shape[-1]
        if naming.WRITE_INDICES_INPUT in self.names:
            _require_within(position_ids, first, width, self.capacity)
        values = {naming.WRITE_INDICES_INPUT: first, naming.NONPAD_KV_SEQLEN_INPUT: held}
        for name in self.names:
            if name == naming.ATTENTION_MASK_INPUT:
                shape = (rows, int(held.max()))
                self._buffer(name, shape)[...] = np.arange(shape[1])[None, :] < held[:, None]
            else:
                shape = (rows,)
                self._buffer(name, shape)[...] = values[name]
            self._bind(io, name, shape)
            self.last[name] = self._buffers[(name, shape)][0]


def _require_within(position_ids: np.ndarray, first: np.ndarray, width: int, capacity: int) -> None:
    """A static cache writes a row's ``width`` columns at slots ``first .. first + width - 1``: the row's valid
    positions must be exactly those from its first column, and the slots within the capacity (one line if not)."""
    text = position_ids[0] if position_ids.ndim == 3 else position_ids
    if int(first.max()) + width > capacity:
        raise RuntimeInputError(f"a static cache writes {width} slots from position {int(first.max())}: past its "
                                f"capacity of {capacity} slots")
    cols = first[:, None] + np.arange(width)[None, :]
    valid = text >= 0
    if not np.array_equal(np.where(valid, text, cols), cols) or (np.diff(valid.astype(np.int8), axis=1) > 0).any():
        raise RuntimeInputError("a static cache needs each row's positions consecutive from its first column "
                                "(padding only after them)")


def resolve(layout, names_in: dict, capacity: int) -> DialectFeeds:
    """The feeds of a graph whose KV is in ``layout.dialect`` and whose inputs are ``names_in`` (name -> tensor
    info); a static cache without ``write_indices`` is refused in one line (nowhere to say where to write)."""
    dialect = layout.dialect
    wanted = [n for n in CONTROL_INPUTS.get(dialect, ()) if n in names_in]
    if dialect == naming.STATIC_CACHE and naming.WRITE_INDICES_INPUT not in wanted:
        raise ContractError(f"static-cache graph has no {naming.WRITE_INDICES_INPUT!r} input: the runtime cannot say "
                            "where its TensorScatter writes")
    if not wanted:   # padding -1 is the retained-state peers' convention; another dialect's graph runs unpadded
        return DialectFeeds(pads=dialect == naming.RETAINED_STATE)
    dtypes = {}
    for n in wanted:
        dt = names_in[n].dtype
        dtypes[n] = np.dtype(np.int64 if dt in (None, "unknown") else dt)
    return ControlFeeds(dtypes, capacity, pads=dialect == naming.RETAINED_STATE)
