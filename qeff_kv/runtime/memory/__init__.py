"""The runtime's memory, the one home of the session's cache: one interface (:mod:`.base`), one module per kind of
retained state the state spec names (:mod:`.positional`: ``full``/``ring``/``latent`` KV buffers and the ring rule;
:mod:`.recurrent`: recurrent states and their checkpoints), the RoPE marks of images (:mod:`.rope_marks`, a memory
without buffers), the registry that says which memory holds each kind and builds them (:mod:`.registry`), and the
hybrid that holds the sequence table (:class:`Sequence`) and applies every verb to all of them (:mod:`.hybrid`: the
session's ``cache``). See docs/architecture.md, "The runtime's memory".

Every module of this folder is imported with the package, so that a memory class registers itself (``@holds``) by
being one file here: a new kind edits nothing else.
"""

import importlib as _importlib
import pkgutil as _pkgutil

from qeff_kv.runtime.memory.base import Memory
from qeff_kv.runtime.memory.hybrid import HybridMemory, Sequence
from qeff_kv.runtime.memory.positional import PositionalMemory
from qeff_kv.runtime.memory.recurrent import CheckpointPolicy, RecurrentMemory
from qeff_kv.runtime.memory.rope_marks import RopeMarks

for _module in _pkgutil.iter_modules(__path__):
    _importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["CheckpointPolicy", "HybridMemory", "Memory", "PositionalMemory", "RecurrentMemory", "RopeMarks",
           "Sequence"]
