"""The memory interface: what every kind of retained state a session keeps (attention KV, a ring, a recurrent
state, the RoPE marks of images) answers, so that the hybrid (:mod:`.hybrid`) composes them without knowing which
kinds it holds, and a state file (:mod:`qeff_kv.runtime.memory.state_file`) or a hand-off (:mod:`qeff_kv.serve.cluster.transfer`)
asks them for their part without branching on a kind.

The shape is llama.cpp's ``llama_memory_i`` (``seq_rm``, ``seq_cp``, ``state_write``, ``state_read``) with one
difference: every verb is split into a *refusal* (a question that changes nothing) and an *apply*, so that the
hybrid asks every memory first and applies to all only when none refuses: no partial success.

A memory holds, for every sequence slot of the session (``seq.slot``, the row of its buffers):

* **buffers** (``arrays``/``values``, ``spare_*`` when double-buffered, ``shapes``, ``dtypes``): what the session
  binds to the graph (:meth:`bindings`); a memory may have none (the RoPE marks);
* a sequence's **row**: :meth:`create` (a new sequence: the row as if empty), :meth:`clear` (a reset to 0),
  :meth:`destroy` (the slot is freed), :meth:`write` (one buffer's row from a state);
* the **verbs**: :meth:`truncate_refusal` / :meth:`truncate` (keep positions ``[0, n)``) and :meth:`copy_refusal` /
  :meth:`copy` (``dst`` becomes ``src``'s first ``n`` positions); a refusal is one line naming what is possible,
  raised by the hybrid as :attr:`refusal_error`; :meth:`reachable` lists the positions a rewind can reach when the
  memory restricts them; :meth:`relocate_refusal` / :meth:`move_rows` (a sequence's rows into another slot, in
  exchange with the sequence there: every row whole by default, :meth:`row_part` narrows it; per-sequence records
  stay on the sequence or, like recurrent checkpoints, keyed by its id, so they move with it);
* **bytes**: :attr:`capacity` (its buffers), :meth:`used` (holding valid data of live sequences),
  :attr:`bytes_per_position`, :attr:`bytes_per_sequence`, :meth:`valid_bytes` (what a hand-off of one sequence
  moves), :meth:`report` (its entries of ``Session.memory()``);
* its part of a **state** (a file or a hand-off): :meth:`state_write` (tensors and metadata entries),
  :meth:`state_check` (its metadata, checked, parsed into a *part*), :meth:`state_expected` (the tensors the part
  must hold), :meth:`state_check_tensors`, :meth:`state_read` (the sequence's bookkeeping from the part, and the
  rows the hybrid writes into its buffers); and :meth:`slicing_specs` (how a hand-off cuts each buffer, the peer's
  ``DimSpecs``).

Per-sequence bookkeeping a memory keeps on the :class:`~.hybrid.Sequence` record: the positional memory owns
``written`` and ``floor``, the RoPE marks own ``rope_marks``; the recurrent memory keeps its checkpoints itself.
``length``, ``tokens`` and ``pending`` belong to the sequence table (the hybrid).
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from typing import Any

import numpy as np
import onnxruntime as ort

from qeff_kv.errors import RuntimeInputError, StateFileError
from qeff_kv.runtime.execution import device as device_mod

def meta_int(text) -> int:
    """An integer of a state's metadata: ASCII digits (``int()`` also reads ``'١٤'``, ``'1_4'``, ``' 14'``);
    ``ValueError`` otherwise."""
    if not isinstance(text, str) or not re.fullmatch(r"-?[0-9]+", text):
        raise ValueError(f"{text!r} is not an integer")
    return int(text)


class Memory(ABC):
    """One kind of retained state (see the module docstring). Subclasses set the buffer dicts in ``__init__``
    (empty for a memory without buffers) and implement the abstract methods."""

    #: the state spec's kinds this memory holds (set by :func:`qeff_kv.runtime.memory.registry.holds`)
    kinds: tuple[str, ...] = ()
    #: the hybrid's attribute naming this memory (``cache.<role>``; set by ``holds``; empty: none)
    role: str = ""
    #: the error class the hybrid raises with this memory's refusals
    refusal_error: type[Exception] = RuntimeInputError
    #: how messages name a tensor of this memory's state part
    tensor_label = "tensor"

    arrays: dict[str, np.ndarray]
    values: dict[str, ort.OrtValue]
    spare_arrays: dict[str, np.ndarray]
    spare_values: dict[str, ort.OrtValue]
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, np.dtype]
    double_buffer: bool = False
    #: where its buffers live (:mod:`qeff_kv.runtime.execution.device`; ``arrays`` are their host views)
    device: device_mod.Device = device_mod.CPU

    @classmethod
    def build(cls, pairs: list, settings) -> "Memory":
        """The memory of ``pairs`` (of the kinds it holds) for a session with ``settings``
        (:class:`qeff_kv.runtime.memory.registry.Settings`)."""
        raise NotImplementedError

    @classmethod
    def need(cls, pairs: list, settings) -> tuple[int, str]:
        """Before anything is allocated: the bytes the memory of ``pairs`` will take with ``settings`` and its
        words in the refusal's line (:func:`qeff_kv.runtime.memory.registry.require_memory`); none by default."""
        return 0, ""

    def _allocate(self, name: str, shape: tuple[int, ...], dtype: np.dtype) -> None:
        """One buffer of ``shape`` (and its spare when double-buffered), zeros, on :attr:`device`: the ``OrtValue``
        bound to the graph and its host view."""
        self.shapes[name], self.dtypes[name] = shape, dtype
        self.arrays[name], self.values[name] = self.device.buffer(shape, dtype)
        if self.double_buffer:
            self.spare_arrays[name], self.spare_values[name] = self.device.buffer(shape, dtype)

    # ------------------------------------------------------------------------------------ buffers
    @property
    def names(self) -> list[str]:
        """Its buffers' KV input names, in graph order."""
        return list(self.shapes)

    def swap(self) -> None:
        """After a run with separate output buffers: the outputs become the current buffers."""
        if self.double_buffer:
            self.arrays, self.spare_arrays = self.spare_arrays, self.arrays
            self.values, self.spare_values = self.spare_values, self.values

    def bindings(self) -> list[tuple[str, ort.OrtValue, ort.OrtValue | None]]:
        """``(KV input name, current value, spare value or None)`` of every buffer."""
        return [(n, v, self.spare_values.get(n)) for n, v in self.values.items()]

    @abstractmethod
    def write(self, seq, name: str, data: np.ndarray) -> None:
        """Write ``data`` (a state's tensor of buffer ``name``, as :meth:`state_read` returns it) into ``seq``'s row."""

    # ------------------------------------------------------------------------------------ a sequence's row
    def create(self, seq) -> None:
        """A new sequence in ``seq.slot``: its row as if empty (a freed slot keeps its last data)."""
        self.clear(seq)

    @abstractmethod
    def clear(self, seq) -> None:
        """``seq`` emptied (a reset, a truncate to 0)."""

    def destroy(self, seq) -> None:
        """``seq`` is gone; its slot becomes free (nothing to do unless the memory keeps more than the row)."""

    # ------------------------------------------------------------------------------------ verbs
    @abstractmethod
    def truncate_refusal(self, seq, n: int) -> str | None:
        """Why ``seq`` cannot keep exactly its positions ``[0, n)`` (``0 <= n <= length``), or ``None``."""

    @abstractmethod
    def truncate(self, seq, n: int) -> None:
        """Apply a truncate every memory allowed (``seq.length`` is still the old length)."""

    @abstractmethod
    def copy_refusal(self, src, n: int) -> str | None:
        """Why ``src``'s first ``n`` positions (``0 <= n <= length``) cannot be copied into another sequence, or
        ``None``."""

    @abstractmethod
    def copy(self, src, dst, n: int) -> None:
        """Apply a copy every memory allowed: ``dst`` holds ``src``'s first ``n`` positions (``dst.length`` is still
        its old length)."""

    def relocate_refusal(self) -> str | None:
        """Why this memory cannot move a sequence's rows into another slot, or ``None``."""
        if self.double_buffer:
            return "its buffers are double-buffered (outputs not bound in place)"
        return None

    def row_part(self, name: str, seq, other) -> tuple:
        """The part of a row of buffer ``name`` (after the slot axis) holding ``seq``'s and ``other``'s data: the
        whole row."""
        return ()

    def move_rows(self, seq, slot: int, other) -> None:
        """Apply a relocation every memory allowed: ``seq``'s rows into ``slot`` (``seq.slot`` is still the old
        one); ``other``, the sequence in ``slot`` or ``None``, takes ``seq``'s old rows in exchange."""
        for name, arr in self.arrays.items():
            part = self.row_part(name, seq, other)
            here, there = (seq.slot, *part), (slot, *part)
            if other is None:   # into a free slot: one pass
                arr[there] = arr[here]
                continue
            moving = arr[here].copy()
            arr[here] = arr[there]
            arr[there] = moving

    def reachable(self, seq) -> list[int] | None:
        """The positions a truncate or copy of ``seq`` can reach, ascending, when this memory restricts them to a
        few; ``None``: any position (its refusals may still say no)."""
        return None

    # ------------------------------------------------------------------------------------ bytes
    @property
    def capacity(self) -> int:
        """Bytes of its buffers (one set)."""
        return sum(a.nbytes for a in self.arrays.values())

    @abstractmethod
    def used(self, seqs) -> int:
        """Bytes of its buffers holding valid data of the sequences ``seqs``."""

    @property
    def bytes_per_position(self) -> int:
        """Bytes one position of one sequence takes (0: no position axis)."""
        return 0

    @property
    @abstractmethod
    def bytes_per_sequence(self) -> int:
        """Bytes of one sequence's row across its buffers."""

    @abstractmethod
    def valid_bytes(self, seq) -> int:
        """Bytes of ``seq``'s part of a state: what a hand-off of ``seq`` moves."""

    def report(self, seqs) -> dict:
        """Its entries of ``Session.memory()``."""
        return {}

    # ------------------------------------------------------------------------------------ states
    @abstractmethod
    def state_write(self, seq, select=None) -> tuple[dict[str, np.ndarray], dict[str, str]]:
        """``seq``'s part of a state: tensors (of the buffers in ``select``, every one when ``None``; copies) and
        metadata entries (strings)."""

    @abstractmethod
    def state_check(self, meta: dict[str, str], n: int, where: str) -> Any:
        """Check its metadata entries of a state of ``n`` positions against this memory (one-line
        :class:`~qeff_kv.errors.StateFileError` naming ``where``); returns the parsed part for
        :meth:`state_expected` and :meth:`state_read`."""

    @abstractmethod
    def state_expected(self, part) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """Every tensor its part of the state must hold -> (shape, dtype)."""

    def state_check_tensors(self, tensors: dict[str, np.ndarray], declared: dict, part, where: str) -> None:
        """Its tensors have the shape and dtype :meth:`state_expected` says, and the shape the state's own
        ``declared`` shapes (name -> list) say."""
        for name, (want, dtype) in self.state_expected(part).items():
            arr = tensors[name]
            if tuple(arr.shape) != want or list(arr.shape) != declared.get(name):
                raise StateFileError(f"{where}: {self.tensor_label} {name!r} has shape {list(arr.shape)}, expected "
                                     f"{list(want)}")
            if arr.dtype != dtype:
                raise StateFileError(f"{where}: tensor {name!r} is {arr.dtype}, the graph's buffer is {dtype}")

    @abstractmethod
    def state_read(self, seq, tensors: dict[str, np.ndarray], part) -> dict[str, np.ndarray]:
        """Take ``seq``'s bookkeeping from a checked state part; returns the rows to :meth:`write` into its buffers
        (buffer name -> data), which the hybrid writes."""

    def slicing_specs(self) -> dict[str, list]:
        """How a hand-off cuts each buffer (the peer's ``DimSpecs``: one entry per axis, ``batch_index`` for the
        sequence's row, ``ctx_start`` for the first position moved, 0 for an axis moved whole)."""
        return {}
