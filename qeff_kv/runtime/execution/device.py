"""Where a session's bound values live: the one allocator of every ``OrtValue`` the runtime binds to a graph (the KV
and recurrent state, the lock-step row views of it, the small inputs, the logits).

A :class:`Device` gives a buffer as a pair: the ``OrtValue`` bound to the graph, allocated once on the device, and
the host view the cache verbs read and write. The state's ``OrtValue`` is bound as both the input ``X`` and the
output ``X_RetainedState`` (:class:`~qeff_kv.runtime.session.Session`), so a step updates it where it lives; the
small inputs and the logits are buffers of their own, so feeding a step and reading its logits never copies the
state.

On the CPU (:data:`CPU`, the only device implemented) the host view *is* the buffer: an ``OrtValue`` over a numpy
array's memory, so the verbs (truncate, copy, relocate, state files, hand-off) work on the bytes in place. A
device whose memory the host cannot address (CUDA) would give the verbs staging copies, moving bytes to the host
only where a verb needs them; it is not implemented, and ``device="cuda"`` is refused before this is reached
(:mod:`.ep_proofs`: no graph kind is proved exact on that EP). Under the EP proofs' measurement hook
(:func:`.ep_proofs.measuring`) a session on another EP keeps its buffers here, in host memory, and onnxruntime
copies them to and from the EP's device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from qeff_kv.errors import ProviderError
from qeff_kv.runtime.execution import ep_proofs


@dataclass(frozen=True)
class Device:
    """A device for bound values: ``name`` (onnxruntime's ``device_name()``) and the EP that runs on it."""

    name: str
    provider: str

    def buffer(self, shape: tuple[int, ...], dtype) -> tuple[np.ndarray, ort.OrtValue]:
        """A zeroed buffer of ``shape``: its host view and the ``OrtValue`` bound to the graph (one memory)."""
        array = np.zeros(shape, dtype)
        return array, ort.OrtValue.ortvalue_from_numpy(array)

    def wrap(self, view: np.ndarray) -> ort.OrtValue:
        """An ``OrtValue`` over a contiguous part of a buffer's host view (lock step's rows), sharing its memory."""
        return ort.OrtValue.ortvalue_from_numpy(view)


CPU = Device("cpu", ep_proofs.CPU)


def for_providers(providers: list[str]) -> Device:
    """The device of a session on ``providers`` (already proved, :func:`.ep_proofs.require`)."""
    if providers[0] == ep_proofs.CPU or ep_proofs.measuring():
        return CPU
    raise ProviderError(f"{providers[0]}: buffers on its device are not implemented (only the CPU's)")
