"""Export at scale (issue 39): wall time and peak memory of qeff-kv's exporter and onnxruntime-genai's model builder
on the same random-weight bf16 checkpoints (benchmarks/make_checkpoint.py), from the 360M shape up.

    python benchmarks/bench_export_scale.py --shapes smollm2-360m --exporter both
    python benchmarks/bench_export_scale.py --shapes llama-8b --exporter qeff --precisions int4 --gguf Q4_0
    python benchmarks/bench_export_scale.py --shapes llama-8b --exporter qeff \\
        --qeff-command "/work/main/.venv/bin/python -m qeff_kv_cli.main export"   # with PYTHONPATH=<other tree>

Each export runs as a subprocess under ``/usr/bin/time -v``; a sampler sums the RSS of the process and all its
descendants every ``--poll`` seconds (the process tree's peak; time's figure is the largest single process), and
its anonymous part (RSS less file-backed pages, such as those of a memory-mapped checkpoint, which the kernel can
drop under pressure).
qeff-kv: ``fp16`` is ``--target portable --dtype float16``, ``int4`` is ``--target onnxruntime-fused --weights
int4`` (float32 activations), both ``--verify`` (``--skip-verify``: ``--no-verify``) and ``--ctx-len 1024``; the
run counts as verified when the manifest's ``verification.status`` is ``passed``. genai: ``python -m
onnxruntime_genai.models.builder -i CKPT -o OUT -p fp16|int4 -e cpu`` with ``--genai-python`` (a venv with the
``bench`` extra's onnxruntime-genai); the builder does not verify. A run whose tree's anonymous RSS passes
``--max-rss-gb`` is killed and recorded as such. Checkpoints are written first when missing (``--ckpt-root``); outputs are deleted after each
run unless ``--keep``. Results merge into ``--json`` by (shape, exporter, precision, verify); a markdown table is
printed (``--table``: the table of every run in ``--json``). Stage times of qeff-kv runs come from its progress lines.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_checkpoint  # noqa: E402
import make_gguf  # noqa: E402

GB = 1e9
QEFF_ARGS = {"fp16": ["--target", "portable", "--dtype", "float16"],
             "int4": ["--target", "onnxruntime-fused", "--weights", "int4"]}


def tree_rss(proc: psutil.Process) -> tuple[int, int]:
    """Sums over ``proc`` and every descendant still alive of the RSS and of its anonymous part (RSS less the
    file-backed and shared pages: a memory-mapped checkpoint's pages count in RSS but the kernel can drop them)."""
    total = anon = 0
    try:
        procs = [proc] + proc.children(recursive=True)
    except psutil.NoSuchProcess:
        return 0, 0
    for p in procs:
        try:
            info = p.memory_info()
        except psutil.Error:
            continue
        total += info.rss
        anon += info.rss - getattr(info, "shared", 0)
    return total, anon


def run_measured(cmd: list[str], log: Path, poll: float, max_rss: int, timeout: float, env=None) -> dict:
    """Run ``cmd`` under ``/usr/bin/time -v``, sampling the tree's RSS; returns wall, peaks (and when the tree's
    peak came), the anonymous part's peak, rc, time's report and the tree's RSS once a second
    (``[seconds, RSS GB, anonymous GB]``). The run is killed when the anonymous part passes ``max_rss``."""
    timefile = log.with_suffix(".time")
    full = ["/usr/bin/time", "-v", "-o", str(timefile)] + cmd
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(full, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        ps, peak, peak_anon, peak_at, killed, timeline = psutil.Process(proc.pid), 0, 0, 0.0, None, []
        while proc.poll() is None:
            rss, anon = tree_rss(ps)
            elapsed = time.perf_counter() - start
            if rss > peak:
                peak, peak_at = rss, elapsed
            peak_anon = max(peak_anon, anon)
            if not timeline or elapsed - timeline[-1][0] >= 1.0:
                timeline.append([round(elapsed, 1), round(rss / GB, 2), round(anon / GB, 2)])
            if anon > max_rss or elapsed > timeout:
                killed = (f"killed: anonymous tree RSS {anon / GB:.1f} GB over --max-rss-gb" if anon > max_rss
                          else f"killed: over --timeout {timeout:.0f} s")
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                break
            time.sleep(poll)
    wall = time.perf_counter() - start
    report = timefile.read_text() if timefile.is_file() else ""

    def field(label):
        m = re.search(rf"{re.escape(label)}: (\S+)", report)
        return m.group(1) if m else None

    maxrss_kb = field("Maximum resident set size (kbytes)")
    user, system = field("User time (seconds)"), field("System time (seconds)")
    return {"wall_s": round(wall, 1), "peak_tree_rss_bytes": peak, "peak_at_s": round(peak_at, 1),
            "peak_tree_anon_bytes": peak_anon, "rss_timeline_gb": timeline,
            "time_max_rss_bytes": int(maxrss_kb) * 1024 if maxrss_kb else None,
            "cpu_s": round(float(user) + float(system), 1) if user and system else None,
            "rc": proc.returncode, "killed": killed, "log": str(log)}


def dir_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (apparent size)."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def ensure_checkpoint(shape: str, root: Path) -> tuple[Path, dict]:
    """The checkpoint folder of ``shape`` under ``root``, written first when missing."""
    path = root / shape
    if not (path / "model.safetensors.index.json").is_file():
        print(f"writing checkpoint {shape} to {path}", flush=True)
        make_checkpoint.write_checkpoint(shape, path, sparse=(shape == "llama-70b"))
    index = json.loads((path / "model.safetensors.index.json").read_text())
    cfg = json.loads((path / "config.json").read_text())
    params = sum(math.prod(s[1]) for s in make_checkpoint.tensor_specs(
        {k: cfg[k] for k in make_checkpoint.SHAPES[shape]}))
    return path, {"bytes": index["metadata"]["total_size"], "params": params}


def qeff_cmd(base: list[str], ckpt: Path, out: Path, precision: str, verify: bool, ctx_len: int) -> list[str]:
    """The qeff-kv export command line for one run."""
    return base + [str(ckpt), "-o", str(out), "--ctx-len", str(ctx_len), "--force",
                   "--verify" if verify else "--no-verify"] + QEFF_ARGS[precision]


def qeff_verified(out: Path, log: Path) -> str:
    """``passed`` / ``skipped`` / ``failed`` / ``none`` from the export's manifest and its log."""
    manifest = out / "manifest.json"
    if manifest.is_file():  # written only by a run that finished
        status = (json.loads(manifest.read_text()).get("verification") or {}).get("status")
        if status:
            return status
    return "failed" if "verification failed" in log.read_text(errors="replace") else "none"


def stages(log: Path) -> list[list]:
    """qeff-kv's progress lines ``[  12.3s] what`` of a run's log, as ``[seconds, what]``."""
    found = re.findall(r"^\[\s*([\d.]+)s\] (.*)$", log.read_text(errors="replace"), re.M)
    return [[float(t), what] for t, what in found]


def run_one(args, shape: str, exporter: str, precision: str, ckpt: Path, info: dict) -> dict:
    """One export of ``ckpt`` by ``exporter`` at ``precision``, measured."""
    out = args.work / f"{shape}-{exporter}-{precision}"
    if out.exists():
        shutil.rmtree(out)
    log = args.work / f"{shape}-{exporter}-{precision}.log"
    if exporter == "qeff":
        cmd = qeff_cmd(shlex.split(args.qeff_command), ckpt, out, precision, not args.skip_verify, args.ctx_len)
    else:
        cache = args.work / "genai-cache"
        cmd = [args.genai_python, "-m", "onnxruntime_genai.models.builder", "-i", str(ckpt), "-o", str(out),
               "-p", precision, "-e", "cpu", "-c", str(cache)]
    print(f"[{shape} {exporter} {precision}] {shlex.join(cmd)}", flush=True)
    load0 = os.getloadavg()[0]
    res = run_measured(cmd, log, args.poll, int(args.max_rss_gb * GB), args.timeout)
    res["out_bytes"] = dir_bytes(out)
    if exporter == "qeff":
        res["verified"] = qeff_verified(out, log)
        res["stages"] = stages(log)
    else:
        res["verified"] = "not done by the builder"
        shutil.rmtree(args.work / "genai-cache", ignore_errors=True)
    if res["rc"] != 0:
        res["error_tail"] = log.read_text(errors="replace").strip().splitlines()[-3:]
    if not args.keep:
        shutil.rmtree(out, ignore_errors=True)
    res.update({"shape": shape, "release": make_checkpoint.RELEASES[shape], "exporter": exporter,
                "precision": precision, "verify": (not args.skip_verify) if exporter == "qeff" else None,
                "command": shlex.join(cmd), "ckpt_bytes": info["bytes"], "source": info.get("source", "bf16"),
                "params": info["params"], "peak_over_ckpt": round(res["peak_tree_rss_bytes"] / info["bytes"], 2),
                "loadavg_1min_start": round(load0, 2), "loadavg_1min_end": round(os.getloadavg()[0], 2),
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())})
    print(f"  -> {res['wall_s']} s, tree peak {res['peak_tree_rss_bytes'] / GB:.2f} GB "
          f"({res['peak_over_ckpt']}x the checkpoint), rc {res['rc']}, verified: {res['verified']}"
          + (f", {res['killed']}" if res["killed"] else ""), flush=True)
    return res


def run_key(r: dict) -> tuple:
    """What a new run replaces in the results file: same shape, exporter, weights and verification choice."""
    return r["shape"], r["exporter"], r["precision"], r.get("verify"), r.get("source", "bf16")


def trace_seconds(stage_lines: list) -> str:
    """Seconds from a qeff-kv run's ``tracing`` line to the next stage line ("-" without them)."""
    for (t, line), nxt in zip(stage_lines, stage_lines[1:]):
        if line.startswith("tracing "):
            return f"{nxt[0] - t:.0f}"
    return "-"


def table(rows: list[dict]) -> str:
    """The markdown table of ``rows``."""
    head = ("| shape | checkpoint | ckpt GB | exporter | weights | wall s | CPU s | CPU s per B params | trace s "
            "| peak RSS tree GB | of it anonymous GB | time -v max RSS GB | peak / ckpt | output GB | verified | rc |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        tmax = f"{r['time_max_rss_bytes'] / GB:.2f}" if r.get("time_max_rss_bytes") else "-"
        rc = r["killed"] or str(r["rc"])
        anon = f"{r['peak_tree_anon_bytes'] / GB:.2f}" if r.get("peak_tree_anon_bytes") is not None else "-"
        verified = r["verified"] if r.get("verify") is not False else "--no-verify"
        per_b = f"{r['cpu_s'] / (r['params'] / 1e9):.0f}" if r.get("cpu_s") and r.get("params") else "-"
        lines.append(f"| {r['release']} | {r.get('source', 'bf16')} | {r['ckpt_bytes'] / GB:.2f} | {r['exporter']} | {r['precision']} | "
                     f"{r['wall_s']:.0f} | {r['cpu_s'] if r['cpu_s'] is not None else '-'} | {per_b} | "
                     f"{trace_seconds(r.get('stages') or [])} | "
                     f"{r['peak_tree_rss_bytes'] / GB:.2f} | {anon} | {tmax} | {r['peak_over_ckpt']:.2f}x | "
                     f"{r['out_bytes'] / GB:.2f} | {verified} | {rc} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="smollm2-360m", help="comma-separated keys of make_checkpoint.SHAPES")
    ap.add_argument("--exporter", choices=["qeff", "genai", "both"], default="both")
    ap.add_argument("--precisions", default="fp16,int4")
    ap.add_argument("--qeff-command", default=f"{sys.executable} -m qeff_kv_cli.main export",
                    help="the export command (its environment's PYTHONPATH picks the tree)")
    ap.add_argument("--genai-python", default=os.environ.get("GENAI_PYTHON", sys.executable),
                    help="python with onnxruntime-genai (default $GENAI_PYTHON or this python)")
    ap.add_argument("--skip-verify", action="store_true", help="qeff-kv with --no-verify")
    ap.add_argument("--ctx-len", type=int, default=1024)
    ap.add_argument("--ckpt-root", type=Path, default=Path("/tmp/scale-ckpt"))
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench-export-scale"), help="outputs and logs")
    ap.add_argument("--keep", action="store_true", help="keep the exported folders")
    ap.add_argument("--poll", type=float, default=0.2, help="RSS sampling period, seconds")
    ap.add_argument("--max-rss-gb", type=float, default=16.0,
                    help="kill a run whose tree's anonymous RSS passes this (GB)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="kill a run after this many seconds")
    ap.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "export_scale.json")
    ap.add_argument("--table", action="store_true", help="print the table of every run in --json and stop")
    ap.add_argument("--gguf", choices=["Q4_0", "Q8_0"], help="export the checkpoint converted to a GGUF file of "
                    "this type (benchmarks/make_gguf.py: llama.cpp's layout; written first when missing)")
    args = ap.parse_args(argv)
    if args.table:
        runs = json.loads(args.json.read_text())["runs"]
        print(table(sorted(runs, key=lambda r: (r["params"], r["exporter"] != "qeff", r["precision"],
                                                r.get("verify") is False))))
        return 0
    args.work.mkdir(parents=True, exist_ok=True)
    exporters = ["qeff", "genai"] if args.exporter == "both" else [args.exporter]
    if "genai" in exporters:
        probe = subprocess.run([args.genai_python, "-c", "import onnxruntime_genai"], capture_output=True, text=True)
        if probe.returncode != 0:
            sys.exit(f"onnxruntime-genai does not import in {args.genai_python} (pip install "
                     f"'onnxruntime-genai>=0.18,<0.19' there, or pass --genai-python)")
    old = json.loads(args.json.read_text())["runs"] if args.json.is_file() else []
    new = []
    for shape in args.shapes.split(","):
        ckpt, info = ensure_checkpoint(shape, args.ckpt_root)
        if args.gguf:
            path = args.ckpt_root / f"{shape}-{args.gguf.lower()}.gguf"
            if not path.is_file():
                print(f"writing {path}", flush=True)
                make_gguf.write_gguf(ckpt, path, args.gguf)
            ckpt, info = path, {"bytes": path.stat().st_size, "params": info["params"], "source": f"GGUF {args.gguf}"}
        for exporter in exporters:
            for precision in args.precisions.split(","):
                new.append(run_one(args, shape, exporter, precision, ckpt, info))
    keys = {run_key(r) for r in new}
    runs = [r for r in old if run_key(r) not in keys] + new
    args.json.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.json.with_suffix(".json.partial")
    tmp.write_text(json.dumps({"machine": f"{os.cpu_count()} CPUs, "
                                          f"{psutil.virtual_memory().total / GB:.0f} GB RAM", "runs": runs}, indent=1))
    tmp.replace(args.json)
    print(table(new))
    return 0


if __name__ == "__main__":
    sys.exit(main())
