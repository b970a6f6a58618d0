"""KV cache events in vLLM's format (``qeff-kv serve --kv-events tcp://HOST:PORT``): what a KV-aware router reads.

The wire (vLLM's ``ZmqEventPublisher``, what Ray Serve's KV-aware router, NVIDIA Dynamo's KV router and llm-d's
precise prefix-cache routing subscribe to): a ZeroMQ **PUB** socket bound to the endpoint; each message is three
frames ``[topic, seq, payload]``: ``topic`` (default ``kv-events``, the topic vLLM's example subscriber
subscribes to), ``seq`` an 8-byte big-endian sequence number (0 for the first message, +1 for each next),
``payload`` a msgpack ``KVEventBatch``: the array ``[ts, events, data_parallel_rank]`` (``ts`` seconds since the
epoch as a float; ``data_parallel_rank`` the replica's rank, 0 for the local engine), each event a tagged array:

* ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]``: blocks now held,
  in chain order; ``parent_block_hash`` the hash of the block before the first one (``None`` at the start of a
  sequence); ``token_ids`` the tokens of every listed block, concatenated; ``lora_id`` ``None`` for the base model,
  for a sequence of a LoRA adapter the adapter's ``lora_int_id`` (vLLM's integer id: ``--lora-modules`` in
  their order 1, 2, ..., adapters loaded at run time the next ones; ``/v1/models`` lists it); ``medium``
  ``"GPU"`` (vLLM's name for an engine's primary KV cache, where prefix hits are made, whatever the device);
* ``["BlockRemoved", block_hashes, medium]``: blocks no sequence holds any more;
* ``["AllBlocksCleared"]``: nothing is held (sent when the publisher starts: the server's start-up, a restarted
  prefill replica's).

**Blocks.** A sequence's valid positions are cut into blocks of ``block_size`` tokens (``--kv-events-block-size``,
default 16); only full blocks are published. A block is stored when a sequence's prompt is prefilled, when a kept
sequence grows (a finished request keeps its generated tokens too), when a state is restored into a slot or
handed to a decode replica; removed when the last sequence holding it is evicted, erased, destroyed, or
truncated below it (prompt reuse continuing a kept sequence from a shorter prefix). Several sequences holding
one block (one system prompt) count once: a reference count per block. The block positions of a recurrent or
hybrid sequence are published like any other, though prompt reuse there returns only to a checkpoint.

**Hash** (stable across processes, machines and Python versions; nothing random, no ``hash()``)::

    block_hash = int.from_bytes(SHA-256(parent || tokens)[:8], "big", signed=True)

where ``parent`` is ``b"\\x00"`` for a sequence's first block, else ``b"\\x01"`` followed by the parent block's
hash as 8 bytes big-endian (two's complement), and ``tokens`` are the block's token ids, each 4 bytes big-endian
unsigned. Hashes are int64 (msgpack ints, as vLLM's ``ExternalBlockHash`` int form). The first block of a sequence of a
LoRA adapter (whose KV differs from the base model's for the same tokens) has ``parent`` ``b"\\x02"`` followed by
the adapter's name in UTF-8 (its length first, 4 bytes big-endian) and its scale (8 bytes, a big-endian IEEE
double): as vLLM puts the adapter's name into its block hashes, the same tokens under two adapters (or two scales)
are different blocks, and one adapter's blocks hash alike on every server. Likewise a **quantized KV cache**
(``--kv-cache-dtype int8``/``int4``: the same tokens held in int8 are not the float cache's KV, and a decode replica
of another dtype refuses its state): the first block's ``parent`` is ``b"\\x03"`` followed by the cache dtype's name
in ASCII (its length first, 4 bytes big-endian) and then the head it would have otherwise (``b"\\x00"``, or the
adapter's ``b"\\x02..."``); a float cache (``float32``, ``float16``...) keeps the hashes above unchanged. The served
cache dtype is ``kv_cache_dtype`` in ``/v1/models``.

**Never slowing the engine.** The engine thread only diffs the blocks of the sequence it tells about (SHA-256 of
the new blocks only) and appends the batch to a bounded queue (:data:`MAX_QUEUE` batches); a background thread
encodes and sends. When the queue is full the oldest batch is dropped and :attr:`KVEventPublisher.dropped`
counts it (``qeff_kv_kv_events_dropped_total`` in ``/metrics``); its sequence number is then missing on the wire,
so a subscriber sees the gap (vLLM's example subscriber asks the replay socket for it; a dropped batch cannot be
replayed). Sequence numbers are given when a batch is queued.

**Replay** (``--kv-events-replay tcp://HOST:PORT``, vLLM's replay socket): a ROUTER socket; a client (REQ)
sends a sequence number as 8 bytes big-endian and gets every buffered batch from that number on, each as
``[seq, payload]``, then ``[-1 as 8 signed bytes, b""]`` (behind the ROUTER's ``[identity, b""]`` envelope). A
DEALER client reads them all; a REQ client (vLLM's example subscriber) reads the first reply of each request.
The last :data:`REPLAY_BUFFER` batches sent are buffered.
"""

from __future__ import annotations

import collections
import hashlib
import struct
import threading
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from qeff_kv.contract.layout import QUANTIZED_KV_DTYPES
from qeff_kv.errors import MissingDependencyError, RuntimeInputError

DEFAULT_BLOCK_SIZE = 16
DEFAULT_TOPIC = "kv-events"
#: vLLM's medium of an engine's primary KV cache
MEDIUM = "GPU"
#: batches waiting to be sent beyond which the oldest is dropped (and counted)
MAX_QUEUE = 10_000
#: batches kept for the replay socket
REPLAY_BUFFER = 10_000
#: the replay socket's end-of-replay sequence number
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def block_hash(parent: int | None, tokens: Seq[int], lora: tuple[str, float] | None = None,
               kv_dtype: str | None = None) -> int:
    """The chained hash of one block (see the module docstring); ``lora``: the adapter and scale of a sequence's
    first block; ``kv_dtype``: the cache's dtype, salting the first block of a quantized cache only."""
    if parent is not None:
        head = b"\x01" + int(parent).to_bytes(8, "big", signed=True)
    elif lora is not None:
        name = lora[0].encode("utf-8")
        head = b"\x02" + struct.pack(">I", len(name)) + name + struct.pack(">d", float(lora[1]))
    else:
        head = b"\x00"
    if parent is None and kv_dtype in QUANTIZED_KV_DTYPES:
        head = b"\x03" + struct.pack(">I", len(kv_dtype)) + kv_dtype.encode("ascii") + head
    digest = hashlib.sha256(head + struct.pack(f">{len(tokens)}I", *tokens)).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def block_hashes(tokens: Seq[int], block_size: int, parent: int | None = None,
                 lora: tuple[str, float] | None = None, kv_dtype: str | None = None) -> list[int]:
    """The hashes of the full blocks of ``tokens`` (up to the first unknown, negative, token id), chained from
    ``parent`` (``lora``: a sequence's adapter and scale, ``kv_dtype`` the cache's dtype, read for its first
    block)."""
    out = []
    for i in range(0, len(tokens) - block_size + 1, block_size):
        block = tokens[i:i + block_size]
        if min(block) < 0:
            break
        parent = block_hash(parent, block, lora, kv_dtype)
        out.append(parent)
    return out


def check_endpoint(endpoint: str, option: str = "--kv-events") -> str:
    """``tcp://HOST:PORT`` (``*`` for every interface), ``ipc://PATH`` or ``inproc://NAME``; else a one-line error."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep or scheme not in ("tcp", "ipc", "inproc") or not rest:
        raise RuntimeInputError(f"{option} {endpoint!r}: give tcp://HOST:PORT, ipc://PATH or inproc://NAME")
    if scheme == "tcp":
        host, colon, port = rest.rpartition(":")
        if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise RuntimeInputError(f"{option} {endpoint!r}: a tcp endpoint needs HOST:PORT with a port in "
                                    "[1, 65535]")
    return endpoint


def offset_endpoint(endpoint: str, rank: int) -> str:
    """The endpoint of replica ``rank``: a tcp port moved up by ``rank`` (vLLM's rule for data-parallel ranks),
    an ipc/inproc name suffixed ``_dp{rank}``."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return f"{base}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"


class BlockTable:
    """Which blocks each sequence holds and how many sequences hold each block; turns ``holds(key, tokens)``
    into the events of what changed (no socket, no thread: the publisher's bookkeeping, tested alone)."""

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE, kv_dtype: str | None = None):
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise RuntimeInputError(f"--kv-events-block-size must be a positive int, got {block_size!r}")
        self.block_size = block_size
        #: the served KV cache's dtype (a quantized one salts every sequence's first block; None: a float cache)
        self.kv_dtype = kv_dtype
        self._chains: dict[int, tuple] = {}   # key -> (its full blocks' tokens, hashes, its adapter)
        self._refs: collections.Counter[int] = collections.Counter()

    def holds(self, key: int, tokens: Seq[int], lora: tuple[str, float] | None = None,
              lora_id: int | None = None) -> list[list]:
        """Sequence ``key`` holds exactly ``tokens`` (computed with adapter and scale ``lora``, whose integer id is
        ``lora_id``; None: the base model): the events (BlockRemoved, then BlockStored) of blocks whose reference
        count left or reached zero."""
        bs = self.block_size
        old_tokens, old, old_lora = self._chains.get(key, ([], [], None))
        full = list(tokens[:len(tokens) // bs * bs])
        same = 0   # leading blocks unchanged
        while old_lora == lora and same < len(old) and same * bs + bs <= len(full) and \
                old_tokens[same * bs:same * bs + bs] == full[same * bs:same * bs + bs]:
            same += 1
        new = old[:same] + block_hashes(full[same * bs:], bs, old[same - 1] if same else None, lora, self.kv_dtype)
        full = full[:len(new) * bs]   # up to an unknown token id
        events = self._removed(old[same:])
        events += self._stored(new, same, full, lora_id)
        if new:
            self._chains[key] = (full, new, lora)
        else:
            self._chains.pop(key, None)
        return events

    def clear(self) -> list[list]:
        self._chains.clear()
        self._refs.clear()
        return [["AllBlocksCleared"]]

    def _removed(self, hashes: list[int]) -> list[list]:
        gone = []
        for h in reversed(hashes):
            self._refs[h] -= 1
            if self._refs[h] <= 0:
                del self._refs[h]
                gone.append(h)
        return [["BlockRemoved", gone, MEDIUM]] if gone else []

    def _stored(self, chain: list[int], start: int, tokens: list[int], lora_id: int | None = None) -> list[list]:
        """One BlockStored per run of consecutive blocks of ``chain[start:]`` that no sequence held before."""
        bs, events, run = self.block_size, [], None
        for i in range(start, len(chain)):
            self._refs[chain[i]] += 1
            if self._refs[chain[i]] > 1:
                run = None
                continue
            if run is None:
                run = ["BlockStored", [], chain[i - 1] if i else None, [], bs, lora_id, MEDIUM]
                events.append(run)
            run[1].append(chain[i])
            run[3].extend(tokens[i * bs:(i + 1) * bs])
        return events

    def held(self) -> set[int]:
        """Every block hash some sequence holds."""
        return set(self._refs)


@dataclass
class KVEventsSection:
    """The KV events section of the serve options (a section of :class:`qeff_kv.serve.config.ServeConfig`; present
    with ``--kv-events``): where the ZeroMQ PUB socket binds, and its blocks, topic and replay socket."""
    kv_events: str
    kv_events_block_size: int = DEFAULT_BLOCK_SIZE
    kv_events_topic: str = DEFAULT_TOPIC
    #: where the replay ROUTER socket binds, or None (no replay)
    kv_events_replay: str | None = None

    #: the field whose value turns the section on
    SWITCH = "kv_events"

    @staticmethod
    def refuse_without(given: list[str]) -> None:
        """Options of the section given while it is absent: the replay socket is refused (the block size and the
        topic are left unread)."""
        if "kv_events_replay" in given:
            raise RuntimeInputError("--kv-events-replay goes with --kv-events")

    def check(self) -> None:
        """``--kv-events*`` options, refused in one line before anything is loaded."""
        check_endpoint(self.kv_events)
        if self.kv_events_replay is not None:
            check_endpoint(self.kv_events_replay, "--kv-events-replay")
        BlockTable(self.kv_events_block_size)


def open_publisher(section: KVEventsSection | None, rank: int = 0,
                   kv_dtype: str | None = None) -> "KVEventPublisher | None":
    """The publisher the ``section`` asks for, for replica ``rank`` (its endpoints' ports moved up by ``rank``) of a
    KV cache of ``kv_dtype``, or None without ``--kv-events`` (no section)."""
    if section is None:
        return None
    replay = section.kv_events_replay
    return KVEventPublisher(offset_endpoint(section.kv_events, rank), block_size=section.kv_events_block_size,
                            topic=section.kv_events_topic, rank=rank, kv_dtype=kv_dtype,
                            replay_endpoint=None if replay is None else offset_endpoint(replay, rank))


class KVEventPublisher:
    """Publishes the :class:`BlockTable`'s events on a ZeroMQ PUB socket (see the module docstring); a
    :class:`~qeff_kv.runtime.memory.prefix_cache.CacheListener`. Binding fails at construction with a one-line error.

    Args:
        endpoint: where the PUB socket binds (``tcp://HOST:PORT``; ``tcp://*:PORT`` for every interface).
        block_size: tokens per block.
        topic: the first frame of every message.
        replay_endpoint: where the replay ROUTER socket binds, or None (no replay).
        rank: ``data_parallel_rank`` of every batch (the replica's index).
        kv_dtype: the served KV cache's dtype (``int8`` salts the block hashes; a float dtype or None does not).
    """

    def __init__(self, endpoint: str, *, block_size: int = DEFAULT_BLOCK_SIZE, topic: str = DEFAULT_TOPIC,
                 replay_endpoint: str | None = None, rank: int = 0, max_queue: int = MAX_QUEUE,
                 kv_dtype: str | None = None):
        try:
            import msgpack  # noqa: F401
            import zmq  # noqa: F401
        except ImportError as exc:
            raise MissingDependencyError(f"--kv-events needs pyzmq and msgpack (pip install 'qeff-kv[serve]'): "
                                         f"{exc}") from None
        self.endpoint = check_endpoint(endpoint)
        self.replay_endpoint = None if replay_endpoint is None else check_endpoint(replay_endpoint,
                                                                                   "--kv-events-replay")
        self.table = BlockTable(block_size, kv_dtype)
        self.topic = topic.encode("utf-8")
        self.rank = rank
        #: adapter name -> its ``lora_int_id`` (the server's :class:`~qeff_kv.serve.engine.lora.AdapterTable`
        #: ``lora_id``), or None: an adapter's blocks are published with ``lora_id`` None
        self.lora_ids = None
        #: batches dropped because the queue was full (their sequence numbers never appear on the wire)
        self.dropped = 0
        #: batches sent
        self.sent = 0
        self._queue: collections.deque = collections.deque(maxlen=max_queue)
        self._seq = 0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._ready = threading.Event()
        self._error: str | None = None
        self._thread = threading.Thread(target=self._run, name="qeff-kv-kv-events", daemon=True)
        self._thread.start()
        self._ready.wait(timeout=30)
        if self._error is not None:
            self._thread.join(timeout=5)
            raise RuntimeInputError(self._error)
        self.clear()   # a subscriber's view starts empty

    # ------------------------------------------------------------------------------------ CacheListener
    def holds(self, key: int, tokens: Seq[int], lora: tuple[str, float] | None = None) -> None:
        lora_id = self.lora_ids(lora[0]) if lora is not None and self.lora_ids is not None else None
        with self._lock:
            events = self.table.holds(key, tokens, lora, lora_id)
            if events:
                self._enqueue(events)

    def clear(self) -> None:
        with self._lock:
            self._enqueue(self.table.clear())

    def _enqueue(self, events: list) -> None:
        if len(self._queue) == self._queue.maxlen:
            self.dropped += 1   # deque(maxlen) drops the oldest on append
        self._queue.append((self._seq, [time.time(), events, self.rank]))
        self._seq += 1
        self._wake.set()

    def stats(self) -> dict:
        """Batches queued so far (sequence numbers given) and dropped (``/metrics``)."""
        return {"kv_events_batches": self._seq, "kv_events_dropped": self.dropped}

    # ------------------------------------------------------------------------------------ sender thread
    def _run(self) -> None:
        import msgpack
        import zmq

        ctx = zmq.Context.instance()
        pub = replay = None
        where = self.endpoint
        try:
            pub = ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.SNDHWM, 100_000)
            pub.bind(self.endpoint)
            if self.replay_endpoint is not None:
                where = self.replay_endpoint
                replay = ctx.socket(zmq.ROUTER)
                replay.bind(self.replay_endpoint)
        except zmq.ZMQError as exc:
            for sock in (pub, replay):
                if sock is not None:
                    sock.close(linger=0)
            self._error = f"cannot bind {where} for KV events: {exc}"
            self._ready.set()
            return
        self._ready.set()
        buffer: collections.deque = collections.deque(maxlen=REPLAY_BUFFER)
        try:
            self._serve(pub, replay, buffer, msgpack, zmq)
        finally:
            pub.close(linger=500)
            if replay is not None:
                replay.close(linger=0)

    def _serve(self, pub, replay, buffer, msgpack, zmq) -> None:
        while True:
            while True:
                with self._lock:
                    item = self._queue.popleft() if self._queue else None
                if item is None:
                    break
                seq, batch = item
                payload = msgpack.packb(batch, use_bin_type=True)
                pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
                buffer.append((seq, payload))
                self.sent += 1
            if self._stop:
                return
            if replay is not None and replay.poll(20):
                self._replay(replay, buffer)
            elif replay is None:
                self._wake.wait(0.05)
            self._wake.clear()

    @staticmethod
    def _replay(replay, buffer) -> None:
        frames = replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            return   # not a replay request (a REQ client sends [identity, b"", 8-byte start])
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(buffer):
            if seq >= first:
                replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        replay.send_multipart((client, b"", END_SEQ, b""))

    def close(self) -> None:
        """Send what is queued, then close the sockets."""
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)
