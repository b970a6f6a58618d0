"""An ONNX file's content as comparable data: two exports are the same graph when their digests are equal."""

from __future__ import annotations

import hashlib


def graph_digest(path) -> dict:
    """Nodes (op, domain, name, inputs, outputs, attributes), inputs, outputs and initializers (name -> dtype,
    dims, sha256 of the bytes) of an ONNX file, external data read."""
    import onnx
    from onnx import numpy_helper

    g = onnx.load(str(path)).graph
    nodes = [(n.op_type, n.domain, n.name, tuple(n.input), tuple(n.output),
              tuple((a.name, onnx.helper.printable_attribute(a)) for a in n.attribute)) for n in g.node]
    inits = [(t.name, t.data_type, tuple(t.dims), hashlib.sha256(numpy_helper.to_array(t).tobytes()).hexdigest())
             for t in g.initializer]
    return {"nodes": nodes, "initializers": inits, "inputs": [v.name for v in g.input],
            "outputs": [v.name for v in g.output]}
