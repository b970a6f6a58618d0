"""The runtime's memory: one interface (:mod:`.base`), one module per kind of retained state the state spec names
(:mod:`.positional`: ``full``/``ring``/``latent`` KV buffers and the ring rule; :mod:`.recurrent`: recurrent states
and their checkpoints), the RoPE marks of images (:mod:`.rope_marks`, a memory without buffers), and the hybrid that
holds the sequence table and applies every verb to all of them (:mod:`.hybrid`). See docs/architecture.md, "The
runtime's memory"."""

from qeff_kv.runtime.memory.base import Memory
from qeff_kv.runtime.memory.hybrid import HybridMemory, Sequence
from qeff_kv.runtime.memory.positional import PositionalMemory
from qeff_kv.runtime.memory.recurrent import CheckpointPolicy, RecurrentMemory
from qeff_kv.runtime.memory.rope_marks import RopeMarks

__all__ = ["CheckpointPolicy", "HybridMemory", "Memory", "PositionalMemory", "RecurrentMemory", "RopeMarks",
           "Sequence"]
