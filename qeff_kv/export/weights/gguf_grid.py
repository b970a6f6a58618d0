"""Int4 weights on the GGUF's own 4-bit grid (``--weights int4 --gguf-grid``): MatMulNBits blocks copied from the
GGUF where its quantization maps onto onnxruntime's MatMulNBits exactly, a one-line reason per GGUF type where
it does not.

MatMulNBits (4 bits, blocks of 32 along K) dequantizes ``w = scale * (q - zp)`` with a float ``scale`` and an
*integer* zero point ``zp`` in ``[0, 15]`` per block (default 8 when the node has no ``zero_points`` input).
The GGUF types, block by block:

* ``Q4_0``: ``w = d * (q - 8)``, ``d`` an fp16 scale per 32 values: **exact** (``scale = d``, ``zp = 8``, the
  default; gguf's own dequantization computes ``d * (q - 8)`` in float32, as onnxruntime does);
* ``Q4_1``: ``w = d * q + m``: ``zp = -m / d`` would have to be an integer in ``[0, 15]``; for a min-max block
  (``m`` the block's minimum, ``d = (max - min) / 15``) it almost never is, and float zero points run a slow path
  on CPU (57x slower per MatMulNBits here). So the offset is taken out of the block (issue 54):
  ``x . w = sum_b d_b * (x_b . q_b) + sum_b m_b * sum(x_b)``: a ``MatMulNBits`` with scale ``d`` and zero point 0,
  plus the input's block sums (``x @ S``, ``S [K, K/32]`` of ones, one per K) times the offsets ``M [K/32, N]``
  (two small float MatMuls and an Add beside it): **fits**, the same weights to float32 rounding (the sum is
  regrouped, not approximated);
* ``Q4_K``: super-blocks of 256, eight sub-blocks of 32 with 6-bit scales and mins, ``w = d*sc * q - dmin*m``:
  the zero point ``dmin*m / (d*sc)`` is again not an integer in general, and ``d*sc`` is rounded once more in
  float32 before the product: **does not fit**;
* ``Q5_*``, ``Q6_K``, ``Q8_0``, ``F16``, ``F32`` and the rest hold more than 4 bits per weight: **does not fit**
  int4 (they are requantized, and said so); except the vocabulary table (embedding / tied head, which the int4
  path quantizes for ``GatherBlockQuantized`` and the head's ``MatMulNBits`` together): a ``Q8_0`` table
  (``w = d * q``, ``q`` int8) is taken exactly at 8 bits (``u = q + 128``, zero point 128, scale ``d``), a
  ``Q4_0`` table at 4 bits.

The float graph's weights are the GGUF's, dequantized by transformers with gguf's own dequantization (rows of Q/K
permuted back for Llama's rotary layout, matrices transposed for ``MatMul``, Q/K/V possibly packed side by side
by a fused target): so each column ``n`` of a ``MatMul`` weight ``B [K, N]`` is, bit for bit, one row of a GGUF
tensor. Columns are matched to rows by content (a hash of the float32 bytes), which survives every one of those
rearrangements; a weight whose columns all come from ``Q4_0`` or ``Q4_1`` rows gets those rows' blocks, repacked,
as its ``MatMulNBits``; every other weight is left to the ordinary quantizer and listed with the reason.
"""

from __future__ import annotations

import hashlib
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from qeff_kv.errors import ExportError, MissingDependencyError

#: the GGUF block (MatMulNBits' block size here)
BLOCK = 32
#: GGUF types whose blocks are MatMulNBits blocks exactly, and how (``zp``: the integer zero point)
FITS = {"Q4_0": "w = d * (q - 8): scale d, zero point 8 (MatMulNBits' default)",
        "Q4_1": "w = d * q + m: scale d, zero point 0, plus the input's block sums times m (a [K/32, N] MatMul "
                "beside the MatMulNBits)"}
#: why the others do not
WHY_NOT = {
    "Q4_K": "w = d*sc * q - dmin*m per sub-block of 32: the zero point dmin*m/(d*sc) is not an integer in [0, 15]",
}
MORE_BITS = "more than 4 bits per weight (int4 would requantize them)"


def _hash(row: np.ndarray) -> bytes:
    return hashlib.blake2b(np.ascontiguousarray(row, dtype=np.float32).tobytes(), digest_size=16).digest()


@dataclass
class GGUFRows:
    """Every matrix row of a GGUF file, by the hash of its float32 dequantization: ``(tensor index, row)``."""

    path: Path
    names: list[str] = field(default_factory=list)
    types: list[str] = field(default_factory=list)
    ndims: list[int] = field(default_factory=list)
    index: dict[bytes, tuple[int, int]] = field(default_factory=dict)
    _reader: object = None

    @classmethod
    def read(cls, path: Path) -> "GGUFRows":
        try:
            from gguf import GGUFReader, dequantize
        except ImportError:
            raise MissingDependencyError("--gguf-grid reads the GGUF's blocks with the gguf package: "
                                         "pip install 'qeff-kv[gguf]'") from None
        out = cls(Path(path))
        out._reader = GGUFReader(str(path))
        for ti, t in enumerate(out._reader.tensors):
            out.names.append(t.name)
            out.types.append(t.tensor_type.name)
            out.ndims.append(len(t.shape))
            if len(t.shape) != 2:
                continue
            rows = dequantize(t.data, t.tensor_type).reshape(-1, int(t.shape[0]))
            for r in range(rows.shape[0]):
                out.index.setdefault(_hash(rows[r]), (ti, r))
        return out

    def q4_0_blocks(self, ti: int, row: int) -> tuple[np.ndarray, np.ndarray]:
        """Row ``row`` of Q4_0 tensor ``ti`` as MatMulNBits data: packed ``[K/32, 16]`` uint8 (element ``2i`` in
        the low nibble of byte ``i``) and scales ``[K/32]`` float32."""
        packed, d, _m = self.column_blocks(ti, row)
        return packed, d

    def column_blocks(self, ti: int, row: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Row ``row`` of the Q4_0 or Q4_1 tensor ``ti``: packed ``[K/32, 16]`` uint8 (element ``2i`` in the low
        nibble of byte ``i``), scales ``d [K/32]`` and (Q4_1) offsets ``m [K/32]`` float32 (None for Q4_0)."""
        t = self._reader.tensors[ti]
        q4_1 = self.types[ti] == "Q4_1"
        raw = np.asarray(t.data).reshape(-1, np.asarray(t.data).shape[-1])[row].reshape(-1, 20 if q4_1 else 18)
        d = raw[:, :2].copy().view(np.float16)[:, 0].astype(np.float32)
        m = raw[:, 2:4].copy().view(np.float16)[:, 0].astype(np.float32) if q4_1 else None
        qs = raw[:, 4:] if q4_1 else raw[:, 2:]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=1)   # GGUF: byte j holds elements j and j + 16
        packed = (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)
        return packed, d, m


    def table_blocks(self, table: np.ndarray):
        """A vocabulary table ``[vocab, hidden]`` (rows are GGUF rows as they are) as MatMulNBits /
        GatherBlockQuantized data from the GGUF's own blocks: ``(packed [vocab, hidden/32, blob], scales
        [vocab, hidden/32], bits, type)`` when every row is a ``Q4_0`` row (4 bits) or every row a ``Q8_0`` row
        (``d * q``: 8 bits, zero point 128, ``u = q + 128``), else None."""
        if table.ndim != 2 or table.shape[1] % BLOCK:
            return None
        hits = [self.index.get(_hash(table[r])) for r in range(table.shape[0])]
        if any(h is None for h in hits):
            return None
        types = {self.types[ti] for ti, _ in hits}
        if types == {"Q4_0"}:
            parts = [self.q4_0_blocks(ti, r) for ti, r in hits]
            return np.stack([p for p, _ in parts]), np.stack([d for _, d in parts]), 4, "Q4_0"
        if types == {"Q8_0"}:
            packed = np.empty((table.shape[0], table.shape[1] // BLOCK, BLOCK), np.uint8)
            scales = np.empty((table.shape[0], table.shape[1] // BLOCK), np.float32)
            for j, (ti, r) in enumerate(hits):
                t = self._reader.tensors[ti]
                raw = np.asarray(t.data).reshape(-1, np.asarray(t.data).shape[-1])[r].reshape(-1, 34)
                scales[j] = raw[:, :2].copy().view(np.float16)[:, 0].astype(np.float32)
                packed[j] = (raw[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
            return packed, scales, 8, "Q8_0"
        return None


@dataclass
class GridPlan:
    """Which MatMul weights take the GGUF's blocks (``fitted``: initializer name -> per-column (tensor, row)) and
    which do not, with the GGUF tensors and types behind them (``report``)."""

    rows: GGUFRows
    fitted: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    report: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return self.report


def plan(matmul_weights: dict[str, np.ndarray], gguf_path: Path) -> GridPlan:
    """Match the float ``MatMul`` weights (``name -> B [K, N]``) to the GGUF's rows and decide per weight."""
    rows = GGUFRows.read(gguf_path)
    out = GridPlan(rows)
    fitted_tensors: set[str] = set()
    not_fitting: dict[str, set[str]] = defaultdict(set)     # GGUF type -> its tensors behind requantized weights
    unmatched: list[str] = []
    for name, w in matmul_weights.items():
        if w.ndim != 2 or w.shape[0] % BLOCK:
            unmatched.append(name)
            continue
        cols = [rows.index.get(_hash(w[:, n])) for n in range(w.shape[1])]
        if any(c is None for c in cols):
            unmatched.append(name)
            continue
        types = {rows.types[ti] for ti, _ in cols}
        tensors = {rows.names[ti] for ti, _ in cols}
        if types <= set(FITS):
            out.fitted[name] = cols
            fitted_tensors |= tensors
        else:
            for ti, _ in cols:
                if rows.types[ti] not in FITS:
                    not_fitting[rows.types[ti]].add(rows.names[ti])
    matched = {rows.names[ti] for name, w in matmul_weights.items() if name not in unmatched
               for ti in {rows.index[_hash(w[:, n])][0] for n in range(w.shape[1])}}
    types_count = Counter(rows.types)
    out.report = {
        "gguf": rows.path.name,
        "gguf_types": dict(sorted(types_count.items())),
        "fitted": {"weights": len(out.fitted), "gguf_tensors": sorted(fitted_tensors),
                   "how": {t: FITS[t] for t in sorted({rows.types[ti] for c in out.fitted.values() for ti, _ in c})}},
        "requantized": [{"type": t, "gguf_tensors": len(ns), "why": WHY_NOT.get(t, MORE_BITS),
                         "examples": sorted(ns)[:3]} for t, ns in sorted(not_fitting.items())],
        "not_from_gguf": sorted(unmatched),
        # matrices of the GGUF behind no MatMul weight: the vocabulary table (embedding / tied head), which the
        # ordinary int4 path quantizes for GatherBlockQuantized and the head's MatMulNBits
        "not_taken": [{"gguf_tensor": n, "type": t} for n, t, nd in zip(rows.names, rows.types, rows.ndims)
                      if nd == 2 and n not in matched],
    }
    return out


def summary_lines(report: dict) -> list[str]:
    """The report as the lines the export prints."""
    lines = [f"--gguf-grid: {report['gguf']} holds " + ", ".join(f"{n} {t}" for t, n in report["gguf_types"].items()),
             f"--gguf-grid: {report['fitted']['weights']} MatMul weights take the GGUF's own blocks "
             f"({len(report['fitted']['gguf_tensors'])} GGUF tensors" +
             "".join(f"; {t}: {how}" for t, how in report["fitted"]["how"].items()) + ")"]
    for r in report["requantized"]:
        lines.append(f"--gguf-grid: {r['gguf_tensors']} {r['type']} tensors do not fit MatMulNBits' integer zero "
                     f"points and are requantized (RTN int4): {r['why']}; e.g. {', '.join(r['examples'])}")
    for t in report["not_taken"]:
        lines.append(f"--gguf-grid: {t['gguf_tensor']} ({t['type']}) is not a MatMul weight of the graph (the "
                     "vocabulary table: taken from the GGUF where its rows are Q4_0 or Q8_0, see below)")
    if report["not_from_gguf"]:
        lines.append(f"--gguf-grid: {len(report['not_from_gguf'])} MatMul weights match no GGUF row and are "
                     f"quantized as usual: {', '.join(report['not_from_gguf'][:3])}")
    return lines


def matmulnbits_node(matmul, b_name: str, cols: list[tuple[int, int]], rows: GGUFRows, k: int, n: int,
                     accuracy_level: int | None):
    """The nodes (and their initializers) replacing ``matmul`` (an ``onnx.NodeProto`` reading ``B = b_name [k,
    n]``), with column ``j``'s blocks from GGUF row ``cols[j]``: one ``MatMulNBits`` where every column is Q4_0;
    with Q4_1 columns, zero points (8 for Q4_0 columns, 0 for Q4_1) and the offsets' term added to its output
    (``x @ S @ M``: :func:`_offset_nodes`)."""
    import onnx
    from onnx import numpy_helper

    kb = k // BLOCK
    packed = np.empty((n, kb, BLOCK // 2), np.uint8)
    scales = np.empty((n, kb), np.float32)
    zp = np.full((n, kb), 8, np.uint8)
    offsets = np.zeros((kb, n), np.float32)
    for j, (ti, r) in enumerate(cols):
        if rows.types[ti] not in FITS:   # pragma: no cover - plan() fits these only
            raise ExportError(f"--gguf-grid: {rows.names[ti]} is {rows.types[ti]}, not Q4_0 or Q4_1")
        packed[j], scales[j], m = rows.column_blocks(ti, r)
        if m is not None:
            zp[j], offsets[:, j] = 0, m
    qname, sname = f"{b_name}_Q4_gguf", f"{b_name}_scales_gguf"
    inits = [numpy_helper.from_array(packed, qname), numpy_helper.from_array(scales.reshape(-1), sname)]
    attrs = dict(K=k, N=n, bits=4, block_size=BLOCK)
    if accuracy_level:
        attrs["accuracy_level"] = accuracy_level
    inputs = [matmul.input[0], qname, sname]
    with_offsets = bool((zp == 0).any())
    if with_offsets:
        zname = f"{b_name}_zero_points_gguf"
        zpad = np.pad(zp, ((0, 0), (0, kb % 2)))   # two a byte, low nibble first
        inits.append(numpy_helper.from_array((zpad[:, 0::2] | (zpad[:, 1::2] << 4)).astype(np.uint8).reshape(-1),
                                             zname))
        inputs.append(zname)
    name = (matmul.name or "MatMul") + "_Q4_gguf"
    out = f"{matmul.output[0]}_Q4_gguf" if with_offsets else matmul.output[0]
    nodes = [onnx.helper.make_node("MatMulNBits", inputs, [out], name=name, domain="com.microsoft", **attrs)]
    if with_offsets:
        more_nodes, more_inits = _offset_nodes(matmul, b_name, out, offsets, k)
        nodes += more_nodes
        inits += more_inits
    return nodes, inits


def block_sums_name(k: int) -> str:
    """The ``[k, k/32]`` block-sum matrix's initializer (one per K, shared by the weights of that K)."""
    return f"gguf_block_sums_{k}"


def _offset_nodes(matmul, b_name: str, nbits_out: str, offsets: np.ndarray, k: int):
    """``y = MatMulNBits(x) + (x @ S) @ M``: ``S [k, k/32]`` the block-sum matrix of ones, ``M [k/32, n]`` the
    Q4_1 offsets (0 for Q4_0 columns)."""
    import onnx
    from onnx import numpy_helper

    x, y, base = matmul.input[0], matmul.output[0], matmul.name or "MatMul"
    sums = np.kron(np.eye(k // BLOCK, dtype=np.float32), np.ones((BLOCK, 1), np.float32))
    oname = f"{b_name}_offsets_gguf"
    inits = [numpy_helper.from_array(sums, block_sums_name(k)), numpy_helper.from_array(offsets, oname)]
    nodes = [onnx.helper.make_node("MatMul", [x, block_sums_name(k)], [f"{y}_block_sums"], name=f"{base}_block_sums"),
             onnx.helper.make_node("MatMul", [f"{y}_block_sums", oname], [f"{y}_offsets"], name=f"{base}_offsets"),
             onnx.helper.make_node("Add", [nbits_out, f"{y}_offsets"], [y], name=f"{base}_Q4_gguf_add")]
    return nodes, inits
