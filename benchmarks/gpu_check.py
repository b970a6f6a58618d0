"""Issue 40's GPU half in one run: our runtime's tokens on an execution provider (EP) other than the CPU's, against
the CPU, on the tiny graphs of ``benchmarks/gpu_check_prepare.py`` (exported and referenced on a CPU machine).

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/gpu_check.py .gpu/graphs --ep CUDAExecutionProvider --out R.json

For each graph, the same greedy script (the 40-token prompt in prefill chunks, then 24 decode steps) runs as:

* ``a_cpu``: :class:`qeff_kv.runtime.Session` on the CPU EP (the reference here; also compared with the
  ``reference.json`` of the machine that exported the graphs);
* ``e_session_fixed``: ``Session(path, device="cuda")`` as ``generate``/``serve --device cuda`` open it: no hook
  (a kind ``runtime/execution/ep_proofs.py`` does not prove on the EP is refused: that is the result), the
  session's own binding path on that EP (host buffers, every input bound again before each run:
  ``runtime/execution/device.py``); the executor and device it got are recorded;
* ``b_session``: the same session with that rebinding bypassed (each input bound once, the CPU's path: round 1's
  wrong tokens, kept as the control that the rebinding is what makes ``e`` exact);
* ``c_plain``: a plain onnxruntime loop, every state input an ``OrtValue`` on the EP's device bound as the input and
  its retained output, the other inputs bound from host arrays before each run (the feeds ``a_cpu`` ran, with the
  loop's own greedy token in each decode step): what a state resident on the device would give;
* ``f_script``: the conformance script of ``tests/helpers/_ep_script.py`` (short last chunk, decode, truncate, and on the
  full-buffer graphs two lock-step rows or continuous-batching slots: copy, relocate) through
  ``Session(device=...)`` and through the CPU: tokens equal, largest logit difference (``tests/runtime/test_ep_cuda.py``
  without pytest).

Round 1 (H100) also ran ``d_session_rebind`` (every input bound again by this harness): ``e`` is that, done by the
runtime itself.

Each is compared with ``a_cpu`` twice: free-running (its own greedy tokens: equal or not, the first mismatch and
the CPU's top-1/top-2 margin there, so that a flip at a tiny margin shows as arithmetic; the decode step's time),
and teacher-forced (fed the CPU's tokens, traced: the logit difference at every step, whether each argmax agrees,
and, where outputs differ, the first run whose outputs differ: its feeds and, per output, how much and where, the
indices along each axis, so that the cause shows from one run). Two probes of onnxruntime itself on the EP
come first: whether a bound host input is copied at bind time, and whether ``OrtValue.update_inplace`` on the
device reaches the next run. Everything goes to one JSON file (``--out``). ``--ep CPUExecutionProvider`` is the
dry run on a machine without a GPU (every mode must then equal ``a_cpu``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))   # _ep_script (numpy only)

CPU, CUDA = "CPUExecutionProvider", "CUDAExecutionProvider"
#: the prompt (40 tokens: chunks of 16 -> 16, 16, 8) and the greedy decode steps after it
PROMPT = [(37 * i + 11) % 250 + 3 for i in range(40)]
STEPS = 24
#: a difference larger than ATOL + RTOL * max|expected| is "differs" (EPs' float arithmetic differs below it)
ATOL, RTOL = 1e-2, 1e-2


def rounded(rows) -> list[list[float]]:
    return [[round(float(x), 5) for x in np.asarray(r, np.float64)] for r in rows]


def margins(rows) -> list[float]:
    """top-1 minus top-2 logit of each step (a token flip at a tiny margin is arithmetic, not a bug)."""
    return [round(float(np.diff(np.sort(np.asarray(r, np.float64))[-2:])[0]), 5) for r in rows]


# ============================================================================================ Session modes
class Recorder:
    """Wraps a session's executor: records every input bound; ``rebind``: binds them all again before each run;
    ``trace``: keeps each run's feeds (every input but the state) and a copy of every output after it."""

    def __init__(self, sess, *, rebind: bool, trace: bool, once: bool = False):
        self.sess, self.rebind, self.trace = sess, rebind, trace
        self.state = {n for n, _, _ in sess.cache.bindings()}
        self.bound = {n: v for n, v, _ in sess.cache.bindings()}
        io = sess.binding.io
        self._bind, self._run = io.bind_ortvalue_input, io.run
        if once and hasattr(io, "_io"):   # bypass the executor's own rebinding (RebindingExecutor): bound once
            self._run = lambda: io.sess.run_with_iobinding(io._io)
        io.bind_ortvalue_input, io.run = self.bind_input, self.run
        self.phase, self.runs = "prefill", []

    def bind_input(self, name, value) -> None:
        self.bound[name] = value
        self._bind(name, value)

    def run(self) -> None:
        if self.rebind:
            for name, value in self.bound.items():
                self._bind(name, value)
        feeds = {n: v.numpy().copy() for n, v in self.bound.items() if n not in self.state} if self.trace else None
        self._run()
        if self.trace:
            outs = {n: v.numpy().copy() for n, v in zip(self.sess.binding.out_order, self.sess.binding.io.get_outputs())}
            self.runs.append({"phase": self.phase, "feeds": feeds, "outputs": outs})


def drive_session(path, providers: list[str] | None, *, rebind: bool = False, trace: bool = False,
                  forced: list[int] | None = None, device: str | None = None, once: bool = False) -> dict:
    """The greedy script through a :class:`Session` on ``providers`` (or ``device``); ``forced``: feed these
    tokens in the decode steps instead of the session's own (teacher forcing: the logits compare step by step even
    after a flip); ``once``: each input bound once (the session's rebinding bypassed)."""
    from qeff_kv.runtime import Session

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sess = Session(path, providers=providers, device=device)
    rec = Recorder(sess, rebind=rebind, trace=trace, once=once)
    seq = sess.add_sequence()
    t0 = time.perf_counter()
    rows = [sess.prefill(seq, PROMPT)]
    prefill_ms = (time.perf_counter() - t0) * 1e3
    rec.phase, step_ms = "decode", []
    for k in range(STEPS):
        t0 = time.perf_counter()
        out = sess.decode({seq: int(np.argmax(rows[-1])) if forced is None else forced[k]})[seq]
        step_ms.append((time.perf_counter() - t0) * 1e3)
        rows.append(out)
    return {"tokens": [int(np.argmax(r)) for r in rows], "logits": rows, "margins": margins(rows),
            "prefill_ms": prefill_ms, "decode_ms": step_ms, "runs": rec.runs,
            "warnings": [str(w.message)[:300] for w in caught],
            "state": {n: (list(v.numpy().shape), str(v.numpy().dtype)) for n, v, _ in sess.cache.bindings()},
            "onnx_path": str(sess.files.onnx_path), "providers": sess.binding.executor_session.get_providers(),
            "executor": type(sess.binding.io).__name__, "rebind_each_run": sess.device.rebind_each_run}


def conformance(path, device: str, rows: int | None) -> dict:
    """``tests/helpers/_ep_script.py``'s script through ``Session(device=device)`` and through the CPU."""
    from _ep_script import script
    from qeff_kv.runtime import Session

    want_toks, want_logits = script(Session(path, max_sequences=rows))
    sess = Session(path, device=device, max_sequences=rows)
    toks, logits = script(sess)
    diffs = [float(np.max(np.abs(a - b))) for a, b in zip(logits, want_logits)]
    return {"tokens_equal": toks == want_toks, "tokens": toks, "cpu_tokens": want_toks, "rows": rows,
            "max_logit_diff": max(diffs), "providers": sess.binding.executor_session.get_providers(),
            "executor": type(sess.binding.io).__name__}


# ============================================================================================ the plain loop
def plain_loop(onnx_path: str, providers: list[str], device: str, state: dict, cpu_runs: list[dict], *,
               trace: bool, forced: bool = False) -> dict:
    """onnxruntime alone: every state input a device ``OrtValue`` bound as the input and its retained output; the
    other inputs bound from host arrays before each run (``cpu_runs``' feeds; the decode token the loop's own, or
    with ``forced`` the CPU's)."""
    import onnxruntime as ort
    from qeff_kv import naming

    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(onnx_path, so, providers=providers)
    io = sess.io_binding()
    values = {}
    for name, (shape, dtype) in state.items():
        values[name] = ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, np.dtype(dtype)), device, 0)
        io.bind_ortvalue_input(name, values[name])
        io.bind_ortvalue_output(naming.retained_name(name), values[name])
    order = [naming.retained_name(n) for n in values]
    for out in sess.get_outputs():
        if out.name not in order:
            io.bind_output(out.name, "cpu")
            order.append(out.name)
    emits = _emitting_runs(cpu_runs)
    rows, runs, run_ms, prefill_ms = [], [], [], 0.0
    for i, r in enumerate(cpu_runs):
        feeds = dict(r["feeds"])
        if r["phase"] == "decode" and not forced:
            feeds["input_ids"] = np.array([[int(np.argmax(rows[-1]))]], np.int64)
        t0 = time.perf_counter()
        for name, a in feeds.items():
            io.bind_cpu_input(name, a)
        sess.run_with_iobinding(io)
        outs = io.get_outputs()
        logits = outs[order.index("logits")].numpy().copy()   # its memory is reused by the next run
        dt = (time.perf_counter() - t0) * 1e3
        if r["phase"] == "decode":
            run_ms.append(dt)
        else:
            prefill_ms += dt
        if i in emits:
            rows.append(logits[0, 0] if logits.shape[1] == 1 else logits[0, feeds["input_ids"].shape[1] - 1])
        if trace:
            runs.append({"phase": r["phase"], "feeds": feeds,
                         "outputs": {n: v.numpy().copy() for n, v in zip(order, outs)}})
    return {"tokens": [int(np.argmax(r)) for r in rows], "logits": rows, "margins": margins(rows),
            "prefill_ms": prefill_ms, "decode_ms": run_ms, "runs": runs, "warnings": [],
            "providers": sess.get_providers()}


def _emitting_runs(runs: list[dict]) -> set[int]:
    """The runs whose logits give a token: the last prefill run before each decode phase, and every decode run."""
    out = {i for i, r in enumerate(runs) if r["phase"] == "decode"}
    out |= {i for i, r in enumerate(runs) if r["phase"] == "prefill"
            and (i + 1 == len(runs) or runs[i + 1]["phase"] == "decode")}
    return out


# ============================================================================================ comparing
def compare(ref: dict, forced: dict, free: dict) -> dict:
    """``free`` (its own greedy tokens) and ``forced`` (fed ``ref``'s tokens, traced) against ``ref``."""
    n = min(len(ref["tokens"]), len(free["tokens"]))
    mismatch = next((i for i in range(n) if ref["tokens"][i] != free["tokens"][i]), None)
    diffs = [float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
             for a, b in zip(ref["logits"], forced["logits"])]
    argmax = [int(np.argmax(r)) for r in forced["logits"]]
    out = {"tokens": free["tokens"], "tokens_equal": ref["tokens"] == free["tokens"],
           "first_token_mismatch": mismatch,
           "margin_at_mismatch": None if mismatch is None else ref["margins"][mismatch],
           "forced_max_logit_diff": max(diffs) if diffs else None,
           "forced_logit_diff_per_step": [round(d, 6) for d in diffs], "forced_argmax_equal": argmax == ref["tokens"],
           "forced_argmax_flips_at_margins": [ref["margins"][i] for i, t in enumerate(argmax)
                                              if t != ref["tokens"][i]]}
    if forced.get("runs") and ref.get("runs"):
        out["divergence"] = divergence(ref["runs"], forced["runs"])
    return out


def _tol(a: np.ndarray) -> float:
    return ATOL + RTOL * (float(np.max(np.abs(a))) if a.size else 0.0)


def divergence(ref_runs: list[dict], got_runs: list[dict]) -> dict:
    """Each run's largest difference per output, and the first run where an output differs, dumped."""
    table, first = [], None
    for i, (r, g) in enumerate(zip(ref_runs, got_runs)):
        row = {}
        for name, a in r["outputs"].items():
            b = g["outputs"].get(name)
            if b is None or a.shape != b.shape:
                row[name] = f"shape {None if b is None else list(b.shape)} != {list(a.shape)}"
                continue
            row[name] = round(float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))), 6)
        table.append({"run": i, "phase": r["phase"], "width": int(r["feeds"]["input_ids"].shape[-1]),
                      "max_diff": row})
        if first is None and any(isinstance(v, str) or v > _tol(r["outputs"][k]) for k, v in row.items()):
            first = i
    return {"runs": table, "first_differing_run": first,
            "dump": None if first is None else dump(ref_runs, got_runs, first)}


def dump(ref_runs: list[dict], got_runs: list[dict], i: int) -> dict:
    """Run ``i``: both feeds, and for each differing output where it differs (indices per axis), the first values,
    whether the values are zero, and whether they equal the reference's output of an earlier run (stale state)."""
    r, g = ref_runs[i], got_runs[i]
    outs = {}
    for name, a in r["outputs"].items():
        b = g["outputs"].get(name)
        if b is None or a.shape != b.shape:
            continue
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        bad = np.abs(a64 - b64) > _tol(a64)
        if not bad.any():
            continue
        where = np.argwhere(bad)
        first_idx = tuple(int(x) for x in where[0])
        outs[name] = {
            "shape": list(a.shape), "differing": int(bad.sum()), "of": int(bad.size),
            "indices_per_axis": [sorted({int(x) for x in where[:, ax]})[:64] for ax in range(a.ndim)],
            "first_index": list(first_idx), "expected_at_first": float(a64[first_idx]),
            "got_at_first": float(b64[first_idx]), "got_all_zero": bool(not b64.any()),
            "expected_flat_head": [round(float(x), 5) for x in a64.ravel()[:12]],
            "got_flat_head": [round(float(x), 5) for x in b64.ravel()[:12]],
            "got_equals_reference_run": [j for j in range(i) if ref_runs[j]["outputs"][name].shape == b.shape
                                         and np.allclose(ref_runs[j]["outputs"][name], b64, atol=_tol(a64))][:8],
        }
    return {"run": i, "phase": r["phase"],
            "feeds_expected": {k: v.tolist() for k, v in r["feeds"].items()},
            "feeds_got_host": {k: v.tolist() for k, v in g["feeds"].items()},   # as written on the host
            "outputs": outs, "first_output": next(iter(outs), None)}


def timing(result: dict) -> dict:
    steps = result["decode_ms"][2:] or result["decode_ms"]
    return {"decode_ms_median": round(statistics.median(steps), 4), "decode_ms_min": round(min(steps), 4),
            "prefill_ms": round(result["prefill_ms"], 3)}


# ============================================================================================ the probes
def probes(ep: str, device: str) -> dict:
    """onnxruntime on ``ep``: (1) a host input bound, then written, then run: which value did the run see?
    (2) a device input refilled by ``update_inplace`` 200 times, each followed by a run: how many runs saw it?"""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    g = helper.make_graph([helper.make_node("Add", ["x", "x"], ["y"])], "probe",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4096])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4096])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    sess = ort.InferenceSession(model.SerializeToString(), providers=[ep, CPU])
    out = {"providers": sess.get_providers()}
    host = np.zeros((1, 4096), np.float32)
    io = sess.io_binding()
    io.bind_ortvalue_input("x", ort.OrtValue.ortvalue_from_numpy(host))
    io.bind_output("y", "cpu")
    host[:] = 1.0   # written after binding, before the run
    sess.run_with_iobinding(io)
    y = io.get_outputs()[0].numpy()
    out["host_input_written_after_bind_seen_by_run"] = bool(np.all(y == 2.0))
    out["host_input_run_saw_bind_time_value"] = bool(np.all(y == 0.0))
    dev = ort.OrtValue.ortvalue_from_numpy(np.zeros((1, 4096), np.float32), device, 0)
    io = sess.io_binding()
    io.bind_ortvalue_input("x", dev)
    io.bind_output("y", "cpu")
    seen = 0
    for k in range(200):
        dev.update_inplace(np.full((1, 4096), float(k), np.float32))
        sess.run_with_iobinding(io)
        seen += bool(np.all(io.get_outputs()[0].numpy() == 2.0 * k))
    out["update_inplace_runs_seeing_the_new_value"] = f"{seen}/200"
    return out


# ============================================================================================ main
def run_case(path: Path, ep: str, device: str, reference: dict | None) -> dict:
    from qeff_kv.runtime.execution import ep_proofs

    res: dict = {}
    on_ep = [ep, CPU] if ep != CPU else [CPU]
    a = drive_session(path, [CPU], trace=True)
    res["a_cpu"] = {"tokens": a["tokens"], "margins": a["margins"], **timing(drive_session(path, [CPU])),
                    "providers": a["providers"]}
    if reference is not None:
        res["a_cpu"]["tokens_equal_to_reference_json"] = reference["tokens"] == a["tokens"]
        res["a_cpu"]["max_logit_diff_to_reference_json"] = float(np.max(np.abs(
            np.asarray(reference["logits"], np.float64) - np.asarray(a["logits"], np.float64))))
    res["e_session_fixed"] = _guarded(lambda: _mode(
        a, drive_session(path, None, device=device, trace=True, forced=a["tokens"][:STEPS]),
        drive_session(path, None, device=device)))
    os.environ[ep_proofs.MEASURE_ENV] = "1"   # b: a kind not proved on the EP still runs (with a warning)
    try:
        res["b_session"] = _guarded(lambda: _mode(
            a, drive_session(path, on_ep, trace=True, forced=a["tokens"][:STEPS], once=True),
            drive_session(path, on_ep, once=True)))
    finally:
        os.environ.pop(ep_proofs.MEASURE_ENV, None)
    res["c_plain"] = _guarded(lambda: _mode(
        a, plain_loop(a["onnx_path"], on_ep, device, a["state"], a["runs"], trace=True, forced=True),
        plain_loop(a["onnx_path"], on_ep, device, a["state"], a["runs"], trace=False)))
    rows = 2 if path.name.startswith("llama") and "-cb" not in path.name else None
    res["f_script"] = _guarded(lambda: conformance(path, device, rows))
    return res


def fill_weights(folder: Path) -> dict:
    """A skeleton's weights (``gpu_check_prepare.py --skeleton``: too big to carry), written here: every external
    tensor seeded normal(0, 0.02) at its dtype (a transformers-style random init; the norms and constants stayed in
    the graph), into the file ``skeleton.json`` names; nothing when it is there at its size."""
    import onnx
    from onnx import helper

    spec = json.loads((folder / "skeleton.json").read_text())
    target = folder / spec["weights"]
    if target.is_file() and target.stat().st_size >= spec["bytes"]:
        return {"weights_mb": round(spec["bytes"] / 1e6, 1), "made_s": 0.0}
    t0 = time.perf_counter()
    model = onnx.load(str(next(folder.glob("*.onnx"))), load_external_data=False)
    rng = np.random.default_rng(spec["seed"])
    tmp = target.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.truncate(spec["bytes"])
        for t in model.graph.initializer:
            if t.data_location != onnx.TensorProto.EXTERNAL:
                continue
            info = {e.key: e.value for e in t.external_data}
            dtype = helper.tensor_dtype_to_np_dtype(t.data_type)
            values = (rng.standard_normal(int(np.prod(t.dims)), np.float32) * 0.02).astype(dtype)
            assert values.nbytes == int(info["length"]), t.name
            f.seek(int(info["offset"]))
            f.write(values.tobytes())
    tmp.replace(target)
    return {"weights_mb": round(spec["bytes"] / 1e6, 1), "made_s": round(time.perf_counter() - t0, 1)}


def run_big(path: Path, device: str) -> dict:
    """A skeleton graph (weights made here): the greedy script on the CPU and through ``Session(device=...)``
    (the fixed path), untraced: tokens equal, the teacher-forced logit difference, decode ms per step."""
    made = fill_weights(path)
    a = drive_session(path, [CPU], trace=True)
    for r in a["runs"]:
        r["outputs"] = {}   # the feeds are what c_plain needs
    res = {"weights": made, "a_cpu": {"tokens": a["tokens"], "margins": a["margins"], **timing(a)}}
    res["e_session_fixed"] = _guarded(lambda: _mode(
        a, drive_session(path, None, device=device, forced=a["tokens"][:STEPS]),
        drive_session(path, None, device=device)))
    on_ep = [CUDA, CPU] if device == "cuda" else [CPU]
    res["c_plain"] = _guarded(lambda: _mode(   # the state resident on the device: what staging costs
        a, plain_loop(a["onnx_path"], on_ep, device, a["state"], a["runs"], trace=False, forced=True),
        plain_loop(a["onnx_path"], on_ep, device, a["state"], a["runs"], trace=False)))
    return res


def _mode(a: dict, forced: dict, free: dict) -> dict:
    out = compare(a, forced, free)
    out.update(timing(free), providers=forced["providers"], warnings=forced["warnings"][:2])
    if "executor" in forced:
        out.update(executor=forced["executor"], rebind_each_run=forced["rebind_each_run"])
    return out


def _guarded(fn) -> dict:
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001  (a mode that fails is a result)
        return {"error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:600]}",
                "traceback": traceback.format_exc()[-2000:]}


def environment(ep: str) -> dict:
    import onnxruntime as ort

    env = {"python": platform.python_version(), "onnxruntime": ort.__version__, "onnxruntime_file": ort.__file__,
           "available_providers": ort.get_available_providers(), "ep": ep}
    try:
        env["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                                    capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        env["gpu"] = None
    return env


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("graphs", type=Path, help="the folder gpu_check_prepare.py wrote")
    ap.add_argument("--ep", default=CUDA)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--cases", default=None, help="comma-separated case names (default: every folder)")
    args = ap.parse_args()
    import onnxruntime as ort

    if args.ep != CPU and hasattr(ort, "preload_dlls"):
        ort.preload_dlls()   # the CUDA/cuDNN libraries of the machine's torch wheels
    device = "cpu" if args.ep == CPU else "cuda"
    t_start = time.perf_counter()
    ref = json.loads((args.graphs / "reference.json").read_text())
    cases = [c for c in args.cases.split(",") if c in ref["cases"]] if args.cases else sorted(ref["cases"])
    report = {"environment": environment(args.ep), "prompt": PROMPT, "steps": STEPS, "atol": ATOL, "rtol": RTOL,
              "probes": _guarded(lambda: probes(args.ep, device)), "cases": {}}
    print(json.dumps(report["probes"]), flush=True)
    cases += [p.name for p in sorted(args.graphs.iterdir()) if (p / "skeleton.json").is_file()
              and p.name not in cases and (args.cases is None or p.name in args.cases.split(","))]
    for case in cases:
        t0 = time.perf_counter()
        path = args.graphs / case
        report["cases"][case] = res = (run_big(path, device) if (path / "skeleton.json").is_file() else
                                       run_case(path, args.ep, device, ref["cases"].get(case)))
        line = {m: (r.get("error") or r.get("tokens_equal", r.get("tokens_equal_to_reference_json",
                                                                    r.get("decode_ms_median"))))
                for m, r in res.items() if isinstance(r, dict)}
        print(case, f"{time.perf_counter() - t0:.1f}s", json.dumps(line), flush=True)
        _write(args.out, report)
    report["wall_s"] = round(time.perf_counter() - t_start, 1)
    _write(args.out, report)
    print("wall", report["wall_s"], "s ->", args.out, flush=True)


def _write(path: Path, report: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str))
    tmp.replace(path)


if __name__ == "__main__":
    sys.exit(main())
