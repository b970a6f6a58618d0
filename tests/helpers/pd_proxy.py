"""A disaggregated prefill/decode proxy speaking vLLM's P/D protocol, as vLLM's own
``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py`` does (written here from the protocol; nothing copied):

1. the client's request goes to a prefill server (round robin) with ``kv_transfer_params = {"do_remote_decode":
   true, "do_remote_prefill": false, "remote_engine_id": null, "remote_block_ids": null, "remote_host": null,
   "remote_port": null}``, ``stream: false``, ``max_tokens: 1`` (and ``max_completion_tokens: 1`` where the request
   has it), without ``stream_options``, ``min_tokens`` and ``min_completion_tokens``, with an ``X-Request-Id`` header
   and ``Authorization: Bearer $OPENAI_API_KEY``;
2. the ``kv_transfer_params`` of its JSON answer, when there are any, replace the client request's own;
3. that request goes to a decode server (round robin) and its answer is streamed back as it comes.

Run: ``python tests/helpers/pd_proxy.py --prefiller-host 127.0.0.1 --prefiller-port 8100 --decoder-host 127.0.0.1
--decoder-port 8200 --port 8000`` (the options of vLLM's proxy), or :func:`make_app` in a test.
"""

from __future__ import annotations

import argparse
import itertools
import os
import uuid

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

PREFILL_ASK = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
               "remote_block_ids": None, "remote_host": None, "remote_port": None}


def make_app(prefill_urls: list[str], decode_urls: list[str]) -> FastAPI:
    """The proxy over servers at ``http://host:port`` base URLs."""
    app = FastAPI()
    prefill = [httpx.AsyncClient(base_url=u.rstrip("/") + "/v1", timeout=None) for u in prefill_urls]
    decode = [httpx.AsyncClient(base_url=u.rstrip("/") + "/v1", timeout=None) for u in decode_urls]
    turn = {"prefill": itertools.cycle(range(len(prefill))), "decode": itertools.cycle(range(len(decode)))}
    app.state.counts = {"requests": 0, "handed_off": 0}

    def headers(request_id: str) -> dict:
        return {"Authorization": f"Bearer {os.environ.get('OPENAI_API_KEY')}", "X-Request-Id": request_id}

    async def ask_prefill(client: httpx.AsyncClient, route: str, body: dict, request_id: str) -> dict:
        ask = dict(body, kv_transfer_params=dict(PREFILL_ASK), stream=False, max_tokens=1)
        if "max_completion_tokens" in ask:
            ask["max_completion_tokens"] = 1
        for key in ("stream_options", "min_tokens", "min_completion_tokens"):
            ask.pop(key, None)
        r = await client.post(route, json=ask, headers=headers(request_id))
        r.raise_for_status()
        return r.json()

    async def handle(route: str, request: Request):
        body = await request.json()
        request_id = str(uuid.uuid4())
        app.state.counts["requests"] += 1
        answer = await ask_prefill(prefill[next(turn["prefill"])], route, body, request_id)
        params = answer.get("kv_transfer_params") or {}
        body = dict(body)   # the client's own request (its min_tokens untouched: only the prefill ask drops them)
        if params:
            body["kv_transfer_params"] = params
            app.state.counts["handed_off"] += 1
        client = decode[next(turn["decode"])]

        async def relay():
            async with client.stream("POST", route, json=body, headers=headers(request_id)) as r:
                r.raise_for_status()
                async for chunk in r.aiter_bytes():
                    yield chunk

        return StreamingResponse(relay(), media_type="application/json")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle("/completions", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle("/chat/completions", request)

    @app.get("/healthcheck")
    async def healthcheck():
        return {"status": "ok", "prefill_instances": len(prefill), "decode_instances": len(decode)}

    return app


def main() -> None:
    import uvicorn

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--prefiller-hosts", "--prefiller-host", nargs="+", default=["127.0.0.1"])
    ap.add_argument("--prefiller-ports", "--prefiller-port", type=int, nargs="+", default=[8100])
    ap.add_argument("--decoder-hosts", "--decoder-host", nargs="+", default=["127.0.0.1"])
    ap.add_argument("--decoder-ports", "--decoder-port", type=int, nargs="+", default=[8200])
    a = ap.parse_args()
    if len(a.prefiller_hosts) != len(a.prefiller_ports) or len(a.decoder_hosts) != len(a.decoder_ports):
        ap.error("give one port per host")
    app = make_app([f"http://{h}:{p}" for h, p in zip(a.prefiller_hosts, a.prefiller_ports)],
                   [f"http://{h}:{p}" for h, p in zip(a.decoder_hosts, a.decoder_ports)])
    uvicorn.run(app, host=a.host, port=a.port)


if __name__ == "__main__":
    main()
