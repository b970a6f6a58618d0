"""What the local engine shares between the threads that submit and the engine thread: the waiting requests, the
control actions, the count of admitted sequences, the closed flag, the counters and the slot table.

:class:`Inbox` is one object per :class:`~.scheduler.Scheduler` and holds no scheduler: every method takes what it
needs and returns what it decided; its state is read and written under its own lock. A waiting entry is a
*group*: the first choice's handle and request, and the other choices of an ``n``-choice request (empty for
``n = 1``), admitted together when as many sequence slots are available as the group has members.
"""

from __future__ import annotations

import collections
import threading
import time
from concurrent.futures import Future

from qeff_kv.errors import QueueFullError, RuntimeInputError, UnavailableError
from qeff_kv.serve.engine.engine import GenerationRequest, RequestHandle

#: while busy, the slot table and counters are published at most this often (it walks every sequence)
PUBLISH_EVERY_S = 0.02

Group = tuple  # (RequestHandle, GenerationRequest, list[tuple[RequestHandle, GenerationRequest]])


class Inbox:
    """The submitting threads' side of the engine (see the module docstring)."""

    def __init__(self, max_sequences: int, kv_bytes_capacity: int):
        self.max_sequences = max_sequences
        self.lock = threading.Lock()
        #: set when there is something for the engine thread to do
        self.wake = threading.Event()
        self.waiting: collections.deque[Group] = collections.deque()
        self.control: collections.deque[tuple[Future, object]] = collections.deque()
        self.admitted = 0   # sequences of requests taken from the queue and not yet finished
        self.closed = False
        self.published = 0.0
        self.counters = {"queue_depth": 0, "sequences_active": 0, "sequences_cached": 0, "kv_bytes_used": 0,
                         "prompt_tokens_reused": 0, "decode_steps": 0, "prefill_chunks": 0,
                         "kv_bytes_capacity": kv_bytes_capacity, "max_sequences": max_sequences}
        self.table: list[dict] = free_slots(max_sequences)

    # ---- the submitting threads
    def put(self, handles: list[RequestHandle], reqs: list[GenerationRequest], max_queue: int) -> None:
        """Queue one group (``n`` choices: ``n`` handles); refused when closed or full (``max_queue`` requests
        waiting beyond those a free slot is about to take)."""
        self._put([(handles[0], reqs[0], list(zip(handles[1:], reqs[1:])))], max_queue)

    def put_each(self, handles: list[RequestHandle], reqs: list[GenerationRequest], max_queue: int) -> None:
        """Queue each request as a group of its own, one after another; refused (none queued) as :meth:`put`
        refuses one request."""
        self._put([(h, r, []) for h, r in zip(handles, reqs)], max_queue)

    def _put(self, groups: list[Group], max_queue: int) -> None:
        with self.lock:
            if self.closed:
                raise UnavailableError("the engine is closed")
            # the queue holds max_queue requests beyond those a free slot is about to take
            if len(self.waiting) >= max_queue + max(0, self.max_sequences - self.admitted):
                raise QueueFullError(f"the queue is full ({max_queue} requests waiting); retry later")
            self.waiting.extend(groups)
            self.counters["queue_depth"] = len(self.waiting)
        self.wake.set()

    def run(self, what) -> Future:
        """Queue a control action for the engine thread."""
        fut: Future = Future()
        with self.lock:
            if self.closed:
                raise RuntimeInputError("the engine is closed")
            self.control.append((fut, what))
        self.wake.set()
        return fut

    def close(self) -> bool:
        """Mark closed; True the first time."""
        with self.lock:
            if self.closed:
                return False
            self.closed = True
        self.wake.set()
        return True

    def stats(self) -> dict:
        with self.lock:
            return dict(self.counters)

    def slots(self) -> list[dict]:
        with self.lock:
            return [dict(s) for s in self.table]

    # ---- the engine thread
    def count(self, stat: str, n: int) -> None:
        """Add ``n`` to the counter ``stat``."""
        with self.lock:
            self.counters[stat] += n

    def admissible(self, available: int) -> bool:
        """The first waiting group fits in ``available`` slots."""
        with self.lock:
            return bool(self.waiting) and available >= 1 + len(self.waiting[0][2])

    def next_group(self, available: int) -> Group | None:
        """The first waiting group when it fits in ``available`` slots (its members count as admitted), else None."""
        with self.lock:
            if not self.waiting or available < 1 + len(self.waiting[0][2]):
                return None
            group = self.waiting.popleft()
            self.admitted += 1 + len(group[2])
            return group

    def waiting_requests(self) -> list[GenerationRequest]:
        """Every waiting request (each choice of each group)."""
        with self.lock:
            return [r for _, first, others in self.waiting for r in [first] + [o for _, o in others]]

    def left(self, n: int = 1) -> None:
        """``n`` admitted sequences ended."""
        with self.lock:
            self.admitted -= n

    def cancelled(self) -> list[tuple[RequestHandle, GenerationRequest]]:
        """The waiting groups whose first choice was cancelled leave the queue: all their members (cancelling the
        first choice of a waiting ``n``-choice request cancels all its choices)."""
        with self.lock:
            gone = [g for g in self.waiting if g[0].cancelled]
            if gone:
                self.waiting = collections.deque(g for g in self.waiting if not g[0].cancelled)
        return [m for h, r, others in gone for m in [(h, r)] + others]

    def apply_control(self, run) -> None:
        """Run each queued control action with ``run(what)``; its result or exception goes to its future."""
        while True:
            with self.lock:
                if not self.control:
                    return
                fut, what = self.control.popleft()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(run(what))
            except Exception as exc:   # noqa: BLE001 - handed to the caller
                fut.set_exception(exc)

    def drain(self) -> tuple[list[tuple[RequestHandle, GenerationRequest]], list[Future]]:
        """At shutdown: every waiting member and every control action's future (the queues empty)."""
        with self.lock:
            waiting, self.waiting = list(self.waiting), collections.deque()
            control, self.control = list(self.control), collections.deque()
        return [m for h, r, others in waiting for m in [(h, r)] + others], [f for f, _ in control]

    def due(self, busy: bool) -> bool:
        """Time to publish: always when idle, at most every :data:`PUBLISH_EVERY_S` while ``busy``."""
        now = time.monotonic()
        if busy and now - self.published < PUBLISH_EVERY_S:
            return False
        self.published = now
        return True

    def publish(self, table: list[dict], **counters) -> None:
        """The slot table and the gauges, as the engine thread saw them."""
        with self.lock:
            self.counters.update(queue_depth=len(self.waiting), **counters)
            self.table = table


def free_slots(n: int) -> list[dict]:
    """A slot table of ``n`` free slots."""
    return [{"id": i, "state": "free", "n_tokens": 0} for i in range(n)]
