"""A growing past/present graph run from fixed buffers (issue 49): the default build of mobius-onnx and of optimum,
``past_key_values.{i}.key [batch, kv_heads, past_sequence_len, head_dim]`` -> ``present.{i}.key [batch, kv_heads,
past_sequence_len + sequence_len, head_dim]`` (``present = Concat(past, new)``), ``attention_mask [batch,
past_sequence_len + sequence_len]``.

The cache keeps its fixed buffers ``[slots, heads, capacity, head_dim]`` (positions on axis 2: every cache verb,
rewind, copy, relocation, state files, the prefix cache, works on them unchanged). Per run, :class:`GrowingKV`
feeds each KV input the contiguous past of the positions the step's rows hold (a copy, ``arr[rows, :, :n]``), lets
the executor allocate each present, and copies its new positions ``n .. n + seq_len`` back into the buffers. Not in
place (the session's ``inplace`` is ``False``): a step costs a copy of the held cache in and of the present out.

The graph appends every row at one past length, so the rows of one run hold equally many positions: a step whose
rows hold different lengths (lock step: sequences of other lengths, idle rows) runs one run per length, each with
its rows' inputs, ``attention_mask`` and logits (exact; one run per distinct length). A row's positions must be
``n .. n + seq_len - 1`` (the graph writes every column: never padded) within the capacity, else one line.
"""

from __future__ import annotations

import numpy as np

from qeff_kv.contract import naming
from qeff_kv.errors import ContractError, RuntimeInputError
from qeff_kv.runtime.execution import device as device_mod
from qeff_kv.runtime.execution.dialect_feeds import row_spans

#: the small inputs with a row per step row (``input_ids [rows, seq_len]``, ``position_ids [(4,) rows, seq_len]``)
STEP_ROWS = (naming.INPUT_IDS_INPUT, naming.POSITION_IDS_INPUT)
#: the small inputs of one value per step row (a LoRA graph's ``lora_ids [rows]``, ``lora_scales [rows]``)
ROW_VALUES = (naming.LORA_IDS_INPUT, naming.LORA_SCALES_INPUT)


class GrowingKV:
    """Feeds a growing graph's KV pairs from ``arrays`` (KV input name -> the fixed buffer, rows = slots) and
    copies each present's new positions back (module docstring). ``outputs``: KV input name -> its present."""

    def __init__(self, arrays: dict[str, np.ndarray], outputs: dict[str, str], device=None):
        self.arrays = arrays
        self.outputs = outputs
        self.device = device or device_mod.CPU
        #: the buffers' row of the step's first row (a lock-step prefill binds its sequence's row)
        self.start = 0
        #: each run's ``(first buffer row, rows, held positions before it)``, the last step's (tests, diagnostics)
        self.last_runs: list[tuple[int, int, int]] = []
        self._bind_out = None

    def bind_outputs(self, bind_out) -> None:
        """Every present (and the logits) bound to a value the executor allocates, as before each run: its shape
        changes every run (IOBinding keeps a value it allocated as the next run's output otherwise)."""
        self._bind_out = bind_out
        for name in self.arrays:
            bind_out(self.outputs[name], None)
        bind_out(naming.LOGITS_OUTPUT, None)

    def use_rows(self, start: int) -> None:
        """The step's rows are the buffers' rows from ``start`` on."""
        self.start = int(start)

    def run(self, io, small: dict[str, np.ndarray], small_values: dict, feeds, outputs) -> np.ndarray | None:
        """Run the step whose small inputs are ``small`` (arrays; ``small_values``: the values bound): one run per
        held length. ``feeds``: the dialect's control inputs (``attention_mask``); ``outputs()``: the last run's
        outputs by name. Returns the logits assembled over several runs, or ``None`` (one run: read them bound)."""
        pos = small[naming.POSITION_IDS_INPUT]
        held = held_lengths(pos, next(iter(self.arrays.values())).shape[2])
        lengths = sorted(set(held.tolist()))
        self.last_runs = []
        if len(lengths) == 1:
            self._run_rows(io, np.arange(len(held)), lengths[0], pos, feeds, outputs)
            return None
        logits = None
        for n in lengths:
            idx = np.flatnonzero(held == n)
            parts = {k: np.ascontiguousarray(small[k][..., idx, :]) for k in STEP_ROWS}
            parts.update({k: np.ascontiguousarray(small[k][idx]) for k in ROW_VALUES if k in small})
            kept = [self.device.wrap(a) for a in parts.values()]
            for k, value in zip(parts, kept):
                io.bind_ortvalue_input(k, value)
            out = self._run_rows(io, idx, n, parts[naming.POSITION_IDS_INPUT], feeds, outputs)
            if logits is None:
                logits = np.empty((len(held),) + out.shape[1:], out.dtype)
            logits[idx] = out
        for k in parts:   # the step's own values, as the binding left them
            io.bind_ortvalue_input(k, small_values[k])
        return logits

    def _run_rows(self, io, idx: np.ndarray, n: int, pos: np.ndarray, feeds, outputs) -> np.ndarray:
        """One run of the step's rows ``idx``, each holding ``n`` positions: their past in, the present's new
        positions back; returns this run's logits."""
        rows = self.start + idx
        width = pos.shape[-1]
        kept = []
        for name, arr in self.arrays.items():
            kept.append(self.device.wrap(np.ascontiguousarray(arr[rows, :, :n])))
            io.bind_ortvalue_input(name, kept[-1])
        feeds.feed(io, pos)
        self.bind_outputs(self._bind_out)
        io.run()
        out = outputs()
        for name, arr in self.arrays.items():
            present = out[self.outputs[name]].numpy()
            if present.shape != (len(rows), arr.shape[1], n + width, arr.shape[3]):
                raise ContractError(f"{self.outputs[name]} has shape {list(present.shape)} after a past of {n} "
                                    f"positions and {width} new; expected [{len(rows)}, {arr.shape[1]}, "
                                    f"{n + width}, {arr.shape[3]}]")
            arr[rows, :, n:n + width] = present[:, :, n:]
        self.last_runs.append((int(rows[0]), len(rows), n))
        return out[naming.LOGITS_OUTPUT].numpy()


def held_lengths(position_ids: np.ndarray, capacity: int) -> np.ndarray:
    """Positions each row of the step holds before it (its first position); refused in one line: a padded column
    (the graph appends every column), positions not consecutive, a write past ``capacity``."""
    text = position_ids[0] if position_ids.ndim == 3 else position_ids
    first, end = row_spans(position_ids)
    width = text.shape[1]
    if not np.array_equal(text, first[:, None] + np.arange(width)[None, :]):
        raise RuntimeInputError("a growing past/present graph appends every column of a row: its positions must be "
                                "consecutive from the row's held length, never padded")
    if int(end.max()) > capacity:
        raise RuntimeInputError(f"a growing past/present graph would append position {int(end.max()) - 1}: past the "
                                f"cache's capacity of {capacity} positions (--ctx-len)")
    return first
