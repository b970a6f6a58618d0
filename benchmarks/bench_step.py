"""Where a decode step's time goes: wall time per step against the time inside onnxruntime's kernels.

    python benchmarks/bench_step.py --engine before=qeff:OLD_EXPORT --engine after=qeff:NEW_EXPORT \\
        --engine genai=genai:GENAI_DIR --prompt 128 --steps 64 --rounds 5 --threads 2

Every engine runs in its own worker process (benchmarks/workerproc.py) with the same threads. ``qeff:DIR`` is
qeff-kv's ``Session`` on an export (greedy: ``np.argmax`` of each step's logits, as a user's loop does);
``genai:DIR`` is onnxruntime-genai on a model its builder made (its own greedy search; the intra-op threads are
set in a copy of its ``genai_config.json``). The prompt is ``fixtures/text/gettysburg.txt`` repeated and
tokenized with the first qeff export's tokenizer, cut to ``--prompt`` tokens; then ``--steps`` new tokens.

1. **Timing** (no profiler): ``--rounds`` interleaved rounds (the order rotates); per engine the median over
   rounds of each run's decode tokens/s and the median step wall time, and the median over rounds of its
   tokens/s divided by the first engine's in the same round (robust to a load that changes between rounds:
   on a shared machine prefer many short rounds, ``--steps 24 --rounds 30``). Greedy tokens are compared across engines.
2. **Profile** (``--profile``, a separate process per engine with onnxruntime's profiler on): per decode step the
   sum of kernel durations (``*_kernel_time`` events), the number of kernels, the ``model_run`` duration, and time
   per op type. ``outside-kernel`` = step wall time of the timing run - kernel time of the profiled run (the
   profiler adds its own cost per kernel, so the unprofiled wall is the honest one); it is split into
   ``in run`` (``model_run`` - kernels: onnxruntime's executor between kernels) and ``outside run`` (the
   profiled step's wall - ``model_run``: the runtime's own Python/C++ work per step). For qeff-kv the runtime's
   own work is also timed directly: ``decode`` + argmax with onnxruntime's run replaced by a no-op
   (``runtime_only_us``).

Writes ``--out`` (JSON) and prints a table. ``uptime``'s load average is recorded with every round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from workerproc import WorkerProcess  # noqa: E402

TEXT = HERE.parent / "fixtures" / "text" / "gettysburg.txt"


def prompt_tokens(tokenizer: Path, n: int, vocab: int | None = None) -> list[int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer))
    text = TEXT.read_text().strip()
    ids: list[int] = []
    k = 1
    while len(ids) < n:
        ids = tok.encode("\n\n".join([text] * k), add_special_tokens=False).ids
        k += 1
    return ids[:n]


# =============================================================================================== engines
class Qeff:
    def __init__(self, path: Path, threads: int, ctx: int, chunk: int, profile_dir: Path | None):
        import onnxruntime as ort

        from qeff_kv.runtime import Session

        orig = ort.SessionOptions
        if profile_dir is not None:
            def profiled():   # Session builds its own options: switch the profiler on in them (this process only)
                so = orig()
                so.enable_profiling = True
                so.profile_file_prefix = str(profile_dir / "qeff")
                return so
            ort.SessionOptions = profiled
        try:
            self.sess = Session(path, ctx_len=ctx, threads=threads, prefill_seq_len=chunk)
        finally:
            ort.SessionOptions = orig

    def run(self, prompt, new):
        import numpy as np

        sess = self.sess
        for s in list(sess.sequences):
            sess.remove_sequence(s)
        seq = sess.add_sequence()
        t0 = time.perf_counter()
        tok = int(np.argmax(sess.prefill(seq, prompt)))
        t_first = time.perf_counter() - t0
        toks, steps = [tok], []
        for _ in range(new - 1):
            t = time.perf_counter()
            tok = int(np.argmax(sess.decode({seq: tok})[seq]))
            steps.append(time.perf_counter() - t)
            toks.append(tok)
        return toks, t_first, steps

    def end_profiling(self) -> str:
        return self.sess.binding.executor_session.end_profiling()

    def runtime_only(self, prompt, steps: int) -> float:
        """Median microseconds of ``decode`` + argmax with onnxruntime's run replaced by a no-op: the runtime's own
        work per step (binding, bookkeeping, the logits copy and the argmax), nothing of onnxruntime's."""
        import numpy as np

        sess = self.sess
        for s in list(sess.sequences):
            sess.remove_sequence(s)
        seq = sess.add_sequence()
        sess.prefill(seq, prompt)
        real = sess.binding.io.run
        sess.binding.io.run = lambda: None   # the executor's run (runtime/executor.py) replaced by a no-op
        try:
            ts = []
            tok = prompt[-1]
            for _ in range(steps):
                t = time.perf_counter()
                tok = int(np.argmax(sess.decode({seq: tok})[seq])) % 100
                ts.append(time.perf_counter() - t)
        finally:
            sess.binding.io.run = real
        sess.remove_sequence(seq)
        return statistics.median(ts) * 1e6


class Genai:
    def __init__(self, path: Path, threads: int, ctx: int, profile_dir: Path | None):
        import onnxruntime_genai as og

        tmp = Path(tempfile.mkdtemp(prefix="bench-step-genai-"))
        for f in path.iterdir():   # a copy of the config (threads, profiler), the weights linked
            if f.name != "genai_config.json":
                (tmp / f.name).symlink_to(f.resolve())
        cfg = json.loads((path / "genai_config.json").read_text())
        so = cfg["model"]["decoder"].setdefault("session_options", {})
        so["intra_op_num_threads"] = threads
        so.pop("enable_profiling", None)
        if profile_dir is not None:
            so["enable_profiling"] = str(profile_dir / "genai")
        (tmp / "genai_config.json").write_text(json.dumps(cfg))
        self.og, self.ctx, self.profile_dir, self.tmp = og, ctx, profile_dir, tmp
        self.model = og.Model(str(tmp))

    def run(self, prompt, new):
        og = self.og
        t0 = time.perf_counter()
        params = og.GeneratorParams(self.model)
        params.set_search_options(max_length=self.ctx, min_length=len(prompt) + new, do_sample=False, batch_size=1)
        gen = og.Generator(self.model, params)
        gen.append_tokens(prompt)
        stamps, toks = [], []
        while len(toks) < new and not gen.is_done():
            gen.generate_next_token()
            toks.append(int(gen.get_next_tokens()[0]))
            stamps.append(time.perf_counter())
        del gen
        return toks, stamps[0] - t0, [b - a for a, b in zip(stamps, stamps[1:])]

    def end_profiling(self) -> str:
        import gc

        del self.model
        gc.collect()
        found = sorted(self.profile_dir.glob("genai*.json"))
        if not found:
            raise RuntimeError("onnxruntime-genai wrote no profile")
        return str(found[-1])


def make(spec: str, threads: int, ctx: int, chunk: int, profile_dir: Path | None):
    kind, path = spec.split(":", 1)
    if kind == "qeff":
        return Qeff(Path(path), threads, ctx, chunk, profile_dir)
    if kind == "genai":
        return Genai(Path(path), threads, ctx, profile_dir)
    raise ValueError(f"unknown engine kind {kind!r} (qeff:DIR or genai:DIR)")


# =============================================================================================== profile
def decode_profile(path: Path, steps: int) -> dict:
    """Per decode step (the last ``steps`` model runs): kernel time, kernels, model_run time, time per op type."""
    events = json.loads(path.read_text())
    runs = sorted((e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"),
                  key=lambda e: e["ts"])[-steps:]
    nodes = sorted((e for e in events if e.get("cat") == "Node" and str(e.get("name", "")).endswith("_kernel_time")),
                   key=lambda e: e["ts"])
    per_run_kernel, per_run_nodes = [], []
    acc: dict[str, float] = {}
    count: dict[str, int] = {}
    j = 0
    for r in runs:
        a, b = r["ts"], r["ts"] + r["dur"]
        while j < len(nodes) and nodes[j]["ts"] < a:
            j += 1
        k = n = 0
        while j < len(nodes) and nodes[j]["ts"] <= b:
            op = nodes[j].get("args", {}).get("op_name", "?")
            acc[op] = acc.get(op, 0.0) + nodes[j]["dur"]
            count[op] = count.get(op, 0) + 1
            k += nodes[j]["dur"]
            n += 1
            j += 1
        per_run_kernel.append(k)
        per_run_nodes.append(n)
    total = sum(acc.values()) or 1.0
    return {"model_run_ms": statistics.median(r["dur"] for r in runs) / 1e3,
            "kernel_ms": statistics.median(per_run_kernel) / 1e3, "kernels": int(statistics.median(per_run_nodes)),
            "by_op": [{"op": o, "ms": acc[o] / len(runs) / 1e3, "share": acc[o] / total, "kernels": count[o] // len(runs)}
                      for o in sorted(acc, key=acc.get, reverse=True)]}


# =============================================================================================== worker / driver
def serve(spec: str, threads: int, ctx: int, chunk: int, profile: bool) -> None:
    pdir = Path(tempfile.mkdtemp(prefix="bench-step-prof-")) if profile else None
    eng = make(spec, threads, ctx, chunk, pdir)
    print(json.dumps({"ready": True}), flush=True)
    try:
        _answer(eng)
    finally:   # the profiles and genai's config copy are this worker's own temporary folders
        import shutil

        for d in (pdir, getattr(eng, "tmp", None)):
            if d is not None:
                shutil.rmtree(d, ignore_errors=True)


def _answer(eng) -> None:
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("cmd") == "quit":
            break
        if req.get("cmd") == "runtime_only":
            print(json.dumps({"us": eng.runtime_only(req["prompt"], req["steps"])
                              if hasattr(eng, "runtime_only") else None}), flush=True)
            continue
        if req.get("cmd") == "profile":
            out = decode_profile(Path(eng.end_profiling()), req["steps"])
            print(json.dumps(out), flush=True)
            continue
        toks, t_first, steps = eng.run(req["prompt"], req["new"])
        print(json.dumps({"tokens": toks, "t_first": t_first, "steps": steps}), flush=True)


class Worker(WorkerProcess):
    def __init__(self, spec: str, args, profile: bool):
        argv = [__file__, "--worker", spec, "--threads", str(args.threads), "--ctx", str(args.ctx), "--chunk",
                str(args.chunk)] + (["--profile-worker"] if profile else [])
        super().__init__(spec, argv, args.threads)


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", action="append", default=[], help="NAME=qeff:DIR or NAME=genai:DIR (repeat)")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=64, help="new tokens per run")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=128, help="qeff-kv's prefill chunk")
    ap.add_argument("--profile", action="store_true", help="also profile each engine (separate processes)")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "step.json")
    ap.add_argument("--worker")
    ap.add_argument("--profile-worker", action="store_true")
    args = ap.parse_args(argv)
    if args.worker:
        serve(args.worker, args.threads, args.ctx, args.chunk, args.profile_worker)
        return 0
    engines = dict(e.split("=", 1) for e in args.engine)
    first_qeff = next(Path(s.split(":", 1)[1]) for s in engines.values() if s.startswith("qeff:"))
    prompt = prompt_tokens(first_qeff / "tokenizer.json", args.prompt)
    res: dict = {"prompt": args.prompt, "new_tokens": args.steps, "rounds": args.rounds, "threads": args.threads,
                 "engines": engines, "loadavg": [], "timing": {}, "profile": {}}
    workers = {n: Worker(s, args, False) for n, s in engines.items()}
    runs: dict[str, list] = {n: [] for n in engines}
    try:
        for w in workers.values():
            w.request({"prompt": prompt, "new": 8})   # warm-up
        names = list(engines)
        for r in range(args.rounds):
            for n in names[r % len(names):] + names[:r % len(names)]:
                runs[n].append(workers[n].request({"prompt": prompt, "new": args.steps}))
            res["loadavg"].append(os.getloadavg())
            say(f"round {r + 1}/{args.rounds}, load average {os.getloadavg()[0]:.2f}")
    finally:
        for w in workers.values():
            w.close()
    ref = None
    for n, rs in runs.items():
        rates = [len(x["steps"]) / sum(x["steps"]) for x in rs]
        steps = [s for x in rs for s in x["steps"]]
        ref = ref or rs[-1]["tokens"]
        first = [len(x["steps"]) / sum(x["steps"]) for x in runs[names[0]]]
        res["timing"][n] = {"decode_tok_s": statistics.median(rates), "min": min(rates), "max": max(rates),
                            "rates": rates, "paired_ratio_to_first_engine": statistics.median(
                                a / b for a, b in zip(rates, first)),
                            "step_ms": statistics.median(steps) * 1e3, "tokens": rs[-1]["tokens"],
                            "tokens_equal_first_engine": rs[-1]["tokens"] == ref}
    if args.profile:
        for n, s in engines.items():
            w = Worker(s, args, True)
            try:
                w.request({"prompt": prompt, "new": 8})
                p = w.request({"prompt": prompt, "new": args.steps})
                prof = w.request({"cmd": "profile", "steps": args.steps - 2})
                prof["runtime_only_us"] = w.request({"cmd": "runtime_only", "prompt": prompt, "steps": 200})["us"]
            finally:
                w.close()
            t = res["timing"][n]
            wall_prof = statistics.median(p["steps"]) * 1e3
            prof.update(profiled_step_ms=wall_prof, outside_kernel_ms=t["step_ms"] - prof["kernel_ms"],
                        in_run_outside_kernel_ms=prof["model_run_ms"] - prof["kernel_ms"],
                        outside_run_ms=wall_prof - prof["model_run_ms"])
            res["profile"][n] = prof
    res["loadavg_end"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"prompt {args.prompt}, {args.steps} new tokens, {args.threads} threads, {args.rounds} rounds; load average "
          f"{min(l[0] for l in res['loadavg']):.2f}-{max(l[0] for l in res['loadavg']):.2f}")
    for n, t in res["timing"].items():
        line = (f"  {n:<14} {t['decode_tok_s']:7.1f} tok/s [{t['min']:.1f}-{t['max']:.1f}]  step {t['step_ms']:.3f} ms"
                f"  tokens {'=' if t['tokens_equal_first_engine'] else '!='} {names[0]}"
                f"  (median of per-round ratios to {names[0]}: {t['paired_ratio_to_first_engine']:.3f})")
        p = res["profile"].get(n)
        if p:
            line += (f"\n      kernels {p['kernel_ms']:.3f} ms in {p['kernels']} kernels; outside kernels "
                     f"{p['outside_kernel_ms']:.3f} ms (profiled: {p['in_run_outside_kernel_ms']:.3f} ms in "
                     f"onnxruntime's run between kernels, {p['outside_run_ms']:.3f} ms outside the run"
                     + (f"; the runtime alone, run replaced by a no-op: {p['runtime_only_us']:.0f} us"
                        if p.get("runtime_only_us") is not None else "") + ")\n      top: "
                     + ", ".join(f"{o['op']} {o['ms']:.3f} ms x{o['kernels']}" for o in p["by_op"][:6]))
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
