"""Where a lock-step decode step's time goes as rows and context grow, and two kernel levers tried against it.

    python benchmarks/bench_rows.py EXPORT --threads 2 [--rows 1,2,4,8,16] [--contexts 100,600,1200]
        [--profile] [--matmulnbits] [--fp16-kv] [--out results/rows.json]

1. **Step by rows** (always): a :class:`~qeff_kv.runtime.Session` with ``max_sequences`` = the largest row count;
   every row is prefilled with ``C`` seeded random tokens, then a decode step of the first ``R`` rows is timed
   (median of ``--steps``) for every ``R`` and context ``C``. With ``--profile`` the same steps run again with
   onnxruntime's profiler on, and each ``(R, C)`` gets its kernel time per step by op type (MatMulNBits,
   GroupQueryAttention, ...): what grows with the rows (the projections at ``M = R``) and what grows with rows x
   context (attention reading the fp32 KV cache).
2. ``--matmulnbits``: one ``MatMulNBits`` node alone at each distinct ``(K, N)`` of the export's, random 4-bit
   weights, for ``M`` in 1, 8, 32 (one decode row, eight lock-step rows, one prefill chunk), block size 32 and 128,
   accuracy level 4 (int8 compute, the exporter's default) and 1 (fp32 compute); microseconds per run.
3. ``--fp16-kv``: the export's graph rewritten in memory so that every ``GroupQueryAttention`` keeps its cache in
   float16 (its query and cos/sin caches cast to float16, its output cast back; the KV inputs and retained outputs
   typed float16), run with plain onnxruntime and in-place bound buffers against the unchanged graph at the same
   rows and contexts (a measurement of onnxruntime's CPU kernel, not a target qeff-kv offers).

Prints tables and writes ``--out`` (JSON). A script, not a test: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def median_ms(fn, steps: int) -> float:
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(1e3 * statistics.median(times), 3)


# ---------------------------------------------------------------------------------------------- 1. step by rows
def open_session(export: str, rows: int, threads: int, profile: bool):
    """A session of ``rows`` sequences; with ``profile``, onnxruntime's profiler on (it slows every kernel: the
    step times come from a session without it)."""
    import onnxruntime as ort

    from qeff_kv.runtime import Session

    made = ort.SessionOptions
    if profile:   # the session's own options, with the profiler on
        prefix = os.path.join(tempfile.mkdtemp(prefix="bench-rows-"), "step")

        def options():
            so = made()
            so.enable_profiling = True
            so.profile_file_prefix = prefix
            return so
        ort.SessionOptions = options
    try:
        return Session(export, max_sequences=rows, threads=threads)
    finally:
        ort.SessionOptions = made


def run_windows(session, rows: list[int], contexts: list[int], steps: int, say: bool):
    """For each context, every row prefilled to it, then ``steps`` timed decode steps of the first ``R`` rows for
    each ``R``: the rows' figures and each window's ``(index of its first run, rows, context)``."""
    tm = session.timings
    rng = np.random.default_rng(0)
    out, windows = [], []
    for ctx in contexts:
        seqs = []
        for _ in range(max(rows)):
            seq = session.add_sequence()
            session.prefill(seq, [int(t) for t in rng.integers(100, session.vocab_size - 1, ctx)])
            seqs.append(seq)
        for r in rows:
            feed = [(s, 5) for s in seqs[:r]]
            session.decode(feed)   # the first run of this row count is not timed
            first = tm.prefill_runs + tm.decode_steps   # index of the first timed run among the session's runs
            ms = median_ms(lambda: session.decode(feed), steps)
            windows.append((first, r, ctx))
            for s in seqs[:r]:   # each step wrote one position: back to the context measured
                session.truncate(s, ctx)
            out.append({"rows": r, "context": ctx, "step_ms": ms, "tok_per_s": round(1e3 * r / ms, 1)})
            if say:
                print(f"rows {r:2d} context {ctx:5d}: {ms:7.2f} ms a step, {out[-1]['tok_per_s']:7.1f} tok/s",
                      flush=True)
        for s in seqs:
            session.remove_sequence(s)
    return out, windows


def step_by_rows(export: str, rows: list[int], contexts: list[int], steps: int, threads: int,
                 profile: bool) -> list[dict]:
    session = open_session(export, max(rows), threads, profile=False)
    out, _ = run_windows(session, rows, contexts, steps, say=True)
    del session
    if profile:
        session = open_session(export, max(rows), threads, profile=True)
        _, windows = run_windows(session, rows, contexts, steps, say=False)
        tm = session.timings
        split = op_times(session.binding.executor_session.end_profiling(), windows, steps,
                         tm.prefill_runs + tm.decode_steps)
        for row in out:
            row["kernel_ms_by_op"] = split[(row["rows"], row["context"])]
            ops = ", ".join(f"{op} {ms}" for op, ms in list(row["kernel_ms_by_op"].items())[:4])
            print(f"rows {row['rows']:2d} context {row['context']:5d}: kernel ms a step by op (profiled): {ops}")
    return out


def op_times(trace_file: str, windows, steps: int, runs_made: int) -> dict:
    """Kernel time per op type per step for each window ``(index of its first run, rows, context)``: the
    profiler's ``model_run`` events are the session's runs in order (any it made before ours come first)."""
    events = json.load(open(trace_file))
    runs = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "model_run")
    offset = len(runs) - runs_made
    kernels = sorted((e["ts"], e["args"]["op_name"], e["dur"]) for e in events
                     if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time"))
    out = {}
    for first, r, ctx in windows:
        lo, hi = runs[offset + first][0], runs[offset + first + steps - 1][1]
        tot: collections.Counter = collections.Counter()
        for ts, op, dur in kernels:
            if lo <= ts <= hi:
                tot[op] += dur
        out[(r, ctx)] = {op: round(us / steps / 1e3, 3) for op, us in tot.most_common()}
    return out


# ---------------------------------------------------------------------------------------------- 2. MatMulNBits
def matmulnbits_shapes(export: str) -> list[tuple[int, int]]:
    from qeff_kv.graph import graphio
    from qeff_kv.runtime.model_files import resolve_model

    model = graphio.load(resolve_model(export).onnx_path)
    shapes = []
    for node in model.graph:
        if node.op_type == "MatMulNBits":
            kn = (node.attributes["K"].as_int(), node.attributes["N"].as_int())
            if kn not in shapes:
                shapes.append(kn)
    return shapes


def matmulnbits(shapes: list[tuple[int, int]], threads: int, runs: int = 200) -> list[dict]:
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    out = []
    for K, N in shapes:
        for block in (32, 128):
            for level in (4, 1):
                blocks = (K + block - 1) // block
                rng = np.random.default_rng(0)
                inits = [numpy_helper.from_array(rng.integers(0, 255, (N, blocks, block // 2)).astype(np.uint8), "W"),
                         numpy_helper.from_array((rng.random(N * blocks) * 0.01).astype(np.float32), "S")]
                node = helper.make_node("MatMulNBits", ["A", "W", "S"], ["Y"], domain="com.microsoft", K=K, N=N,
                                        bits=4, block_size=block, accuracy_level=level)
                graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", K])],
                                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", N])], inits)
                model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                                helper.make_opsetid("com.microsoft", 1)])
                so = ort.SessionOptions()
                so.intra_op_num_threads = threads
                sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
                row = {"K": K, "N": N, "block_size": block, "accuracy_level": level}
                for M in (1, 8, 32):
                    a = rng.standard_normal((M, K)).astype(np.float32)
                    for _ in range(20):
                        sess.run(None, {"A": a})
                    row[f"M{M}_us"] = round(1e3 * median_ms(lambda: sess.run(None, {"A": a}), runs), 1)
                out.append(row)
                print(f"MatMulNBits K {K} N {N} block {block} accuracy {level}: " +
                      ", ".join(f"M={M} {row[f'M{M}_us']} us" for M in (1, 8, 32)), flush=True)
    return out


# ---------------------------------------------------------------------------------------------- 3. fp16 KV
def fp16_kv_graph(export: str, path: Path) -> None:
    """The export's graph with every GroupQueryAttention's cache in float16 (see the module docstring)."""
    import onnx_ir as ir

    from qeff_kv.graph import graphio
    from qeff_kv.runtime.model_files import resolve_model

    model = graphio.load(resolve_model(export).onnx_path)
    graph = model.graph
    halved: set[int] = set()
    for node in list(graph):
        if node.op_type != "GroupQueryAttention":
            continue
        q = node.inputs[0]
        cast_q = ir.node("Cast", [q], attributes={"to": ir.DataType.FLOAT16})
        graph.insert_before(node, cast_q)
        node.replace_input_with(0, cast_q.outputs[0])
        for i in (3, 4):   # the cache inputs (graph inputs) and their retained outputs
            node.inputs[i].dtype = ir.DataType.FLOAT16
            node.outputs[i - 2].dtype = ir.DataType.FLOAT16
        for i in (7, 8):   # cos/sin caches
            const = node.inputs[i].producer()
            if const is not None and id(const) not in halved:
                halved.add(id(const))
                arr = const.attributes["value"].as_tensor().numpy().astype(np.float16)
                const.attributes["value"] = ir.AttrTensor("value", ir.tensor(arr))
                node.inputs[i].dtype = ir.DataType.FLOAT16
        out = node.outputs[0]
        users = list(out.uses())
        cast_o = ir.node("Cast", [out], attributes={"to": ir.DataType.FLOAT})
        graph.insert_after(node, cast_o)
        for use in users:
            use.node.replace_input_with(use.idx, cast_o.outputs[0])
        out.dtype = ir.DataType.FLOAT16
    graphio.save(model, path, source_dir=resolve_model(export).onnx_path.parent)


def raw_steps(onnx_path: str, kv_dtype, rows: int, ctx: int, threads: int, steps: int) -> float:
    """A decode step of ``rows`` rows at position ``ctx`` with plain onnxruntime, the KV bound in place."""
    import onnxruntime as ort

    from qeff_kv.graph import graphio

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.log_severity_level = 3
    sess = ort.InferenceSession(onnx_path, so, providers=["CPUExecutionProvider"])
    layout = graphio.layout_of(graphio.load(onnx_path))
    io = sess.io_binding()
    io.bind_cpu_input("input_ids", np.full((rows, 1), 5, np.int64))
    io.bind_cpu_input("position_ids", np.full((rows, 1), ctx, np.int64))
    rng = np.random.default_rng(0)
    keep = []
    for pair in layout.pairs:
        shape = [rows if i == 0 else (d if isinstance(d, int) else 2 * ctx + 64)
                 for i, d in enumerate(pair.input.shape)]
        value = ort.OrtValue.ortvalue_from_numpy((0.1 * rng.standard_normal(shape)).astype(kv_dtype))
        keep.append(value)
        io.bind_ortvalue_input(pair.input_name, value)
        io.bind_ortvalue_output(pair.output_name, value)
    for name in (o.name for o in sess.get_outputs()):
        if name not in {p.output_name for p in layout.pairs}:
            io.bind_output(name)
    sess.run_with_iobinding(io)
    return median_ms(lambda: sess.run_with_iobinding(io), steps)


def fp16_kv(export: str, rows: list[int], contexts: list[int], threads: int, steps: int) -> list[dict]:
    from qeff_kv.runtime.model_files import resolve_model

    work = Path(tempfile.mkdtemp(prefix="bench-fp16kv-"))
    half = work / "fp16kv.onnx"
    fp16_kv_graph(export, half)
    base = str(resolve_model(export).onnx_path)
    out = []
    for r in rows:
        for ctx in contexts:
            a = raw_steps(base, np.float32, r, ctx, threads, steps)
            b = raw_steps(str(half), np.float16, r, ctx, threads, steps)
            out.append({"rows": r, "context": ctx, "fp32_kv_ms": a, "fp16_kv_ms": b})
            print(f"rows {r:2d} context {ctx:5d}: fp32 KV {a:7.2f} ms, fp16 KV {b:7.2f} ms a step", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("export")
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--contexts", default="100,600,1200")
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--profile", action="store_true", help="kernel time by op type (onnxruntime's profiler)")
    ap.add_argument("--matmulnbits", action="store_true", help="MatMulNBits alone: M, block size, accuracy level")
    ap.add_argument("--fp16-kv", action="store_true", help="the graph with a float16 cache against float32")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    rows, contexts = ints(args.rows), ints(args.contexts)
    result = {"command": " ".join(sys.argv), "threads": args.threads, "loadavg_start": os.getloadavg(),
              "steps": step_by_rows(args.export, rows, contexts, args.steps, args.threads, args.profile)}
    if args.matmulnbits:
        result["matmulnbits"] = matmulnbits(matmulnbits_shapes(args.export), args.threads)
    if args.fp16_kv:
        result["fp16_kv"] = fp16_kv(args.export, [r for r in rows if r in (1, 8)] or rows[:1], contexts,
                                    args.threads, args.steps)
    result["loadavg_end"] = os.getloadavg()
    if args.out:
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1))
        tmp.replace(args.out)


if __name__ == "__main__":
    main()
