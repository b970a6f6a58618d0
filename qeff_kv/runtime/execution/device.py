"""Where a session's bound values live: the one allocator of every ``OrtValue`` the runtime binds to a graph (the KV
and recurrent state, the lock-step row views of it, the small inputs, the logits), and how they reach the EP.

A :class:`Device` gives a buffer as a pair: the ``OrtValue`` bound to the graph, allocated once, and the host view
the cache verbs read and write. The state's ``OrtValue`` is bound as both the input ``X`` and the output
``X_RetainedState`` (:class:`~qeff_kv.runtime.session.Session`), so a step updates it where it lives; the small
inputs and the logits are buffers of their own, so feeding a step and reading its logits never copies the state.

Every device today keeps its buffers in host memory: an ``OrtValue`` over a numpy array's memory, so the verbs
(truncate, copy, relocate, state files, hand-off) work on the bytes in place.

* :data:`CPU`: the CPU EP computes on those bytes; each input is bound once (when its buffer or shape changes).
* :func:`staged` (every other EP: CUDA): the EP computes on its own device, and onnxruntime copies a bound *host*
  input to it when the input is **bound** (``IOBinding``'s ``BindInput`` copies across devices then), not when it
  runs: a value written into the host buffer afterwards never reaches a run (measured on an H100: the session bound
  once answered wrong tokens from the first run on every graph; bound again before each run, the CPU's tokens on
  every graph, ``docs/runtime.md``). So its :attr:`Device.rebind_each_run` makes the executor bind every input
  again before each run (:class:`~.executor.RebindingExecutor`): the state goes to the EP and its retained
  output back into the host buffer on every step (exact; costs two copies of the state per step, which a state
  resident on the EP's device would save, not implemented).

Which EP may run which graph kind at all is :mod:`.ep_proofs`'s; this module only says where the bytes are.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from qeff_kv.runtime.execution import ep_proofs


@dataclass(frozen=True)
class Device:
    """Where bound values live (``name``: onnxruntime's ``device_name()`` of the buffers) and the EP that runs on
    them; ``rebind_each_run``: the EP copies a bound host input at bind time, so every input is bound again
    before each run (module docstring)."""

    name: str
    provider: str
    rebind_each_run: bool = False

    def buffer(self, shape: tuple[int, ...], dtype) -> tuple[np.ndarray, ort.OrtValue]:
        """A zeroed buffer of ``shape``: its host view and the ``OrtValue`` bound to the graph (one memory)."""
        array = np.zeros(shape, dtype)
        return array, ort.OrtValue.ortvalue_from_numpy(array)

    def wrap(self, view: np.ndarray) -> ort.OrtValue:
        """An ``OrtValue`` over a contiguous part of a buffer's host view (lock step's rows), sharing its memory."""
        return ort.OrtValue.ortvalue_from_numpy(view)


CPU = Device("cpu", ep_proofs.CPU)


def staged(provider: str) -> Device:
    """Host buffers for ``provider``, an EP computing on its own device: every input bound again before each run."""
    return Device("cpu", provider, rebind_each_run=True)


def for_providers(providers: list[str]) -> Device:
    """The device of a session on ``providers`` (already proved for the graph, :func:`.ep_proofs.require`)."""
    return CPU if providers[0] == ep_proofs.CPU else staged(providers[0])
