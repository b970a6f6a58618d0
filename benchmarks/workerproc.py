"""One engine in its own process, for the side-by-side benchmarks (bench_decode.py, bench_race.py).

The parent starts ``python <script> --worker <engine> ...``; the worker prints one JSON line when it is ready,
then answers each JSON request line on stdin with one JSON line on stdout, until ``{"cmd": "quit"}``. Each
engine's peak RSS is its own process's (``VmHWM``), and every engine gets the same thread count through the
usual environment variables.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys


def peak_rss() -> int:
    """This process's peak resident set size in bytes (``VmHWM``)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


class WorkerProcess:
    """A worker process speaking JSON lines; :attr:`ready` is its first line."""

    def __init__(self, name: str, argv: list[str], threads: int, python: str | None = None):
        """``python``: the interpreter to run ``argv`` with (default: this one)."""
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads),
                   MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
        self.name = name
        self.proc = subprocess.Popen([python or sys.executable, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env)
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {name} failed to start")
        self.ready = json.loads(line)

    def request(self, payload: dict) -> dict:
        self.proc.stdin.write(json.dumps(payload) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.name} died")
        return json.loads(line)

    def close(self) -> None:
        try:
            self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=30)
        except Exception:
            self.proc.kill()
