"""The KV hand-off of disaggregated serving vs the prefill it follows (issue 18, part 5).

For a prompt of ``--prompt-len`` tokens:

* in one process: the prefill (``Session.prefill``), then the hand-off pieces: extracting the valid positions
  (``transfer.extract``, an in-memory state with the identity check) and installing them into another session
  (``transfer.install``); for comparison the same with the full SHA-256 checksum of state files
  (``export_state`` + ``import_state``);
* on Ray (a local instance): the real :class:`qeff_kv.serve.cluster.disagg.PrefillWorker` actor prefills, its
  :class:`~qeff_kv.serve.cluster.transfer.KVTransfer` goes by reference through the object store to a receiving actor that
  installs it into its own session. Hand-off = the driver's wall time of the whole call chain minus the prefill
  itself: extraction, serialization into the object store, the transport, deserialization, validation, the
  copy into the decode buffers and the Ray call overheads.

Target: hand-off <= 10% of the prefill time. Prints a table and writes ``--json``.

    .venv/bin/python benchmarks/bench_handoff.py EXPORT [--decode-export D] [--prompt-len 1024] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np


def _median(xs):
    return statistics.median(xs)


def in_process(args) -> dict:
    from qeff_kv.runtime import GREEDY, Session
    from qeff_kv.runtime.memory.state_file import export_state, import_state
    from qeff_kv.serve.cluster.transfer import Prefiller, extract, install

    pre = Session(args.export, ctx_len=args.ctx_len, threads=args.threads)
    dec = Session(args.decode_export or args.export, ctx_len=args.ctx_len, threads=args.threads)
    vocab = pre.vocab_size or 1000
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, vocab, size=args.prompt_len)]
    Prefiller(pre, reuse=False).run("warm", prompt[:64], GREEDY)
    rows = {"prefill_s": [], "extract_s": [], "install_s": [], "export_checksum_s": [], "import_checksum_s": []}
    nbytes = 0
    for _ in range(args.repeats):
        seq = pre.add_sequence()
        t0 = time.perf_counter()
        pre.prefill(seq, prompt)
        rows["prefill_s"].append(time.perf_counter() - t0)
        seq.pending = 7
        t0 = time.perf_counter()
        tr = extract(pre, seq)
        rows["extract_s"].append(time.perf_counter() - t0)
        nbytes = tr.nbytes
        t0 = time.perf_counter()
        got = install(dec, tr)
        rows["install_s"].append(time.perf_counter() - t0)
        dec.remove_sequence(got)
        t0 = time.perf_counter()
        st = export_state(pre, seq)
        rows["export_checksum_s"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        got = import_state(dec, st)
        rows["import_checksum_s"].append(time.perf_counter() - t0)
        dec.remove_sequence(got)
        pre.remove_sequence(seq)
    out = {k: _median(v) for k, v in rows.items()}
    out["bytes"] = nbytes
    out["bytes_expected"] = args.prompt_len * pre.cache.bytes_per_position
    return out


def on_ray(args) -> dict:
    import ray

    from qeff_kv.serve.cluster.disagg import PrefillWorker

    class Receiver:
        def __init__(self, export, ctx_len, threads):
            from qeff_kv.runtime import Session

            self.session = Session(export, ctx_len=ctx_len, threads=threads)

        def install(self, transfer):
            from qeff_kv.serve.cluster.transfer import install

            t0 = time.perf_counter()
            seq = install(self.session, transfer)
            took = time.perf_counter() - t0
            self.session.remove_sequence(seq)
            return took, transfer.prefill_s, transfer.extract_s, transfer.nbytes

    ray.init(num_cpus=2, include_dashboard=False, logging_level="warning", log_to_driver=False)
    try:
        pre = ray.remote(PrefillWorker).options(num_cpus=1).remote(args.export, args.ctx_len, None, args.threads)
        rec = ray.remote(Receiver).options(num_cpus=1).remote(args.decode_export or args.export, args.ctx_len,
                                                               args.threads)
        vocab = ray.get(pre.facts.remote())["vocab_size"] or 1000
        prompt = tuple(int(t) for t in np.random.default_rng(0).integers(3, vocab, size=args.prompt_len))
        from qeff_kv.runtime import GREEDY

        ray.get(rec.install.remote(pre.prefill.remote("warm", prompt[:64], GREEDY)))
        rows = {"wall_s": [], "prefill_s": [], "extract_s": [], "install_s": [], "handoff_s": []}
        nbytes = 0
        for i in range(args.repeats):
            t0 = time.perf_counter()
            p = (i + 3,) + prompt[1:]   # another first token each time: the replica's prompt reuse finds nothing
            install_s, prefill_s, extract_s, nbytes = ray.get(rec.install.remote(
                pre.prefill.remote(f"r{i}", p, GREEDY)))
            wall = time.perf_counter() - t0
            for k, v in (("wall_s", wall), ("prefill_s", prefill_s), ("extract_s", extract_s),
                         ("install_s", install_s), ("handoff_s", wall - prefill_s)):
                rows[k].append(v)
        out = {k: _median(v) for k, v in rows.items()}
        out["bytes"] = nbytes
        return out
    finally:
        ray.shutdown()


def ttft(args) -> dict:
    """Time to first token of ``--prompt-len``-token prompts (distinct: no prompt reuse), through the engines: the
    single-host Scheduler vs the disaggregated engine (1 prefill + 1 decode replica), one thread per session."""
    import ray

    from qeff_kv.runtime import GREEDY, Session
    from qeff_kv.serve.config import ServeConfig
    from qeff_kv.serve.server import build_engine
    from qeff_kv.serve.engine.engine import GenerationRequest
    from qeff_kv.serve.engine.scheduler import Scheduler

    def measure(engine, vocab) -> list[float]:
        out = []
        for i in range(args.repeats + 1):
            prompt = tuple(int(t) for t in np.random.default_rng(100 + i).integers(3, vocab, size=args.prompt_len))
            t0 = time.perf_counter()
            h = engine.submit(GenerationRequest(f"t{i}", prompt, 2, GREEDY, frozenset()))
            events = h.iter_sync(timeout=600)
            next(events)
            took = time.perf_counter() - t0
            list(events)
            if i:   # the first is a warm-up
                out.append(took)
        return out

    sess = Session(args.decode_export or args.export, ctx_len=args.ctx_len, threads=args.threads)
    vocab = sess.vocab_size or 1000
    sched = Scheduler(sess, reuse_prompts=False)
    try:
        local = measure(sched, vocab)
    finally:
        sched.close()
    del sess, sched
    ray.init(num_cpus=2, include_dashboard=False, logging_level="warning", log_to_driver=False)
    try:
        eng = build_engine(ServeConfig(args.decode_export or args.export, prefill_export=args.export,
                                       disaggregate=True, ctx_len=args.ctx_len, threads=args.threads))
        try:
            disagg = measure(eng, vocab)
        finally:
            eng.close()
    finally:
        ray.shutdown()
    return {"scheduler_ttft_s": _median(local), "disaggregated_ttft_s": _median(disagg)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("export", help="the prefill export (folder)")
    ap.add_argument("--decode-export", default=None, help="the decode export (default: the prefill export)")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--ctx-len", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1, help="onnxruntime threads per session (default 1: two "
                                                           "actors on two cores)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-ray", action="store_true")
    ap.add_argument("--ttft", action="store_true", help="also time to first token through both engines")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    res = {"export": args.export, "decode_export": args.decode_export, "prompt_len": args.prompt_len,
           "threads": args.threads, "repeats": args.repeats, "in_process": in_process(args)}
    if not args.no_ray:
        res["ray"] = on_ray(args)
        if args.ttft:
            res["ttft"] = ttft(args)
    ip = res["in_process"]
    mb = ip["bytes"] / 1e6
    print(f"prompt {args.prompt_len} tokens, KV moved {mb:.1f} MB (valid positions: {ip['bytes_expected'] / 1e6:.1f} MB)")
    print(f"in process: prefill {ip['prefill_s'] * 1e3:.0f} ms | extract {ip['extract_s'] * 1e3:.1f} ms + install "
          f"{ip['install_s'] * 1e3:.1f} ms = {(ip['extract_s'] + ip['install_s']) / ip['prefill_s']:.1%} of the "
          f"prefill | with the file checksum: export {ip['export_checksum_s'] * 1e3:.1f} ms + import "
          f"{ip['import_checksum_s'] * 1e3:.1f} ms")
    if "ray" in res:
        r = res["ray"]
        print(f"on Ray: prefill {r['prefill_s'] * 1e3:.0f} ms | hand-off {r['handoff_s'] * 1e3:.1f} ms "
              f"({r['handoff_s'] / r['prefill_s']:.1%} of the prefill; extract {r['extract_s'] * 1e3:.1f} ms, install "
              f"{r['install_s'] * 1e3:.1f} ms, the rest transport and call overheads)")
    if "ttft" in res:
        t = res["ttft"]
        print(f"time to first token: single-host Scheduler {t['scheduler_ttft_s'] * 1e3:.0f} ms | disaggregated "
              f"{t['disaggregated_ttft_s'] * 1e3:.0f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
