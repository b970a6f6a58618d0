"""A memory-bandwidth limit for decode, and the bytes one decode token reads.

    python benchmarks/bandwidth.py                         # measure (2 threads, 1 GiB buffer), print JSON
    python benchmarks/bandwidth.py --graph benchmarks/work/M-exports/qeff-onnxruntime-fused --valid-len 192

**Bandwidth.** Several streaming reads of one buffer far larger than the last-level cache (1 GiB by default;
this machine has 32 MiB of L3), each by a native kernel on ``threads`` threads. Every variant reads the whole
buffer once per pass; the figure is bytes / median pass time over ``repeats`` passes after a warm-up pass.
The limit is the fastest variant (all are reported):

- ``numpy_sum_f32``: ``ndarray.sum`` over float32 slices, one slice per Python thread (numpy releases the GIL);
- ``numpy_add_reduce_i64``: ``np.add.reduce`` over int64 views of the same bytes, one slice per thread;
- ``ort_reducesum``: onnxruntime ``ReduceSum`` over the buffer seen as [1024, n] (``intra_op_num_threads``);
- ``ort_matvec``: onnxruntime ``MatMul`` of a vector by the buffer seen as [k, 4096], the matrix fed as an input;
- ``ort_matvec_prepacked``: the same ``MatMul`` with the matrix as an initializer, which onnxruntime pre-packs
  into MLAS's panel layout at session start, exactly as it does the weights of an exported graph. This is the
  kernel and the layout a decode step reads its weights with, so the runtime cannot beat it with a better kernel.

The measurement runs in a subprocess so the thread environment (OMP/OpenBLAS) is its own.

**Bytes per token.** From the exported graph's own initializers, each counted once by name (a tied embedding is
stored once): the sum of their sizes, minus every initializer that only ``Gather`` reads along axis 0 (the
embedding lookup reads one row per token, which is added back), plus the KV cache read at the step's valid
length (K and V of every layer: ``n_kv_heads * valid_len * head_dim * itemsize``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

_KERNEL = r"""
import json, statistics, sys, threading, time
import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

threads, nbytes, repeats = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
n = nbytes // 4 // (1024 * 4096) * (1024 * 4096)  # float32 elements, divisible by the shapes below
buf = np.full(n, 1.0, np.float32)                 # touched: every page is resident before timing
nbytes = buf.nbytes


def timed(fn):
    fn()                                          # warm-up pass, not counted
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return {"gb_s": nbytes / statistics.median(ts) / 1e9, "gb_s_max": nbytes / min(ts) / 1e9,
            "gb_s_min": nbytes / max(ts) / 1e9}


def threaded(view, op):
    parts = np.array_split(view, threads)
    def run():
        out = [None] * threads
        ths = [threading.Thread(target=lambda j=j: out.__setitem__(j, op(parts[j]))) for j in range(threads)]
        for th in ths:
            th.start()
        for th in ths:
            th.join()
        return out
    return run


def ort_session(node, out_shape, inputs, initializer=()):
    g = helper.make_graph([node], "bw", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)],
                          initializer=list(initializer))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 9
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])


res = {}
res["numpy_sum_f32"] = timed(threaded(buf, np.sum))
res["numpy_add_reduce_i64"] = timed(threaded(buf.view(np.int64), np.add.reduce))

x2 = buf.reshape(1024, -1)
rs = ort_session(helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=0), [1024],
                 [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x2.shape))],
                 [helper.make_tensor("axes", TensorProto.INT64, [1], [1])])
res["ort_reducesum"] = timed(lambda: rs.run(None, {"x": x2}))

w = buf.reshape(-1, 4096)
v = np.ones((1, w.shape[0]), np.float32)
mv = ort_session(helper.make_node("MatMul", ["v", "w"], ["y"]), [1, 4096],
                 [helper.make_tensor_value_info("v", TensorProto.FLOAT, list(v.shape)),
                  helper.make_tensor_value_info("w", TensorProto.FLOAT, list(w.shape))])
res["ort_matvec"] = timed(lambda: mv.run(None, {"v": v, "w": w}))
del mv

# The same GEMV with the matrix as an initializer, as the weights of an exported graph are: onnxruntime pre-packs
# a constant MatMul weight into MLAS's panel layout (a copy) at session start, and reads that every run.
g = helper.make_graph([helper.make_node("MatMul", ["v", "w"], ["y"])], "bw",
                      [helper.make_tensor_value_info("v", TensorProto.FLOAT, list(v.shape))],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4096])])
t = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=list(w.shape), data_location=TensorProto.EXTERNAL)
for k, val in (("location", "supplied-by-session-options"), ("offset", "0"), ("length", str(w.nbytes))):
    e = t.external_data.add()
    e.key, e.value = k, val
g.initializer.append(t)
m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
m.ir_version = 9
so = ort.SessionOptions()
so.intra_op_num_threads = threads
so.inter_op_num_threads = 1
so.add_external_initializers(["w"], [ort.OrtValue.ortvalue_from_numpy(w)])
pk = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
res["ort_matvec_prepacked"] = timed(lambda: pk.run(None, {"v": v}))
print(json.dumps({"bytes": nbytes, "threads": threads, "repeats": repeats, "variants": res}))
"""


def measure_bandwidth(threads: int = 2, nbytes: int = 1 << 30, repeats: int = 7) -> dict:
    """Streaming-read bandwidth of ``nbytes`` on ``threads`` threads: every variant, and the fastest as the limit."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", _KERNEL, str(threads), str(nbytes), str(repeats)],
                         capture_output=True, text=True, env=env, check=True)
    r = json.loads(out.stdout)
    best = max(r["variants"], key=lambda k: r["variants"][k]["gb_s"])
    r["limit_variant"], r["limit_gb_s"] = best, r["variants"][best]["gb_s"]
    return r


def graph_bytes(export_dir: Path) -> dict:
    """Bytes a decode token reads from the weights of the export in ``export_dir`` (no KV), and the KV layout."""
    import onnx
    from onnx import helper

    manifest = json.loads((Path(export_dir) / "manifest.json").read_text())
    model = onnx.load(str(Path(export_dir) / manifest["onnx"]), load_external_data=False)
    g = model.graph
    sizes, rows = {}, {}
    for t in g.initializer:
        n = 1
        for d in t.dims:
            n *= d
        item = helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
        sizes[t.name] = n * item
        rows[t.name] = (n // t.dims[0] * item) if t.dims else n * item
    consumers: dict[str, list] = {}
    for node in g.node:
        for j, name in enumerate(node.input):
            if name in sizes:
                axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
                consumers.setdefault(name, []).append((node.op_type, j, axis))
    gather_only = [n for n, c in consumers.items()
                   if c and all(op in ("Gather", "GatherBlockQuantized") and j == 0 and ax == 0 for op, j, ax in c)]
    total = sum(sizes.values())
    weights = total - sum(sizes[n] - rows[n] for n in gather_only)
    return {"initializer_bytes": total, "gather_only": {n: sizes[n] for n in gather_only},
            "weight_bytes_per_token": weights, "n_layers": len(manifest["buffers"]) // 2,
            "n_kv_heads": manifest["n_kv_heads"], "head_dim": manifest["head_dim"],
            "kv_itemsize": 1 if (manifest.get("kv_cache") or {}).get("dtype") == "int8" else 4}


def bytes_per_token(info: dict, valid_len: float) -> float:
    """Weights read per token plus the K and V of every layer at ``valid_len`` slots."""
    kv = 2 * info["n_layers"] * info["n_kv_heads"] * info["head_dim"] * info["kv_itemsize"] * valid_len
    return info["weight_bytes_per_token"] + kv


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mib", type=int, default=1024, help="buffer size in MiB (default 1024)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--graph", type=Path, help="an export folder: also print its bytes per token")
    ap.add_argument("--valid-len", type=float, default=0)
    args = ap.parse_args(argv)
    r = measure_bandwidth(args.threads, args.mib << 20, args.repeats)
    if args.graph:
        info = graph_bytes(args.graph)
        r["graph"] = info
        r["bytes_per_token"] = bytes_per_token(info, args.valid_len)
        r["limit_tok_s"] = r["limit_gb_s"] * 1e9 / r["bytes_per_token"]
    print(json.dumps(r, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
