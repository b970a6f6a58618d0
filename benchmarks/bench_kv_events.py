"""What ``--kv-events`` costs the engine thread: one ``KVEventPublisher.holds`` call (serve/kv_events.py).

    python benchmarks/bench_kv_events.py [--tokens 1024] [--block-size 16] [--calls 200] [--rounds 5]

The engine thread calls ``holds(key, tokens)`` when a prompt is prefilled and when a finished sequence is kept;
it diffs that sequence's blocks (SHA-256 of the new ones only), updates the reference counts and queues one batch;
encoding and sending are the publisher thread's. Per case, the median over rounds of the time of one call, on a
publisher bound to a free 127.0.0.1 port with nobody subscribed (ZeroMQ drops unsubscribed messages at the
socket, so the sender thread runs as in production): a new sequence whose blocks are all new, a new sequence whose
blocks another sequence holds (a shared system prompt: refcounts only), a kept sequence grown by one block, and a
sequence removed. ``uptime``'s load average is printed.
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import statistics
import time

from qeff_kv.serve.cluster.kv_events import KVEventPublisher


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_round(pub: KVEventPublisher, prompt: list[int], calls: int, base: int, bs: int) -> dict[str, float]:
    def timed(fn) -> float:
        t0 = time.perf_counter()
        for k in range(calls):
            fn(k)
        return (time.perf_counter() - t0) / calls

    return {
        "new sequence, every block new": timed(lambda k: pub.holds(base + k, [base + k] + prompt[1:])),
        "new sequence, every block held by another": timed(lambda k: pub.holds(base + calls + k, prompt)),
        "kept sequence grown by one block": timed(lambda k: pub.holds(base + k, [base + k] + prompt[1:] + [7] * bs)),
        "sequence removed": timed(lambda k: pub.holds(base + k, ())),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    rng = random.Random(0)
    prompt = [rng.randrange(50_000) for _ in range(args.tokens)]
    pub = KVEventPublisher(f"tcp://127.0.0.1:{_port()}", block_size=args.block_size)
    try:
        pub.holds(-1, prompt)   # the shared prompt's blocks, held once
        rounds = [one_round(pub, prompt, args.calls, 10 * args.calls * (r + 1), args.block_size)
                  for r in range(args.rounds)]
    finally:
        pub.close()
    print(f"load average {os.getloadavg()[0]:.1f}; {args.tokens} tokens, blocks of {args.block_size}; "
          f"batches {pub.stats()['kv_events_batches']}, dropped {pub.dropped}")
    for case in rounds[0]:
        print(f"{case:45s} {statistics.median(r[case] for r in rounds) * 1e6:8.0f} us per call")


if __name__ == "__main__":
    main()
