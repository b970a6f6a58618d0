"""The vocabulary-sized weights of an exported graph, block-quantized with onnxruntime's kernel
(:meth:`DefaultWeightOnlyQuantizer.qbits_block_quant`), for :func:`.quantize.quantize_graph`:

* the output head ``Gemm(transB=1)`` reading ``[vocab, hidden]`` becomes ``MatMulNBits(K=hidden, N=vocab)``:
  its packed weight ``[vocab, hidden/block, block*bits/8]`` is the row-major layout of the embedding table;
* the embedding lookup ``Gather`` becomes ``GatherBlockQuantized`` (uint8 data, ``bits``, ``quantize_axis=2``)
  reading **the same packed initializer**, so a tied embedding stays stored once; its scales are the head's
  through a ``Reshape`` to ``[vocab, hidden/block, 1]``, and a ``Reshape`` restores ``[..., hidden]``.

Invariant: only readers of a vocabulary table change; every other node, input, output and KV pairing is untouched.
"""

from __future__ import annotations

import numpy as np

from qeff_kv.export.schemes import WeightScheme, min_k


def quantize_vocab_weights(proto, scheme: WeightScheme, quantizer, table_blocks=None) -> int:
    """The head ``Gemm(transB=1)`` -> ``MatMulNBits`` and the embedding ``Gather`` -> ``GatherBlockQuantized``,
    sharing one packed initializer when they read the same (tied) table. Returns the tables quantized.
    ``table_blocks(name, table)``: ``(packed, scales, bits, type)`` taken from elsewhere (the GGUF's own blocks,
    ``--gguf-grid``), or None to quantize the table here."""
    import onnx
    from onnx import numpy_helper

    graph = proto.graph
    inits = {t.name: t for t in graph.initializer}
    readers: dict[str, list] = {}
    for node in graph.node:
        for idx, name in enumerate(node.input):
            if name in inits:
                readers.setdefault(name, []).append((node, idx))
    block = scheme.block_size
    done = 0
    new_nodes: dict[int, list] = {}   # id(node) -> replacement nodes
    for name, uses in readers.items():
        t = inits[name]
        if len(t.dims) != 2 or t.data_type != onnx.TensorProto.FLOAT or t.dims[1] < min_k(block):
            continue
        if not all(_is_head(n, i) or _is_lookup(n, i) for n, i in uses):
            continue
        table = numpy_helper.to_array(t)
        if table.shape[1] % block:
            continue  # GatherBlockQuantized reads whole blocks; such a table stays float
        _quantize_table(graph, name, table, uses, scheme, quantizer, table_blocks, new_nodes)
        graph.initializer.remove(t)
        done += 1
    if new_nodes:
        nodes = []
        for node in graph.node:
            nodes.extend(new_nodes.get(id(node), [node]))
        graph.ClearField("node")
        graph.node.extend(nodes)
    return done


def _is_head(node, idx) -> bool:
    """``node`` reads the table as an output head: ``Gemm(transB=1)`` with no scaling, as input 1."""
    from onnx import helper

    if node.op_type != "Gemm" or idx != 1:
        return False
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    return (attrs.get("transB", 0) == 1 and attrs.get("transA", 0) == 0 and attrs.get("alpha", 1.0) == 1.0
            and (len(node.input) < 3 or not node.input[2] or attrs.get("beta", 1.0) == 1.0))


def _is_lookup(node, idx) -> bool:
    """``node`` reads the table as an embedding lookup: ``Gather`` on axis 0, as input 0."""
    from onnx import helper

    if node.op_type != "Gather" or idx != 0:
        return False
    return all(a.name != "axis" or helper.get_attribute_value(a) == 0 for a in node.attribute)


def _quantize_table(graph, name: str, table: np.ndarray, uses: list, scheme: WeightScheme, quantizer, table_blocks,
                    new_nodes: dict) -> None:
    """One table's packed blocks and scales as initializers, and its readers' replacements in ``new_nodes``."""
    from onnx import numpy_helper

    rows, k = table.shape
    bits = scheme.bits
    got = table_blocks(name, table) if table_blocks is not None else None
    if got is not None:
        packed, scales, bits, _type = got
    else:
        packed, scales, _zp = quantizer.qbits_block_quant(np.ascontiguousarray(table.T))  # [rows, kb, blob]
    kb = packed.shape[1]
    qname, sname = f"{name}_Q{bits}", f"{name}_scales"
    graph.initializer.extend([numpy_helper.from_array(packed, qname),
                              numpy_helper.from_array(scales.astype(table.dtype), sname)])
    if any(_is_lookup(n, i) for n, i in uses):
        graph.initializer.append(numpy_helper.from_array(np.array([rows, kb, 1], np.int64), f"{name}_scales_shape"))
        graph.initializer.append(numpy_helper.from_array(np.array([k], np.int64), f"{name}_row_shape"))
    first_lookup = True
    for node, _idx in uses:
        if _is_head(node, 1) and node.input[1] == name:
            new_nodes[id(node)] = [_head_node(node, qname, sname, k, rows, bits, scheme)]
        else:
            new_nodes[id(node)] = _lookup_nodes(node, name, qname, sname, bits, scheme.block_size, first_lookup)
            first_lookup = False


def _head_node(node, qname: str, sname: str, k: int, rows: int, bits: int, scheme: WeightScheme):
    """``MatMulNBits(K=hidden, N=vocab)`` in place of the head's ``Gemm`` (its bias kept)."""
    from onnx import helper

    inputs = [node.input[0], qname, sname]
    if len(node.input) > 2 and node.input[2]:
        inputs += ["", "", node.input[2]]  # zero_points, g_idx absent; bias
    kw = {"K": k, "N": rows, "bits": bits, "block_size": scheme.block_size}
    if scheme.accuracy_level:
        kw["accuracy_level"] = scheme.accuracy_level
    return helper.make_node("MatMulNBits", inputs, list(node.output), name=f"{node.name}_Q{bits}",
                            domain="com.microsoft", **kw)


def _lookup_nodes(node, name: str, qname: str, sname: str, bits: int, block: int, first_lookup: bool) -> list:
    """``GatherBlockQuantized`` in place of the lookup's ``Gather``, reshaped back to ``[..., hidden]``; the first
    lookup of a table also reshapes its scales to ``[vocab, hidden/block, 1]``."""
    from onnx import helper

    pre = f"{node.name}_Q{bits}"
    out = node.output[0]
    repl = []
    s3 = f"{name}_scales_3d"
    if first_lookup:
        repl.append(helper.make_node("Reshape", [sname, f"{name}_scales_shape"], [s3], name=f"{name}_scales_reshape"))
    # [..., kb, block] -> [..., hidden]: Shape(indices) ++ [hidden]
    repl += [
        helper.make_node("GatherBlockQuantized", [qname, node.input[1], s3], [f"{pre}_blocks"],
                         name=pre, domain="com.microsoft", gather_axis=0, quantize_axis=2,
                         block_size=block, bits=bits),
        helper.make_node("Shape", [node.input[1]], [f"{pre}_ishape"], name=f"{pre}_ishape"),
        helper.make_node("Concat", [f"{pre}_ishape", f"{name}_row_shape"], [f"{pre}_oshape"],
                         name=f"{pre}_oshape", axis=0),
        helper.make_node("Reshape", [f"{pre}_blocks", f"{pre}_oshape"], [out], name=f"{pre}_reshape"),
    ]
    return repl
