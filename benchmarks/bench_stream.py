"""One served stream against ``qeff-kv generate``: what the path from the session to the socket costs per token.

In one run, interleaved ``--rounds`` times (generate, serve, generate, serve, ...): ``qeff-kv generate`` decodes
``--new`` tokens greedily from a ``--prompt-tokens``-token prompt (``--ignore-eos``, its own decode tok/s), and one
streaming client of ``qeff-kv serve`` (started once, one warm-up request) asks the same prompt ids for the same
number of tokens (``/v1/completions``, ``temperature 0``, ``ignore_eos``): its decode tok/s is the tokens after the
first over the time from the first SSE chunk to the last (as in ``bench_serve.py``). The served text is checked
against the text of generate's tokens. Also reported: the server's CPU seconds per streamed token by thread (its
event loop, its engine thread, onnxruntime's pool threads; from /proc), which machine load does not blur as it
blurs tok/s.

``--replay STEP_MS``: the same stream from a server whose engine is no model at all: a thread that emits the prompt's
tokens again (cycled) one per ``STEP_MS`` (a sleep, releasing the GIL as onnxruntime's step does). What is left is
the path from the engine to the socket: the event loop's and the engine thread's CPU per token, and the stream's
tok/s against the ``1000 / STEP_MS`` the engine gives.

    python benchmarks/bench_stream.py --export /tmp/speed-smol --threads 2 --new 256 --rounds 4
    python benchmarks/bench_stream.py --export /tmp/speed-smol --replay 2 --new 1000 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from bench_serve import Server, free_port, say, stream_one  # noqa: E402


def cli() -> str:
    exe = REPO / ".venv" / "bin" / "qeff-kv"
    return str(exe) if exe.is_file() else "qeff-kv"


def run_generate(export: str, ids: list[int], new: int, threads: int) -> dict:
    argv = [cli(), "generate", export, "--prompt-ids", ",".join(map(str, ids)), "--max-tokens", str(new),
            "--ignore-eos", "--threads", str(threads), "--json"]
    out = json.loads(subprocess.run(argv, check=True, capture_output=True, text=True).stdout)
    return {"tok_per_s": out["timings"]["decode_tokens_per_s"], "tokens": out["sequences"][0]["tokens"]}


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds of each thread of process ``pid`` (schedstat: nanoseconds on a CPU)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out[int(tid)] = int(open(f"/proc/{pid}/task/{tid}/schedstat").read().split()[0]) / 1e9
        except OSError:
            continue
    return out


def cpu_per_token(pid: int, before: dict, after: dict, tokens: int) -> dict:
    """ms of CPU per token: the event loop (the main thread), the busiest other thread (the engine thread), the
    rest (onnxruntime's pool)."""
    used = {t: after[t] - before.get(t, 0.0) for t in after}
    loop = used.pop(pid, 0.0)
    others = sorted(used.values(), reverse=True)
    ms = lambda s: round(1e3 * s / max(1, tokens), 3)  # noqa: E731
    return {"loop_ms": ms(loop), "busiest_other_ms": ms(others[0] if others else 0.0),
            "rest_ms": ms(sum(others[1:]))}


def emit_wall(url: str) -> tuple[float, int] | None:
    """The replay engine's seconds spent in ``RequestHandle.emit`` and tokens emitted so far (None: a model)."""
    import httpx

    h = httpx.get(url + "/health", timeout=10).json()
    return (h["emit_s"], h["emitted"]) if "emit_s" in h else None


def serve_replay(export: str, port: int, step_ms: float) -> None:
    """A server whose engine replays the prompt's tokens one per ``step_ms`` (no model)."""
    import uvicorn
    from tokenizers import Tokenizer

    from qeff_kv.serve.http.app import TextFacts, create_app
    from qeff_kv.serve.engine.engine import Engine, Finished, RequestHandle, TokenOut

    class Replay(Engine):
        model_name, ctx_len, max_sequences = "replay", 1 << 20, 1

        def __init__(self):
            self.jobs: queue.Queue = queue.Queue()
            self.emit_s, self.emitted = 0.0, 0   # wall time the engine thread spends handing tokens over
            threading.Thread(target=self.run, daemon=True).start()

        def submit(self, req):
            handle = RequestHandle(req.request_id)
            self.jobs.put((handle, req))
            return handle

        def run(self):   # one engine thread, as the scheduler's
            while True:
                handle, req = self.jobs.get()
                done = 0
                for i in range(req.max_tokens):
                    time.sleep(step_ms / 1e3)
                    if handle.cancelled:
                        break
                    t0 = time.perf_counter()
                    handle.emit(TokenOut(req.prompt[i % len(req.prompt)]))
                    self.emit_s += time.perf_counter() - t0
                    self.emitted += 1
                    done += 1
                handle.emit(Finished("length", len(req.prompt), 0, done))

        def stats(self):
            return {"queue_depth": 0, "sequences_active": 0, "kv_bytes_used": 0, "prompt_tokens_reused": 0,
                    "emit_s": self.emit_s, "emitted": self.emitted}

        def close(self):
            pass

    tok = Tokenizer.from_file(str(Path(export) / "tokenizer.json"))
    uvicorn.run(create_app(Replay(), text=TextFacts(tokenizer=tok)), host="127.0.0.1", port=port,
                log_level="warning")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--export", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    ap.add_argument("--replay", type=float, default=None, metavar="STEP_MS",
                    help="serve no model: replay the prompt's tokens one per STEP_MS (the path's own cost)")
    ap.add_argument("--serve-replay", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_replay is not None:
        serve_replay(args.export, args.serve_replay, args.replay)
        return
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(args.export) / "tokenizer.json"))
    text = (REPO / "fixtures" / "text" / "gettysburg.txt").read_text(encoding="utf-8")
    ids = tok.encode(text, add_special_tokens=False).ids[:args.prompt_tokens]
    port = free_port()
    argv = ([sys.executable, __file__, "--export", args.export, "--replay", str(args.replay), "--serve-replay",
             str(port)] if args.replay is not None else
            [cli(), "serve", args.export, "--port", str(port), "--max-sequences", "1", "--no-prompt-reuse",
             "--threads", str(args.threads)])
    srv = Server(argv, port, Path("/tmp") / f"bench-stream-{port}.log")
    gen, served, cpu, same = [], [], [], True
    try:
        stream_one(srv.url, ids, 8, None)   # warm-up
        for rnd in range(args.rounds):
            g = None if args.replay is not None else run_generate(args.export, ids, args.new, args.threads)
            before, emit0 = thread_cpu(srv.proc.pid), emit_wall(srv.url)
            s = stream_one(srv.url, ids, args.new, None)
            cpu.append(cpu_per_token(srv.proc.pid, before, thread_cpu(srv.proc.pid), s["tokens"]))
            if emit0 is not None:
                emit1 = emit_wall(srv.url)
                cpu[-1]["emit_wall_ms"] = round(1e3 * (emit1[0] - emit0[0]) / max(1, emit1[1] - emit0[1]), 4)
            rate = len(s["itl"]) / max(1e-9, sum(s["itl"]))
            if g is not None:
                same = same and s["text"] == tok.decode(g["tokens"]) and s["tokens"] == len(g["tokens"])
                gen.append(g["tok_per_s"])
            served.append(round(rate, 2))
            say(f"round {rnd + 1}: generate {g['tok_per_s'] if g else '-'} tok/s, served stream {rate:.1f} tok/s, "
                f"server CPU per token {cpu[-1]}")
    finally:
        srv.stop()
    res = {"new_tokens": args.new, "prompt_tokens": len(ids), "threads": args.threads, "replay_step_ms": args.replay,
           "generate_tok_per_s": gen, "served_tok_per_s": served, "served_median": statistics.median(served),
           "cpu_ms_per_token": cpu,
           "loop_ms_per_token_median": statistics.median(c["loop_ms"] for c in cpu),
           "engine_ms_per_token_median": statistics.median(c["busiest_other_ms"] for c in cpu)}
    if gen:
        res.update(generate_median=statistics.median(gen), same_text=same,
                   served_over_generate=round(statistics.median(served) / statistics.median(gen), 3))
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))
    print(json.dumps(res))


if __name__ == "__main__":
    main()
