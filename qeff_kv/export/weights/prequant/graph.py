"""The float graph's ``MatMul`` weights replaced by ``com.microsoft::MatMulNBits`` built from the checkpoint's own
int4 blocks (no requantization).

The float graph was traced from the dequantized model (:mod:`.folder`), so each column ``n`` of a ``MatMul`` weight
``B [K, N]`` is, bit for bit, one row of a quantized Linear's dequantization, whatever the exporter did on the way
(transposed for ``MatMul``, Q/K/V or gate/up packed side by side by a fused target's passes). Columns are matched
to rows by content (a hash of the float32 bytes) as ``--gguf-grid`` does; a weight whose columns all come from
quantized rows becomes ``MatMulNBits`` with those rows' integers, scales and zero points
(:meth:`~.blocks.QuantizedLinear.matmulnbits_rows`); every other weight (the vocabulary tables, Linears the
checkpoint left in float) stays as it is, and the report lists it.

Act-order Linears read the activation's columns in group order (a ``Gather`` on the last axis, shared by the
nodes that read the same input in the same order); a packed weight whose columns come from Linears with different
orders becomes one ``MatMulNBits`` per run of columns and a ``Concat``.
"""

from __future__ import annotations

import hashlib
import time
from functools import lru_cache
from pathlib import Path

import numpy as np

from qeff_kv.errors import ExportError
from qeff_kv.export.weights.prequant.blocks import QuantizedLinear, pack_zero_points
from qeff_kv.export.weights.prequant.folder import Tensors, quantized_linears, read_linear
from qeff_kv.export.weights.prequant.scheme import PrequantScheme


def _hash(row: np.ndarray) -> bytes:
    return hashlib.blake2b(np.ascontiguousarray(row, dtype=np.float32).tobytes(), digest_size=16).digest()


def folder_scheme(folder: Path) -> PrequantScheme:
    """The scheme ``config.json`` of ``folder`` names (refused when it names none)."""
    import json

    from qeff_kv.export.weights.prequant.detection import detect

    scheme = detect(json.loads((Path(folder) / "config.json").read_text()))
    if scheme is None:
        raise ExportError(f"{folder}: config.json has no quantization_config")
    return scheme


def apply(float_path: Path, folder: Path, scheme: PrequantScheme, accuracy_level: int | None, say=lambda _m: None,
          report: dict | None = None):
    """The float graph at ``float_path`` with the checkpoint's own int4 blocks, as an ``onnx_ir`` model (not yet
    written); ``report`` receives what was taken and what stayed float."""
    import onnx
    import onnx_ir as ir

    t0 = time.perf_counter()
    tensors = Tensors(folder)
    names, index = _row_index(tensors, scheme)

    @lru_cache(maxsize=8)   # a packed weight reads a few Linears (Q/K/V, gate/up) at once: read again on demand
    def linears(li: int) -> QuantizedLinear:
        return read_linear(tensors, scheme, names[li])
    proto = onnx.load(str(float_path), load_external_data=True)
    nodes, new_inits, used, gathers, taken_linears, kept_float, n_nodes = _replaced_nodes(proto.graph, index,
                                                                                         linears, accuracy_level)
    if not taken_linears:
        raise ExportError(f"no MatMul weight of the graph is one of the checkpoint's {len(names)} int4 Linears "
                          "(the float graph does not hold their dequantized weights)")
    graph = proto.graph
    del graph.node[:]
    graph.node.extend(nodes)
    still = {x for nd in nodes for x in nd.input}
    keep = [t for t in graph.initializer if t.name not in used or t.name in still]
    del graph.initializer[:]
    graph.initializer.extend(keep + new_inits)
    if not any(o.domain == "com.microsoft" for o in proto.opset_import):
        proto.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))
    out = {"format": scheme.format, "scheme": scheme.to_json(), "linears": len(names),
           "linears_taken": len(taken_linears), "matmulnbits": n_nodes, "act_order_gathers": len(gathers),
           "linears_not_taken": sorted(names[li] for li in set(range(len(names))) - taken_linears),
           "kept_float": sorted(kept_float)}
    if report is not None:
        report.update(out)
    say(f"{scheme.format}: {len(taken_linears)} of the checkpoint's {len(names)} int4 Linears became {n_nodes} "
        f"MatMulNBits with their own blocks (no requantization; {len(gathers)} act-order gathers) in "
        f"{time.perf_counter() - t0:.1f}s; float: {len(kept_float)} other MatMul weights")
    for name in out["linears_not_taken"][:3]:
        say(f"{scheme.format}: {name} is not a MatMul weight of the graph: its dequantized weight stays float there")
    return ir.serde.deserialize_model(proto)


def _row_index(tensors: Tensors, scheme: PrequantScheme) -> tuple[list[str], dict[bytes, tuple[int, int]]]:
    """The quantized Linears' names, and each dequantized row's hash -> ``(Linear, row)`` (the Linears themselves
    are not kept)."""
    names: list[str] = []
    index: dict[bytes, tuple[int, int]] = {}
    for li, ql in enumerate(quantized_linears(tensors, scheme)):
        names.append(ql.name)
        w = ql.dequantize()
        for r in range(w.shape[0]):
            index.setdefault(_hash(w[r]), (li, r))
        del ql, w
    return names, index


def _replaced_nodes(graph, index: dict, linears, accuracy_level: int | None):
    """The graph's nodes with every float MatMul whose weight columns are all checkpoint rows replaced:
    ``(nodes, new initializers, replaced weight names, act-order gathers, Linears taken, weights kept float,
    MatMulNBits built)``."""
    import onnx
    from onnx import numpy_helper

    inits = {t.name: t for t in graph.initializer}
    nodes, new_inits, used, gathers = [], [], set(), {}
    taken_linears: set[int] = set()
    kept_float: list[str] = []
    n_nodes = 0
    for i, node in enumerate(graph.node):
        w = inits.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) == 2 else None
        if w is None or len(w.dims) != 2 or w.data_type != onnx.TensorProto.FLOAT:
            nodes.append(node)
            continue
        b = numpy_helper.to_array(w)
        cols = [index.get(_hash(b[:, n])) for n in range(b.shape[1])]
        if any(c is None for c in cols):
            if any(c is not None for c in cols):
                kept_float.append(f"{node.input[1]} (only some of its columns are the checkpoint's int4 rows)")
            elif b.shape[0] >= 16:
                kept_float.append(node.input[1])
            nodes.append(node)
            continue
        built, inits_here = _replace(node, cols, linears, accuracy_level, gathers, f"{node.name or 'MatMul'}_{i}")
        nodes += built
        new_inits += inits_here
        n_nodes += sum(1 for nd in built if nd.op_type == "MatMulNBits")
        used.add(node.input[1])
        taken_linears |= {li for li, _ in cols}
    return nodes, new_inits, used, gathers, taken_linears, kept_float, n_nodes


def _replace(node, cols, linears, accuracy_level, gathers: dict, base: str):
    """The nodes (and initializers) replacing ``node``: one ``MatMulNBits`` per run of columns sharing an input
    order, joined by a ``Concat`` when there are several."""
    import onnx

    runs: list[list[int]] = []
    keys = []
    key_of: dict[int, tuple] = {}
    for li in {li for li, _ in cols}:
        order = linears(li).order
        key_of[li] = (None if order is None else order.tobytes(), linears(li).block)
    for j, (li, _) in enumerate(cols):
        key = key_of[li]
        if runs and keys[-1] == key:
            runs[-1].append(j)
        else:
            runs.append([j])
            keys.append(key)
    nodes, inits = [], []
    outs = [node.output[0]] if len(runs) == 1 else [f"{base}_part{r}_out" for r in range(len(runs))]
    for r, run in enumerate(runs):
        first = linears(cols[run[0]][0])
        src = node.input[0]
        if first.order is not None:
            gkey = (src, keys[r][0])
            if gkey not in gathers:
                idx_name = f"{base}_order{r}"
                gathers[gkey] = f"{idx_name}_x"
                inits.append(onnx.numpy_helper.from_array(first.order.astype(np.int64), idx_name))
                nodes.append(onnx.helper.make_node("Gather", [src, idx_name], [gathers[gkey]], axis=-1,
                                                   name=f"{idx_name}_gather"))
            src = gathers[gkey]
        made, made_inits = _matmulnbits([cols[j] for j in run], linears, src, outs[r], f"{base}_part{r}",
                                        accuracy_level)
        nodes.append(made)
        inits += made_inits
    if len(runs) > 1:
        nodes.append(onnx.helper.make_node("Concat", outs, [node.output[0]], axis=-1, name=f"{base}_concat"))
    return nodes, inits


def _matmulnbits(cols, linears, src: str, out: str, base: str, accuracy_level):
    import onnx
    from onnx import numpy_helper

    k = linears(cols[0][0]).shape[1]
    block = linears(cols[0][0]).block
    parts = {}
    for li in {li for li, _ in cols}:
        rows = np.array([r for l2, r in cols if l2 == li])
        parts[li] = dict(zip(rows.tolist(), zip(*linears(li).matmulnbits_rows(rows))))
    packed = np.stack([parts[li][r][0] for li, r in cols])
    scales = np.stack([parts[li][r][1] for li, r in cols]).astype(np.float32)
    zeros = np.stack([parts[li][r][2] for li, r in cols]).astype(np.uint8)
    inputs = [src, f"{base}_Q4_ckpt", f"{base}_scales_ckpt"]
    inits = [numpy_helper.from_array(packed, inputs[1]), numpy_helper.from_array(scales.reshape(-1), inputs[2])]
    if (zeros != 8).any():   # 8 is MatMulNBits' default zero point
        inputs.append(f"{base}_zp_ckpt")
        inits.append(numpy_helper.from_array(pack_zero_points(zeros), inputs[3]))
    attrs = dict(K=k, N=len(cols), bits=4, block_size=block)
    if accuracy_level:
        attrs["accuracy_level"] = accuracy_level
    return onnx.helper.make_node("MatMulNBits", inputs, [out], name=f"{base}_Q4_ckpt", domain="com.microsoft",
                                 **attrs), inits
