"""``qeff-kv serve`` on the command line: bad options are one line and exit 2 before anything listens; a real
server process answers and stops cleanly on Ctrl-C."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from qeff_kv_cli.main import main  # noqa: E402
from serve_helpers import free_port  # noqa: E402


def _one_line_error(result, needle):
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], result.output


def test_bad_options_are_one_line(tmp_path, own_cb_graph):
    runner = CliRunner()
    _one_line_error(runner.invoke(main, ["serve", str(tmp_path / "missing")]), "no such file or folder")
    _one_line_error(runner.invoke(main, ["serve", str(own_cb_graph), "--decode-replicas", "2"]),
                    "go with --disaggregate")
    _one_line_error(runner.invoke(main, ["serve", str(own_cb_graph), "--port", "70000"]), "--port")
    bare = tmp_path / "no-tokenizer"
    shutil.copytree(own_cb_graph, bare)
    (bare / "tokenizer.json").unlink()
    _one_line_error(runner.invoke(main, ["serve", str(bare)]), "has no tokenizer.json")
    afile = tmp_path / "afile"
    afile.write_text("x")
    _one_line_error(runner.invoke(main, ["serve", str(own_cb_graph), "--state-dir", str(afile)]), "--state-dir")
    _one_line_error(runner.invoke(main, ["serve", str(own_cb_graph), "--min-p", "3"]), "min_p must be in [0, 1]")
    _one_line_error(runner.invoke(main, ["serve", str(own_cb_graph), "--max-n", "9", "--port", str(free_port())]),
                    "--max-n 9: the server runs 3 sequences at once")
    broken = tmp_path / "broken-generation-config"
    shutil.copytree(own_cb_graph, broken)
    (broken / "generation_config.json").write_text('{"temperature": "warm"}')
    _one_line_error(runner.invoke(main, ["serve", str(broken)]), "temperature must be a number")


def test_serve_process_answers_and_stops_on_ctrl_c(own_cb_graph):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "qeff_kv_cli.main", "serve", str(own_cb_graph), "--port", str(port),
                             "--model-name", "tiny", "--max-queue", "4"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stderr.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.1)
        assert [m["id"] for m in httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).json()["data"]] == ["tiny"]
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30,
                       json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0,
                             "ignore_eos": True}).json()
        assert r["usage"]["completion_tokens"] == 3
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=20)
        assert proc.returncode == 0
        assert "serving tiny on http://127.0.0.1:" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
