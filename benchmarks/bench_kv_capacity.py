"""Sequences that fit in a fixed KV memory budget: the float32 cache, the int8 cache, llama.cpp's f16 cache.

For each export (``--export NAME=DIR``, the same model exported with and without ``--kv-cache-dtype int8``):

* **from the graph**: ``qeff-kv buffers`` at the export's ``ctx_len`` (every KV pair at its own capacity): bytes per
  sequence, and ``floor(budget / bytes per sequence)`` sequences (``--budget-gib``, default 2 GiB);
* **confirmed in a Session**: a fresh process opens ``Session(DIR, max_sequences=N)`` for ``N`` = 1 and ``N`` = the
  sequences that fit, writes every byte of every KV buffer (numpy allocates the buffers zeroed and lazily: untouched
  pages take no memory, a full sequence's pages all do), and reads its resident set (``VmRSS``); the growth from 1 to
  ``N`` rows over ``N - 1`` is the measured bytes per sequence. The ``N``-row session then generates a few tokens
  (it runs at that size), and ``session.memory()["capacity"]`` is recorded beside.

llama.cpp (``--gguf FILE``): its default cache is f16 for keys and values, ``2 bytes x layers x kv_heads x head_dim x
2`` per token (read from the GGUF's metadata), times ``--ctx`` per slot. With ``--llama-server PATH`` it is confirmed
the same way: ``llama-server -np N -c ctx*N`` for ``N`` = 1 and the sequences that fit, its own log line of the KV
cache's size, and its resident set once healthy.

    python benchmarks/bench_kv_capacity.py --export fp32-cache=smollm2-int4/ --export int8-cache=smollm2-int4-kv8/ \\
        --gguf SmolLM2-135M-Instruct.Q4_1.gguf --llama-server llama-server --budget-gib 2 \\
        --out benchmarks/results/kv_capacity.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
GIB = 1 << 30


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def rss_bytes(pid: int | str = "self") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


# ------------------------------------------------------------------------------------------------ qeff-kv
def graph_figures(export: str) -> dict:
    """What ``qeff-kv buffers --json`` says of the export at its own ctx_len."""
    from qeff_kv.tools.buffers import buffers_report

    man = json.loads((Path(export) / "manifest.json").read_text())
    ctx = int(man.get("ctx_len") or 0) or None
    rep = buffers_report(export, ctx_len=ctx).to_json()
    dtypes = sorted({p.get("dtype") for p in rep["pairs"]})
    return {"ctx_len": ctx, "bytes_per_token": rep["bytes_per_token"],
            "bytes_per_sequence": rep["bytes_per_sequence"], "kv_dtypes": dtypes, "layers": rep["num_layers"]}


def child(export: str, rows: int, threads: int | None) -> dict:
    """In a fresh process: a Session of ``rows`` rows, every KV byte written, its RSS; then a short generate."""
    from qeff_kv.runtime import Session

    before = rss_bytes()
    session = Session(export, max_sequences=rows, threads=threads)
    opened = rss_bytes()
    buffers = [a for m in session.cache.memories for a in m.arrays.values()]
    for a in buffers:
        a.fill(0)   # writes every page (a zero write commits a page as any other)
    touched = rss_bytes()
    [g] = session.generate([[1, 2, 3, 4, 5, 6, 7, 8]], max_tokens=4, stop_tokens=[])
    return {"rows": rows, "rss_before_session": before, "rss_session_open": opened, "rss_kv_written": touched,
            "kv_buffer_bytes": sum(a.nbytes for a in buffers), "memory_capacity": session.memory()["capacity"],
            "generated": list(map(int, g.tokens))}


def run_child(export: str, rows: int, threads: int | None) -> dict:
    cmd = [sys.executable, __file__, "--child", export, "--rows", str(rows)]
    if threads:
        cmd += ["--threads", str(threads)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def qeff_capacity(export: str, budget: int, threads: int | None) -> dict:
    fig = graph_figures(export)
    fits = budget // fig["bytes_per_sequence"]
    say(f"{export}: {fig['bytes_per_sequence']} B/sequence at ctx {fig['ctx_len']}: {fits} fit; confirming")
    one, many = run_child(export, 1, threads), run_child(export, fits, threads)
    per_seq = (many["rss_kv_written"] - one["rss_kv_written"]) / (fits - 1)
    return {**fig, "export": export, "fits_by_graph": fits, "session_1": one, f"session_{fits}": many,
            "measured_bytes_per_sequence": round(per_seq), "fits_by_rss": int(budget // per_seq),
            "rss_over_graph": round(per_seq / fig["bytes_per_sequence"], 4)}


# ------------------------------------------------------------------------------------------------ llama.cpp
def gguf_figures(path: str, ctx: int) -> dict:
    """Layers, KV heads and head dim from the GGUF's metadata; llama.cpp's f16 cache per token and per slot."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")

    def val(key: str) -> int:
        f = reader.fields[f"{arch}.{key}"]
        return int(f.parts[f.data[0]][0])

    layers, heads = val("block_count"), val("attention.head_count")
    kv_heads = val("attention.head_count_kv")
    head_dim = val("embedding_length") // heads
    per_token = 2 * layers * kv_heads * head_dim * 2
    return {"arch": arch, "layers": layers, "kv_heads": kv_heads, "head_dim": head_dim, "cache_type": "f16",
            "bytes_per_token": per_token, "ctx_per_slot": ctx, "bytes_per_sequence": per_token * ctx}


KV_LINE = re.compile(r"(llama_kv_cache[^\n]*size\s*=\s*[\d.]+\s*MiB[^\n]*)")


def llama_rss(server: str, gguf: str, slots: int, ctx: int, log: Path) -> dict:
    """``llama-server -np slots -c ctx*slots``: its KV log line and resident set once healthy."""
    import httpx

    port = 20000 + os.getpid() % 20000
    argv = [server, "-m", gguf, "--port", str(port), "-np", str(slots), "-c", str(ctx * slots), "--threads", "2",
            "-lv", "4"]   # verbosity 4: its llama_kv_cache size lines
    with open(log, "w") as fh:
        proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        time.sleep(1)
        rss = rss_bytes(proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    lines = KV_LINE.findall(log.read_text(errors="replace"))
    return {"slots": slots, "rss": rss, "kv_log": lines}


def llama_capacity(args, budget: int) -> dict:
    fig = gguf_figures(args.gguf, args.ctx)
    fits = budget // fig["bytes_per_sequence"]
    out = {**fig, "gguf": args.gguf, "fits_by_formula": fits}
    if args.llama_server:
        logs = HERE / "work" / "kv_capacity"
        logs.mkdir(parents=True, exist_ok=True)
        one = llama_rss(args.llama_server, args.gguf, 1, args.ctx, logs / "llama-1.log")
        many = llama_rss(args.llama_server, args.gguf, fits, args.ctx, logs / f"llama-{fits}.log")
        per_seq = (many["rss"] - one["rss"]) / (fits - 1)
        out.update({"server_1": one, f"server_{fits}": many, "measured_bytes_per_sequence": round(per_seq),
                    "fits_by_rss": int(budget // per_seq)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--export", action="append", default=[], metavar="NAME=DIR")
    ap.add_argument("--budget-gib", type=float, default=2.0)
    ap.add_argument("--gguf", default=None, help="the GGUF llama.cpp loads (its f16 cache's shape)")
    ap.add_argument("--llama-server", default=None, help="confirm llama.cpp's figure with this llama-server")
    ap.add_argument("--ctx", type=int, default=2048, help="llama.cpp's context per slot")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "kv_capacity.json")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--rows", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.rows, args.threads)))
        return
    budget = int(args.budget_gib * GIB)
    res = {"command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]), "budget_bytes": budget,
           "loadavg_start": [round(x, 2) for x in os.getloadavg()], "qeff": {}}
    for spec in args.export:
        name, _, export = spec.partition("=")
        res["qeff"][name] = qeff_capacity(export, budget, args.threads)
    if args.gguf:
        res["llama_cpp"] = llama_capacity(args, budget)
    res["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    print(table(res))


def table(res: dict) -> str:
    rows = [("cache", "B/token", "MB/sequence", "fit (graph)", "measured B/sequence (RSS)", "fit (RSS)")]
    for name, r in res["qeff"].items():
        rows.append((name, r["bytes_per_token"], round(r["bytes_per_sequence"] / 1e6, 1), r["fits_by_graph"],
                     r["measured_bytes_per_sequence"], r["fits_by_rss"]))
    if "llama_cpp" in res:
        r = res["llama_cpp"]
        rows.append(("llama.cpp f16", r["bytes_per_token"], round(r["bytes_per_sequence"] / 1e6, 1),
                     r["fits_by_formula"], r.get("measured_bytes_per_sequence", "-"), r.get("fits_by_rss", "-")))
    return "\n".join("| " + " | ".join(str(c) for c in row) + " |" for row in rows)


if __name__ == "__main__":
    main()
