"""The chat page at ``/`` in headless Chromium (tests/helpers/cdp_browser.py: the DevTools protocol over a pipe).

Against a live ``qeff-kv serve`` on the tiny chat export: a question typed key by key and sent with Enter, the answer
read from the DOM while it streams and when done (equal to the same chat prompt run alone, greedy); Stop cancels the
stream and the server frees the sequence (``/slots``, ``/metrics``); "New chat" during a stream stops it and the new
chat starts empty (the next request carries only the new question); the mark on an answer cut at ``max_tokens``;
conversations kept over a reload, switched and deleted; the API key asked for, remembered, and the header's error
gone once it works.

Against a stub OpenAI-compatible server (a test double at the HTTP layer: the page's own file, scripted answers):
an answer holding ``<img onerror>``, ``<script>`` and a ``javascript:`` link runs nothing and shows as text, while
its markdown (code block with a copy button, lists, table, emphasis) is rendered; after many turns the input stays
pinned in view.

Screenshots go to ``test-artifacts/serve-chat-*.png`` (git-ignored). Skips where Chromium is absent.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from cdp_browser import CHROMIUM, Browser, chromium_available  # noqa: E402
from suite import REPO  # noqa: E402
from serve_helpers import LiveServer, SlowDecode, chat_export  # noqa: E402

KEY = "page-key"
ARTIFACTS = REPO / "test-artifacts"


MODEL_SHOWN = "document.getElementById('model').textContent.startsWith('{name} · context')"
RECORD_BODIES = ("window.__bodies = []; const __f = window.fetch; window.fetch = (u, o) => "
                 "{ if (o && o.body) window.__bodies.push(JSON.parse(o.body)); return __f(u, o); }; true")


@pytest.fixture(scope="module")
def page_server(tmp_path_factory, request):
    if not chromium_available():     # before the tiny export is made: nothing to serve it to
        pytest.skip(f"no Chromium at {CHROMIUM} (set QEFF_KV_CHROMIUM)")
    own_cb_graph = request.getfixturevalue("own_cb_graph")
    from qeff_kv.serve.config import ServeConfig
    from qeff_kv.serve.server import build_engine, text_facts

    folder = chat_export(own_cb_graph, tmp_path_factory.mktemp("page") / "tiny-chat")
    config = ServeConfig(export_dir=str(folder), api_key=KEY)
    engine = build_engine(config)
    srv = LiveServer(engine, text_facts(config), api_key=KEY)
    srv.slow, srv.folder, srv.text = SlowDecode(engine.session), folder, text_facts(config)
    yield srv
    srv.stop()


@pytest.fixture
def browser():
    if not chromium_available():
        pytest.skip(f"no Chromium at {CHROMIUM} (set QEFF_KV_CHROMIUM)")
    b = Browser()
    yield b
    b.close()


def greedy_answer(srv, messages: list[dict], max_tokens: int, finish: list | None = None) -> str:
    """What the export answers to ``messages`` alone, greedy: the reference for the page's text (``finish``: gets
    the finish reason and the token count appended)."""
    from qeff_kv.runtime import Session

    text = srv.text
    ids = text.tokenizer.encode(text.chat_template.render(messages), add_special_tokens=False).ids
    ref = Session(srv.folder, max_sequences=1)
    [g] = ref.generate([list(ids)], max_new_tokens=max_tokens)
    toks = g.tokens[:-1] if g.finish_reason == "stop" else g.tokens
    if finish is not None:
        finish += [g.finish_reason, len(g.tokens)]
    return text.tokenizer.decode(toks, skip_special_tokens=True)


def server_json(srv, path: str):
    req = urllib.request.Request(srv.url + path, headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        body = r.read().decode()
    return json.loads(body) if path != "/metrics" else body


def cancelled_count(srv) -> float:
    m = re.search(r'^qeff_kv_requests_total\{outcome="cancelled"\} (\S+)$', server_json(srv, "/metrics"), re.M)
    return float(m.group(1)) if m else 0.0


def stored_chats(browser) -> list[dict]:
    return browser.evaluate("JSON.parse(localStorage.getItem('qeff-kv.chats') || '[]')")


def ask(browser, question: str) -> None:
    browser.evaluate("document.getElementById('q').focus()")
    browser.type_text(question)
    browser.press_enter()


def wait_state(browser, states=("done", "stopped", "error"), timeout: float = 60) -> str:
    return browser.wait_for(f"{json.dumps(list(states))}.includes(document.body.dataset.state) && "
                            "document.body.dataset.state", timeout=timeout)


def open_page(browser, srv, query: str = "", name: str = "tiny-chat") -> None:
    browser.open(f"{srv.url}/{query}")
    browser.wait_for(MODEL_SHOWN.format(name=name))


def test_the_pages_policy_allows_exactly_its_script():
    page = resources.files("qeff_kv.serve.http").joinpath("static/chat.html").read_text(encoding="utf-8")
    scripts = re.findall(r"<script>(.*?)</script>", page, re.S)
    assert len(scripts) == 1 and "<script" not in page.replace("<script>" + scripts[0] + "</script>", "")
    digest = base64.b64encode(hashlib.sha256(scripts[0].encode()).digest()).decode()
    [policy] = re.findall(r'<meta http-equiv="Content-Security-Policy" content="([^"]+)">', page)
    assert f"script-src 'sha256-{digest}';" in policy, f"put script-src 'sha256-{digest}' into the page's policy"
    assert "unsafe-inline" not in policy.split("script-src")[1].split(";")[0]
    assert "connect-src 'self'" in policy and "default-src 'none'" in policy


# ---------------------------------------------------------------------------------------------- the real server
def test_chat_page_streams_an_answer(page_server, browser):
    question, max_tokens = "Hi there", 24
    ref = []
    want = greedy_answer(page_server, [{"role": "user", "content": question}], max_tokens, ref)
    assert ref == ["length", max_tokens]    # the tiny model's greedy answer runs to the limit

    page_server.slow.delay = 0.04   # about a second of streaming: partial answers are visible in the DOM
    try:
        open_page(browser, page_server, f"?key={KEY}&max={max_tokens}&temp=0")
        browser.evaluate("document.getElementById('q').focus()")
        browser.type_text(question)
        assert browser.evaluate("document.getElementById('q').value") == question
        browser.press_enter()
        seen = set()
        deadline = time.monotonic() + 60
        state = None
        while time.monotonic() < deadline:
            state, partial = browser.evaluate(
                "[document.body.dataset.state, (document.querySelector('#answer .body') || {}).textContent || '']")
            seen.add(partial)
            if state in ("done", "error"):
                break
            time.sleep(0.01)
        browser.screenshot(ARTIFACTS / "serve-chat-page.png")
        assert state == "done", browser.evaluate("document.getElementById('log').textContent")
        answer, bubbles, stats = browser.evaluate(
            "[document.querySelector('#answer .body').textContent, "
            "[...document.querySelectorAll('.msg')].map(e => e.className + ':' + e.querySelector('.body').textContent),"
            " Object.assign({}, document.querySelector('#answer .stats').dataset)]")
    finally:
        page_server.slow.delay = 0.0
    assert answer == want
    assert bubbles == [f"msg user:{question}", f"msg assistant:{want}"]
    # streamed: the DOM showed the answer growing, not only at the end
    assert any(0 < len(p) < len(want) and want.startswith(p) for p in seen), seen
    # per-answer speed: time to first token and tokens/s measured by the page
    assert float(stats["ttftMs"]) > 0 and float(stats["tokensPerS"]) > 0, stats
    [chat] = stored_chats(browser)
    assert [(m["role"], m["content"]) for m in chat["messages"]] == [("user", question), ("assistant", want)]
    assert (chat["messages"][1]["finish"], chat["messages"][1]["stats"]["tokens"]) == ("length", max_tokens)


def test_stop_cancels_the_stream_and_frees_the_slot(page_server, browser):
    before = cancelled_count(page_server)
    page_server.slow.delay = 0.2
    try:
        open_page(browser, page_server, f"?key={KEY}&max=50&temp=0")
        ask(browser, "Hi there")
        browser.wait_for("(document.querySelector('#answer .body') || {}).textContent.length >= 3")
        assert browser.evaluate("document.body.dataset.state") == "streaming"
        assert server_json(page_server, "/health")["sequences_active"] == 1
        browser.screenshot(ARTIFACTS / "serve-chat-streaming.png")   # the Stop button in place of Send
        browser.click("#stop")
        assert wait_state(browser, timeout=10) == "stopped"
        shown = browser.evaluate("document.querySelector('#answer .body').textContent")
        # the server notices the closed connection and frees the sequence
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            busy = [s for s in server_json(page_server, "/slots") if s["state"] == "busy"]
            if not busy and cancelled_count(page_server) == before + 1:
                break
            time.sleep(0.1)
        assert busy == [], busy
        assert cancelled_count(page_server) == before + 1
        assert server_json(page_server, "/health")["sequences_active"] == 0
    finally:
        page_server.slow.delay = 0.0
    assert browser.evaluate("document.querySelector('#answer').dataset.finish") == "stopped"
    assert browser.evaluate("document.querySelector('#answer .badge.stopped').textContent") == "stopped"
    assert browser.evaluate("getComputedStyle(document.getElementById('send')).display !== 'none' && "
                            "!document.getElementById('send').disabled")
    [chat] = stored_chats(browser)
    assert chat["messages"][1]["finish"] == "stopped"
    assert chat["messages"][1]["content"] == shown and 3 <= len(shown) < 50


def test_a_reload_during_a_stream_keeps_what_was_saved_and_frees_the_slot(page_server, browser):
    want = greedy_answer(page_server, [{"role": "user", "content": "Hi there"}], 50)
    before = cancelled_count(page_server)
    page_server.slow.delay = 0.2
    try:
        open_page(browser, page_server, f"?key={KEY}&max=50&temp=0")
        ask(browser, "Hi there")
        # the page saves a streaming answer about once a second
        browser.wait_for("(document.querySelector('#answer .body') || {}).textContent.length >= 10")
        browser.reload()
        browser.wait_for(MODEL_SHOWN.format(name="tiny-chat"))
        deadline = time.monotonic() + 10
        while cancelled_count(page_server) != before + 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert cancelled_count(page_server) == before + 1
        assert [s for s in server_json(page_server, "/slots") if s["state"] == "busy"] == []
    finally:
        page_server.slow.delay = 0.0
    [chat] = stored_chats(browser)
    kept = chat["messages"][1]
    assert kept["finish"] == "stopped" and "pending" not in kept
    assert 0 < len(kept["content"]) < len(want) and want.startswith(kept["content"])
    assert browser.evaluate("[document.body.dataset.state, document.querySelector('#answer').dataset.finish, "
                            "document.querySelector('#answer .body').textContent]") == ["idle", "stopped",
                                                                                          kept["content"]]


def test_new_chat_during_a_stream_stops_it_and_starts_empty(page_server, browser):
    first, second, max_tokens = "Hi there", "Why?", 12
    want = greedy_answer(page_server, [{"role": "user", "content": second}], max_tokens)
    page_server.slow.delay = 0.15
    try:
        open_page(browser, page_server, f"?key={KEY}&max=50&temp=0")
        browser.evaluate(RECORD_BODIES)
        ask(browser, first)
        browser.wait_for("(document.querySelector('#answer .body') || {}).textContent.length >= 2")
        browser.click("#new")
        browser.wait_for("document.body.dataset.state === 'stopped'", timeout=10)
        assert browser.evaluate("document.querySelectorAll('#log .msg').length") == 0
        assert browser.evaluate("!document.getElementById('send').disabled")
    finally:
        page_server.slow.delay = 0.0
    browser.click("#toggle-settings")
    browser.evaluate(f"document.getElementById('max').value = '{max_tokens}'; true")
    ask(browser, second)
    assert wait_state(browser) == "done"
    bodies = browser.evaluate("window.__bodies")
    assert [b["messages"] for b in bodies] == [[{"role": "user", "content": first}],
                                               [{"role": "user", "content": second}]]
    assert bodies[1]["temperature"] == 0 and bodies[1]["max_tokens"] == max_tokens
    assert browser.evaluate("document.querySelector('#answer .body').textContent") == want
    chats = stored_chats(browser)
    assert [[(m["role"], m.get("finish")) for m in c["messages"]] for c in chats] == [
        [("user", None), ("assistant", "stopped")], [("user", None), ("assistant", chats[1]["messages"][1]["finish"])]]
    assert chats[1]["messages"][1]["content"] == want


def test_an_answer_cut_at_max_tokens_is_marked(page_server, browser):
    open_page(browser, page_server, f"?key={KEY}&max=4&temp=0")
    ask(browser, "Hi there")
    assert wait_state(browser) == "done"
    assert browser.evaluate("document.querySelector('#answer').dataset.finish") == "length"
    assert browser.evaluate("document.querySelector('#answer .badge.cut').textContent") == \
        "cut at the max tokens limit (4)"
    assert browser.evaluate("document.querySelector('#answer .stats').textContent").startswith("4 tokens")


def test_conversations_are_kept_listed_switched_and_deleted(page_server, browser):
    open_page(browser, page_server, f"?key={KEY}&max=6&temp=0")
    ask(browser, "Hi")
    assert wait_state(browser) == "done"
    ask(browser, "Ok")                      # a second turn in the same conversation
    assert wait_state(browser) == "done"
    shown = ("[...document.querySelectorAll('#log .msg')].map(e => [e.className, e.dataset.finish || '', "
             "e.querySelector('.body').innerHTML, (e.querySelector('.meta') || {}).textContent || ''])")
    first_log = browser.evaluate(shown)
    assert len(first_log) == 4 and [m[1] for m in first_log] == ["", "length", "", "length"]
    browser.click("#new")
    ask(browser, "Yo")
    assert wait_state(browser) == "done"
    browser.reload()
    browser.wait_for(MODEL_SHOWN.format(name="tiny-chat"))
    titles = browser.evaluate("[...document.querySelectorAll('#chats .open')].map(b => b.textContent)")
    assert titles == ["Yo", "Hi"]           # the newest first; the current one stays shown after the reload
    assert browser.evaluate("[...document.querySelectorAll('#log .msg.user')].map(e => e.textContent)") == ["Yo"]
    browser.click("#chats li:nth-child(2) .open")
    browser.wait_for("document.querySelectorAll('#log .msg').length === 4")
    assert browser.evaluate(shown) == first_log
    browser.screenshot(ARTIFACTS / "serve-chat-conversations.png")
    browser.click("#chats li:nth-child(1) .delete")        # delete "Yo" (not the one shown)
    assert browser.evaluate("[...document.querySelectorAll('#chats .open')].map(b => b.textContent)") == ["Hi"]
    assert [c["title"] for c in stored_chats(browser)] == ["Hi"]
    browser.click("#chats li:nth-child(1) .delete")        # delete the one shown: the log empties
    assert browser.evaluate("document.querySelectorAll('#log .msg').length") == 0
    assert stored_chats(browser) == []


def test_api_key_asked_for_remembered_and_the_error_cleared(page_server, browser):
    browser.open(f"{page_server.url}/")
    status = browser.wait_for("document.getElementById('status').textContent")
    assert status.startswith("invalid or missing API key")
    assert browser.evaluate("document.body.classList.contains('show-settings')")   # the field is shown
    browser.evaluate("document.getElementById('key').focus()")
    browser.type_text(KEY)
    browser.click("#q")                     # leaving the field applies the key
    browser.wait_for(MODEL_SHOWN.format(name="tiny-chat"))
    assert browser.evaluate("document.getElementById('status').textContent") == ""
    browser.screenshot(ARTIFACTS / "serve-chat-settings.png")
    browser.reload()
    browser.wait_for(MODEL_SHOWN.format(name="tiny-chat"))
    assert browser.evaluate("document.getElementById('key').value") == KEY
    assert browser.evaluate("document.getElementById('status').textContent") == ""
    browser.evaluate("document.getElementById('max').value = '3'")
    ask(browser, "Hi")
    assert wait_state(browser) == "done"


# ---------------------------------------------------------------------------------------------- a stub server
class StubOpenAI:
    """An OpenAI-compatible stub serving the page's own file and answering every chat request with ``answer``
    (streamed in ``chunk``-character deltas), ``finish`` as its finish reason."""

    def __init__(self):
        self.answer, self.finish, self.chunk = "", "stop", 7
        self.error: str | None = None        # set: the next chat request fails with HTTP 400 and this message
        self.model_extra: dict = {}          # more fields of the model object in /v1/models
        self.cut_short = False               # end the stream after the text: no finish reason, no [DONE]
        self.requests: list[dict] = []
        page = resources.files("qeff_kv.serve.http").joinpath("static/chat.html").read_bytes()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _send(self, status: int, ctype: str, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path.split("?")[0] == "/":
                    self._send(200, "text/html; charset=utf-8", page)
                elif self.path == "/health":
                    self._send(200, "application/json", b'{"status": "ok", "model": "stub-model"}')
                elif self.path == "/v1/models":
                    self._send(200, "application/json", json.dumps(
                        {"object": "list", "data": [{"id": "stub-model", "object": "model",
                                                     "max_model_len": 4096, **stub.model_extra}]}).encode())
                else:
                    self._send(404, "application/json", b'{"error": {"message": "not found"}}')

            def do_POST(self):
                stub.requests.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                if stub.error is not None:
                    message, stub.error = stub.error, None
                    self._send(400, "application/json", json.dumps(
                        {"error": {"message": message, "type": "invalid_request_error"}}).encode())
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Connection", "close")
                self.end_headers()
                text = stub.answer
                for k in range(0, len(text), stub.chunk):
                    self._event({"choices": [{"index": 0, "delta": {"content": text[k:k + stub.chunk]},
                                              "finish_reason": None}]})
                if stub.cut_short:
                    self.close_connection = True
                    return
                self._event({"choices": [{"index": 0, "delta": {}, "finish_reason": stub.finish}]})
                self._event({"choices": [], "usage": {"completion_tokens": len(text)}})
                self.wfile.write(b"data: [DONE]\n\n")
                self.close_connection = True

            def _event(self, obj) -> None:
                self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
                self.wfile.flush()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stub():
    s = StubOpenAI()
    yield s
    s.stop()


HOSTILE = """Here is **bold**, *italic*, `inline <b>code</b>` and a [link](https://example.com/a?b=1&c=2).

<img src=x onerror="window.__pwned = 1">
<script>window.__pwned = 2</script>
[click me](javascript:window.__pwned=3) <a href="javascript:window.__pwned=4">a</a>
[x](https://e.com/" onmouseover="window.__pwned=5)

## Steps
1. first <b>item</b>
2. second
   - nested `x`

| col | <i>two</i> |
|-----|-----:|
| 1 | <svg onload="window.__pwned=6"> |

```html
<img src=x onerror="window.__pwned = 7">
```
```python
def f(x):  # add "one" </span><b>
    return x + 1.5, 'a<b'
```
> quoted <iframe src="javascript:window.__pwned=8">"""


def test_model_html_is_escaped_and_markdown_rendered(stub, browser):
    stub.answer = HOSTILE
    open_page(browser, stub, name="stub-model")
    browser.send("Browser.grantPermissions", {"origin": stub.url,
                                              "permissions": ["clipboardReadWrite", "clipboardSanitizedWrite"]})
    ask(browser, "show me")
    assert wait_state(browser) == "done"
    time.sleep(0.3)   # an onerror/onload handler would have run by now
    browser.screenshot(ARTIFACTS / "serve-chat-markdown.png")
    assert browser.evaluate("window.__pwned === undefined")
    body = "document.querySelector('#answer .body')"
    # no element from the model's text: only the renderer's own tags
    tags = set(browser.evaluate(f"[...{body}.querySelectorAll('*')].map(e => e.tagName.toLowerCase())"))
    assert tags <= {"p", "strong", "em", "code", "a", "br", "h2", "ol", "ul", "li", "table", "thead", "tbody", "tr",
                    "th", "td", "div", "span", "button", "pre", "blockquote"}, tags
    assert browser.evaluate(f"[...{body}.querySelectorAll('*')].flatMap(e => [...e.attributes].map(a => a.name))"
                            ".filter(n => !['class', 'type', 'href', 'target', 'rel', 'style'].includes(n))") == []
    hrefs = browser.evaluate(f"[...{body}.querySelectorAll('a')].map(a => a.getAttribute('href'))")
    assert hrefs == ["https://example.com/a?b=1&c=2", "https://e.com/"], hrefs   # javascript: never a link
    text = browser.evaluate(f"{body}.textContent")
    for raw in ('<img src=x onerror="window.__pwned = 1">', "<script>window.__pwned = 2</script>",
                "[click me](javascript:window.__pwned=3)", '<a href="javascript:window.__pwned=4">a</a>',
                '<svg onload="window.__pwned=6">', '<iframe src="javascript:window.__pwned=8">'):
        assert raw in text, raw
    # the markdown itself
    assert browser.evaluate(f"{body}.querySelector('strong').textContent") == "bold"
    assert browser.evaluate(f"{body}.querySelector('em').textContent") == "italic"
    assert browser.evaluate(f"{body}.querySelector('p code').textContent") == "inline <b>code</b>"
    assert browser.evaluate(f"{body}.querySelector('h2').textContent") == "Steps"
    assert browser.evaluate(f"[...{body}.querySelectorAll('ol > li')].length") == 2
    assert browser.evaluate(f"{body}.querySelector('ol li ul li code').textContent") == "x"
    assert browser.evaluate(f"[...{body}.querySelectorAll('th')].map(e => e.textContent)") == ["col", "<i>two</i>"]
    assert browser.evaluate(f"{body}.querySelector('.code pre code').textContent") == \
        '<img src=x onerror="window.__pwned = 7">'
    assert browser.evaluate(f"{body}.querySelector('.code-head span').textContent") == "html"
    # the python block: highlighted, its text unchanged
    py = f"{body}.querySelectorAll('.code')[1]"
    assert browser.evaluate(f"{py}.querySelector('code').textContent") == \
        "def f(x):  # add \"one\" </span><b>\n    return x + 1.5, 'a<b'"
    assert browser.evaluate(f"[...{py}.querySelectorAll('code span')].map(e => e.className + ' ' + e.textContent)") \
        == ["tok-keyword def", 'tok-comment # add "one" </span><b>', "tok-keyword return", "tok-number 1.5",
            "tok-string 'a<b'"]
    assert browser.evaluate(f"{body}.querySelector('blockquote').textContent") == \
        'quoted <iframe src="javascript:window.__pwned=8">'
    # and the page's policy would have stopped such HTML anyway: an inline handler inserted on purpose does not run
    browser.evaluate("document.body.insertAdjacentHTML('beforeend', '<img src=x onerror=\"window.__csp = 1\">'); true")
    time.sleep(0.3)
    assert browser.evaluate("window.__csp === undefined")
    browser.click("#answer .copy")
    browser.wait_for("document.querySelector('#answer .copy').textContent === 'Copied'")
    assert browser.evaluate("navigator.clipboard.readText()", await_promise=True) == \
        '<img src=x onerror="window.__pwned = 7">'      # the code as the model wrote it
    # the stored conversation keeps the raw text
    assert stored_chats(browser)[0]["messages"][1]["content"] == HOSTILE


def test_input_stays_pinned_after_many_turns(stub, browser):
    stub.answer = "A longer answer.\n\n" + "\n".join(f"- point {k}: some words to fill the line" for k in range(6))
    open_page(browser, stub, "?system=Be%20brief&temp=0.7&top_p=0.9&seed=7&max=200", name="stub-model")
    for turn in range(12):
        ask(browser, f"question {turn}")
        assert wait_state(browser) == "done"
        browser.wait_for("!document.getElementById('send').disabled")
    assert browser.evaluate("document.querySelectorAll('#log .msg').length") == 24
    rect = browser.evaluate("(() => { const r = document.getElementById('q').getBoundingClientRect(); "
                            "return [r.top, r.bottom, innerHeight]; })()")
    assert 0 < rect[0] and rect[1] <= rect[2], rect          # the input is inside the viewport
    assert browser.evaluate("document.scrollingElement.scrollTop") == 0          # the page itself does not scroll
    assert browser.evaluate("(() => { const l = document.getElementById('log'); "
                            "return l.scrollHeight > l.clientHeight && "
                            "l.scrollHeight - l.scrollTop - l.clientHeight < 2; })()")   # the log scrolled to the end
    browser.click("#q")
    browser.screenshot(ARTIFACTS / "serve-chat-many-turns.png")
    last = stub.requests[-1]
    assert last["messages"][0] == {"role": "system", "content": "Be brief"}
    assert len(last["messages"]) == 1 + 2 * 11 + 1
    assert (last["temperature"], last["top_p"], last["seed"], last["max_tokens"]) == (0.7, 0.9, 7, 200)
    assert last["stream"] is True and last["stream_options"] == {"include_usage": True}


def test_a_failed_turn_is_shown_but_not_sent_as_history(stub, browser):
    stub.model_extra = {"sampling_defaults": {"temperature": 0.6, "top_p": 0.95}}
    stub.answer = "fine"
    open_page(browser, stub, name="stub-model")
    # the server's defaults, as /v1/models reports them, are what an empty field means
    assert browser.evaluate("[document.getElementById('temp').placeholder, document.getElementById('top_p')"
                            ".placeholder]") == ["default 0.6", "default 0.95"]
    ask(browser, "one")
    assert wait_state(browser) == "done"
    stub.error = "top_p must be in (0, 1], got 7"
    ask(browser, "two")
    assert wait_state(browser) == "error"
    assert browser.evaluate("document.querySelector('#answer .badge.error').textContent") == \
        "error: top_p must be in (0, 1], got 7"
    assert browser.evaluate("!document.getElementById('send').disabled")
    ask(browser, "three")
    assert wait_state(browser) == "done"
    assert [m["content"] for m in stub.requests[-1]["messages"]] == ["one", "fine", "three"]
    assert "temperature" not in stub.requests[-1] and "top_p" not in stub.requests[-1]
    assert browser.evaluate("[...document.querySelectorAll('#log .msg .body')].map(e => e.textContent)") == \
        ["one", "fine", "two", "", "three", "fine"]
    # Regenerate: the last answer asked for again with the same history, in its place
    stub.answer = "better"
    browser.click("#answer .regen")
    assert wait_state(browser) == "done"
    assert stub.requests[-1]["messages"] == stub.requests[-2]["messages"]
    assert browser.evaluate("[...document.querySelectorAll('#log .msg .body')].map(e => e.textContent)") == \
        ["one", "fine", "two", "", "three", "better"]
    assert browser.evaluate("document.querySelectorAll('#log .regen').length") == 1
    # a stream that ends without its finish reason (the connection lost) is an error, not a finished answer
    stub.cut_short = True
    ask(browser, "four")
    assert wait_state(browser) == "error"
    assert browser.evaluate("[document.querySelector('#answer .body').textContent, "
                            "document.querySelector('#answer .badge.error').textContent]") == \
        ["better", "error: the stream ended without a finish reason (connection lost?)"]
    # and Regenerate on a failed answer is a retry: the question once, the failed answer not in the history
    stub.cut_short = False
    browser.click("#answer .regen")
    assert wait_state(browser) == "done"
    assert [m["content"] for m in stub.requests[-1]["messages"]] == ["one", "fine", "three", "better", "four"]
    assert browser.evaluate("document.querySelector('#answer .body').textContent") == "better"


def test_two_tabs_keep_each_others_conversations(stub, browser):
    stub.answer = "ok"
    open_page(browser, stub, name="stub-model")
    ask(browser, "from tab one")
    assert wait_state(browser) == "done"
    first_tab = browser.session
    open_page(browser, stub, name="stub-model")          # a second tab of the same origin
    browser.click("#new")
    ask(browser, "from tab two")
    assert wait_state(browser) == "done"
    browser.session = first_tab
    browser.wait_for("document.querySelectorAll('#chats li').length === 2")   # tab one saw tab two's chat
    ask(browser, "again from tab one")
    browser.wait_for("document.querySelectorAll('#log .msg').length === 4 && document.body.dataset.state === 'done'")
    chats = {c["title"]: [m["content"] for m in c["messages"]] for c in stored_chats(browser)}
    assert chats == {"from tab one": ["from tab one", "ok", "again from tab one", "ok"],
                     "from tab two": ["from tab two", "ok"]}


LINK = '<a href="{0}" target="_blank" rel="noopener noreferrer">{0}</a>'
MARKDOWN_CASES = [
    ("a_b_c and snake_case_name", "<p>a_b_c and snake_case_name</p>"),          # no emphasis inside words
    ("2 * 3 * 4 = 24", "<p>2 * 3 * 4 = 24</p>"),
    ("**unclosed and *half", "<p>**unclosed and *half</p>"),                     # what is still streaming
    ("`a*b*c` and *em*", "<p><code>a*b*c</code> and <em>em</em></p>"),
    ("x < y && z > \"q\" 's'", "<p>x &lt; y &amp;&amp; z &gt; &quot;q&quot; &#39;s&#39;</p>"),
    ("line1\nline2", "<p>line1<br>line2</p>"),
    ("- a\n- b\n\nafter", "<ul><li>a</li><li>b</li></ul><p>after</p>"),
    ("1. x\n\n2. y\n   more", "<ol><li>x</li><li>y<br>more</li></ol>"),
    ("3) three\n4) four", '<ol start="3"><li>three</li><li>four</li></ol>'),
    ("# T\n***\ntext", "<h1>T</h1><hr><p>text</p>"),
    ("see http://a.b/c?d=1&e=2.", f"<p>see {LINK.format('http://a.b/c?d=1&amp;e=2')}.</p>"),
    ("~~gone~~ ok", "<p><del>gone</del> ok</p>"),
    ("> q1\n> q2\n\np", "<blockquote><p>q1<br>q2</p></blockquote><p>p</p>"),
    ("a | b\n--|--\n1 | 2", "<table><thead><tr><th>a</th><th>b</th></tr></thead><tbody><tr><td>1</td><td>2</td></tr>"
                            "</tbody></table>"),
    ("```\ncode <b>", '<div class="code"><div class="code-head"><span>code</span><button type="button" class="copy">'
                      "Copy</button></div><pre><code>code &lt;b&gt;</code></pre></div>"),   # a fence not closed yet
]


def test_markdown_renderer_cases(stub, browser):
    open_page(browser, stub, name="stub-model")
    got = browser.evaluate(f"{json.dumps([c for c, _ in MARKDOWN_CASES])}.map(renderMarkdown)")
    assert list(zip([c for c, _ in MARKDOWN_CASES], got)) == MARKDOWN_CASES


def test_the_pages_token_limit_is_the_servers_constant():
    from qeff_kv.serve.engine.defaults import PAGE_MAX_TOKENS

    page = resources.files("qeff_kv.serve.http").joinpath("static/chat.html").read_text(encoding="utf-8")
    assert f"const PAGE_MAX_TOKENS = {PAGE_MAX_TOKENS};" in page
    assert "if (body.max_tokens === undefined && pageMaxTokens !== null) body.max_tokens = pageMaxTokens;" in page


def test_the_page_sends_its_token_limit_when_the_server_has_none(stub, browser):
    """An empty max-tokens field and no server default: the page sends its own limit (serve/defaults.py's), so a
    small model sampling at the server's defaults cannot run for minutes."""
    from qeff_kv.serve.engine.defaults import PAGE_MAX_TOKENS

    stub.model_extra = {"sampling_defaults": {"temperature": 0.8, "max_tokens": None}}
    stub.answer = "fine"
    open_page(browser, stub, name="stub-model")
    ask(browser, "hi")
    assert wait_state(browser) == "done"
    assert stub.requests[-1]["max_tokens"] == PAGE_MAX_TOKENS
