"""Benchmark: `qeff-kv rewrite` of a 128-layer retained-state graph with several GB of external weights.

Compares, each in a fresh subprocess (so peak RSS is the operation's own):

* ``ours-same-folder``   qeff_kv.tools.rewrite.rewrite(src, <same folder>/out.onnx, prefix="VLLM")
* ``ours-other-folder``  the same into another folder (the data file is cloned or copied beside the output,
                         in the kernel; a sparse file stays sparse, so this is measured on a dense file too)
* ``ours-check``         qeff_kv.tools.check.check(src) (all rules, onnx checker included)
* ``naive``              onnx.load(src) (loads every weight) + rename the KV names + onnx.save(...) with
                         external data (writes every weight again)

The external-data file is sparse (``truncate``), so the "several GB" cost no disk space for the source; the
naive variant writes its copy for real, which is why it only runs at the smaller sizes by default. One dense
data file (``--dense-gib``, 1 GiB by default) measures what a copy into another folder costs with real bytes.
Each process reports its wall time for the operation (imports excluded; process wall time is recorded too)
and its peak RSS (``VmHWM`` from /proc/self/status). Results go to benchmarks/results/rewrite.json.

    .venv/bin/python benchmarks/bench_rewrite.py                    # default sizes
    .venv/bin/python benchmarks/bench_rewrite.py --sizes-gib 2,4 --ours-only-gib 16 --dense-gib 1 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "rewrite.json"
LAYERS = 128


# ------------------------------------------------------------------------------------------------ build
def build(folder: Path, total_bytes: int, layers: int = LAYERS, dense: bool = False) -> Path:
    """A retained-state graph: per layer one MatMul weight [d, d] float32 stored externally (sparse file),
    and past_key.i / past_value.i each updated by ScatterND into its _RetainedState output."""
    from onnx import TensorProto, helper

    from qeff_kv.contract import naming

    d = int(math.sqrt(total_bytes / layers / 4))
    per = d * d * 4
    folder.mkdir(parents=True, exist_ok=True)
    data_name = "model.onnx.data"
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", "seq_len"]),
              helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["batch_size", "seq_len", d]),
              helper.make_tensor_value_info("kv_update", TensorProto.FLOAT, [1, 8, "ctx_len", 128])]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch_size", "seq_len", d])]
    nodes, inits = [], [helper.make_tensor("scatter_idx", TensorProto.INT64, [1, 1], [0])]
    h = "hidden"
    for i in range(layers):
        w = TensorProto(name=f"model.layers.{i}.mlp.weight", data_type=TensorProto.FLOAT, dims=[d, d])
        w.data_location = TensorProto.EXTERNAL
        for k, v in (("location", data_name), ("offset", str(i * per)), ("length", str(per))):
            e = w.external_data.add()
            e.key, e.value = k, v
        inits.append(w)
        out = "logits" if i == layers - 1 else f"/model/layers.{i}/MatMul_output_0"
        nodes.append(helper.make_node("MatMul", [h, w.name], [out], name=f"/model/layers.{i}/MatMul"))
        h = out
        for stem in naming.EXPORT_STEMS:
            x = naming.kv_input_name(stem, i)
            inputs.append(helper.make_tensor_value_info(x, TensorProto.FLOAT, ["batch_size", 8, "ctx_len", 128]))
            outputs.append(helper.make_tensor_value_info(naming.retained_name(x), TensorProto.FLOAT,
                                                         ["batch_size", 8, "ctx_len", 128]))
            nodes.append(helper.make_node("ScatterND", [x, "scatter_idx", "kv_update"], [naming.retained_name(x)],
                                          name=f"/model/layers.{i}/{stem}/ScatterND"))
    graph = helper.make_graph(nodes, "bench", inputs, outputs, initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = folder / "model.onnx"
    path.write_bytes(model.SerializeToString())
    with open(folder / data_name, "wb") as f:
        if dense:  # real blocks on disk: what copying into another folder costs with real weights
            block = bytes(range(256)) * (1 << 14)  # 4 MiB
            left = per * layers
            while left > 0:
                left -= f.write(block[: min(len(block), left)])
        else:
            f.truncate(per * layers)  # sparse: no blocks written
    return path


# ------------------------------------------------------------------------------------------------ child
def _vm(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])  # KiB
    return -1


def child(variant: str, src: str, dst: str) -> None:
    import onnx  # noqa: F401  (imports before the clock: both variants import onnx)

    from qeff_kv.tools import check as qcheck
    from qeff_kv.contract import naming
    from qeff_kv.tools.rewrite import rewrite

    rss0 = _vm("VmRSS")
    t0 = time.perf_counter()
    if variant in ("ours-same-folder", "ours-other-folder"):
        rewrite(src, dst, prefix="VLLM")
    elif variant == "ours-check":
        report = qcheck.check(src)
        assert report.ok, report.format_text()
    elif variant == "naive":
        import onnx as _onnx

        Path(dst).parent.mkdir(parents=True, exist_ok=True)
        m = _onnx.load(src)  # loads every external tensor into memory
        renames = {}
        for v in list(m.graph.input) + list(m.graph.output):
            if naming.parse_kv_name(v.name) is not None:
                renames[v.name] = naming.rename_kv(v.name, "VLLM")
                v.name = renames[v.name]
        for n in m.graph.node:
            n.input[:] = [renames.get(x, x) for x in n.input]
            n.output[:] = [renames.get(x, x) for x in n.output]
        _onnx.save(m, dst, save_as_external_data=True, all_tensors_to_one_file=True,
                   location=Path(dst).name + ".data")
    else:
        raise SystemExit(f"unknown variant {variant}")
    seconds = time.perf_counter() - t0
    print(json.dumps({"seconds": seconds, "vmhwm_kib": _vm("VmHWM"), "rss_before_kib": rss0}))


# ------------------------------------------------------------------------------------------------ parent
def run_variant(variant: str, src: Path, dst: Path) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--child", variant, str(src), str(dst)],
                          capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{variant} failed:\n{proc.stderr}")
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    res["process_seconds"] = wall
    return res


def _disk_bytes(path: Path) -> int:
    total = 0
    for p in path.rglob("*"):
        if p.is_file():
            total += p.stat().st_blocks * 512
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", nargs=3, metavar=("VARIANT", "SRC", "DST"), help=argparse.SUPPRESS)
    ap.add_argument("--sizes-gib", default="2,4", help="weight sizes for every variant (comma list, GiB)")
    ap.add_argument("--ours-only-gib", default="16", help="extra sizes for our variants only (naive skipped)")
    ap.add_argument("--dense-gib", default="1",
                    help="sizes with a dense (really written) data file, for the copy into another folder")
    ap.add_argument("--repeat", type=int, default=3, help="runs per (variant, size) of our variants; median quoted")
    ap.add_argument("--workdir", default=None, help="scratch folder (default: a temp folder, removed at the end)")
    ap.add_argument("--output", default=str(RESULTS))
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return

    both = [float(x) for x in args.sizes_gib.split(",") if x]
    ours_only = [float(x) for x in args.ours_only_gib.split(",") if x]
    dense = [float(x) for x in args.dense_gib.split(",") if x]
    scratch = Path(tempfile.mkdtemp(prefix="qeff-bench-", dir=args.workdir))
    rows = []
    try:
        plan = [(g, False) for g in sorted(set(both + ours_only))] + [(g, True) for g in dense]
        for gib, is_dense in plan:
            folder = scratch / f"src-{gib:g}{'-dense' if is_dense else ''}"
            src = build(folder, int(gib * (1 << 30)), dense=is_dense)
            weight_bytes = (folder / "model.onnx.data").stat().st_size
            if is_dense:
                variants = ["ours-same-folder", "ours-other-folder"]
            else:
                variants = ["ours-same-folder", "ours-other-folder", "ours-check"] + (["naive"] if gib in both else [])
            for variant in variants:
                runs = []
                for rep in range(1 if variant == "naive" else args.repeat):
                    out_dir = folder if variant == "ours-same-folder" else scratch / f"out-{variant}-{gib:g}-{rep}"
                    dst = out_dir / f"out-{rep}.onnx"
                    runs.append(run_variant(variant, src, dst))
                    if variant in ("naive", "ours-other-folder"):
                        runs[-1]["disk_written_bytes"] = _disk_bytes(out_dir)
                    if out_dir != folder:
                        shutil.rmtree(out_dir, ignore_errors=True)
                    else:
                        dst.unlink(missing_ok=True)
                row = {
                    "variant": variant, "layers": LAYERS, "weight_bytes": weight_bytes,
                    "data_file": "dense" if is_dense else "sparse",
                    "graph_file_bytes": src.stat().st_size, "runs": len(runs),
                    "seconds_median": statistics.median(r["seconds"] for r in runs),
                    "process_seconds_median": statistics.median(r["process_seconds"] for r in runs),
                    "peak_rss_mib_median": statistics.median(r["vmhwm_kib"] for r in runs) / 1024,
                    "rss_after_imports_mib_median": statistics.median(r["rss_before_kib"] for r in runs) / 1024,
                }
                if "disk_written_bytes" in runs[0]:
                    row["disk_written_bytes"] = runs[0]["disk_written_bytes"]
                rows.append(row)
                print(f"{variant:18} {weight_bytes / (1 << 30):6.1f} GiB {row['data_file']:6}  "
                      f"op {row['seconds_median']:7.3f} s  process {row['process_seconds_median']:6.2f} s  "
                      f"peak RSS {row['peak_rss_mib_median']:8.1f} MiB", flush=True)
            shutil.rmtree(folder, ignore_errors=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    import onnx
    import onnx_ir

    result = {
        "benchmark": "rewrite", "layers": LAYERS, "target": {"seconds": 2.0, "peak_rss": "independent of weight bytes"},
        "machine": {"python": platform.python_version(), "onnx": onnx.__version__, "onnx_ir": onnx_ir.__version__,
                    "cpus": os.cpu_count(), "platform": platform.platform()},
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "results": rows,
    }
    sys.path.insert(0, str(HERE.parent))
    from qeff_kv.support import fsutil

    fsutil.write_json(args.output, result)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
