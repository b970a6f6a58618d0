"""Issue 31 on the ``qeff-kv serve`` process: SIGTERM drains (item 5), start-up refusals in one line (items 8, 11).

The drain test runs the real CLI in a child process whose decode steps are slowed (a sitecustomize-free wrapper
script), so that requests are in flight when SIGTERM arrives.
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from click.testing import CliRunner  # noqa: E402
from serve_helpers import free_port  # noqa: E402

from qeff_kv_cli.main import main  # noqa: E402

SLOW_SERVE = """
import sys, time
from qeff_kv.runtime.session import Session
_decode = Session.decode
def slow(self, feeds):
    time.sleep(0.1)
    return _decode(self, feeds)
Session.decode = slow
from qeff_kv_cli.main import main
main(sys.argv[1:], prog_name="qeff-kv")
"""


def _wait_up(proc, port):
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, proc.stderr.read()
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the server did not come up"
        time.sleep(0.1)


def _stream(url, body, out: list, first: threading.Event):
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        out.append(r.status_code)
        for line in r.iter_lines():
            if line:
                out.append(line)
                first.set()


def test_sigterm_drains_and_exits_143_with_one_line(own_cb_graph, tmp_path):
    script = tmp_path / "slow_serve.py"
    script.write_text(SLOW_SERVE)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, str(script), "serve", str(own_cb_graph), "--port", str(port),
                             "--model-name", "tiny", "--drain-seconds", "2.5"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_up(proc, port)
        long = {"prompt": [5, 6, 7], "max_tokens": 60, "temperature": 0, "ignore_eos": True}
        short = {"prompt": [5, 6, 8], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        stream, first = [], threading.Event()
        results: dict = {}
        threads = [threading.Thread(target=_stream, args=(url, long, stream, first)),
                   threading.Thread(target=lambda: results.__setitem__(
                       "long", httpx.post(url + "/v1/completions", json=long, timeout=60)))]
        for t in threads:
            t.start()
        assert first.wait(30)
        time.sleep(0.2)
        short_t = threading.Thread(target=lambda: results.__setitem__(
            "short", httpx.post(url + "/v1/completions", json=short, timeout=60)))
        short_t.start()
        time.sleep(0.15)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        late = httpx.post(url + "/v1/completions", json=short, timeout=30)   # arrives during the drain
        for t in threads + [short_t]:
            t.join(60)
        proc.wait(timeout=60)
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert late.status_code == 503 and late.json()["error"]["code"] == "server_shutting_down"
    # the short request finished normally within the grace period
    assert results["short"].status_code == 200 and results["short"].json()["usage"]["completion_tokens"] == 4
    # the long ones were stopped: an error, never a normal end
    assert results["long"].status_code == 503, results["long"].text
    assert results["long"].json()["error"]["code"] == "server_shutting_down"
    assert stream[0] == 200 and stream[-1] == "data: [DONE]"
    last = json.loads(stream[-2][len("data: "):])
    assert last["error"]["code"] == "server_shutting_down"
    assert not any('"finish_reason": "stop"' in s or '"finish_reason": "length"' in s for s in stream[1:])
    assert proc.returncode == 143, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines[0].startswith("serving tiny on http://127.0.0.1:")
    assert lines[1:] == ["error: terminated (SIGTERM); 2 running request(s) stopped with an error"], err


def test_sigterm_with_nothing_running_exits_143_at_once(own_cb_graph):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "qeff_kv_cli.main", "serve", str(own_cb_graph), "--port",
                             str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_up(proc, port)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        assert time.monotonic() - t0 < 5
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    err = [ln for ln in proc.stderr.read().splitlines() if ln.strip()]
    assert proc.returncode == 143
    assert err[1:] == ["error: terminated (SIGTERM); every running request finished"]


# ------------------------------------------------------------------------------------------ start-up refusals
def _one_line(result, *needles):
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def test_a_state_dir_below_a_file_is_one_line_and_nothing_is_created(own_cb_graph, tmp_path):
    runner = CliRunner()
    afile = tmp_path / "afile"
    afile.write_text("x")
    _one_line(runner.invoke(main, ["serve", str(own_cb_graph), "--state-dir", str(afile / "x")]),
              "--state-dir", "is not a folder")
    # a start refused later (another reason) creates no state folder
    new = tmp_path / "new-states"
    _one_line(runner.invoke(main, ["serve", str(tmp_path / "missing-export"), "--state-dir", str(new)]))
    assert not new.exists()


def test_a_port_in_use_is_one_line_without_the_serving_line(own_cb_graph, tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        new = tmp_path / "states"
        result = CliRunner().invoke(main, ["serve", str(own_cb_graph), "--port", str(port), "--state-dir", str(new)])
    _one_line(result, f"cannot listen on 127.0.0.1:{port}")
    assert "serving" not in result.output and not new.exists()


@pytest.mark.parametrize("args,needle", [
    (["--api-key", " k "], "--api-key must be printable ASCII"),
    (["--api-key", "k\u00e9y"], "--api-key must be printable ASCII"),
    (["--model-name", "a\nb"], "--model-name must be 1-256 printable characters"),
    (["--model-name", "  "], "--model-name"),
    (["--served-model-name", "a", "b", "a"], "--served-model-name: a name given twice"),
    (["--served-model-name", "a", "--model-name", "b"], "give --served-model-name or --model-name, not both"),
    (["--checkpoint-every", "16"], "--checkpoint-every and --max-checkpoints go with a recurrent"),
    (["--max-checkpoints", "2"], "--checkpoint-every and --max-checkpoints go with a recurrent"),
    (["--disaggregate", "--state-dir", "x"], "--state-dir does not go with --disaggregate"),
    (["--max-request-bytes", "10"], "--max-request-bytes"),
    (["--deterministic", "--prefill-chunk", "auto"], "--deterministic does not go with --prefill-chunk auto"),
    (["--deterministic", "--speculative", "lookup"], "--deterministic does not go with --speculative"),
])
def test_options_that_could_never_work_are_refused(own_cb_graph, args, needle):
    _one_line(CliRunner().invoke(main, ["serve", str(own_cb_graph), *args]), needle)


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(own_cb_graph, tmp_path):
    folder = tmp_path / "bigtok"
    shutil.copytree(own_cb_graph, folder)
    tok = json.loads((folder / "tokenizer.json").read_text())
    tok.setdefault("added_tokens", []).append({"id": 300, "content": "<extra>", "single_word": False,
                                               "lstrip": False, "rstrip": False, "normalized": False,
                                               "special": True})
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    _one_line(CliRunner().invoke(main, ["serve", str(folder), "--port", str(free_port())]),
              "the tokenizer's ids reach 256, the model's vocabulary holds 256")
