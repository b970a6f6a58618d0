"""KV cache events in vLLM's format (serve/kv_events.py, ``qeff-kv serve --kv-events``).

The subscriber here reads the wire as vLLM's example subscriber (examples/online_serving/kv_events_subscriber.py)
does: a SUB socket subscribed to the topic, ``recv_multipart`` into ``[topic, seq, payload]``, the sequence number
an 8-byte big-endian int that grows by one, the payload a msgpack ``[ts, events, data_parallel_rank]`` whose
events are tagged arrays. Requests are served through the HTTP server over a real engine.
"""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys
import time

import pytest

zmq = pytest.importorskip("zmq", reason="KV events need pyzmq (the [serve] extra)")
msgpack = pytest.importorskip("msgpack", reason="KV events need msgpack (the [serve] extra)")

from qeff_kv.errors import RuntimeInputError  # noqa: E402
from qeff_kv.serve.cluster.kv_events import (BlockTable, KVEventPublisher, block_hash, block_hashes,  # noqa: E402
                                     check_endpoint)
from serve_helpers import LiveServer, free_port  # noqa: E402

BS = 4


class Subscriber:
    """vLLM's example subscriber's decoding: SUB + topic, [topic, seq, payload], msgpack, increasing seq."""

    def __init__(self, endpoint: str, topic: str = "kv-events"):
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.connect(endpoint)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.topic = topic.encode()
        self.last_seq = -1
        self.batches = []
        time.sleep(0.3)   # the subscription reaches the publisher (ZeroMQ's slow joiner)

    def read(self, quiet: float = 0.5, gaps: bool = False) -> list:
        """Batches until none arrives for ``quiet`` seconds; each ``(seq, ts, events, rank)``."""
        got = []
        while self.sub.poll(int(quiet * 1000)):
            topic, seq_bytes, payload = self.sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            assert topic == self.topic and len(seq_bytes) == 8
            assert seq > self.last_seq and (gaps or self.last_seq < 0 or seq == self.last_seq + 1)
            self.last_seq = seq
            ts, events, rank = msgpack.unpackb(payload)
            assert isinstance(ts, float) and abs(ts - time.time()) < 60
            got.append((seq, ts, events, rank))
        self.batches += got
        return got

    def close(self):
        self.sub.close(linger=0)
        self.ctx.term()


def _events(batches, tag):
    return [e for _, _, events, _ in batches for e in events if e[0] == tag]


def _formula(parent, tokens):
    """The documented hash, written out again: SHA-256 over the parent marker and the tokens, first 8 bytes."""
    head = b"\x00" if parent is None else b"\x01" + parent.to_bytes(8, "big", signed=True)
    return int.from_bytes(hashlib.sha256(head + b"".join(t.to_bytes(4, "big") for t in tokens)).digest()[:8],
                          "big", signed=True)


# ------------------------------------------------------------------------------------------ the hash
def test_block_hash_is_the_documented_formula_and_chained():
    toks = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    h = block_hashes(toks, BS)
    assert len(h) == 2                                            # full blocks only
    assert h[0] == _formula(None, toks[:4]) and h[1] == _formula(h[0], toks[4:8])
    assert block_hash(None, toks[:4]) == h[0] and -2 ** 63 <= h[1] < 2 ** 63
    assert block_hashes([1, 2, 3, 4, 5, -1, 7, 8], BS) == [_formula(None, [1, 2, 3, 4])]   # stops at unknown ids
    assert block_hashes([9] + toks[1:], BS)[1] != h[1]            # a block's hash depends on its whole prefix


def test_block_hash_is_stable_across_processes():
    code = ("from qeff_kv.serve.cluster.kv_events import block_hashes; "
            "print(block_hashes(list(range(100, 164)), 16))")
    outs = []
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        outs.append(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                   check=True, timeout=60).stdout.strip())
    assert outs[0] == outs[1] == str(block_hashes(list(range(100, 164)), 16))


# ------------------------------------------------------------------------------------------ the block table
def test_block_table_counts_references_and_diffs_sequences():
    t = BlockTable(2)
    a = block_hashes([1, 2, 3, 4, 5], 2)
    assert t.holds(1, [1, 2, 3, 4, 5]) == [["BlockStored", a, None, [1, 2, 3, 4], 2, None, "GPU"]]
    b = block_hashes([1, 2, 3, 9], 2)
    assert b[0] == a[0]
    assert t.holds(2, [1, 2, 3, 9]) == [["BlockStored", [b[1]], a[0], [3, 9], 2, None, "GPU"]]   # shared: once
    assert t.holds(1, [1, 2, 3, 4, 5]) == []                      # nothing changed
    assert t.holds(1, [1, 2, 3, 4, 5, 6]) == [["BlockStored", [block_hashes([1, 2, 3, 4, 5, 6], 2)[2]], a[1],
                                                [5, 6], 2, None, "GPU"]]   # grew by a block
    assert t.holds(1, [1, 2, 3]) == [["BlockRemoved", [block_hashes([1, 2, 3, 4, 5, 6], 2)[2], a[1]], "GPU"]]
    assert t.holds(2, []) == [["BlockRemoved", [b[1]], "GPU"]]    # a[0] still held by sequence 1
    assert t.held() == {a[0]}
    assert t.holds(1, ()) == [["BlockRemoved", [a[0]], "GPU"]] and t.held() == set()
    assert t.clear() == [["AllBlocksCleared"]]
    with pytest.raises(RuntimeInputError, match="block-size must be a positive int, got 0"):
        BlockTable(0)


@pytest.mark.parametrize("endpoint", ["127.0.0.1:5557", "http://x:1", "tcp://host", "tcp://h:0", "tcp://h:x"])
def test_bad_endpoints_are_refused_in_one_line(endpoint):
    with pytest.raises(RuntimeInputError, match=r"^--kv-events '"):
        check_endpoint(endpoint)


def test_a_port_in_use_is_one_line():
    port = free_port()
    first = KVEventPublisher(f"tcp://127.0.0.1:{port}")
    try:
        with pytest.raises(RuntimeInputError, match=rf"^cannot bind tcp://127.0.0.1:{port} for KV events: "):
            KVEventPublisher(f"tcp://127.0.0.1:{port}")
    finally:
        first.close()


def test_a_full_queue_drops_the_oldest_batches_and_counts_them():
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    pub = KVEventPublisher(endpoint, max_queue=2)
    sub = Subscriber(endpoint)
    try:
        with pub._lock:   # the sender cannot take anything meanwhile: the queue fills
            for key in range(5):
                pub.table.holds(key, [])
                pub._enqueue([["BlockRemoved", [key], "GPU"]])
        got = sub.read(gaps=True)
        assert pub.dropped == 3
        assert [events for _, _, events, _ in got] == [[["BlockRemoved", [3], "GPU"]],
                                                        [["BlockRemoved", [4], "GPU"]]]
        assert [seq for seq, *_ in got] == [4, 5]                 # 1..3 were dropped: the gap shows it
    finally:
        pub.close()
        sub.close()


# ------------------------------------------------------------------------------------------ served requests
@pytest.fixture(scope="module")
def served(own_cb_graph):
    from qeff_kv.serve.config import ServeConfig
    from qeff_kv.serve.server import build_engine, check_config, text_facts

    port, replay = free_port(), free_port()
    config = ServeConfig(export_dir=str(own_cb_graph), kv_events=f"tcp://127.0.0.1:{port}",
                         kv_events_block_size=BS, kv_events_replay=f"tcp://127.0.0.1:{replay}")
    check_config(config)
    srv = LiveServer(build_engine(config), text_facts(config))
    srv.config = config
    yield srv
    srv.stop()


def _complete(served, ids, n=5):
    import httpx

    r = httpx.post(served.url + "/v1/completions", timeout=60,
                   json={"prompt": ids, "max_tokens": n, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def test_served_requests_publish_their_blocks_and_evictions(served):
    sub = Subscriber(served.config.events.kv_events)
    try:
        a = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49]
        _complete(served, a)
        stored = _events(sub.read(), "BlockStored")
        # after the prefill: the prompt's 2 full blocks; when kept: its 4 generated positions fill a third
        [seq] = [s for s in served.engine.prefix_cache.kept if s.tokens[:10] == a]
        held = list(seq.tokens)
        assert len(held) == 14
        chain = block_hashes(held, BS)
        assert stored[0] == ["BlockStored", chain[:2], None, a[:8], BS, None, "GPU"]
        assert stored[1] == ["BlockStored", chain[2:3], chain[1], held[8:12], BS, None, "GPU"]
        assert len(stored) == 2
        # a prompt sharing a's first 6 tokens: a's blocks are not stored again; its own third block is
        b = a[:6] + [70, 71, 72, 73, 74]
        first = _complete(served, b)
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 6
        got = sub.read()
        assert _events(got, "BlockRemoved") == []
        bseq = [s for s in served.engine.prefix_cache.kept if s.tokens[:11] == b][0]
        bchain = block_hashes(list(bseq.tokens), BS)
        new = [h for e in _events(got, "BlockStored") for h in e[1]]
        assert bchain[0] == chain[0] and bchain[0] not in new and set(new) == set(bchain[1:])
        # two more prompts fill the three slots, the next evicts a (least recently used): its blocks go
        for p in ([90, 91, 92, 93, 94, 95], [80, 81, 82, 83, 84, 85]):
            _complete(served, p)
        removed = [h for e in _events(sub.read(), "BlockRemoved") for h in e[1]]
        assert sorted(removed) == sorted(chain[1:])               # chain[0] is still b's first block
        assert all(s.tokens[:10] != a for s in served.engine.prefix_cache.kept)
        import httpx

        metrics = httpx.get(served.url + "/metrics", timeout=10).text
        assert f"qeff_kv_kv_events_batches_total {float(sub.last_seq + 1)}" in metrics
        assert "qeff_kv_kv_events_dropped_total 0.0" in metrics
    finally:
        sub.close()


def test_replay_returns_the_buffered_batches_from_a_sequence_number(served):
    """vLLM's replay protocol: [identity, b"", start] in; [identity, b"", seq, payload] per batch from ``start``,
    then the end marker (-1, b""). A DEALER client reads them all (a REQ client, as vLLM's example subscriber
    uses, reads the first reply of each request)."""
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(served.config.events.kv_events_replay)
    req = ctx.socket(zmq.REQ)
    req.connect(served.config.events.kv_events_replay)
    try:
        _complete(served, [20, 21, 22, 23, 24, 25, 26, 27, 28])
        time.sleep(0.3)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        got = []
        while dealer.poll(2000):
            empty, seq_bytes, payload = dealer.recv_multipart()
            assert empty == b""
            if not payload:
                assert int.from_bytes(seq_bytes, "big", signed=True) == -1
                break
            got.append((int.from_bytes(seq_bytes, "big"), msgpack.unpackb(payload)))
        assert got[0][0] == 0 and got[0][1][1] == [["AllBlocksCleared"]]   # start-up
        assert [s for s, _ in got] == list(range(len(got))) and len(got) > 1
        assert any(e[0] == "BlockStored" and e[3] == [20, 21, 22, 23, 24, 25, 26, 27]
                   for _, (_, events, _) in got for e in events)
        req.send((1).to_bytes(8, "big"))
        seq_bytes, payload = req.recv_multipart()
        assert int.from_bytes(seq_bytes, "big") == 1 and msgpack.unpackb(payload) == got[1][1]
    finally:
        dealer.close(linger=0)
        req.close(linger=0)
        ctx.term()


def test_prefill_replica_publishes_on_its_port(own_cb_graph):
    """--disaggregate: prefill replica i binds PORT + i and says its rank; the prefill worker's reuse drives it."""
    from qeff_kv.runtime import GREEDY
    from qeff_kv.serve.config import ServeConfig
    from qeff_kv.serve.cluster.disagg import PrefillWorker
    from qeff_kv.serve.engine.session_from_config import EngineSection

    port = free_port()
    config = ServeConfig(export_dir=str(own_cb_graph), kv_events=f"tcp://127.0.0.1:{port - 1}",
                         kv_events_block_size=BS)
    worker = PrefillWorker(str(own_cb_graph), EngineSection(threads=1), True, kv_events=(config.events, 1))
    sub = Subscriber(f"tcp://127.0.0.1:{port}")
    try:
        p = [30, 31, 32, 33, 34, 35, 36, 37, 38]
        t = worker.prefill("r", p, GREEDY)
        got = sub.read()
        assert {rank for *_, rank in got} == {1}
        assert _events(got, "BlockStored") == [["BlockStored", block_hashes(p, BS), None, p[:8], BS, None, "GPU"]]
        t2 = worker.prefill("r2", p[:5] + [50, 51, 52, 53, 54], GREEDY)
        assert t.cached_tokens == 0 and t2.cached_tokens == 5
        got = sub.read()
        new = block_hashes(p[:5] + [50, 51, 52, 53, 54], BS)
        assert _events(got, "BlockRemoved") == []                 # p stays (copied from, not truncated)
        assert _events(got, "BlockStored") == [["BlockStored", new[1:], new[0], [34, 50, 51, 52], BS, None, "GPU"]]
    finally:
        worker.kv_events.close()
        sub.close()
