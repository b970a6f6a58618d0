"""Weight-only quantization of an exported onnxruntime graph (``--weights int4|int8``).

Runs after the float graph was verified against PyTorch. MatMul weights become onnxruntime's
``com.microsoft::MatMulNBits`` through onnxruntime's own quantizer
(:class:`onnxruntime.quantization.matmul_nbits_quantizer.MatMulNBitsQuantizer`, round-to-nearest, symmetric,
blocks along K). The vocabulary-sized weights are done by :mod:`.vocab_tables` with the same kernel
(:meth:`DefaultWeightOnlyQuantizer.qbits_block_quant`):

* the output head ``Gemm(transB=1)`` reading ``[vocab, hidden]`` becomes ``MatMulNBits(K=hidden, N=vocab)``:
  its packed weight ``[vocab, hidden/block, block*bits/8]`` is the row-major layout of the embedding table;
* the embedding lookup ``Gather`` becomes ``GatherBlockQuantized`` (uint8 data, ``bits``, ``quantize_axis=2``)
  reading **the same packed initializer**, so a tied embedding stays stored once. Its scales are the head's
  ``[vocab, hidden/block]`` scales through a ``Reshape`` to ``[vocab, hidden/block, 1]`` (the op wants the rank
  of its data; onnxruntime folds that Reshape at load), and a ``Reshape`` restores ``[..., hidden]``.

Symmetric quantization has no zero-point tensors: both ops then use the default zero point ``2^(bits-1)``.
KV inputs, outputs, pairing and the in-place updaters are untouched (only weight readers change).

The quantized graph is checked loosely (:func:`compare_graphs`): it must load and run the probe, and its top-1
agreement with the float graph and max logit difference are recorded in the manifest. The probe's random tokens
say little about quality, so when the export has a tokenizer both graphs also read :data:`NATURAL_TEXT` (a fixed
English paragraph, teacher-forced: :func:`natural_text_check`); a quantized graph whose perplexity on it exceeds
:data:`MAX_PERPLEXITY_RATIO` times the float graph's gets a loud warning and the manifest's check says
``"failed"`` (the export is kept: the user chooses whether to use it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from qeff_kv.errors import ExportError, VerificationError  # noqa: F401 (ExportError re-raised by callers)
from qeff_kv.export.probe_runner import ProbeRunner, first_line
from qeff_kv.export.weights import vocab_tables
from qeff_kv.export.weights.natural_text import (  # noqa: F401 (NATURAL_TEXT, MAX_PERPLEXITY_RATIO: tests)
    MAX_PERPLEXITY_RATIO, NATURAL_TEXT, NATURAL_TOKENS, natural_reference, natural_rows, natural_text_check,
    natural_verdict, say_natural)
from qeff_kv.export.schemes import (ACCURACY_LEVELS, DEFAULT_ACCURACY_LEVEL, DEFAULT_BLOCK_SIZE, SCHEMES,  # noqa: F401
                      WeightScheme, check_scheme, min_k, resolve_options)

#: quantize as the weights are written (:mod:`.quantize_stream`) where it builds the same graph; False: the
#: whole-graph quantizer always (for comparisons)
STREAM = True



def quantize_export(onnx_path: Path, work: Path, options, probe, vocab_size: int, say, *, save,
                    kv_batch: int = 1, gguf: Path | None = None, tokenizer=None, prequant: Path | None = None) -> dict:
    """Replace the verified float graph at ``onnx_path`` (in the staging folder) by its quantized version.

    The quantized graph is written by ``save(model, path)`` into ``work``, checked against the float graph on the
    probe (:func:`compare_graphs`; the verification probe, or a fresh one when verification was skipped), then
    renamed over the float files. Returns the manifest's ``weights`` record. ``gguf``: with ``--gguf-grid``, the
    GGUF whose own 4-bit blocks become the MatMulNBits weights where they fit (:mod:`.gguf_grid`). ``tokenizer``:
    a ``tokenizers.Tokenizer`` for :func:`natural_text_check` (None: only the probe is compared). ``prequant``: the
    pre-quantized checkpoint folder whose own int4 blocks become the MatMulNBits weights (:mod:`.prequant`)."""
    from qeff_kv.export.verify import make_probe

    scheme = WeightScheme.of(options)
    work.mkdir(parents=True, exist_ok=True)
    qpath = work / onnx_path.name
    grid: dict = {}
    model = _quantized_model(onnx_path, options, scheme, say, gguf=gguf, prequant=prequant, grid=grid)
    save(model, qpath)
    del model
    if probe is None:
        probe = make_probe(vocab_size, options.ctx_len, options.prefill_seq_len)
    say(f"checking the {scheme.scheme} graph against the float graph ({len(probe.prompt)}-token probe)")
    agreement = compare_graphs(onnx_path, qpath, probe, ctx_len=options.ctx_len, kv_batch=kv_batch,
                               ccl=options.ccl)
    say(f"{scheme.scheme}: top-1 agreement with the float graph {agreement.top1_agreement:.0%} over "
        f"{agreement.steps} steps, max |logit difference| {agreement.max_abs_logit_diff:.3g}")
    natural = None
    if tokenizer is not None:
        natural = _natural_check(onnx_path, qpath, tokenizer, options, scheme, say, kv_batch=kv_batch,
                                 slot=probe.slot)
    float_bytes = _replace_float_graph(onnx_path, work)
    record = scheme.to_json()
    record["float_graph_bytes"] = float_bytes
    record["graph_bytes"] = sum(p.stat().st_size for p in onnx_path.parent.glob(onnx_path.name + "*"))
    record["check"] = agreement.to_json()
    if natural is not None:
        record["check"]["natural_text"] = natural
        record["check"]["status"] = natural["status"]
    if gguf is not None:
        record["gguf_grid"] = grid
    if prequant is not None:   # the checkpoint's own blocks: no quantizer ran
        record.update(symmetric=grid["scheme"]["symmetric"], zero_points=not grid["scheme"]["symmetric"],
                      quantizer=f"none: the checkpoint's own int4 blocks ({grid['format']}), repacked for "
                      "MatMulNBits", prequantized=grid)
    return record


def _quantized_model(onnx_path: Path, options, scheme: WeightScheme, say, *, gguf, prequant, grid: dict):
    """The quantized model: from a pre-quantized checkpoint's own blocks, else streamed where that builds the
    same graph, else onnxruntime's whole-graph quantizer (``grid`` receives the GGUF/checkpoint report)."""
    if prequant is not None:
        from qeff_kv.export.weights.prequant import graph as prequant_graph

        model = prequant_graph.apply(onnx_path, prequant, prequant_graph.folder_scheme(prequant),
                                     options.accuracy_level, say, grid)
    else:
        from qeff_kv.export.weights.quantize_stream import quantize_graph_streamed

        model = quantize_graph_streamed(onnx_path, scheme, say, min_k(scheme.block_size), gguf) \
            if STREAM else None
    if model is None:
        model = quantize_graph(onnx_path, scheme, say, gguf=gguf, grid_report=grid)
    return model


def _natural_check(onnx_path: Path, qpath: Path, tokenizer, options, scheme: WeightScheme, say, *, kv_batch: int,
                   slot) -> dict:
    """:func:`natural_text_check` on :data:`NATURAL_TEXT`, said (loudly when it fails)."""
    ids = list(tokenizer.encode(NATURAL_TEXT).ids)[:min(NATURAL_TOKENS, options.ctx_len)]
    natural = natural_text_check(onnx_path, qpath, ids, ctx_len=options.ctx_len, kv_batch=kv_batch,
                                 ccl=options.ccl, slot=slot)
    say_natural(scheme, natural, say)
    return natural


def _replace_float_graph(onnx_path: Path, work: Path) -> int:
    """Move the quantized files of ``work`` over the float graph's; returns the float graph's bytes."""
    float_bytes = sum(p.stat().st_size for p in onnx_path.parent.glob(onnx_path.name + "*"))
    for old in (onnx_path, onnx_path.with_name(onnx_path.name + ".data")):
        old.unlink(missing_ok=True)
    for f in sorted(work.iterdir()):
        f.replace(onnx_path.parent / f.name)
    return float_bytes


# ------------------------------------------------------------------- quantized as the weights stream (no float graph)
def quantize_in_memory(model, scheme: WeightScheme, say, spill=None) -> bool:
    """The streaming exporter's float graph (in memory, its weights lazy reads of the checkpoint) quantized in
    place by :func:`.quantize_stream.quantize_model_streamed`: the graph the float graph would have become on disk,
    never written. Returns the float weights' bytes (past :data:`.options.EXTERNAL_DATA_THRESHOLD` that float graph,
    and so its quantized graph, would have had external data); refuses (:class:`.stream.StreamRefused`: the exporter then loads the model whole) a graph
    only the whole-graph quantizer handles. ``spill``: the blocks the streamed reference packed (written as they
    are: :class:`.packed_spill.PackedSpill`)."""
    from qeff_kv.export.weights.quantize_stream import quantize_model_streamed
    from qeff_kv.export.weights.stream import StreamRefused

    float_bytes = sum(v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None)
    if quantize_model_streamed(model, scheme, say, min_k(scheme.block_size), spill=spill) is None:
        raise StreamRefused(f"--weights {scheme.scheme} on this graph needs the whole-graph quantizer")
    return float_bytes


def streamed_record(onnx_path: Path, options, probe, natural: dict | None, say, *, kv_batch: int = 1,
                    float_bytes: int | None = None) -> dict:
    """The manifest's ``weights`` record of a graph quantized as it streamed (verified against the
    quantized-then-dequantized reference by the verify stage): the scheme, the graph's bytes, and the natural-text
    check of the quantized graph against the float PyTorch model (``natural``: :func:`natural_reference`)."""
    scheme = WeightScheme.of(options)
    record = scheme.to_json()
    if float_bytes is not None:   # the float weights' bytes (no float graph was written)
        record["float_graph_bytes"] = float_bytes
    record["graph_bytes"] = sum(p.stat().st_size for p in onnx_path.parent.glob(onnx_path.name + "*"))
    record["check"] = {"status": "passed", "against": "the verification reference (PyTorch on the quantized then "
                       "dequantized weights): see verification"}
    if natural is not None:
        ids = natural["ids"]
        quant = natural_rows(onnx_path, ids, ctx_len=options.ctx_len, kv_batch=kv_batch, ccl=options.ccl,
                             slot=0 if probe is None else probe.slot, label="quantized")
        nat = natural_verdict(natural["rows"], quant, ids)
        nat["against"] = "the float PyTorch model (weights streamed)"
        nat["kernels"] = KERNELS_NOTE
        record["check"]["natural_text"] = nat
        record["check"]["status"] = nat["status"]
        say_natural(scheme, nat, say, "model")
    return record


#: how verification and the natural-text check run a graph's ``MatMulNBits`` (probe_runner.float32_kernels_copy)
KERNELS_NOTE = ("onnxruntime's prepacked MatMulNBits at accuracy level 1 (float32 activations); the graph's own "
                "level applies when it is served")


# ------------------------------------------------------------------------------------------ quantization
def quantize_graph(float_path: Path, scheme: WeightScheme, say=lambda _m: None, *, gguf: Path | None = None,
                   grid_report: dict | None = None):
    """The float graph at ``float_path`` with quantized weights, as an ``onnx_ir`` model (not yet written).
    ``gguf``: take the MatMulNBits blocks of the weights whose GGUF type fits from that file (``grid_report``
    receives what fitted and what did not, :func:`.gguf_grid.plan`)."""
    import logging

    import onnx
    import onnx_ir as ir
    from onnxruntime.quantization import matmul_nbits_quantizer as mnq

    logging.getLogger("onnxruntime.quantization").setLevel(logging.ERROR)
    t0 = time.perf_counter()
    proto = onnx.load(str(float_path), load_external_data=True)
    graph = proto.graph
    inits = {t.name: t for t in graph.initializer}
    exclude = _excluded_matmuls(graph, inits, scheme)
    grid = None
    if gguf is not None:
        grid = _gguf_plan(graph, inits, exclude, gguf, say, grid_report)
        exclude += [n.name for n in graph.node if n.op_type == "MatMul" and n.input[1] in grid.fitted]
    quantizer = mnq.MatMulNBitsQuantizer(proto, nodes_to_exclude=exclude, algo_config=_matmul_config(mnq, scheme))
    quantizer.process()
    proto = quantizer.model.model
    if grid is not None and grid.fitted:
        _apply_grid(proto, grid, scheme)
    n_matmul = 0
    for node in proto.graph.node:
        if node.op_type == "MatMulNBits":
            n_matmul += 1
            if scheme.accuracy_level and not any(a.name == "accuracy_level" for a in node.attribute):
                node.attribute.append(onnx.helper.make_attribute("accuracy_level", scheme.accuracy_level))
    vcfg = mnq.DefaultWeightOnlyQuantConfig(block_size=scheme.block_size, is_symmetric=True,
                                            accuracy_level=scheme.accuracy_level or None,
                                            op_types_to_quantize=("MatMul",), bits=scheme.bits)
    table_blocks = _gguf_table_blocks(grid, grid_report) if grid is not None else None
    n_vocab = vocab_tables.quantize_vocab_weights(proto, scheme, mnq.DefaultWeightOnlyQuantizer(vcfg), table_blocks)
    if grid is not None and grid_report is not None:
        for name, how in grid_report.get("tables", {}).items():
            say(f"--gguf-grid: vocabulary table {name} takes the GGUF's own {how['gguf_type']} blocks ({how['bits']} "
                "bits)" if how["taken"] else f"--gguf-grid: vocabulary table {name} is not on a GGUF grid that "
                "fits (Q4_0 or Q8_0 rows): quantized by the ordinary int4 path")
    if n_matmul + n_vocab == 0:   # a setting that does nothing is refused, not recorded as done
        ks = [int(inits[n.input[1]].dims[0]) for n in graph.node if n.op_type == "MatMul" and len(n.input) > 1
              and n.input[1] in inits and len(inits[n.input[1]].dims) == 2]
        raise ExportError(f"--weights {scheme.scheme} --block-size {scheme.block_size} quantizes no weight matrix: "
                          f"the largest has {max(ks, default=0)} input features, fewer than one block; use a "
                          f"smaller --block-size")
    if not any(o.domain == "com.microsoft" for o in proto.opset_import):
        proto.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))
    say(f"quantized {n_matmul} MatMul weights and {n_vocab} vocabulary-sized weights to {scheme.scheme} "
        f"(block {scheme.block_size}, accuracy level {scheme.accuracy_level}) in {time.perf_counter() - t0:.1f}s")
    return ir.serde.deserialize_model(proto)


def _excluded_matmuls(graph, inits: dict, scheme: WeightScheme) -> list[str]:
    """Name every node (the quantizer excludes by name); the MatMuls kept as they are: small or non-constant."""
    import onnx

    exclude = []
    for i, node in enumerate(graph.node):
        if not node.name:
            node.name = f"{node.op_type}_{i}"
        if node.op_type == "MatMul":
            w = inits.get(node.input[1]) if len(node.input) > 1 else None
            if w is None or len(w.dims) != 2 or w.dims[0] < min_k(scheme.block_size) \
                    or w.data_type not in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16):
                exclude.append(node.name)
    return exclude


def _gguf_plan(graph, inits: dict, exclude: list[str], gguf: Path, say, grid_report: dict | None):
    """``--gguf-grid``: which float MatMul weights take the GGUF's own blocks (:func:`.gguf_grid.plan`), said and
    recorded in ``grid_report``."""
    import onnx
    from onnx import numpy_helper

    from qeff_kv.export.weights import gguf_grid

    weights = {}
    for node in graph.node:
        if node.op_type == "MatMul" and node.name not in exclude and node.input[1] in inits:
            w = inits[node.input[1]]
            if w.data_type == onnx.TensorProto.FLOAT:
                weights[node.input[1]] = numpy_helper.to_array(w)
    grid = gguf_grid.plan(weights, gguf)
    del weights
    for line in gguf_grid.summary_lines(grid.report):
        say(line)
    if grid_report is not None:
        grid_report.update(grid.report)
    return grid


def _matmul_config(mnq, scheme: WeightScheme):
    """onnxruntime's quantizer configuration for the MatMul weights."""
    if scheme.algorithm == "hqq":
        return mnq.HQQWeightOnlyQuantConfig(block_size=scheme.block_size, bits=scheme.bits,
                                            op_types_to_quantize=("MatMul",))
    return mnq.DefaultWeightOnlyQuantConfig(block_size=scheme.block_size, is_symmetric=scheme.symmetric,
                                            accuracy_level=scheme.accuracy_level or None,
                                            op_types_to_quantize=("MatMul",), bits=scheme.bits)


def _gguf_table_blocks(grid, grid_report: dict | None):
    """``table_blocks(name, table)`` for :func:`.vocab_tables.quantize_vocab_weights`: the GGUF's own blocks of a vocabulary
    table, where they fit (recorded in ``grid_report["tables"]``)."""
    def table_blocks(name, table):
        got = grid.rows.table_blocks(table)
        if grid_report is not None:
            grid_report.setdefault("tables", {})[name] = (
                {"taken": True, "gguf_type": got[3], "bits": got[2]} if got is not None else {"taken": False})
        return got
    return table_blocks


def _apply_grid(proto, grid, scheme: WeightScheme) -> None:
    """Replace the MatMuls whose weights fit the GGUF grid by MatMulNBits built from the GGUF's blocks."""
    from qeff_kv.export.weights import gguf_grid

    inits = {t.name: t for t in proto.graph.initializer}
    nodes = []
    used: set[str] = set()
    for node in list(proto.graph.node):
        if node.op_type == "MatMul" and len(node.input) > 1 and node.input[1] in grid.fitted:
            k, n = (int(d) for d in inits[node.input[1]].dims)
            new, new_inits = gguf_grid.matmulnbits_node(node, node.input[1], grid.fitted[node.input[1]], grid.rows,
                                                        k, n, scheme.accuracy_level)
            nodes += new
            used.add(node.input[1])
            for t in new_inits:   # a block-sum matrix is shared by the weights of its K
                if t.name not in inits:
                    inits[t.name] = t
                    proto.graph.initializer.append(t)
        else:
            nodes.append(node)
    del proto.graph.node[:]
    proto.graph.node.extend(nodes)
    still = {x for nd in nodes for x in nd.input}
    keep = [t for t in proto.graph.initializer if t.name not in used or t.name in still]
    del proto.graph.initializer[:]
    proto.graph.initializer.extend(keep)


# ------------------------------------------------------------------------------------------ loose check
@dataclass
class Agreement:
    steps: int
    top1_agreement: float
    max_abs_logit_diff: float
    seconds: float

    def to_json(self) -> dict:
        return {"status": "passed", "against": "float graph", "steps": self.steps,
                "top1_agreement": round(self.top1_agreement, 4),
                "max_abs_logit_diff": float(f"{self.max_abs_logit_diff:.4g}"), "seconds": round(self.seconds, 3)}


def compare_graphs(float_path: Path, quant_path: Path, probe, *, ctx_len: int, kv_batch: int = 1,
                   ccl=None) -> Agreement:
    """Run both graphs on ``probe`` (decode teacher-forced with the float graph's greedy tokens): the quantized
    graph must load, run and give finite logits; report its top-1 agreement and max logit difference."""
    t0 = time.perf_counter()
    runs = []
    tokens: list[int] = []
    for label, path in (("float", float_path), ("quantized", quant_path)):
        try:
            runner = ProbeRunner(path, ctx_len, kv_batch, ccl)
            logits = []
            prompt, chunk = probe.prompt, probe.chunk
            last = None
            for start in range(0, len(prompt), chunk):
                part = prompt[start:start + chunk]
                pad = chunk - len(part) if start + chunk <= ctx_len else 0
                last = runner.step(part + [0] * pad, list(range(start, start + len(part))) + [-1] * pad, probe.slot)
            logits.append(last)
            pos = len(prompt)
            for k in range(probe.decode_steps):
                if label == "float":
                    tokens.append(int(np.argmax(logits[-1])))
                logits.append(runner.step([tokens[k]], [pos], probe.slot))
                pos += 1
            del runner
        except Exception as exc:
            raise VerificationError(f"the {label} graph could not run the probe ({first_line(exc)})") from None
        runs.append(logits)
    ref, got = runs
    for i, g in enumerate(got):
        if not np.all(np.isfinite(g)):
            raise VerificationError(f"the quantized graph's logits are not finite at step {i + 1}")
    agree = sum(int(np.argmax(a) == np.argmax(b)) for a, b in zip(ref, got)) / len(ref)
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(ref, got))
    return Agreement(steps=len(ref), top1_agreement=agree, max_abs_logit_diff=diff,
                     seconds=time.perf_counter() - t0)
