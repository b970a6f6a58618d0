"""Issue 52's twelve classes reproduced as a hostile user would, against the installed qeff-kv: one line each.

    PYTHONPATH=. python benchmarks/hostile_round6.py [--work /tmp/hostile-work] [--readme-export /tmp/lp-bench/smollm2]
        [--json benchmarks/results/hostile_round6.json]

Builds its hostile files in ``--work`` (the tiny seeded models of tests/helpers/: the bundled Llama as a Hugging Face
folder, a tiny Llava with its processor, a wider seeded Llama for the embeddings gaps; each exported with the CLI),
runs ``qeff-kv export`` on tampered checkpoints (classes 1, 2, 6) and one ``qeff-kv serve`` at a time (classes 3-5
on the Llava export, 7 on the wider Llama, 8-12 on the README's SmolLM2-135M export). Prints, per reproduction:
class | what was sent | status or exit code | first line of the answer | PASS/FAIL (the rule it was held to).
A PASS is a one-line refusal (exit code 2 / an HTTP 4xx in OpenAI's error shape, no server path) or the right
answer, by the explicit rule of each row.
"""

from __future__ import annotations

import argparse
import base64
import datetime
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "helpers"))
ROWS: list[dict] = []
VICTIM = "model.layers.0.mlp.down_proj.weight"
PROMPT_IDS = [5, 17, 42, 9, 100, 33, 61]


def record(cls: str, sent: str, status, answer: str, ok: bool, rule: str, **figures) -> None:
    first = (answer or "").strip().splitlines()[0][:220] if (answer or "").strip() else ""
    row = {"class": cls, "sent": sent, "status": status, "first_line": first, "verdict": "PASS" if ok else "FAIL",
           "rule": rule, **figures}
    ROWS.append(row)
    extra = " ".join(f"{k}={v}" for k, v in figures.items())
    print(f"{cls:>3} | {sent} | {status} | {first} | {row['verdict']} ({rule}) {extra}", flush=True)


def cli(*argv, timeout: float = 600) -> dict:
    """``qeff-kv ARGV`` in a child: exit code, stdout, stderr, wall seconds, peak RSS (MB, from wait4)."""
    out, err = Path(os.environ["HOSTILE_WORK"]) / "cli.out", Path(os.environ["HOSTILE_WORK"]) / "cli.err"
    t0 = time.monotonic()
    with open(out, "w") as o, open(err, "w") as e:
        p = subprocess.Popen([sys.executable, "-m", "qeff_kv_cli.main", *map(str, argv)], stdout=o, stderr=e)
        timer = threading.Timer(timeout, p.kill)
        timer.start()
        _pid, status, ru = os.wait4(p.pid, 0)
        timer.cancel()
    rc = os.waitstatus_to_exitcode(status)
    p.returncode = rc
    return {"rc": "timeout" if rc == -signal.SIGKILL else rc, "out": out.read_text(), "err": err.read_text(),
            "s": round(time.monotonic() - t0, 1), "rss_mb": ru.ru_maxrss // 1024}


def one_line_refusal(res: dict, *needles: str) -> bool:
    lines = [ln for ln in res["err"].splitlines() if ln.strip()]
    return (res["rc"] == 2 and len(lines) == 1 and lines[0].startswith("error: ")
            and all(n in lines[0] for n in needles))


# ----------------------------------------------------------------------------------------- checkpoints
def bundled_hf(root: Path) -> Path:
    """The bundled tiny Llama as a Hugging Face folder (its weights as the exporter seeds them) with its tokenizer."""
    import torch
    import transformers

    from qeff_kv.export.sources import BUNDLED_SEED, bundled_model_dir

    out = root / "bundled-hf"
    if not (out / "model.safetensors").is_file():
        cfg = transformers.AutoConfig.from_pretrained(bundled_model_dir())
        torch.manual_seed(BUNDLED_SEED)
        transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval().save_pretrained(
            out, safe_serialization=True)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(bundled_model_dir() / name, out / name)
    return out


def case(base: Path, dst: Path) -> Path:
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(base, dst)
    return dst


def export_tokens(folder: Path, out: Path) -> tuple[dict, list | None]:
    res = cli("export", folder, "-o", out, "-q", "--ctx-len", 64, "--prefill-seq-len", 8, "--force")
    if res["rc"] != 0:
        return res, None
    gen = cli("generate", out, "--prompt-ids", ",".join(map(str, PROMPT_IDS)), "--max-tokens", 8, "--ignore-eos",
              "--json")
    return res, json.loads(gen["out"])["sequences"][0]["tokens"] if gen["rc"] == 0 else None


def class1(work: Path, base: Path) -> None:
    from hf_models import hf_greedy
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(base / "model.safetensors"))
    zeros = {VICTIM: tensors[VICTIM] * 0}
    right = hf_greedy(base, PROMPT_IDS, 8)
    stale = case(base, work / "c1-stale-ref")
    save_file({**tensors, **zeros}, str(stale / "model.safetensors"))
    wrong = hf_greedy(stale, PROMPT_IDS, 8)
    rule = "one line naming both files (exit 2), or greedy tokens == transformers'"
    # a: a stale zero copy in a stray file beside model.safetensors, no index
    a = case(base, work / "c1-stray")
    save_file(zeros, str(a / "a-stale.safetensors"))
    res, toks = export_tokens(a, work / "c1-stray-out")
    ok = one_line_refusal(res, "a-stale.safetensors", "model.safetensors") or (toks is not None and toks == right)
    record("1", "model.safetensors + a-stale.safetensors (zero copy of one tensor), no index", res["rc"],
           res["err"] or f"tokens {toks}", ok, rule, s=res["s"], stale_tokens_differ=wrong != right)
    # b: two shards and their index, stray zero copies sorting first and last
    b = case(base, work / "c1-index")
    (b / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {f"model-0000{i + 1}-of-00002.safetensors": names[i::2] for i in range(2)}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(b / shard))
    index = {"metadata": {}, "weight_map": {k: s for s, keys in shards.items() for k in keys}}
    (b / "model.safetensors.index.json").write_text(json.dumps(index))
    for stray in ("a-stale.safetensors", "zz-stale.safetensors"):
        save_file(zeros, str(b / stray))
    res, toks = export_tokens(b, work / "c1-index-out")
    ok = one_line_refusal(res, "a-stale.safetensors") or (toks is not None and toks == right)
    record("1", "two indexed shards + a-stale/zz-stale zero copies", res["rc"],
           res["err"] or f"tokens {toks} (transformers {right})", ok, rule, s=res["s"])


def class2(work: Path, base: Path) -> None:
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(base / "model.safetensors"))
    outside = work / "c2-outside"
    shutil.rmtree(outside, ignore_errors=True)
    outside.mkdir()
    save_file({VICTIM: tensors[VICTIM]}, str(outside / "x.safetensors"))
    fifo = outside / "fifo.safetensors"
    os.mkfifo(fifo)
    entries = {"../c2-outside/x.safetensors": outside / "x.safetensors",
               str(outside / "x.safetensors"): outside / "x.safetensors",
               "/proc/self/environ": None, "/dev/zero": None, str(fifo): None}
    for i, (entry, real) in enumerate(entries.items()):
        folder = case(base, work / f"c2-case{i}")
        save_file({k: v for k, v in tensors.items() if k != VICTIM}, str(folder / "model.safetensors"))
        index = {k: "model.safetensors" for k in tensors if k != VICTIM} | {VICTIM: entry}
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
        if real is not None:    # relatime: a read moves atime forward when it is older than mtime
            st = real.stat()
            os.utime(real, (st.st_mtime - 3600, st.st_mtime))
        res = cli("export", folder, "-o", work / f"c2-out{i}", "-q", "--ctx-len", 64, "--prefill-seq-len", 8,
                  timeout=120)
        unread = real is None or real.stat().st_atime == real.stat().st_mtime - 3600
        ok = one_line_refusal(res) and unread and res["rss_mb"] < 2048 and not (work / f"c2-out{i}").exists()
        record("2", f"index entry {entry!r}", res["rc"], res["err"], ok,
               "exit 2, one line, file not read (atime kept; FIFO no hang; peak RSS < 2 GB), nothing written",
               s=res["s"], rss_mb=res["rss_mb"], **({"atime_kept": unread} if real is not None else {}))


def class2_symlinks(work: Path, base: Path) -> None:
    """The Hugging Face cache's layout (shards symlinked to blobs elsewhere) still exports."""
    folder = case(base, work / "c2-symlinked")
    blobs = work / "c2-blobs"
    shutil.rmtree(blobs, ignore_errors=True)
    blobs.mkdir()
    shutil.move(folder / "model.safetensors", blobs / "0123abcd")
    (folder / "model.safetensors").symlink_to(blobs / "0123abcd")
    res, toks = export_tokens(folder, work / "c2-symlinked-out")
    record("2", "control: model.safetensors a symlink to a blob outside the folder (HF cache)", res["rc"],
           res["err"] or f"tokens {toks}", res["rc"] == 0 and toks is not None, "exports (exit 0)", s=res["s"])


def raw_safetensors(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_raw(path: Path, header: dict, data: bytes) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def class6(work: Path, base: Path) -> None:
    header, data = raw_safetensors(base / "model.safetensors")
    order = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    second = order[1]

    def no_offsets(h, d):
        del h[VICTIM]["data_offsets"]
        return d

    def overlap(h, d):
        b, e = h[second]["data_offsets"]
        h[second]["data_offsets"] = [b - 8, e - 8]
        return d

    def gap(h, d):
        cut = h[order[0]]["data_offsets"][1]
        for k in order[1:]:
            h[k]["data_offsets"] = [x + 8 for x in h[k]["data_offsets"]]
        return d[:cut] + b"\0" * 8 + d[cut:]

    for what, mutate in (("an entry without data_offsets", no_offsets), ("overlapping byte ranges", overlap),
                         ("an 8-byte gap between two tensors", gap)):
        folder = case(base, work / f"c6-{mutate.__name__}")
        h = json.loads(json.dumps(header))
        write_raw(folder / "model.safetensors", h, mutate(h, data))
        res = cli("export", folder, "-o", work / f"c6-out-{mutate.__name__}", "-q", "--ctx-len", 64,
                  "--prefill-seq-len", 8, timeout=300)
        record("6", f"model.safetensors header with {what}", res["rc"], res["err"],
               one_line_refusal(res, "model.safetensors"), "exit 2, one line naming the file", s=res["s"])


# ---------------------------------------------------------------------------------------------- servers
class Server:
    """``qeff-kv serve EXPORT FLAGS`` in a child process; waits for /health."""

    def __init__(self, work: Path, export: Path, *flags, port: int = 18765):
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(work / f"serve-{port}-{int(time.time())}.log", "w")
        t0 = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "-m", "qeff_kv_cli.main", "serve", str(export), "--port",
                                      str(port), *map(str, flags)], stdout=self.log, stderr=subprocess.STDOUT)
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() - t0 > 600:
                raise RuntimeError(f"qeff-kv serve {export} did not start (see {self.log.name})")
            time.sleep(0.1)
        self.start_s = round(time.monotonic() - t0, 1)

    def mem(self) -> dict:
        status = Path(f"/proc/{self.proc.pid}/status").read_text().splitlines()
        return {k: int(v.split()[0]) // 1024 for k, v in (ln.split(":", 1) for ln in status) if k in ("VmRSS", "VmHWM")}

    def post(self, path: str, body, timeout: float = 300) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=timeout)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def error_line(r: httpx.Response) -> str:
    try:
        return r.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return r.text


def refused(r: httpx.Response, *needles: str, status: int = 400) -> bool:
    try:
        err = r.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return (r.status_code == status and "\n" not in err["message"] and "/tmp" not in r.text and "/work" not in r.text
            and all(n in err["message"] or n == err.get("param") for n in needles))


def png_declaring(width: int, height: int, rows: int | None = None) -> bytes:
    """An all-zero grayscale PNG declaring ``width x height`` pixels, holding ``rows`` rows (default: all, a valid
    image), compressed as it is made (never whole in memory)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    comp = zlib.compressobj(9)
    row = b"\0" * (width + 1)
    data = b"".join(comp.compress(row) for _ in range(height if rows is None else rows)) + comp.flush()
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", data) + chunk(b"IEND", b""))


def image_chat(*urls: str, max_tokens: int = 3) -> dict:
    content = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return {"messages": [{"role": "user", "content": content + [{"type": "text", "text": "What is in the picture?"}]}],
            "max_tokens": max_tokens, "temperature": 0}


def llava_export(work: Path) -> Path:
    from hf_models import add_llava_processor, make_llava_dir

    out = work / "llava-export"
    if not (out / "manifest.json").is_file():
        model = make_llava_dir(work / "llava-src")
        add_llava_processor(model)
        res = cli("export", model, "-o", out, "-q", "--ctx-len", 64, "--prefill-seq-len", 8,
                  "--continuous-batching", "--full-batch-size", 4, "--no-verify")
        assert res["rc"] == 0, res["err"]
    return out


def classes_3_4_5(work: Path) -> None:
    from hf_models import write_png

    media = work / "media"
    media.mkdir(exist_ok=True)
    photo = write_png(media / "photo.png", seed=0)
    srv = Server(work, llava_export(work), "--max-sequences", 4, "--allowed-local-media-path", media)
    try:
        url = "data:image/png;base64," + base64.b64encode(photo.read_bytes()).decode()
        with ThreadPoolExecutor(4) as pool:     # class 4 first: the server has answered nothing yet
            answers = list(pool.map(lambda _: srv.post("/v1/chat/completions", image_chat(url)), range(4)))
        texts = [r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else error_line(r)
                 for r in answers]
        record("4", "4 concurrent first image requests on a fresh server", [r.status_code for r in answers],
               repr(texts[0]), all(r.status_code == 200 for r in answers) and len(set(texts)) == 1,
               "all 200, all the same answer", start_s=srv.start_s)
        for n_req, w, rows in ((1, 13000, None), (2, 13000, None), (1, 13000, 1000), (2, 13000, 1000),
                               (1, 7000, None)):
            raw = png_declaring(w, w, rows)
            bomb = "data:image/png;base64," + base64.b64encode(raw).decode()
            what = f"{'valid' if rows is None else f'{rows}-row'} {len(raw) // 1024} KB PNGs of {w}x{w}"
            before = srv.mem()
            t0 = time.monotonic()
            with ThreadPoolExecutor(n_req) as pool:
                rs = list(pool.map(lambda _: srv.post("/v1/chat/completions", image_chat(bomb, bomb, bomb)),
                                   range(n_req)))
            wall, after = round(time.monotonic() - t0, 2), srv.mem()
            grow = after["VmHWM"] - before["VmRSS"]
            record("3", f"{n_req} request(s) at once, each three {what}", [r.status_code for r in rs],
                   error_line(rs[0]), all(refused(r, "pixels") for r in rs) and wall < 10 and grow < 512,
                   "all one-line 400 naming pixels, < 10 s, server peak RSS growth < 512 MB",
                   s=wall, rss_before_mb=before["VmRSS"], peak_growth_mb=grow)
        for sent in (f"file://{media}/photo%00.png", f"file://{media}%00/photo.png"):
            r = srv.post("/v1/chat/completions", image_chat(sent))
            record("5", f"image_url {sent.replace(str(media), '<media>')}", r.status_code, error_line(r),
                   refused(r), "one-line 400, no server path")
        r = srv.post("/v1/chat/completions", image_chat(f"file://{media}/photo.png"))
        record("5", "image_url file://<media>/photo.png (control)", r.status_code,
               r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else error_line(r),
               r.status_code == 200, "200")
    finally:
        srv.stop()


# ------------------------------------------------------------------------------------------- embeddings
def wide_export(work: Path) -> Path:
    """A seeded random Llama wider than the bundled one (byte tokenizer), exported with hidden_states."""
    from hf_models import make_model_dir

    from qeff_kv.export.sources import bundled_model_dir

    out = work / "wide-export"
    if not (out / "manifest.json").is_file():
        model = make_model_dir("llama", work / "wide-src", seed=0, vocab_size=256, hidden_size=512,
                               intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                               num_key_value_heads=4, head_dim=64, max_position_embeddings=2048,
                               initializer_range=0.02)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(bundled_model_dir() / name, model / name)
        res = cli("export", model, "-o", out, "-q", "--ctx-len", 1536, "--prefill-seq-len", 32, "--target",
                  "onnxruntime", "--continuous-batching", "--full-batch-size", 2, "--hidden-states", "--no-verify")
        assert res["rc"] == 0, res["err"]
    return out


def stream_stamps(url: str, n: int, out: list, started: threading.Event) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                out.append(time.monotonic())
                if len(out) == 10:
                    started.set()


def worst_gap_during(srv: Server, path: str, body: dict) -> tuple[float, int, float, float]:
    """A 400-token stream runs; after its 10th token ``body`` is sent to ``path``: the stream's worst gap while
    that request ran, its status, its own time, the stream's median gap meanwhile."""
    stamps, started = [], threading.Event()
    t = threading.Thread(target=stream_stamps, args=(srv.url, 400, stamps, started))
    t.start()
    started.wait(120)
    a = time.monotonic()
    r = srv.post(path, body)
    b = time.monotonic()
    t.join()
    gaps = [y - x for x, y in zip(stamps, stamps[1:]) if y > a and x < b]
    return max(gaps or [0.0]), r.status_code, b - a, sorted(gaps or [0.0])[len(gaps) // 2]


def class7(work: Path) -> None:
    srv = Server(work, wide_export(work), "--max-sequences", 2, "--prefill-chunk", 32)
    try:
        busy, go = [[], []], [threading.Event(), threading.Event()]
        ts = [threading.Thread(target=stream_stamps, args=(srv.url, 200, busy[i], go[i])) for i in range(2)]
        for t in ts:
            t.start()
        for g in go:
            g.wait(120)
        t0 = time.monotonic()
        r = srv.post("/v1/embeddings", {"input": "every sequence is busy"})
        done = time.monotonic()
        waited = round(done - t0, 2)
        for t in ts:
            t.join()
        after_one = min(b[-1] for b in busy) <= done
        vec = r.json()["data"][0]["embedding"] if r.status_code == 200 else None
        record("7", "/v1/embeddings while both sequences stream (--max-sequences 2)", r.status_code,
               f"{len(vec)}-dim vector after {waited} s" if vec else error_line(r),
               r.status_code == 200 and bool(vec) and after_one,
               "200 with a vector, answered once a stream had ended (it waited its turn)", waited_s=waited,
               answered_after_a_stream_ended=after_one)
        alone, ev = [], threading.Event()
        stream_stamps(srv.url, 200, alone, ev)
        alone_gaps = sorted(y - x for x, y in zip(alone[10:], alone[11:]))
        base_gap, base_p50 = alone_gaps[-1], alone_gaps[len(alone_gaps) // 2]
        ids = [3 + (7 * i) % 250 for i in range(1200)]
        emb, plain = [], []
        for _ in range(2):      # interleaved: an embedding input, then a prompt of the same 1200 ids
            emb.append(worst_gap_during(srv, "/v1/embeddings", {"input": ids}))
            plain.append(worst_gap_during(srv, "/v1/completions", {"prompt": ids, "max_tokens": 1}))
        e, p = min(g[0] for g in emb), min(g[0] for g in plain)
        ok = all(g[1] == 200 for g in emb + plain) and e <= 1.5 * p + 0.05
        record("7", "1200-token embedding input vs a 1200-token prompt beside a stream (--prefill-chunk 32)",
               [g[1] for g in emb + plain], f"worst gap {e:.3f} s (embedding) vs {p:.3f} s (prompt)", ok,
               "both 200; embedding's worst gap <= 1.5x the prompt's + 50 ms (best of 2 each)",
               stream_alone_worst_gap_s=round(base_gap, 3), stream_alone_p50_gap_s=round(base_p50, 3),
               embedding_worst_gap_s=[round(g[0], 3) for g in emb], prompt_worst_gap_s=[round(g[0], 3) for g in plain],
               embedding_p50_gap_s=[round(g[3], 3) for g in emb], prompt_p50_gap_s=[round(g[3], 3) for g in plain],
               embedding_request_s=[round(g[2], 2) for g in emb], prompt_request_s=[round(g[2], 2) for g in plain])
    finally:
        srv.stop()


# ------------------------------------------------------------------------------------ the README's export
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
CHAT = [{"role": "user", "content": "What is the weather in Paris and in London?"}]


def class11(srv: Server) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "sunny": {"type": "boolean"}},
              "required": ["city", "sunny"], "additionalProperties": False}
    body = {"messages": CHAT, "max_tokens": 60, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": schema}}}
    t0 = time.monotonic()
    r = srv.post("/v1/chat/completions", body)
    took = round(time.monotonic() - t0, 2)
    text = r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else error_line(r)
    try:
        ok = r.status_code == 200 and set(json.loads(text)) == {"city", "sunny"}
    except ValueError:
        ok = False
    record("11", "first request of a fresh server: response_format json_schema", r.status_code, text, ok,
           "200, content valid for the schema", s=took, server_start_s=srv.start_s)


def class10(srv: Server) -> None:
    bias = {"0": -100, "2": -100}      # <|endoftext|>, <|im_end|>: a forced answer runs on into further calls
    rows, good, calls_seen = [], True, 0
    for limit in (12, 25, 40, 60, 90):
        r = srv.post("/v1/chat/completions", {"messages": CHAT, "tools": [WEATHER], "tool_choice": "required",
                                              "max_tokens": limit, "temperature": 0, "logit_bias": bias})
        if r.status_code != 200:
            good = False
            rows.append(f"{limit}: {r.status_code} {error_line(r)}")
            continue
        ch = r.json()["choices"][0]
        calls = ch["message"].get("tool_calls") or []
        content = ch["message"].get("content") or ""
        try:
            args = [json.loads(c["function"]["arguments"]) for c in calls]
        except ValueError:
            args, good = None, False
        good &= ch["finish_reason"] == "length" and "<tool_call>" not in content and '"name"' not in content
        calls_seen = max(calls_seen, len(calls))
        rows.append(f"max_tokens {limit}: {len(calls)} call(s) {args}, content {content[:40]!r}, {ch['finish_reason']}")
    with httpx.stream("POST", srv.url + "/v1/chat/completions", timeout=300, json={
            "messages": CHAT, "tools": [WEATHER], "tool_choice": "required", "max_tokens": 40, "temperature": 0,
            "logit_bias": bias, "stream": True}) as r:
        deltas = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
    content = "".join((d["choices"][0]["delta"].get("content") or "") for d in deltas if d["choices"])
    names = [c["function"].get("name") for d in deltas if d["choices"]
             for c in d["choices"][0]["delta"].get("tool_calls") or [] if c.get("function", {}).get("name")]
    finish = [d["choices"][0]["finish_reason"] for d in deltas if d["choices"] and d["choices"][0]["finish_reason"]]
    record("10", "the same, streamed, max_tokens 40", r.status_code,
           f"{len(names)} call(s) {names}, content {content!r}, finish {finish}",
           r.status_code == 200 and "<tool_call>" not in content and '"name"' not in content and finish == ["length"]
           and len(names) >= 1, "no markup in content deltas, >= 1 complete call, finish_reason length")
    record("10", "tool_choice required, eos banned, max_tokens 12/25/40/60/90 (cut inside a call)", "200" if good
           else "see detail", "; ".join(rows), good and calls_seen >= 1,
           "every answer: finish_reason length, no markup in content, each tool_call's arguments valid JSON; "
           "at least one complete call returned", detail=rows)


ECHO = {"prompt": "The capital of France is Paris.", "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}


def class9(srv: Server) -> list | None:
    r = srv.post("/v1/completions", ECHO)
    if r.status_code != 200:
        record("9", "echo + logprobs on the plain README export", r.status_code, error_line(r), False, "200")
        return None
    lp = r.json()["choices"][0]["logprobs"]
    vals = lp["token_logprobs"]
    known = [v for v in vals[1:] if v is not None]
    ok = vals[0] is None and len(known) == len(vals) - 1 and all(v <= 0 for v in known)
    record("9", "completions echo:true logprobs:1 max_tokens:1 on the plain README export", r.status_code,
           f"{len(vals)} tokens, logprobs {[round(v, 2) for v in known[:6]]}...", ok,
           "200; every token after the first has a logprob <= 0")
    return vals


def class9_against_spec(work: Path, spec: Path, plain: list | None) -> None:
    """The same request on the --speculative-tokens 4 export (the path that scored prompts before): same values."""
    srv = Server(work, spec)
    try:
        r = srv.post("/v1/completions", ECHO)
    finally:
        srv.stop()
    other = r.json()["choices"][0]["logprobs"]["token_logprobs"] if r.status_code == 200 else None
    diff = (max(abs(a - b) for a, b in zip(plain[1:], other[1:])) if plain and other and len(plain) == len(other)
            else None)
    record("9", "the same echo request on the --speculative-tokens 4 export", r.status_code,
           f"max |logprob difference| {diff:.2e}" if diff is not None else error_line(r),
           diff is not None and diff < 2e-3, "200; every prompt logprob within 2e-3 of the plain export's",
           max_abs_diff=diff)


def class12(srv: Server) -> None:
    r = srv.post("/v1/responses", {"input": "Tell me a long story about a cat.", "max_output_tokens": 8})
    j = r.json() if r.status_code == 200 else {}
    items = [o for o in j.get("output", []) if o.get("type") == "message"]
    ok = (r.status_code == 200 and j["status"] == "incomplete" and items and items[0]["status"] == "incomplete"
          and isinstance(j.get("top_p"), (int, float)))
    record("12", "/v1/responses max_output_tokens 8 (cut)", r.status_code,
           f"status {j.get('status')}, message item {items[0]['status'] if items else None}, top_p {j.get('top_p')}, "
           f"temperature {j.get('temperature')}" if j else error_line(r), ok,
           "response and message item incomplete; top_p echoed as a number (the default applied), not null")
    with httpx.stream("POST", srv.url + "/v1/responses", timeout=300, json={
            "input": "Tell me a long story about a cat.", "max_output_tokens": 8, "stream": True}) as rs:
        events = [json.loads(ln[6:]) for ln in rs.iter_lines() if ln.startswith("data: {")]
    done = [e["item"]["status"] for e in events if e.get("type") == "response.output_item.done"]
    last = events[-1] if events else {}
    record("12", "/v1/responses max_output_tokens 8, streamed", rs.status_code,
           f"output_item.done {done}, last event {last.get('type')} {last.get('response', {}).get('status')}",
           done == ["incomplete"] and last.get("type") == "response.incomplete",
           "the message item's done event incomplete; last event response.incomplete")
    r = srv.post("/v1/responses", {"input": "hi", "max_output_tokens": 4, "top_p": 0.5})
    record("12", "/v1/responses top_p 0.5", r.status_code, f"top_p {r.json().get('top_p')}" if r.status_code == 200
           else error_line(r), r.status_code == 200 and r.json().get("top_p") == 0.5, "200, top_p echoed 0.5")


def model_name(srv: Server, any_name: bool) -> None:
    r = srv.post("/v1/chat/completions", {"model": "gpt-3.5-turbo", "messages": CHAT, "max_tokens": 4,
                                          "temperature": 0})
    if any_name:
        ok = r.status_code == 200 and r.json()["model"] == "gpt-3.5-turbo"
        first = f"model {r.json()['model']}: {r.json()['choices'][0]['message']['content']!r}" if ok else error_line(r)
    else:
        ok, first = refused(r, "gpt-3.5-turbo"), error_line(r)
    record("12", f"chat naming gpt-3.5-turbo, {'with' if any_name else 'without'} --accept-any-model-name",
           r.status_code, first, ok, "200 naming it back" if any_name else "one-line 400 naming the model")


RESPONSES_BAD = [({"stream": 1}, "stream"), ({"store": 0}, "store"), ({"background": 0}, "background"),
                 ({"metadata": {"a": 1}}, "metadata"), ({"metadata": "x"}, "metadata"), ({"user": 5}, "user"),
                 ({"max_output_tokens": -1}, "max_output_tokens"), ({"max_output_tokens": "8"}, "max_output_tokens"),
                 ({"max_output_tokens": 10**6}, "max_output_tokens"), ({"max_tokens": 5}, "max_tokens"),
                 ({"frobnicate": True}, "frobnicate"), ({"text": {"format": {"type": "json_schema"}}}, "text.format")]
TOKENIZE_BAD = [{"messages": [{"role": "user", "content": 5}]}, {"messages": "hi"}, {"prompt": 5},
                {"messages": [{"role": "tool", "content": "x"}]}, {"messages": CHAT, "tools": "x"},
                {"messages": CHAT, "chat_template_kwargs": {"x": 1}}, {"prompt": "hi", "model": "other"},
                {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}]}]


def class8(srv: Server, export: Path) -> None:
    for extra, field in RESPONSES_BAD:
        r = srv.post("/v1/responses", {"input": "hi", "max_output_tokens": 4, **extra})
        err = r.json().get("error", {}) if r.status_code != 200 else {}
        text = json.dumps(err)
        ok = (refused(r) and err.get("param", "").startswith(field)
              and (field == "max_tokens" or "max_tokens" not in text.replace("max_output_tokens", "")))
        record("8", f"/v1/responses {json.dumps(extra)}", r.status_code, error_line(r), ok,
               f"one-line 400, param {field}, no chat field names")
    leaks, codes, sample, answers = [], [], "", []
    for body in TOKENIZE_BAD:
        r = srv.post("/tokenize", body)
        codes.append(r.status_code)
        answers.append(f"{json.dumps(body)[:70]} -> {r.status_code} {error_line(r)[:100]}")
        sample = sample or (f"{json.dumps(body)[:50]}: {error_line(r)}" if r.status_code != 200 else "")
        one = r.status_code == 200 or refused(r, status=r.status_code)
        if not one or str(export) in r.text or str(export.parent) in r.text or "/tmp/" in r.text:
            leaks.append(f"{json.dumps(body)[:60]} -> {r.status_code} {error_line(r)[:100]}")
    record("8", f"/tokenize with {len(TOKENIZE_BAD)} hostile bodies", codes, leaks[0] if leaks else sample, not leaks,
           "each a 200 or a one-line 4xx; none shows the export's path or folder", detail=answers)


def readme_classes(work: Path, export: Path, spec: Path | None) -> None:
    srv = Server(work, export)
    try:
        class11(srv)        # first: the server has answered nothing yet
        class10(srv)
        plain = class9(srv)
        class12(srv)
        model_name(srv, any_name=False)
        class8(srv, export)
    finally:
        srv.stop()
    srv = Server(work, export, "--accept-any-model-name")
    try:
        model_name(srv, any_name=True)
    finally:
        srv.stop()
    if spec is not None:
        class9_against_spec(work, spec, plain)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="/tmp/hostile-work")
    ap.add_argument("--readme-export", default="/tmp/lp-bench/smollm2",
                    help="the README's SmolLM2-135M export (--target onnxruntime-fused --ctx-len 1024)")
    ap.add_argument("--spec-export", default="/tmp/lp-bench/smollm2-spec",
                    help="the same exported with --speculative-tokens 4 (class 9's comparison; '' to skip)")
    ap.add_argument("--json", default=None, help="write the rows and figures here")
    ap.add_argument("--only", default=None, help="comma-separated groups: ckpt,images,embeddings,readme")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    os.environ["HOSTILE_WORK"] = str(work)
    groups = set((args.only or "ckpt,images,embeddings,readme").split(","))
    started, t0 = datetime.datetime.now(datetime.timezone.utc), time.monotonic()
    load0 = os.getloadavg()
    print("class | sent | status | first line of the answer | verdict (rule) figures", flush=True)
    if "ckpt" in groups:
        base = bundled_hf(work)
        class1(work, base)
        class2(work, base)
        class2_symlinks(work, base)
        class6(work, base)
    if "images" in groups:
        classes_3_4_5(work)
    if "embeddings" in groups:
        class7(work)
    if "readme" in groups:
        readme_classes(work, Path(args.readme_export), Path(args.spec_export) if args.spec_export else None)
    failed = [r for r in ROWS if r["verdict"] == "FAIL"]
    print(f"{len(ROWS) - len(failed)} of {len(ROWS)} reproductions PASS; {len(failed)} FAIL", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "command": "python " + " ".join(sys.argv), "date": started.isoformat(timespec="seconds"),
            "wall_s": round(time.monotonic() - t0), "loadavg_start": load0, "loadavg_end": os.getloadavg(),
            "cpus": os.cpu_count(), "passed": len(ROWS) - len(failed), "failed": len(failed), "rows": ROWS},
            indent=1) + "\n")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
