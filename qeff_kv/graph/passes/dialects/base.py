"""What every KV-dialect conversion ensures, in one place: :class:`ConversionPass`.

Invariant of a conversion into dialect ``target``: afterwards every KV buffer is spelled in ``target`` and paired,
the prefixes are as they were, and every graph input and output that is neither a KV buffer nor a dialect's control
port (``write_indices``, ``nonpad_kv_seqlen``, ``attention_mask``: the ports a conversion adds or removes) is as it
was (name, dtype, shape, order). A conversion adds its own checks in :meth:`ConversionPass.check_more`.
"""

from __future__ import annotations

import onnx_ir as ir

from qeff_kv.contract import naming
from qeff_kv.contract.layout import KVLayout
from qeff_kv.graph.graphio import layout_of
from qeff_kv.graph.passes._invariants import InvariantPass, io_signature

#: the ports a conversion may add or remove beside the KV buffers
CONTROL_PORTS = (naming.WRITE_INDICES_INPUT, naming.NONPAD_KV_SEQLEN_INPUT, naming.ATTENTION_MASK_INPUT)


def non_kv_io(model: ir.Model) -> tuple:
    """The graph's inputs and outputs that are neither KV buffers (any dialect) nor :data:`CONTROL_PORTS`."""
    return tuple(tuple(v for v in values if naming.parse_any_kv_name(v[0] or "") is None
                       and v[0] not in CONTROL_PORTS) for values in io_signature(model))


class ConversionPass(InvariantPass):
    """Base of the dialect conversions: ``target`` is the dialect the KV buffers are spelled in afterwards."""

    keeps_io = False
    target: str = naming.RETAINED_STATE
    _before: tuple | None = None

    def requires(self, model: ir.Model) -> None:
        super().requires(model)
        self._before = (non_kv_io(model), layout_of(model).prefixes)

    def check(self, model: ir.Model) -> None:
        layout = layout_of(model)
        if set(layout.dialects) != {self.target} or layout.unpaired_inputs or layout.unpaired_outputs:
            self.violated(f"dialects {layout.dialects}, unpaired {layout.unpaired_inputs + layout.unpaired_outputs}")
        if self._before is not None and (non_kv_io(model), layout.prefixes) != self._before:
            self.violated("it changed a prefix or a graph input or output that is not a KV buffer or a dialect's "
                          "control port")
        self.check_more(model, layout)

    def check_more(self, model: ir.Model, layout: KVLayout) -> None:
        """A conversion's own checks (none by default)."""
