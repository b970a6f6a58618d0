"""Prefix-aware routing across the disaggregated engine's prefill replicas (``qeff-kv serve --disaggregate
--route prefix``, the default; ``--route load`` routes by load alone).

A prefill replica keeps the sequences it prefilled and starts a later prompt from the longest prefix one of them
holds (:class:`~qeff_kv.serve.cluster.transfer.Prefiller`). :class:`PrefixRouter` sends a request to the replica holding
the longest prefix of its prompt (at least :data:`~qeff_kv.runtime.memory.prefix_cache.MIN_REUSE` tokens, else it
counts as none); among replicas holding equally long prefixes, and when none holds one, the least loaded (ties in
turn).

**How the router knows what a replica holds: an index mirrored from the replicas' own reports.** Each prefill
call returns, beside its :class:`~qeff_kv.serve.cluster.transfer.KVTransfer` (which goes to the decode replica, not
through the frontend), a small :func:`holdings` report: every sequence the replica keeps after the call, with its
token ids and the positions it can be returned to (``Session.rewind_points``: a recurrent graph's checkpoints).
The report *replaces* that replica's entry, so evictions (least recently used first out, a kept sequence
truncated and continued) are accounted for exactly; the router's answer for a replica equals the replica's own
``longest_prefix`` (the same rules: at most ``len(prompt) - 1`` tokens, down to a reachable point, at least
``MIN_REUSE``; tested). A request sent to a replica and not yet reported counts its prompt as held there (its
prefill will leave it so; a recurrent graph's checkpoints on it are known once it reports), so a burst of
questions sharing a system prompt follows the first one instead of spreading before it finished. The decision is
a lookup in memory (numpy comparisons over the kept sequences; about 0.1 ms for 4 replicas): no request waits on a
Ray call to choose, and a replica busy prefilling (one request at a time) is never asked anything.

Limits, said plainly: until a replica's calls in flight report, an eviction they cause is not yet known (their
prompts are counted as held); after a replica restarts, its index entry is stale until its next report; a
sliding-window export's rings may still refuse a prefix the index offers (the replica then prefills whole, as
``Prefiller`` does). None of these changes an answer: routing only chooses where the prompt is prefilled.

Decode replicas are chosen by load: they import handed-off states and keep no finished sequence (no prefix reuse
on the decode side today), so there is no prefix to route to.
"""

from __future__ import annotations

import itertools
import threading
import time

import numpy as np

from qeff_kv.errors import RuntimeInputError

#: ``--route`` choices
ROUTES = ("prefix", "load")
#: a load at or above this marks a replica not to be chosen by prefix (stopped, or just refused a call)
_AVOID = 1 << 30


def holdings(cache) -> list[tuple[int, tuple[int, ...], list[int] | None]]:
    """What a prefill replica keeps after a call: ``(sequence id, token ids, rewind points or None)`` of each
    sequence its :class:`~qeff_kv.runtime.memory.prefix_cache.PrefixCache` keeps (none when prompts are not reused)."""
    if not cache.reuse:
        return []
    session = cache.session
    out = []
    for s in cache.kept:
        points = session.rewind_points(s)
        out.append((int(s.id), tuple(int(t) for t in s.tokens[: s.length]),
                    None if points is None else [int(p) for p in points]))
    return out


def report(cache, cached: int, call: int, pid: int) -> dict:
    """What a prefill replica returns to the router beside each transfer: its :func:`holdings`, the prompt
    tokens this call reused, and ``(pid, call)`` to order reports of one replica process."""
    return {"held": holdings(cache), "cached": int(cached), "call": int(call), "pid": int(pid)}


def longest_held(prompt: np.ndarray, tokens: np.ndarray, points: list[int] | None, limit: int) -> int:
    """How many leading tokens of ``prompt`` a sequence holding ``tokens`` gives: the common prefix, at most
    ``limit``, down to the highest of ``points`` at or below it (a recurrent graph's reachable positions)."""
    m = min(len(tokens), limit)
    if m <= 0:
        return 0
    diff = np.flatnonzero(tokens[:m] != prompt[:m])
    n = int(diff[0]) if diff.size else m
    if points is not None:
        n = max((p for p in points if p <= n), default=0)
    return n


class PrefixRouter:
    """The prefill replicas' index and the choice of a replica (see the module docstring)."""

    def __init__(self, replicas: int, *, min_reuse: int, mode: str = "prefix"):
        if mode not in ROUTES:
            raise RuntimeInputError(f"--route {mode}: expected one of {', '.join(ROUTES)}")
        self.mode, self.min_reuse = mode, int(min_reuse)
        self._lock = threading.Lock()
        self._held: list[dict[int, tuple[np.ndarray, list[int] | None]]] = [{} for _ in range(replicas)]
        self._pending: list[dict[int, np.ndarray]] = [{} for _ in range(replicas)]
        self._tickets = itertools.count()
        self._hit_tickets: set[int] = set()
        self._last: list[tuple] = [(None, -1)] * replicas   # (pid, call number) of each replica's latest report
        self.counts = {"route_prefix_hits": 0, "route_prefix_misses": 0, "route_tokens_predicted": 0,
                       "route_tokens_reused": 0, "route_decisions": 0, "route_decision_s": 0.0,
                       "route_decision_max_s": 0.0}

    # ------------------------------------------------------------------------------------ the question
    def longest(self, replica: int, prompt) -> int:
        """The longest prefix of ``prompt`` replica ``replica`` holds (or will, once its calls in flight end),
        by the prefiller's rules; 0 below ``min_reuse``."""
        p = np.asarray(prompt, dtype=np.int64)
        with self._lock:
            return self._longest(replica, p)

    def _longest(self, replica: int, p: np.ndarray) -> int:
        limit = len(p) - 1
        best = 0
        for tokens, points in self._held[replica].values():
            best = max(best, longest_held(p, tokens, points, limit))
        for tokens in self._pending[replica].values():
            best = max(best, longest_held(p, tokens, None, limit))
        return best if best >= self.min_reuse else 0

    # ------------------------------------------------------------------------------------ the choice
    def choose(self, prompt, load: list[int], order: list[int]) -> int:
        """The replica for ``prompt``: with ``mode="prefix"`` the one holding the longest prefix (at least
        ``min_reuse``; ties: least loaded), else the least loaded. ``order``: the replicas in turn for load ties;
        a replica with load >= 2**30 (stopped, or to avoid) is never chosen by prefix."""
        t0 = time.perf_counter()
        p = np.asarray(prompt, dtype=np.int64)
        with self._lock:
            if self.mode == "prefix":
                held = [self._longest(i, p) if load[i] < _AVOID else 0 for i in range(len(load))]
            else:
                held = [0] * len(load)
            best = max(held)
            if best > 0:
                pick = min((i for i in order if held[i] == best), key=lambda i: load[i])
            else:
                pick = min(order, key=lambda i: load[i])
            c = self.counts
            dt = time.perf_counter() - t0
            c["route_decisions"] += 1
            c["route_decision_s"] += dt
            c["route_decision_max_s"] = max(c["route_decision_max_s"], dt)
        return pick

    # ------------------------------------------------------------------------------------ the index
    def dispatched(self, replica: int, prompt) -> int:
        """``prompt`` was sent to ``replica``: a hit if the replica holds a prefix of it (chosen for it, or by
        chance under ``--route load``), else a miss; it counts as held there until the call reports (or fails).
        Returns the ticket to pass to :meth:`reported` / :meth:`dropped`."""
        p = np.asarray(prompt, dtype=np.int64)
        with self._lock:
            ticket = next(self._tickets)
            n = self._longest(replica, p)
            self._pending[replica][ticket] = p
            c = self.counts
            c["route_prefix_hits" if n else "route_prefix_misses"] += 1
            c["route_tokens_predicted"] += n
            if n:
                self._hit_tickets.add(ticket)
        return ticket

    def reported(self, replica: int, ticket: int, report: dict) -> None:
        """The call of ``ticket`` ended: ``report`` (:func:`report` of the replica) replaces what the index knows
        of ``replica``, unless a later call of the same replica process already reported."""
        held = {sid: (np.asarray(tokens, dtype=np.int64), points) for sid, tokens, points in report["held"]}
        stamp = (report.get("pid"), int(report.get("call", 0)))
        with self._lock:
            self._pending[replica].pop(ticket, None)
            last = self._last[replica]
            if stamp[0] != last[0] or stamp[1] > last[1]:
                self._held[replica], self._last[replica] = held, stamp
            if ticket in self._hit_tickets:
                self._hit_tickets.discard(ticket)
                self.counts["route_tokens_reused"] += int(report.get("cached", 0))

    def dropped(self, replica: int, ticket: int) -> None:
        """The call of ``ticket`` failed: its prompt no longer counts as held."""
        with self._lock:
            self._pending[replica].pop(ticket, None)
            self._hit_tickets.discard(ticket)

    def stats(self) -> dict:
        with self._lock:
            return {"route": self.mode, **self.counts}
