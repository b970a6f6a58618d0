"""What every graph pass checks after it ran (not a pass): the base class whose ``ensures`` turns a pass's stated
invariant into a check, and the typed error a violated invariant raises.

A pass of :mod:`qeff_kv.graph.passes` derives from :class:`InvariantPass`: its ``requires`` records the graph's
inputs and outputs (:func:`io_signature`) before the pass runs, and its ``ensures`` refuses a graph whose inputs or
outputs changed (a pass whose invariant allows renaming sets :attr:`InvariantPass.keeps_io` to false) and then runs
the pass's own :meth:`InvariantPass.check`. A violation raises :class:`PassInvariantError`: a
:class:`qeff_kv.errors.PassInvariantError` (one line, the CLI's exit code) that onnx_ir's pass infrastructure
also takes for a postcondition (``ir.passes.PostconditionError``), so it is raised as it is.
"""

from __future__ import annotations

from typing import ClassVar

import onnx_ir as ir

from qeff_kv import errors


class PassInvariantError(errors.PassInvariantError, ir.passes.PostconditionError):
    """A pass broke its stated invariant (see the module docstring)."""


def io_signature(model: ir.Model) -> tuple[tuple, tuple]:
    """The graph's inputs and outputs, in order: ``(name, dtype, shape)`` each (``None`` where not annotated)."""
    def one(v: ir.Value) -> tuple:
        return v.name, v.dtype, None if v.shape is None else tuple(v.shape.dims)

    return tuple(one(v) for v in model.graph.inputs), tuple(one(v) for v in model.graph.outputs)


def _kept(before: tuple, after: tuple) -> bool:
    """Same names in the same order, and every dtype and shape known before is what it is now (a pass may annotate
    what was unknown, never change what was known)."""
    return len(before) == len(after) and all(
        b[0] == a[0] and b[1] in (None, a[1]) and b[2] in (None, a[2]) for b, a in zip(before, after))


def describe(values: tuple) -> str:
    return ", ".join(str(v[0]) for v in values)


class InvariantPass(ir.passes.InPlacePass):
    """An in-place pass whose ``ensures`` checks its invariant (see the module docstring)."""

    #: the graph's inputs and outputs stay as they are (names, order, dtypes, shapes)
    keeps_io: ClassVar[bool] = True
    #: the model dtypes (``--dtype``) the exporter applies the pass to
    dtypes: ClassVar[tuple[str, ...]] = ("float32", "float16")

    _io_before: tuple | None = None

    def requires(self, model: ir.Model) -> None:
        self._io_before = io_signature(model) if self.keeps_io else None

    def ensures(self, model: ir.Model) -> None:
        if self._io_before is not None:
            (ins, outs), (now_ins, now_outs) = self._io_before, io_signature(model)
            for label, before, after in (("inputs", ins, now_ins), ("outputs", outs, now_outs)):
                if not _kept(before, after):
                    self.violated(f"it changed the graph {label} ({describe(before)} -> {describe(after)})")
        self.check(model)

    def check(self, model: ir.Model) -> None:
        """The pass's own part of its invariant, on the graph it left (default: none beyond the inputs/outputs)."""

    def violated(self, what: str) -> None:
        owner = next(c for c in type(self).__mro__ if c.__module__.startswith(__package__ + "."))   # the pass
        raise PassInvariantError(f"{owner.__name__} broke its invariant: {what}")


def label(node: ir.Node) -> str:
    """How a message names a node: its name, else its op type."""
    return node.name or node.op_type
