"""A live ``qeff-kv serve`` for tests: uvicorn in a thread on a free 127.0.0.1 port, stopped at the end.

Used by tests/serve/test_serve*.py (one server per test module, on the tiny exports of tests/conftest.py).
"""

from __future__ import annotations

import json
import shutil
import socket
import threading
import time
from pathlib import Path

#: a short chat template (the tiny tokenizer spends one token per byte and the context holds 64)
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}a:{% endif %}")


def chat_export(src: Path, dst: Path) -> Path:
    """A copy of export folder ``src`` whose tokenizer_config.json carries :data:`CHAT_TEMPLATE`."""
    shutil.copytree(src, dst)
    cfg_path = dst / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(cfg))
    return dst


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SlowDecode:
    """Wraps a session's ``decode`` with a settable delay (seconds per step), so a test can hold requests
    running long enough to disconnect from them or fill the queue; 0 (the default) adds nothing."""

    def __init__(self, session):
        self.delay = 0.0
        self._decode = session.decode
        session.decode = self

    def __call__(self, feeds):
        if self.delay:
            time.sleep(self.delay)
        return self._decode(feeds)


class LiveServer:
    """``create_app`` over ``engine`` served by uvicorn in a thread; ``url``, ``stop()``."""

    def __init__(self, engine, text, **app_kwargs):
        import uvicorn

        from qeff_kv.serve.http.app import create_app
        from qeff_kv.serve.server import uvicorn_config

        self.engine = engine
        self.app = create_app(engine, text=text, **app_kwargs)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn_config(self.app, host="127.0.0.1", port=self.port,
                                                    timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)

    @classmethod
    def from_config(cls, config, **app_kwargs) -> "LiveServer":
        """The server ``qeff-kv serve`` would build from ``config`` (a ``ServeConfig``, checked), its
        ``TextFacts`` kept as ``text``."""
        from qeff_kv.serve.server import build_engine, check_config, text_facts

        check_config(config)
        srv = cls(build_engine(config), text_facts(config), **app_kwargs)
        srv.text = text_facts(config)
        return srv

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.engine.close()


def collect(handle, timeout: float = 120):
    """The token ids and the ``Finished`` event of a request handle's stream (every event checked for its kind)."""
    from qeff_kv.serve.engine.engine import Finished, TokenOut

    toks, fin = [], None
    for ev in handle.iter_sync(timeout=timeout):
        if isinstance(ev, TokenOut):
            toks.append(ev.token)
        else:
            assert isinstance(ev, Finished)
            fin = ev
    return toks, fin
