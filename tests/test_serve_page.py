"""The chat page at ``/`` in headless Chromium: a question typed key by key into the page, sent with Enter, the
answer read from the page's DOM while it streams and when done (equal to the same chat prompt run alone), and
a screenshot kept in ``test-artifacts/serve-chat-page.png`` (git-ignored).

Chromium is driven through the DevTools protocol over ``--remote-debugging-pipe`` (JSON messages ending in NUL on
file descriptors 3 and 4): no websocket client needed. Skips with the reason where Chromium is absent.
"""

from __future__ import annotations

import base64
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from conftest import REPO  # noqa: E402
from serve_helpers import LiveServer, SlowDecode, chat_export  # noqa: E402

CHROMIUM = os.environ.get("QEFF_KV_CHROMIUM", "/usr/bin/chromium")
KEY = "page-key"
ARTIFACTS = REPO / "test-artifacts"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--remote-debugging-pipe", "--window-size=900,700", "about:blank"]

pytestmark = pytest.mark.skipif(not (Path(CHROMIUM).is_file() and os.access(CHROMIUM, os.X_OK)),
                                reason=f"no Chromium at {CHROMIUM} (set QEFF_KV_CHROMIUM)")


class Browser:
    """Headless Chromium and a DevTools-protocol connection over its pipe."""

    def __init__(self):
        self.profile = tempfile.mkdtemp(prefix="qeff-kv-chromium-")
        to_r, self._to = os.pipe()       # we write commands, Chromium reads fd 3
        self._from, from_w = os.pipe()   # Chromium writes fd 4, we read
        self.proc = subprocess.Popen(
            ["bash", "-c", f'exec "$0" "$@" 3<&{to_r} 4>&{from_w}', CHROMIUM, f"--user-data-dir={self.profile}",
             *FLAGS], pass_fds=(to_r, from_w), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_r)
        os.close(from_w)
        self._buf = b""
        self._id = 0
        self.session: str | None = None

    def send(self, method: str, params: dict | None = None, timeout: float = 30.0) -> dict:
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params or {}}
        if self.session is not None and not method.startswith(("Target.", "Browser.")):
            msg["sessionId"] = self.session
        os.write(self._to, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            while b"\0" in self._buf:
                raw, self._buf = self._buf.split(b"\0", 1)
                reply = json.loads(raw)
                if reply.get("id") == self._id:
                    if "error" in reply:
                        raise RuntimeError(f"{method}: {reply['error']}")
                    return reply.get("result", {})
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"Chromium did not answer {method} within {timeout} s")
            ready, _, _ = select.select([self._from], [], [], left)
            if ready:
                chunk = os.read(self._from, 1 << 20)
                if not chunk:
                    raise RuntimeError("Chromium closed its DevTools pipe")
                self._buf += chunk

    def evaluate(self, expression: str):
        r = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        return r.get("result", {}).get("value")

    def wait_for(self, expression: str, timeout: float = 30.0, every: float = 0.02):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            v = self.evaluate(expression)
            if v:
                return v
            time.sleep(every)
        raise TimeoutError(f"the page never satisfied {expression!r}")

    def open(self, url: str) -> None:
        target = self.send("Target.createTarget", {"url": url})["targetId"]
        self.session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        self.send("Page.enable")
        self.send("Runtime.enable")

    def type_text(self, text: str) -> None:
        for ch in text:
            self.send("Input.dispatchKeyEvent", {"type": "keyDown", "text": ch, "key": ch, "unmodifiedText": ch})
            self.send("Input.dispatchKeyEvent", {"type": "keyUp", "key": ch})

    def press_enter(self) -> None:
        for kind in ("keyDown", "keyUp"):
            self.send("Input.dispatchKeyEvent", {"type": kind, "key": "Enter", "code": "Enter",
                                                 "windowsVirtualKeyCode": 13, "nativeVirtualKeyCode": 13,
                                                 **({"text": "\r"} if kind == "keyDown" else {})})

    def close(self) -> None:
        try:
            self.session = None
            self.send("Browser.close", timeout=5)
        except Exception:  # noqa: BLE001 - killed below
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        os.close(self._to)
        os.close(self._from)
        shutil.rmtree(self.profile, ignore_errors=True)


@pytest.fixture(scope="module")
def page_server(own_cb_graph, tmp_path_factory):
    from qeff_kv.serve.config import ServeConfig
    from qeff_kv.serve.server import build_engine, text_facts

    folder = chat_export(own_cb_graph, tmp_path_factory.mktemp("page") / "tiny-chat")
    config = ServeConfig(export_dir=str(folder), api_key=KEY)
    engine = build_engine(config)
    srv = LiveServer(engine, text_facts(config), api_key=KEY)
    srv.slow, srv.folder, srv.text = SlowDecode(engine.session), folder, text_facts(config)
    yield srv
    srv.stop()


def test_chat_page_streams_an_answer(page_server):
    from qeff_kv.runtime import Session

    question = "Hi there"
    max_tokens = 24
    text = page_server.text
    ids = text.tokenizer.encode(text.chat_template.render([{"role": "user", "content": question}]),
                                add_special_tokens=False).ids
    ref = Session(page_server.folder, max_sequences=1)
    [g] = ref.generate([list(ids)], max_new_tokens=max_tokens)
    toks = g.tokens[:-1] if g.finish_reason == "stop" else g.tokens
    want = text.tokenizer.decode(toks, skip_special_tokens=True)

    page_server.slow.delay = 0.04   # about a second of streaming: partial answers are visible in the DOM
    browser = Browser()
    try:
        browser.open(f"{page_server.url}/?key={KEY}&max={max_tokens}")
        browser.wait_for("document.readyState === 'complete' && "
                         "document.getElementById('model').textContent.startsWith('tiny-chat')")
        browser.evaluate("document.getElementById('q').focus()")
        browser.type_text(question)
        assert browser.evaluate("document.getElementById('q').value") == question
        browser.press_enter()
        seen = set()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            state, partial = browser.evaluate(
                "[document.body.dataset.state, (document.getElementById('answer') || {}).textContent || '']")
            seen.add(partial)
            if state in ("done", "error"):
                break
            time.sleep(0.01)
        ARTIFACTS.mkdir(exist_ok=True)
        shot = browser.send("Page.captureScreenshot", {"format": "png"})["data"]
        (ARTIFACTS / "serve-chat-page.png").write_bytes(base64.b64decode(shot))
        assert state == "done", browser.evaluate("document.getElementById('log').textContent")
        answer = browser.evaluate("document.getElementById('answer').textContent")
        bubbles = browser.evaluate("[...document.querySelectorAll('.msg')].map(e => e.className + ':' + e.textContent)")
    finally:
        page_server.slow.delay = 0.0
        browser.close()
    assert answer == want
    assert bubbles == [f"msg user:{question}", f"msg assistant:{want}"]
    # streamed: the DOM showed the answer growing, not only at the end
    assert any(0 < len(p) < len(want) and want.startswith(p) for p in seen), seen
    assert (ARTIFACTS / "serve-chat-page.png").stat().st_size > 1000
