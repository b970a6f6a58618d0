"""``--weights int4|int8`` as the weights stream: the same graph as :func:`.quantize.quantize_graph` (onnxruntime's
``MatMulNBitsQuantizer`` over the whole graph, then the vocabulary tables), built on the float graph's
memory-mapped external data without loading it, each packed weight computed when it is written.

Equivalence with the whole-graph quantizer, node for node and byte for byte (tests/export/test_export_stream.py):

* nodes without a name get ``<op_type>_<index>`` first, as there;
* each 2-D MatMul weight with ``K >= block_size`` (float32/float16, an initializer) becomes ``MatMulNBits`` named
  ``<node>_Q<bits>`` reading ``<weight>_Q<bits>`` and ``<weight>_scales`` (and ``<weight>_zero_points`` when
  asymmetric), attributes ``K``, ``N``, ``bits``, ``block_size`` (and ``accuracy_level`` when set): what
  onnxruntime's ``DefaultWeightOnlyQuantizer.quantize_matmul`` writes for a 2-D weight; the blocks come from its
  own kernel (``qbits_block_quant``) on the same float array, so the bytes are its bytes;
* the new initializers follow the old ones in node order, the float weights no node reads any more are dropped,
  and ``com.microsoft`` opset 1 is imported;
* the vocabulary tables go through :func:`.vocab_tables.quantize_vocab_weights` on a proto that holds every node and
  only the tables' own initializers (the float MatMul weights stay on disk).

Graphs it does not cover (subgraphs: a single-graph VLM's gated encoder; HQQ; ``--gguf-grid``; weights of more
than two dimensions) go through the whole-graph quantizer: :func:`supports` says which.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir


def supports(model: ir.Model, scheme, gguf) -> bool:
    """Whether :func:`quantize_streamed` builds the same graph as the whole-graph quantizer for this model."""
    if gguf is not None or scheme.algorithm == "hqq":
        return False
    for node in model.graph:
        if any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in node.attributes.values()):
            return False
        if node.op_type == "MatMul" and node.domain in ("", "ai.onnx") and len(node.inputs) > 1:
            w = node.inputs[1]
            if w is not None and w.const_value is not None and len(w.const_value.shape) > 2:
                return False
    return True


class _Blocks:
    """One weight's packed blocks, scales and zero points, computed once when the first of them is written and
    dropped when the last one is."""

    def __init__(self, weight: ir.TensorProtocol, quantizer, parts: int, transposed: bool = False, spill=None,
                 symmetric: bool = True):
        self.weight, self.quantizer, self.parts, self.transposed = weight, quantizer, parts, transposed
        self.spill, self.symmetric = spill, symmetric
        self.result = None
        self.taken = 0

    def get(self, i: int) -> np.ndarray:
        if self.result is None and self.spill is not None:   # packed once already, by the reference
            self.result = self.spill.take(self.weight, self.symmetric, self.transposed, self.weight.dtype.numpy())
        if self.result is None:
            arr = self.weight.numpy()
            self.result = _quantize_columns(self.quantizer, arr, self.transposed)
            del arr
            _release(self.weight)
        out = self.result[i]
        self.taken += 1
        if self.taken == self.parts:
            self.result = None
        return out


def _quantize_columns(quantizer, arr: np.ndarray, transposed: bool) -> tuple:
    """``qbits_block_quant`` of the ``[K, N]`` weight ``arr`` (``transposed``: ``arr`` is ``[N, K]``, a vocabulary
    table), :data:`CHUNK_BYTES` of columns at a time: each column's blocks are its own, so the bytes are those of
    one call on the whole weight, without a contiguous copy of it."""
    n, k = (arr.shape[0], arr.shape[1]) if transposed else (arr.shape[1], arr.shape[0])
    cols = max(1, CHUNK_BYTES // max(1, k * arr.itemsize))
    parts = []
    for c0 in range(0, n, cols):
        sub = arr[c0:c0 + cols].T if transposed else arr[:, c0:c0 + cols]
        parts.append(quantizer.qbits_block_quant(np.ascontiguousarray(sub)))
    if len(parts) == 1:
        return parts[0]
    return tuple(None if parts[0][j] is None else np.concatenate([p[j] for p in parts]) for j in range(3))


def _lazy(blocks: _Blocks, i: int, name: str, dtype: ir.DataType, shape: tuple) -> ir.LazyTensor:
    return ir.LazyTensor(lambda: ir.tensor(blocks.get(i), name=name), dtype=dtype, shape=ir.Shape(shape), name=name)


def quantize_streamed(model: ir.Model, scheme, min_k: int, spill=None) -> int:
    """Replace each eligible MatMul of ``model`` (loaded with its external data unread) by ``MatMulNBits`` with
    lazily packed weights (``spill``: a :class:`.packed_spill.PackedSpill` holding blocks packed already). Returns
    how many."""
    import logging

    from onnxruntime.quantization import matmul_nbits_quantizer as mnq

    logging.getLogger("onnxruntime.quantization").setLevel(logging.ERROR)
    graph = model.graph
    for i, node in enumerate(graph):
        if not node.name:
            node.name = f"{node.op_type}_{i}"
    cfg = mnq.DefaultWeightOnlyQuantConfig(block_size=scheme.block_size, is_symmetric=scheme.symmetric,
                                           accuracy_level=scheme.accuracy_level or None,
                                           op_types_to_quantize=("MatMul",), bits=scheme.bits)
    quantizer = mnq.DefaultWeightOnlyQuantizer(cfg)
    bits, block = scheme.bits, scheme.block_size
    done = 0
    for node in list(graph):
        if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or len(node.inputs) < 2:
            continue
        w = node.inputs[1]
        t = w.const_value if w is not None and w.is_initializer() else None
        if t is None or len(t.shape) != 2 or int(t.shape[0]) < min_k \
                or t.dtype not in (ir.DataType.FLOAT, ir.DataType.FLOAT16):
            continue
        k, n = int(t.shape[0]), int(t.shape[1])
        kpack = 8 // bits
        kb = (k + block - 1) // block
        blob = (block + kpack - 1) // kpack
        blocks = _Blocks(t, quantizer, 2 if scheme.symmetric else 3, spill=spill, symmetric=scheme.symmetric)
        q = ir.Value(name=f"{w.name}_Q{bits}", const_value=_lazy(blocks, 0, f"{w.name}_Q{bits}", ir.DataType.UINT8,
                                                                 (n, kb, blob)))
        s = ir.Value(name=f"{w.name}_scales", const_value=_lazy(blocks, 1, f"{w.name}_scales", t.dtype, (n, kb)))
        inputs = [node.inputs[0], q, s]
        graph.register_initializer(q)
        graph.register_initializer(s)
        if not scheme.symmetric:
            zp = ir.Value(name=f"{w.name}_zero_points",
                          const_value=_lazy(blocks, 2, f"{w.name}_zero_points", ir.DataType.UINT8,
                                            (n, (kb + kpack - 1) // kpack)))
            graph.register_initializer(zp)
            inputs.append(zp)
        new = _matmul_nbits(node, inputs, k, n, bits, block, scheme)
        _swap(graph, node, [new], new.outputs[0])
        done += 1
    used = {id(v) for nd in graph for v in nd.inputs if v is not None}
    for name, v in list(graph.initializers.items()):
        if id(v) not in used and not v.is_graph_output():
            del graph.initializers[name]
    model.opset_imports.setdefault("com.microsoft", 1)
    return done


def _attr(node: ir.Node, name: str, default):
    a = node.attributes.get(name)
    return default if a is None else a.value


def _is_head(node: ir.Node, idx: int) -> bool:
    if node.op_type != "Gemm" or idx != 1:
        return False
    return (_attr(node, "transB", 0) == 1 and _attr(node, "transA", 0) == 0 and _attr(node, "alpha", 1.0) == 1.0
            and (len(node.inputs) < 3 or node.inputs[2] is None or _attr(node, "beta", 1.0) == 1.0))


def _is_lookup(node: ir.Node, idx: int) -> bool:
    return node.op_type == "Gather" and idx == 0 and _attr(node, "axis", 0) == 0


def _const(name: str, arr: np.ndarray) -> ir.Value:
    return ir.Value(name=name, const_value=ir.tensor(arr, name=name))


def quantize_vocab_streamed(model: ir.Model, scheme, min_k: int, spill=None) -> int:
    """:func:`.vocab_tables.quantize_vocab_weights` on the ir model, the tables' blocks computed when written: the
    head ``Gemm(transB=1)`` -> ``MatMulNBits``, the embedding ``Gather`` -> ``GatherBlockQuantized`` over the same
    packed initializer. Returns the tables quantized."""
    from onnxruntime.quantization import matmul_nbits_quantizer as mnq

    graph = model.graph
    vcfg = mnq.DefaultWeightOnlyQuantConfig(block_size=scheme.block_size, is_symmetric=True,
                                            accuracy_level=scheme.accuracy_level or None,
                                            op_types_to_quantize=("MatMul",), bits=scheme.bits)
    quantizer = mnq.DefaultWeightOnlyQuantizer(vcfg)
    readers: dict[str, list] = {}
    for node in graph:
        for idx, v in enumerate(node.inputs):
            if v is not None and v.is_initializer():
                readers.setdefault(v.name, []).append((node, idx))
    block, bits = scheme.block_size, scheme.bits
    kpack = 8 // bits
    done = 0
    for name, uses in readers.items():
        value = graph.initializers[name]
        t = value.const_value
        if len(t.shape) != 2 or t.dtype != ir.DataType.FLOAT or int(t.shape[1]) < min_k:
            continue
        if not all(_is_head(n, i) or _is_lookup(n, i) for n, i in uses):
            continue
        rows, k = int(t.shape[0]), int(t.shape[1])
        if k % block:
            continue
        kb = k // block
        blocks = _Blocks(t, quantizer, 2, transposed=True, spill=spill)
        qname, sname = f"{name}_Q{bits}", f"{name}_scales"
        q = ir.Value(name=qname, const_value=_lazy(blocks, 0, qname, ir.DataType.UINT8,
                                                   (rows, kb, (block + kpack - 1) // kpack)))
        s = ir.Value(name=sname, const_value=_lazy(blocks, 1, sname, ir.DataType.FLOAT, (rows, kb)))
        graph.register_initializer(q)
        graph.register_initializer(s)
        if any(_is_lookup(n, i) for n, i in uses):
            s_shape = _const(f"{name}_scales_shape", np.array([rows, kb, 1], np.int64))
            row_shape = _const(f"{name}_row_shape", np.array([k], np.int64))
            graph.register_initializer(s_shape)
            graph.register_initializer(row_shape)
        s3 = None
        for node, _idx in uses:
            if _is_head(node, 1) and node.inputs[1] is value:
                inputs = [node.inputs[0], q, s]
                if len(node.inputs) > 2 and node.inputs[2] is not None:
                    inputs += [None, None, node.inputs[2]]
                new = _matmul_nbits(node, inputs, k, rows, bits, block, scheme)
                _swap(graph, node, [new], new.outputs[0])
            else:
                repl, s3 = _lookup_nodes(node, name, q, s, s3, s_shape, row_shape, bits, block)
                _swap(graph, node, repl, repl[-1].outputs[0])
        del graph.initializers[name]
        done += 1
    return done


def _lookup_nodes(node: ir.Node, name: str, q: ir.Value, s: ir.Value, s3: ir.Value | None, s_shape: ir.Value,
                  row_shape: ir.Value, bits: int, block: int) -> tuple[list[ir.Node], ir.Value]:
    """``GatherBlockQuantized`` in place of the lookup's ``Gather``, reshaped back to ``[..., hidden]``; the table's
    first lookup also reshapes its scales to ``[vocab, hidden/block, 1]`` (``s3``, returned for the next)."""
    pre = f"{node.name}_Q{bits}"
    repl = []
    if s3 is None:
        reshape = ir.node("Reshape", [s, s_shape], name=f"{name}_scales_reshape", num_outputs=1)
        reshape.outputs[0].name = f"{name}_scales_3d"
        s3 = reshape.outputs[0]
        repl.append(reshape)
    gbq = ir.node("GatherBlockQuantized", [q, node.inputs[1], s3],
                  dict(sorted({"gather_axis": 0, "quantize_axis": 2, "block_size": block,
                               "bits": bits}.items())), domain="com.microsoft", name=pre, num_outputs=1)
    gbq.outputs[0].name = f"{pre}_blocks"
    shape = ir.node("Shape", [node.inputs[1]], name=f"{pre}_ishape", num_outputs=1)
    shape.outputs[0].name = f"{pre}_ishape"
    concat = ir.node("Concat", [shape.outputs[0], row_shape], {"axis": 0}, name=f"{pre}_oshape", num_outputs=1)
    concat.outputs[0].name = f"{pre}_oshape"
    out = ir.node("Reshape", [gbq.outputs[0], concat.outputs[0]], name=f"{pre}_reshape", num_outputs=1)
    return repl + [gbq, shape, concat, out], s3


def _release(tensor) -> None:
    """Unmap a memory-mapped float weight once it is quantized (kept mapped while a view of it lives)."""
    release = getattr(tensor, "release", None)
    if release is not None:
        try:
            release()
        except BufferError:
            pass


def _matmul_nbits(node, inputs, k: int, n: int, bits: int, block: int, scheme):
    """The ``MatMulNBits`` node that replaces ``node`` (attributes in the whole-graph quantizer's order)."""
    attrs = {"K": k, "N": n, "bits": bits, "block_size": block}
    if scheme.accuracy_level:
        attrs["accuracy_level"] = scheme.accuracy_level
    return ir.node("MatMulNBits", inputs, dict(sorted(attrs.items())), domain="com.microsoft",
                   name=f"{node.name}_Q{bits}", num_outputs=1)


def _swap(graph: ir.Graph, node: ir.Node, new_nodes: list[ir.Node], new_out: ir.Value) -> None:
    """``new_nodes`` in the place of ``node``, ``new_out`` taking the name and readers of its output."""
    old = node.outputs[0]
    for n in new_nodes:
        graph.insert_before(node, n)
    if old.type is not None:
        new_out.type, new_out.shape = old.type, old.shape
    old.replace_all_uses_with(new_out, replace_graph_outputs=True)
    name = old.name
    graph.remove(node, safe=True)
    new_out.name = name


def quantize_graph_streamed(float_path, scheme, say, min_k: int, gguf=None):
    """The quantized graph of the float graph at ``float_path`` as an ir model whose packed weights are computed
    when it is written; ``None`` where :func:`supports` says the whole-graph quantizer must do it."""
    return quantize_model_streamed(ir.load(str(float_path)), scheme, say, min_k, gguf)


def quantize_model_streamed(model: ir.Model, scheme, say, min_k: int, gguf=None, spill=None):
    """:func:`quantize_graph_streamed` on a float ir model (loaded from disk, or the streaming exporter's graph
    in memory whose weights are lazy reads of the checkpoint: then no float graph is ever written); ``None``
    where :func:`supports` says no, else ``model``, changed in place. ``spill``: the blocks the streamed reference
    packed (:class:`.packed_spill.PackedSpill`), written as they are instead of packed again."""
    import time

    from qeff_kv.errors import ExportError

    t0 = time.perf_counter()
    if not supports(model, scheme, gguf):
        return None
    ks = [int(n.inputs[1].const_value.shape[0]) for n in model.graph if n.op_type == "MatMul" and len(n.inputs) > 1
          and n.inputs[1] is not None and n.inputs[1].is_initializer() and len(n.inputs[1].const_value.shape) == 2]
    n_matmul = quantize_streamed(model, scheme, min_k, spill)
    n_vocab = quantize_vocab_streamed(model, scheme, min_k, spill)
    if n_matmul + n_vocab == 0:   # a setting that does nothing is refused, not recorded as done
        raise ExportError(f"--weights {scheme.scheme} --block-size {scheme.block_size} quantizes no weight matrix: "
                          f"the largest has {max(ks, default=0)} input features, fewer than one block; use a "
                          f"smaller --block-size")
    say(f"quantized {n_matmul} MatMul weights and {n_vocab} vocabulary-sized weights to {scheme.scheme} "
        f"(block {scheme.block_size}, accuracy level {scheme.accuracy_level}) in {time.perf_counter() - t0:.1f}s "
        "(packed as they are written)")
    return model


# ------------------------------------------------------------------ the reference's weights (verification)
#: rows of a weight quantized (and dequantized) at once: the blocks of a column of the graph's ``[K, N]`` weight
#: (a row of the Linear's ``[out, in]``) are its own, so rows taken a few at a time give the same bytes, without
#: a transposed copy of a whole 2 GB vocabulary table
CHUNK_BYTES = 64 << 20


def _mnq():
    """onnxruntime's ``matmul_nbits_quantizer`` module, imported without the root logging handler and INFO level
    its import installs (``logging.basicConfig``: every library's INFO lines would then reach the terminal)."""
    import logging

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    from onnxruntime.quantization import matmul_nbits_quantizer as mnq

    root.handlers[:] = handlers
    root.setLevel(level)
    return mnq


def _quantizer(scheme, symmetric: bool):
    mnq = _mnq()

    cfg = mnq.DefaultWeightOnlyQuantConfig(block_size=scheme.block_size, is_symmetric=symmetric,
                                           accuracy_level=scheme.accuracy_level or None,
                                           op_types_to_quantize=("MatMul",), bits=scheme.bits)
    return mnq.DefaultWeightOnlyQuantizer(cfg)


def dequantized(weight: np.ndarray, scheme, symmetric: bool | None = None, spill=None, key: str | None = None
                ) -> np.ndarray:
    """A ``[out, in]`` weight (a Linear's layout; the graph's MatMul weight is its transpose, ``[K=in, N=out]``)
    as ``MatMulNBits`` reads it back: onnxruntime's own kernel (``qbits_block_quant``, the one that packs the
    graph's blocks) on the same values, then ``(q - zero point) * scale`` per block of ``scheme.block_size`` along
    ``in``: equal to onnxruntime dequantizing the same blocks. ``symmetric``: the vocabulary tables are always
    symmetric (None: the scheme's). ``spill``: the blocks are kept there under the checkpoint ``key`` for the
    writer (:class:`.packed_spill.PackedSpill`: packed once per weight). Rows :data:`CHUNK_BYTES` at a time,
    written over ``weight`` when it is writable (the streamed reference's own fresh array)."""
    from qeff_kv.export.weights.packed_spill import quantize_rows

    sym = scheme.symmetric if symmetric is None else symmetric
    quantizer = _quantizer(scheme, sym)
    out = weight if weight.flags.writeable and weight.flags.c_contiguous else np.array(weight)
    packed, scales, zp = quantize_rows(quantizer, out, CHUNK_BYTES) if spill is None else \
        spill.blocks(key, out, quantizer, sym, CHUNK_BYTES)
    rows = max(1, CHUNK_BYTES // max(1, out.shape[1] * out.itemsize))
    for r0 in range(0, out.shape[0], rows):
        part = out[r0:r0 + rows]
        part[...] = _dequantize(packed[r0:r0 + rows], scales[r0:r0 + rows], None if zp is None else zp[r0:r0 + rows],
                                scheme.bits, scheme.block_size, part.shape[1], sym)
    return out


def _dequantize(packed, scales, zp, bits: int, block: int, k: int, symmetric: bool) -> np.ndarray:
    n, kb, _blob = packed.shape
    q = _unpack(packed.reshape(n, -1), bits)[:, :kb * block].reshape(n, kb, block).astype(np.float32)
    zero = np.float32(2 ** (bits - 1)) if symmetric else _unpack(zp, bits)[:, :kb].astype(np.float32)[:, :, None]
    return ((q - zero) * scales.astype(np.float32)[:, :, None]).reshape(n, kb * block)[:, :k]


def _unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    """uint8 rows holding ``8 // bits`` values a byte, low bits first -> one value an element."""
    if bits == 8:
        return packed
    return np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(packed.shape[0], -1)
