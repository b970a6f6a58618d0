"""The chat page's first paint and time to first token, in headless Chromium against ``qeff-kv serve``.

A ``qeff-kv serve EXPORT --no-prompt-reuse`` subprocess (every question prefilled in full, so runs are comparable),
then ``--runs`` rounds, each in a fresh Chromium profile (nothing cached):

* **page load**: ``first-paint`` and ``first-contentful-paint`` (the browser's Paint Timing entries) and the time
  until the header shows the model (the page's ``/health`` and ``/v1/models`` round trips done);
* **time to first token**: the question put into the input and sent; the page's own figure (``performance.now()``
  from the request to the first non-empty delta, what it shows under the answer) and its tokens/s; the same
  question again in a new chat of the same page (the browser warm); then the same chat request from a plain HTTP
  client (``bench_serve.stream_one``) for the page's overhead over a raw client.

Medians are reported; ``--out`` keeps every run as JSON, ``--screenshot`` the last page (look at it).

    python benchmarks/bench_page.py --export smollm2/ --runs 5 --threads 2 --out benchmarks/results/page.json \\
        --screenshot test-artifacts/bench-page.png
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "tests" / "helpers"))

from bench_serve import Server, free_port, say, stream_one  # noqa: E402
from cdp_browser import Browser, chromium_available  # noqa: E402

PAINTS = ("Object.fromEntries(performance.getEntriesByType('paint').map(e => [e.name, e.startTime]))")


def page_run(url: str, question: str, max_tokens: int) -> dict:
    browser = Browser()
    try:
        browser.open(url + f"/?max={max_tokens}&temp=0")
        t_model = browser.wait_for("document.getElementById('model').dataset.id && performance.now()", timeout=60)
        paints = browser.wait_for(f"(() => {{ const p = {PAINTS}; return p['first-contentful-paint'] && p; }})()")
        nav = browser.evaluate("performance.getEntriesByType('navigation')[0].toJSON()")
        stats = ask(browser, question)
        browser.evaluate("document.getElementById('new').click(); true")   # the same question in a new chat
        browser.wait_for("document.querySelectorAll('#log .msg').length === 0")
        again = ask(browser, question)
        text = browser.evaluate("JSON.parse(localStorage.getItem('qeff-kv.chats'))[0].messages[1].content")
        return {"first_paint_ms": paints.get("first-paint"),
                "first_contentful_paint_ms": paints["first-contentful-paint"],
                "dom_content_loaded_ms": nav["domContentLoadedEventEnd"], "model_shown_ms": t_model,
                "ttft_ms": float(stats["ttftMs"]), "ttft_again_ms": float(again["ttftMs"]),
                "tokens_per_s": float(stats["tokensPerS"]) if stats.get("tokensPerS") else None,
                "text": text, "browser": browser}
    except BaseException:
        browser.close()
        raise


def ask(browser: Browser, question: str) -> dict:
    """Sends ``question`` from the page; the answer's stats as the page shows them (``ttftMs``, ``tokensPerS``)."""
    browser.evaluate(f"document.getElementById('q').value = {json.dumps(question)}; "
                     "document.getElementById('composer').requestSubmit(); true")
    state = browser.wait_for("['done', 'error'].includes(document.body.dataset.state) && "
                             "document.body.dataset.state", timeout=600)
    if state != "done":
        raise RuntimeError(browser.evaluate("document.getElementById('log').textContent"))
    return browser.evaluate("Object.assign({}, document.querySelector('#answer .stats').dataset)")


def median(runs: list[dict], key: str) -> float | None:
    vals = [r[key] for r in runs if r.get(key) is not None]
    return round(statistics.median(vals), 1) if vals else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--export", required=True, type=Path)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--question", default="Write a Python function that adds two numbers.")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--screenshot", type=Path)
    args = ap.parse_args()
    if not chromium_available():
        sys.exit("no Chromium (apt-get install chromium, or set QEFF_KV_CHROMIUM)")
    port = free_port()
    argv = [str(REPO / ".venv/bin/qeff-kv"), "serve", str(args.export), "--port", str(port), "--no-prompt-reuse",
            "--max-sequences", "1"] + (["--threads", str(args.threads)] if args.threads else [])
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench_page_{port}.log"
    server = Server(argv, port, log)
    runs = []
    try:
        stream_one(server.url, args.question, 4, None)   # warm-up: the first request's one-time costs
        for k in range(args.runs):
            r = page_run(server.url, args.question, args.max_tokens)
            browser = r.pop("browser")
            if k == args.runs - 1 and args.screenshot:
                browser.screenshot(args.screenshot)
            browser.close()
            raw = stream_one(server.url, args.question, args.max_tokens, None)
            r["raw_client_ttft_ms"] = raw["ttft"] * 1000
            r["same_text"] = raw["text"] == r.pop("text")
            say(f"run {k + 1}: first contentful paint {r['first_contentful_paint_ms']:.0f} ms, model shown "
                f"{r['model_shown_ms']:.0f} ms, TTFT page {r['ttft_ms']:.0f} ms (again {r['ttft_again_ms']:.0f} ms)"
                f" / raw client "
                f"{r['raw_client_ttft_ms']:.0f} ms, {r['tokens_per_s'] or 0:.1f} tokens/s, same text {r['same_text']}")
            runs.append(r)
    finally:
        server.stop()
    summary = {key: median(runs, key) for key in ("first_paint_ms", "first_contentful_paint_ms",
                                                  "dom_content_loaded_ms", "model_shown_ms", "ttft_ms", "ttft_again_ms",
                                                  "raw_client_ttft_ms", "tokens_per_s")}
    summary["all_same_text"] = all(r["same_text"] for r in runs)
    result = {"export": str(args.export), "runs": runs, "median": summary, "question": args.question,
              "max_tokens": args.max_tokens, "threads": args.threads, "loadavg": os.getloadavg(),
              "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
