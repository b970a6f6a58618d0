"""How a :class:`~qeff_kv.runtime.session.Session` maps the rows of a step to its sequences: one strategy object per
batching mode, chosen once by :class:`~qeff_kv.runtime.graph_description.GraphDescription` from the graph.

* :class:`OneSequence`: a graph without ``batch_index``, one sequence (the KV batch is 1);
* :class:`ContinuousBatching`: a graph with ``batch_index`` (``[rows, 1]``): row ``r`` of a step reads and writes
  KV row ``batch_index[r]``, the slot of its sequence, so any subset of the sequences decodes together;
* :class:`LockStep`: a graph without ``batch_index`` running several sequences (:mod:`.lockstep`): each sequence
  is prefilled alone through a batch-1 view of its row, and the rows in use decode together (a view of the
  first rows, up to the highest slot fed).

``prefill`` and ``decode`` ask the strategy (the small inputs of a step, the rows a decode step runs, which logits
row is whose, which buffers a prefill binds) instead of testing flags. A new batching mode is one more class here
and one more branch in :meth:`GraphDescription.resolve <qeff_kv.runtime.graph_description.GraphDescription>`.
"""

from __future__ import annotations

from typing import Sequence as Seq

import numpy as np
import onnxruntime as ort

from qeff_kv.errors import RuntimeInputError
from qeff_kv.runtime.decoding import lockstep as lockstep_mod
from qeff_kv.runtime.execution.row_views import RowViews
from qeff_kv.runtime.multimodal import positions as pos_mod

BATCH_INDEX = "batch_index"


class OneSequence:
    """A graph without ``batch_index`` holding one sequence: a step has one row, the sequence's."""

    name = "one sequence"
    continuous_batching = False
    lockstep = False
    #: said after "n new sequences requested but only m of k slots are free"
    slots_hint = " (graph without batch_index: one sequence unless max_sequences is given)"

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def usable_ctx_len(self, ctx_len: int) -> int:
        """Positions a sequence may hold in buffers of ``ctx_len`` slots."""
        return ctx_len

    def step_inputs(self, rows: int) -> dict[str, np.ndarray]:
        """The small inputs this mode adds to a ``rows``-row step (beside ``input_ids`` and ``position_ids``)."""
        return {}

    def decode_rows(self, seqs: Seq, max_sequences: int) -> int:
        """Rows of a decode step feeding ``seqs``."""
        if len(seqs) != 1:
            raise RuntimeInputError("a graph without batch_index decodes one sequence per step")
        return 1

    def fill_prefill(self, arrays: dict[str, np.ndarray], seq) -> None:
        """Write this mode's inputs of a one-row prefill chunk of ``seq``."""

    def fill_decode(self, arrays: dict[str, np.ndarray], seqs: Seq, toks: Seq[int], sequences: Seq) -> None:
        """Write a decode step: row ``r`` feeds ``toks[r]`` to ``seqs[r]`` at its next position (``sequences``: every
        sequence of the cache, for modes that run rows nobody fed)."""
        ids, pos = arrays["input_ids"], arrays["position_ids"]
        for r, (s, t) in enumerate(zip(seqs, toks)):
            ids[r, 0] = t
            pos_mod.write(pos, r, s.length, 1, delta=pos_mod.delta(s.rope_marks))
            self._row_slot(arrays, r, s)

    def _row_slot(self, arrays: dict[str, np.ndarray], row: int, seq) -> None:
        """Say which KV row step row ``row`` is (nothing to say with one sequence)."""

    def logits_row(self, row: int, seq, rows: int = 0) -> int:
        """The row of a decode step's logits (``rows`` rows) that belongs to ``seq``, fed in row ``row``."""
        return row

    def prefill_views(self, rows: RowViews, seq) -> dict[str, ort.OrtValue] | None:
        """The KV values a prefill of ``seq`` binds instead of the whole buffers (``None``: the whole buffers)."""
        return None

    def decode_views(self, rows: RowViews, count: int, max_sequences: int, seqs: Seq = ()
                     ) -> dict[str, ort.OrtValue] | None:
        """The KV values a ``count``-row decode step feeding ``seqs`` binds instead of the whole buffers (``None``:
        the whole buffers)."""
        return None


class ContinuousBatching(OneSequence):
    """A graph with ``batch_index``: any subset of the sequences in one step, each row naming its KV slot."""

    name = "continuous batching"
    continuous_batching = True
    slots_hint = ""

    def step_inputs(self, rows: int) -> dict[str, np.ndarray]:
        return {BATCH_INDEX: np.zeros((rows, 1), np.int64)}

    def decode_rows(self, seqs: Seq, max_sequences: int) -> int:
        return len(seqs)

    def fill_prefill(self, arrays: dict[str, np.ndarray], seq) -> None:
        arrays[BATCH_INDEX][0, 0] = seq.slot

    def _row_slot(self, arrays: dict[str, np.ndarray], row: int, seq) -> None:
        arrays[BATCH_INDEX][row, 0] = seq.slot


class LockStep(OneSequence):
    """Several sequences in a graph without ``batch_index`` (:mod:`.lockstep`): a decode step runs the rows up to
    the highest slot fed, bound through a view of those first rows (the idle ones among them write past their
    length, into the slot each row keeps: the usable capacity is ``ctx_len - 1``); a prefill, and a decode step
    feeding one sequence (a **solo step**: the run the sequence alone in slot 0 makes, wherever it is), binds the
    batch-1 view of its sequence's row."""

    name = "lock step"
    lockstep = True
    slots_hint = ""

    def usable_ctx_len(self, ctx_len: int) -> int:
        return ctx_len - 1

    def decode_rows(self, seqs: Seq, max_sequences: int) -> int:
        return 1 if len(seqs) == 1 else lockstep_mod.step_rows(s.slot for s in seqs)

    def decode_views(self, rows: RowViews, count: int, max_sequences: int, seqs: Seq = ()
                     ) -> dict[str, ort.OrtValue] | None:
        if len(seqs) == 1:   # a solo step: its own row, as a prefill binds it
            return rows.row(seqs[0].slot)
        return None if count == max_sequences else rows.first(count)

    def fill_decode(self, arrays: dict[str, np.ndarray], seqs: Seq, toks: Seq[int], sequences: Seq) -> None:
        count = arrays["input_ids"].shape[0]
        if len(seqs) == 1:
            return super().fill_decode(arrays, seqs, toks, sequences)
        lockstep_mod.fill_rows(arrays["input_ids"], arrays["position_ids"],
                               {s.slot: (t, s.length) for s, t in zip(seqs, toks)},
                               {s.slot: s.length for s in sequences if s.slot < count})

    def logits_row(self, row: int, seq, rows: int = 0) -> int:
        return row if rows == 1 else seq.slot

    def prefill_views(self, rows: RowViews, seq) -> dict[str, ort.OrtValue] | None:
        return rows.row(seq.slot)
