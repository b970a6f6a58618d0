"""Watching the disaggregated engine's Ray replicas, off every HTTP route: their figures, restarts and health.

:class:`ReplicaWatch` runs on the engine's own asyncio loop (never on the server's): every :data:`WATCH_S` seconds
it reads each replica's ``stats()`` (with its pid) and keeps the last readings, so that ``/health`` and
``/metrics`` answer from memory and never wait on Ray.

Restarts are budgeted per window, not per lifetime: Ray restarts a dead replica without limit, the watch notices
each restart by the replica's new pid, and a replica restarted more than :data:`RESTART_BUDGET` times within
:data:`RESTART_WINDOW_S` seconds (a crash loop) is stopped for good. So is one that cannot be read for
:data:`UNREACHABLE_S` seconds. A stopped replica takes no more requests; when every replica of a kind is stopped,
the engine refuses requests (503) and its health says why.
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass, field

#: seconds between two readings of the replicas
WATCH_S = 1.0
#: seconds one reading may take
READ_TIMEOUT_S = 5.0
#: restarts of one replica allowed within RESTART_WINDOW_S seconds; one more and it is stopped
RESTART_BUDGET = 10
RESTART_WINDOW_S = 600.0
#: a replica that cannot be read for this long is stopped
UNREACHABLE_S = 120.0


@dataclass(eq=False)
class Replica:
    kind: str                      # "prefill" | "decode"
    index: int
    actor: object
    pid: int | None = None
    restarts: collections.deque = field(default_factory=collections.deque)
    last_ok: float = field(default_factory=time.monotonic)
    stopped: str | None = None     # why it takes no more requests
    reading: dict = field(default_factory=dict)


class ReplicaWatch:
    """The replicas' last readings, restart budget and health (see the module docstring)."""

    def __init__(self, ray, actors: dict[str, list], *, budget: int = RESTART_BUDGET,
                 window: float = RESTART_WINDOW_S, unreachable: float = UNREACHABLE_S):
        self.ray = ray
        self.replicas = [Replica(kind, i, a) for kind, group in actors.items() for i, a in enumerate(group)]
        self.budget, self.window, self.unreachable = budget, window, unreachable
        self.readings = 0

    def stopped(self, kind: str) -> set[int]:
        return {r.index for r in self.replicas if r.kind == kind and r.stopped is not None}

    def problem(self) -> str | None:
        """Why the engine cannot serve (every replica of a kind stopped), else None."""
        for kind in ("prefill", "decode"):
            group = [r for r in self.replicas if r.kind == kind]
            if group and all(r.stopped is not None for r in group):
                return f"every {kind} replica is stopped ({group[0].stopped})"
        return None

    def figures(self) -> list[dict]:
        """The last reading of every replica still serving (from memory)."""
        return [dict(r.reading) for r in self.replicas if r.stopped is None and r.reading]

    def describe(self) -> list[dict]:
        return [{"kind": r.kind, "index": r.index, "restarts_in_window": len(r.restarts),
                 "stopped": r.stopped} for r in self.replicas]

    async def run(self, closed) -> None:
        """Read the replicas until ``closed()``."""
        while not closed():
            await self.read_all()
            await asyncio.sleep(WATCH_S)

    async def read_all(self) -> None:
        live = [r for r in self.replicas if r.stopped is None]
        await asyncio.gather(*(self._read(r) for r in live))
        self.readings += 1

    async def _read(self, r: Replica) -> None:
        now = time.monotonic()
        try:
            ref = r.actor.stats.remote()
            reading = await asyncio.wait_for(asyncio.wrap_future(ref.future()), READ_TIMEOUT_S)
        except Exception:   # noqa: BLE001 - restarting, dead or slow: judged by how long it lasts
            if now - r.last_ok > self.unreachable:
                self.stop(r, f"{r.kind} replica {r.index} could not be reached for {self.unreachable:g} s")
            return
        r.last_ok = now
        pid = reading.get("pid")
        if r.pid is not None and pid != r.pid:
            r.restarts.append(now)
        r.pid, r.reading = pid, reading
        while r.restarts and now - r.restarts[0] > self.window:
            r.restarts.popleft()
        if len(r.restarts) > self.budget:
            self.stop(r, f"{r.kind} replica {r.index} restarted {len(r.restarts)} times within {self.window:g} s")

    def stop(self, r: Replica, why: str) -> None:
        r.stopped = why
        try:
            self.ray.kill(r.actor, no_restart=True)
        except Exception:   # noqa: BLE001 - already gone
            pass
