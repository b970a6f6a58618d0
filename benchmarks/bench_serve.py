"""Load generator for ``qeff-kv serve`` (and optionally llama.cpp's ``llama-server``): streaming clients over HTTP.

Two measurements per export (each against a fresh server process on 127.0.0.1):

* **concurrency**: ``C`` clients (1, 4, 8, 16) each send ``--requests`` streamed ``/v1/completions`` back to back,
  prompts of ``--prompt-min..--prompt-max`` random token ids, ``--new-min..--new-max`` new tokens each
  (``ignore_eos``: exact counts); the server runs ``--max-sequences C``. Reported: time to first token and
  inter-token latency (p50/p99, from SSE chunk arrival times at the client) and aggregate generated tokens/s
  (all tokens over the wall time of the run).
* **arrivals**: one stream of ``--arrival-new`` tokens alone (idle ITL), then the same stream while another client
  keeps sending ``--arrival-prompt``-token prompts (1 new token each, back to back): its p99 ITL against idle.
  Chunked prefill bounds what one arriving prompt costs a running stream to one prefill chunk per token.

Usage (SmolLM2-135M exported as in README "A real checkpoint", ctx 2048):

    python benchmarks/bench_serve.py --export smollm2-fp32/ --export smollm2-int4/ --threads 2 \\
        [--quick] [--llama-server ~/llama.cpp/build/bin/llama-server --gguf SmolLM2.gguf] --out results/serve.json

Speculative decoding (``--speculative lookup|DRAFT_DIR``): every ``--export`` whose graph was exported with
``--speculative-tokens K`` is served with ``qeff-kv serve --speculative ...`` (the others plainly), so an ordinary
export and a speculative one of the same model compare side by side; ``--workload quote`` makes every request the
quoting chat request of ``benchmarks/bench_speculative.py`` (repeat the public-domain passage, ``--new-max`` new
tokens, the model's eos stops it, greedy) instead of random cuts of the text; ``--rounds N`` repeats every target
N times, interleaved (target A, B, A, B, ...), and reports medians; each run records the server's speculative
counters (drafted / accepted, from ``/metrics``) and whether every target gave the same text for each request:

    python benchmarks/bench_serve.py --export plain/ --export spec8/ --speculative lookup --workload quote \\
        --clients 1 --new-max 256 --rounds 3 --threads 2 --no-arrivals --out results/serve_speculative.json

``--llama-server`` runs the same load against ``llama-server -m GGUF -np C -c CTX*C --threads T`` (built from the
llama.cpp tree of llama-cpp-python's source release: the recipe is in docs/benchmarks.md). ``--check-generate``
compares every served text with ``qeff-kv generate`` on the request alone; ``--prefill-seq-len N`` serves (and
generates) with that prefill length.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, max(0, int(round(q / 100 * (len(v) - 1)))))]


class Server:
    """A server subprocess (``qeff-kv serve`` or ``llama-server``) on a free port, stopped by its pid."""

    def __init__(self, argv: list[str], port: int, log: Path, health: str = "/health"):
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(log, "w")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}); see {log}")
            try:
                if httpx.get(self.url + health, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"server did not come up; see {log}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=20)
        self.log.close()


def stream_one(url: str, prompt: list[int] | str, new: int, model: str | None) -> dict:
    """One streamed completion (a chat request when ``prompt`` is text: the quote workload, eos stops it);
    chunk arrival times at the client."""
    chat = isinstance(prompt, str)
    body = {"max_tokens": new, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body.update(prompt=prompt, ignore_eos=True)
    if model:
        body["model"] = model
    t0 = time.perf_counter()
    stamps: list[float] = []
    pieces: list[str] = []
    usage = None
    with httpx.Client(timeout=600) as c:
        with c.stream("POST", url + ("/v1/chat/completions" if chat else "/v1/completions"), json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:300]!r}")
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                j = json.loads(line[6:])
                if j.get("usage"):
                    usage = j["usage"]
                ch = j.get("choices") or []
                piece = (ch[0].get("delta", {}).get("content") if chat else ch[0].get("text")) if ch else None
                if piece:
                    stamps.append(time.perf_counter())
                    pieces.append(piece)
    tokens = usage["completion_tokens"] if usage else len(stamps)
    return {"ttft": stamps[0] - t0 if stamps else None, "itl": [b - a for a, b in zip(stamps, stamps[1:])],
            "tokens": tokens, "start": t0, "end": time.perf_counter(), "text": "".join(pieces)}


class Corpus:
    """Prompts cut from a public-domain English text (fixtures/text/gettysburg.txt, repeated as needed) at random
    offsets: the model continues English, so nearly every token is a text chunk of its own (random token ids
    make it emit multi-byte characters split over several tokens, and per-chunk latencies then span tokens)."""

    def __init__(self, export: str | None):
        from tokenizers import Tokenizer

        text = (REPO / "fixtures" / "text" / "gettysburg.txt").read_text(encoding="utf-8")
        folder = Path(export) if export else None
        tok_path = folder / "tokenizer.json" if folder else None
        if tok_path is None or not tok_path.is_file():
            raise SystemExit(f"no tokenizer.json in {folder}: the prompts are cut from tokenized text")
        self.ids = Tokenizer.from_file(str(tok_path)).encode(text, add_special_tokens=False).ids
        self.quote: str | None = None

    def prompt(self, rng: random.Random, n: int) -> list[int] | str:
        off = rng.randrange(len(self.ids))
        if self.quote is not None:
            return self.quote
        return [self.ids[(off + i) % len(self.ids)] for i in range(n)]


def quote_prompt() -> str:
    """The quoting request of benchmarks/bench_speculative.py (its ``quote`` workload)."""
    text = (REPO / "fixtures" / "text" / "gettysburg.txt").read_text().strip()
    return f"Repeat the following passage exactly, word for word:\n\n{text}"


def concurrency_jobs(clients: int, requests: int, args, corpus: Corpus, seed: int) -> list[list[tuple]]:
    """Each client's requests ``(prompt, new tokens)``: the same for every target and round (seeded)."""
    rng = random.Random(seed)
    return [[(corpus.prompt(rng, rng.randint(args.prompt_min, args.prompt_max)),
              rng.randint(args.new_min, args.new_max)) for _ in range(requests)] for _ in range(clients)]


def generate_texts(export: str, jobs: list[list[tuple]], threads: int | None,
                   prefill_seq_len: int | None = None) -> list[str]:
    """What ``qeff-kv generate`` makes of each request alone (a one-sequence session, greedy, every token up to
    the request's count, the server's incremental detokenizer, the server's prefill length): the text a served
    request must equal."""
    from tokenizers import Tokenizer

    from qeff_kv.runtime import Session
    from qeff_kv.serve.http.text import Detokenizer

    tok = Tokenizer.from_file(str(Path(export) / "tokenizer.json"))
    session = Session(export, max_sequences=1, threads=threads, prefill_seq_len=prefill_seq_len)
    texts = []
    for prompt, new in [job for client in jobs for job in client]:
        [g] = session.generate([prompt], max_tokens=new, stop_tokens=[])
        session.remove_sequence(g.sequence)
        d = Detokenizer(tok)
        texts.append("".join(d.add(t) for t in g.tokens) + d.flush())
    return texts


def run_clients(worker, clients: int) -> float:
    """Run ``worker(i)`` for each client ``i`` in its own thread, all at once; the wall time until all end."""
    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def concurrency_run(url: str, clients: int, requests: int, args, corpus: Corpus, model: str | None,
                    seed: int) -> dict:
    jobs = concurrency_jobs(clients, requests, args, corpus, seed)
    results: list[dict] = []
    errors: list[str] = []

    def worker(i: int) -> None:
        for j, (prompt, new) in enumerate(jobs[i]):
            try:
                results.append(stream_one(url, prompt, new, model) | {"order": (i, j)})
            except Exception as exc:  # noqa: BLE001
                errors.append(repr(exc))

    wall = run_clients(worker, clients)
    results.sort(key=lambda r: r["order"])
    itl = [x for r in results for x in r["itl"]]
    ttft = [r["ttft"] for r in results if r["ttft"] is not None]
    tokens = sum(r["tokens"] for r in results)
    return {"clients": clients, "requests": len(results), "errors": errors[:3], "wall_s": round(wall, 3),
            "texts": [r["text"] for r in results],
            "tokens": tokens, "tok_per_s": round(tokens / wall, 2),
            # after each request's first token: its later tokens over the time from its first to its last chunk
            "decode_tok_per_s": round(sum(len(r["itl"]) for r in results) / max(1e-9, sum(sum(r["itl"])
                                                                                       for r in results)), 2),
            "tokens_per_chunk": round(tokens / max(1, sum(len(r["itl"]) + 1 for r in results)), 3),
            "ttft_p50_ms": _ms(pct(ttft, 50)), "ttft_p99_ms": _ms(pct(ttft, 99)),
            "itl_p50_ms": _ms(pct(itl, 50)), "itl_p99_ms": _ms(pct(itl, 99))}


def arrivals_run(url: str, args, corpus: Corpus, model: str | None) -> dict:
    rng = random.Random(7)
    short = corpus.prompt(rng, args.arrival_short)
    idle = stream_one(url, short, args.arrival_new, model)
    stop = threading.Event()
    arrived = []

    def arrivals() -> None:
        while not stop.is_set():
            p = corpus.prompt(rng, args.arrival_prompt)
            arrived.append(stream_one(url, p, 1, model))

    t = threading.Thread(target=arrivals)
    t.start()
    time.sleep(0.2)
    loaded = stream_one(url, corpus.prompt(rng, args.arrival_short), args.arrival_new, model)
    stop.set()
    t.join()
    out = {"idle_itl_p50_ms": _ms(pct(idle["itl"], 50)), "idle_itl_p99_ms": _ms(pct(idle["itl"], 99)),
           "loaded_itl_p50_ms": _ms(pct(loaded["itl"], 50)), "loaded_itl_p99_ms": _ms(pct(loaded["itl"], 99)),
           "prompts_arrived": len(arrived), "arrival_prompt_tokens": args.arrival_prompt,
           "arrival_ttft_p50_ms": _ms(pct([a["ttft"] for a in arrived if a["ttft"]], 50))}
    out["ratio_p99"] = round(out["loaded_itl_p99_ms"] / out["idle_itl_p99_ms"], 2)
    return out


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1e3, 2)


def is_speculative(export: str) -> bool:
    man = Path(export) / "manifest.json"
    return man.is_file() and bool(json.loads(man.read_text()).get("speculative_tokens"))


def speculative_counts(url: str) -> dict:
    """The server's speculative counters (``/metrics``), or {} when it decodes plainly."""
    text = httpx.get(url + "/metrics", timeout=10).text
    out = {}
    for key, name in (("drafted", "qeff_kv_speculative_draft_tokens_total"),
                      ("accepted", "qeff_kv_speculative_accepted_tokens_total")):
        for line in text.splitlines():
            if line.startswith(name + " "):
                out[key] = float(line.split()[1])
    if out.get("drafted"):
        out["acceptance"] = round(out["accepted"] / out["drafted"], 4)
    return out


def qeff_server(export: str, clients: int, args, log: Path) -> Server:
    port = free_port()
    argv = [str(REPO / ".venv" / "bin" / "qeff-kv"), "serve", export, "--port", str(port),
            "--max-sequences", str(clients), "--max-queue", "1024"]
    if not args.prompt_reuse:
        argv += ["--no-prompt-reuse"]
    if args.speculative and is_speculative(export):
        argv += ["--speculative", args.speculative]
    if args.threads:
        argv += ["--threads", str(args.threads)]
    if args.prefill_chunk:
        argv += ["--prefill-chunk", str(args.prefill_chunk)]
    if args.prefill_seq_len:
        argv += ["--prefill-seq-len", str(args.prefill_seq_len)]
    if not Path(argv[0]).is_file():
        argv[0:1] = [sys.executable, "-m", "qeff_kv_cli.main"]
    return Server(argv, port, log)


def llama_server(clients: int, args, log: Path) -> Server:
    port = free_port()
    argv = [args.llama_server, "-m", args.gguf, "--port", str(port), "-np", str(clients),
            "-c", str(args.ctx * clients), "--threads", str(args.threads or os.cpu_count())]
    return Server(argv, port, log)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--export", action="append", default=[], help="export folder (repeatable)")
    ap.add_argument("--clients", default=None, help="client counts (default 1,4,8,16; --quick: 1,4,8)")
    ap.add_argument("--requests", type=int, default=2, help="requests per client")
    ap.add_argument("--prompt-min", type=int, default=64)
    ap.add_argument("--prompt-max", type=int, default=1024)
    ap.add_argument("--new-min", type=int, default=64)
    ap.add_argument("--new-max", type=int, default=256)
    ap.add_argument("--arrival-prompt", type=int, default=None, help="default 1024 (--quick: 512)")
    ap.add_argument("--arrival-new", type=int, default=128)
    ap.add_argument("--arrival-short", type=int, default=64, help="prompt tokens of the measured stream")
    ap.add_argument("--ctx", type=int, default=2048, help="llama-server context per slot")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--prefill-chunk", default=None, help="qeff-kv serve --prefill-chunk (N or auto)")
    ap.add_argument("--prefill-seq-len", type=int, default=None,
                    help="qeff-kv serve --prefill-seq-len (the prefill run's length, where the graph leaves it symbolic)")
    ap.add_argument("--prompt-reuse", action="store_true",
                    help="serve with prompt reuse on (the server's default; off by default here, so rounds compare)")
    ap.add_argument("--only-arrivals", action="store_true", help="skip the concurrency runs")
    ap.add_argument("--no-arrivals", action="store_true", help="skip the arrivals run")
    ap.add_argument("--quick", action="store_true",
                    help="clients 1,4,8; one request each; prompts 64-512, 64-128 new tokens; arrivals of 512 "
                         "(unless given)")
    ap.add_argument("--llama-server", default=None, help="path of a llama-server binary to compare against")
    ap.add_argument("--gguf", default=None, help="the GGUF llama-server loads")
    ap.add_argument("--tokenizer-from", default=None,
                    help="an export folder whose tokenizer.json cuts the prompts (default: the first --export)")
    ap.add_argument("--speculative", default=None, metavar="lookup|DRAFT_DIR",
                    help="serve every --export exported with --speculative-tokens K with --speculative this")
    ap.add_argument("--workload", choices=("random", "quote"), default="random",
                    help="random: cuts of the text (ignore_eos); quote: bench_speculative's quoting chat request")
    ap.add_argument("--rounds", type=int, default=1, help="repeat every target, interleaved; medians reported")
    ap.add_argument("--check-generate", action="store_true",
                    help="compare every served text (every round) with qeff-kv generate on the request alone")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "serve.json")
    args = ap.parse_args()
    if args.quick:
        args.clients, args.requests = args.clients or "1,4,8", 1
        args.prompt_max, args.new_max = 512, 128
        args.arrival_prompt = args.arrival_prompt or 512
    args.arrival_prompt = args.arrival_prompt or 1024
    if not args.export and not args.llama_server:
        ap.error("give --export DIR (repeatable) and/or --llama-server PATH --gguf FILE")
    clients = [int(c) for c in (args.clients or "1,4,8,16").split(",")]
    logs = HERE / "work" / "serve"
    logs.mkdir(parents=True, exist_ok=True)
    targets = [(Path(e).name, "qeff", e) for e in args.export]
    if args.llama_server:
        targets.append(("llama-server", "llama", None))
    results = {"command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]), "threads": args.threads,
               "cpus": os.cpu_count(), "loadavg_start": [round(x, 2) for x in os.getloadavg()], "runs": {}}
    corpora = {}
    for name, kind, export in targets:
        corpora[name] = Corpus(export or args.export[0] if args.export else args.tokenizer_from)
        if args.workload == "quote":
            corpora[name].quote = quote_prompt()
        results["runs"][name] = {"concurrency": [], "arrivals": None, "rounds": []}
    for rnd in range(args.rounds):
        for name, kind, export in targets:
            corpus, model = corpora[name], None
            runs = []
            for c in ([] if args.only_arrivals else clients):
                say(f"{name}: {c} clients (round {rnd + 1})")
                srv = (qeff_server(export, c, args, logs / f"{name}-{c}.log") if kind == "qeff"
                       else llama_server(c, args, logs / f"{name}-{c}.log"))
                try:
                    runs.append(concurrency_run(srv.url, c, args.requests, args, corpus, model, seed=c))
                    runs[-1]["speculative"] = speculative_counts(srv.url) if kind == "qeff" else {}
                    runs[-1]["loadavg"] = [round(x, 2) for x in os.getloadavg()]
                    say(f"  { {k: v for k, v in runs[-1].items() if k != 'texts'} }")
                finally:
                    srv.stop()
            results["runs"][name]["rounds"].append(runs)
            if not args.no_arrivals and rnd == 0:
                say(f"{name}: arrivals")
                srv = (qeff_server(export, 2, args, logs / f"{name}-arrivals.log") if kind == "qeff"
                       else llama_server(2, args, logs / f"{name}-arrivals.log"))
                try:
                    results["runs"][name]["arrivals"] = arrivals_run(srv.url, args, corpus, model)
                    say(f"  {results['runs'][name]['arrivals']}")
                finally:
                    srv.stop()
    if args.check_generate:
        check_generate(results, targets, clients, args, corpora)
    record_differ_from_first(results, [name for name, kind, _ in targets if kind == "qeff"])
    for name, r in results["runs"].items():
        r["concurrency"] = [median_run([rounds[i] for rounds in r["rounds"]]) for i in range(len(r["rounds"][0]))]
    # the same text from every target and round, request by request (greedy: speculation must not change it)
    texts = [x["texts"] for r in results["runs"].values() for rounds in r["rounds"] for x in rounds]
    results["identical_texts"] = all(t == texts[0] for t in texts) if args.workload == "quote" else None
    for r in results["runs"].values():
        for rounds in r["rounds"]:
            for x in rounds:
                x.pop("texts", None)
    results["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=1))
    tmp.replace(args.out)
    print(table(results))


def check_generate(results: dict, targets, clients: list[int], args, corpora: dict) -> None:
    """Record, per qeff-kv run, how many served texts differ from ``generate`` on the request alone."""
    for name, kind, export in targets:
        if kind != "qeff" or args.workload != "random":
            continue
        for i, c in enumerate([] if args.only_arrivals else clients):
            say(f"{name}: generate alone for the {c}-client requests")
            want = generate_texts(export, concurrency_jobs(c, args.requests, args, corpora[name], seed=c),
                                  args.threads, args.prefill_seq_len)
            for rounds in results["runs"][name]["rounds"]:
                got = rounds[i]["texts"]
                rounds[i]["differ_from_generate"] = sum(a != b for a, b in zip(got, want)) + abs(len(got) - len(want))
            say(f"  differ: {[rounds[i]['differ_from_generate'] for rounds in results['runs'][name]['rounds']]}")


def record_differ_from_first(results: dict, names: list[str]) -> None:
    """Per qeff-kv export after the first, per client count: how many of its first round's texts differ from the
    first export's (the same requests; e.g. an int8 KV cache against the float cache, greedy)."""
    if len(names) < 2:
        return
    first = results["runs"][names[0]]["rounds"][0]
    for name in names[1:]:
        for mine, ref in zip(results["runs"][name]["rounds"][0], first):
            mine["differ_from_first_export"] = sum(a != b for a, b in zip(mine["texts"], ref["texts"]))


def median_run(runs: list[dict]) -> dict:
    """One concurrency row from several rounds: the median of each figure, the rounds' tok/s listed."""
    import statistics

    out = dict(runs[0])
    for key in ("wall_s", "tok_per_s", "decode_tok_per_s", "tokens_per_chunk", "ttft_p50_ms", "ttft_p99_ms",
                "itl_p50_ms", "itl_p99_ms"):
        vals = [r[key] for r in runs if r.get(key) is not None]
        out[key] = round(statistics.median(vals), 2) if vals else None
    out["tok_per_s_rounds"] = [r["tok_per_s"] for r in runs]
    out["decode_tok_per_s_rounds"] = [r.get("decode_tok_per_s") for r in runs]
    if any("differ_from_generate" in r for r in runs):
        out["differ_from_generate"] = sum(r.get("differ_from_generate", 0) for r in runs)
    out.pop("texts", None)
    return out


def table(results: dict) -> str:
    lines = ["| target | clients | requests | tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | acceptance | "
             "texts differing from generate |", "|---|---|---|---|---|---|---|---|"]
    for name, r in results["runs"].items():
        for x in r["concurrency"]:
            acc = x.get("speculative", {}).get("acceptance")
            lines.append(f"| {name} | {x['clients']} | {x['requests']} | {x['tok_per_s']} | "
                         f"{x['ttft_p50_ms']} / {x['ttft_p99_ms']} | {x['itl_p50_ms']} / {x['itl_p99_ms']} | "
                         f"{'-' if acc is None else acc} | {x.get('differ_from_generate', '-')} |")
    lines += ["", "| target | idle ITL p50 / p99 ms | ITL with arriving prompts p50 / p99 ms | p99 ratio | prompts |",
              "|---|---|---|---|---|"]
    for name, r in results["runs"].items():
        a = r["arrivals"]
        if a is None:
            continue
        lines.append(f"| {name} | {a['idle_itl_p50_ms']} / {a['idle_itl_p99_ms']} | {a['loaded_itl_p50_ms']} / "
                     f"{a['loaded_itl_p99_ms']} | {a['ratio_p99']} | {a['prompts_arrived']} x "
                     f"{a['arrival_prompt_tokens']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
