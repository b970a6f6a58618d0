"""Another stream's inter-token gaps while huge requests are refused (issue 31: nothing blocks the event loop).

    python benchmarks/bench_hostile.py EXPORT_DIR [--tokens 200]

Starts ``qeff-kv serve EXPORT_DIR`` (default ``--max-request-bytes``: 8 MiB) in a child process, streams one
greedy request of ``--tokens`` tokens alone (the baseline), then the same stream while another client sends, one
after the other: a 40 MB body (refused from its Content-Length: 413), a text prompt just under the cap (refused
before tokenizing: it cannot fit the context; 400 context_length_exceeded), a prompt of token ids just under the
cap (parsed off the loop, then refused) and the text as a chat message.
Prints the stream's p50 and largest gap between two tokens in both runs, and how long each refusal took.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stream(url: str, n: int, out: list) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                out.append(time.monotonic())


def _gaps(stamps: list, a: float | None = None, b: float | None = None) -> list[float]:
    return [y - x for x, y in zip(stamps, stamps[1:]) if a is None or (y > a and x < b)]


def _hostile(url: str, timings: dict) -> None:
    cap = 8 << 20
    with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1]))) as s:
        t0 = time.monotonic()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: 40000000\r\n\r\n")
        s.recv(65536)
        timings["40 MB declared (413)"] = time.monotonic() - t0
    prompt = "hello world, abc " * ((cap - 4096) // 17)
    ids = [1234] * ((cap - 4096) // 6)
    for label, path, body in (("8 MB text prompt (400)", "/v1/completions", {"prompt": prompt}),
                              ("8 MB token-id prompt (400)", "/v1/completions", {"prompt": ids}),
                              ("8 MB chat message (400)", "/v1/chat/completions",
                               {"messages": [{"role": "user", "content": prompt}]})):
        t0 = time.monotonic()
        r = httpx.post(url + path, json=body, timeout=600)
        timings[label] = time.monotonic() - t0
        timings[label + " status"] = r.status_code


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("export_dir")
    ap.add_argument("--tokens", type=int, default=200)
    args = ap.parse_args()
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "qeff_kv_cli.main", "serve", args.export_dir, "--port", str(port)],
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit("the server did not come up")
            time.sleep(0.2)
        alone: list = []
        _stream(url, args.tokens, alone)
        busy: list = []
        t = threading.Thread(target=_stream, args=(url, args.tokens, busy))
        t.start()
        while len(busy) < 5:
            time.sleep(0.01)
        timings: dict = {}
        a = time.monotonic()
        _hostile(url, timings)
        b = time.monotonic()
        t.join()
    finally:
        proc.terminate()
        proc.wait(timeout=120)
    g0, g1 = _gaps(alone), _gaps(busy, a, b)
    print(f"stream alone: p50 gap {statistics.median(g0) * 1e3:.1f} ms, largest {max(g0) * 1e3:.1f} ms")
    print(f"while refused ({b - a:.2f} s, {len(g1)} gaps): p50 {statistics.median(g1) * 1e3:.1f} ms, "
          f"largest {max(g1) * 1e3:.1f} ms")
    for k, v in timings.items():
        print(f"  {k}: {v if 'status' in k else f'{v:.2f} s'}")


if __name__ == "__main__":
    main()
