"""Small pattern-matching helpers shared by the graph passes (not a pass)."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir


def const_array(v: ir.Value | None) -> np.ndarray | None:
    """The constant value of ``v`` (an initializer or a Constant node, possibly behind Identity nodes)."""
    for _ in range(8):
        if v is None:
            return None
        if v.const_value is not None:
            return v.const_value.numpy()
        p = v.producer()
        if p is not None and p.op_type == "Constant" and "value" in p.attributes:
            return p.attributes["value"].value.numpy()
        if p is None or p.op_type != "Identity":
            return None
        v = p.inputs[0]
    return None


def producer_op(v: ir.Value | None, op_type: str) -> ir.Node | None:
    """The node of standard-domain type ``op_type`` that produces ``v``, or ``None``."""
    p = v.producer() if v is not None else None
    return p if p is not None and p.op_type == op_type and p.domain in ("", "ai.onnx") else None
