"""Headless Chromium driven over the DevTools protocol, for the chat-page tests and benchmarks/bench_page.py.

The protocol runs over ``--remote-debugging-pipe`` (JSON messages ending in NUL on file descriptors 3 and 4): no
websocket client needed, nothing beyond the standard library. Input goes through ``Input.dispatch*Event`` as a
person's would (keys typed one by one, mouse clicks at an element's centre, so a hidden or covered button cannot be
clicked).
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

CHROMIUM = os.environ.get("QEFF_KV_CHROMIUM", "/usr/bin/chromium")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--remote-debugging-pipe"]


def chromium_available() -> bool:
    return Path(CHROMIUM).is_file() and os.access(CHROMIUM, os.X_OK)


class Browser:
    """Headless Chromium (a fresh profile) and a DevTools-protocol connection over its pipe; one page at a time."""

    def __init__(self, width: int = 1000, height: int = 700):
        self.profile = tempfile.mkdtemp(prefix="qeff-kv-chromium-")
        to_r, self._to = os.pipe()       # we write commands, Chromium reads fd 3
        self._from, from_w = os.pipe()   # Chromium writes fd 4, we read
        self.proc = subprocess.Popen(
            ["bash", "-c", f'exec "$0" "$@" 3<&{to_r} 4>&{from_w}', CHROMIUM, f"--user-data-dir={self.profile}",
             *FLAGS, f"--window-size={width},{height}", "about:blank"],
            pass_fds=(to_r, from_w), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_r)
        os.close(from_w)
        self._buf = b""
        self._id = 0
        self.session: str | None = None
        self.events: list[dict] = []     # protocol events seen while waiting for replies (console, dialogs, ...)

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
                if "method" in reply:
                    self.events.append(reply)
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"Chromium did not answer {method} within {timeout} s")
            ready, _, _ = select.select([self._from], [], [], left)
            if ready:
                chunk = os.read(self._from, 1 << 20)
                if not chunk:
                    raise RuntimeError("Chromium closed its DevTools pipe")
                self._buf += chunk

    def evaluate(self, expression: str, await_promise: bool = False):
        r = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                           "awaitPromise": await_promise})
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expression!r} threw: {r['exceptionDetails'].get('exception', r['exceptionDetails'])}")
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
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        self.send("Page.enable")
        self.send("Runtime.enable")
        self.send("Page.navigate", {"url": url})
        self.wait_for("document.readyState === 'complete' && location.href !== 'about:blank'")

    def reload(self) -> None:
        self.evaluate("window.__reloading = 1")
        self.send("Page.reload", {"ignoreCache": True})
        self.wait_for("document.readyState === 'complete' && window.__reloading === undefined")

    def type_text(self, text: str) -> None:
        for ch in text:
            if ch == "\n":   # Shift+Enter: a new line in the page's input
                self.press_enter(shift=True)
                continue
            self.send("Input.dispatchKeyEvent", {"type": "keyDown", "text": ch, "key": ch, "unmodifiedText": ch})
            self.send("Input.dispatchKeyEvent", {"type": "keyUp", "key": ch})

    def press_enter(self, shift: bool = False) -> None:
        for kind in ("keyDown", "keyUp"):
            self.send("Input.dispatchKeyEvent", {"type": kind, "key": "Enter", "code": "Enter",
                                                 "windowsVirtualKeyCode": 13, "nativeVirtualKeyCode": 13,
                                                 "modifiers": 8 if shift else 0,
                                                 **({"text": "\r"} if kind == "keyDown" else {})})

    def click(self, selector: str) -> None:
        """A mouse click at the centre of the first element matching ``selector``; refused (RuntimeError) when the
        element is not shown or another element covers that point."""
        where = self.evaluate(f"""(() => {{
            const el = document.querySelector({json.dumps(selector)});
            if (!el) return 'missing';
            const r = el.getBoundingClientRect();
            if (!r.width || !r.height) return 'not shown';
            const x = r.left + r.width / 2, y = r.top + r.height / 2;
            if (x < 0 || y < 0 || x > innerWidth || y > innerHeight) return 'outside the viewport';
            const hit = document.elementFromPoint(x, y);
            if (hit !== el && !el.contains(hit)) return 'covered by ' + (hit ? hit.outerHTML.slice(0, 80) : 'nothing');
            return [x, y];
        }})()""")
        if not isinstance(where, list):
            raise RuntimeError(f"cannot click {selector}: {where}")
        x, y = where
        self.send("Input.dispatchMouseEvent", {"type": "mouseMoved", "x": x, "y": y})
        for kind in ("mousePressed", "mouseReleased"):
            self.send("Input.dispatchMouseEvent", {"type": kind, "x": x, "y": y, "button": "left", "clickCount": 1})

    def screenshot(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(self.send("Page.captureScreenshot", {"format": "png"})["data"]))
        return path

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
