"""The KV connector: how a prefilled sequence leaves one engine and enters another, the transport a detail behind an
interface in the shape of vLLM's ``KVConnectorBase_V1``.

vLLM's connector is split into a scheduler side (``get_num_new_matched_tokens``, ``update_state_after_alloc``,
``request_finished``) and a worker side (``start_load_kv``, ``wait_for_layer_load``, ``save_kv_layer``,
``wait_for_save``, ``get_finished``) because its KV lives in blocks written layer by layer on a device. Here a
sequence lives in one slot and its state moves as one :class:`~.transfer.KVTransfer` (the valid positions of the
buffers the serving regex selects, cut by the slicing spec, with the metadata an import checks), so the verbs are
per sequence:

==============================  ================================================  =================================
verb here                       vLLM's                                            what it does
==============================  ================================================  =================================
``request_finished``            ``request_finished``                              a finished producer request:
                                                                                  extract and :meth:`save`, return
                                                                                  the ``kv_transfer_params``
``save(request_id, transfer)``  ``save_kv_layer`` + ``wait_for_save``             hold the state; returns the handle
                                                                                  that names it
``matched_tokens(params)``      ``get_num_new_matched_tokens``                    prompt positions the remote holds
``start_load(params)``          ``start_load_kv``                                 begin taking a held state
``wait_load(pending, timeout)`` ``wait_for_layer_load`` (every layer at once)     the transfer, or KVLoadError
``get_finished()``              ``get_finished``                                  request ids whose state was taken
                                                                                  (sent) / loaded (received)
==============================  ================================================  =================================

Two transports, both through Ray's object store:

* :class:`InBandConnector` (``qeff-kv serve --disaggregate``): the handle *is* the transfer; Ray carries it as the
  prefill actor's return value, by reference to the decode actor (never through the frontend).
* :class:`RayHoldConnector` (vLLM's P/D protocol between separate servers, ``--kv-role``): the producer puts the
  transfer into the object store (``ray.put``: the producer process owns it) and gives the reference to a **named
  holder actor** of its own (:class:`KVHolder`, ``qeff-kv-kv-holder-<engine id>`` in Ray namespace ``qeff-kv``,
  no CPUs, dies with the producer). The handle is plain JSON, the ``kv_transfer_params`` of the answer. A consumer
  finds the holder by the engine id, takes the reference (the holder forgets it: a state is taken once) and
  fetches the bytes from the object store. A state nobody takes is dropped by the holder after the hold time
  (``--kv-hold-seconds``); with the last reference gone Ray frees it. The producer gone (its process, hence the
  object's owner and the holder) or the hold expired: :class:`~qeff_kv.errors.KVLoadError`.

This module needs Ray only when a :class:`RayHoldConnector` is made (the ``[ray]`` extra).
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from abc import ABC, abstractmethod

from qeff_kv.errors import KVLoadError, MissingDependencyError
from qeff_kv.serve.cluster.transfer import KVTransfer, extract

#: the Ray namespace of the holder actors
NAMESPACE = "qeff-kv"
#: default seconds a producer holds a state nobody took
DEFAULT_HOLD_SECONDS = 60.0
#: seconds a consumer waits for a held state (finding the holder, taking the reference, fetching the bytes)
LOAD_TIMEOUT = 30.0
ROLES = ("producer", "consumer", "both")
#: the most states one producer's holder keeps, and their bytes (oldest dropped first past either)
MAX_HELD_STATES = 64
MAX_HELD_BYTES = 1 << 30


def holder_name(engine_id: str) -> str:
    return f"qeff-kv-kv-holder-{engine_id}"


class KVConnector(ABC):
    """The interface (see the module docstring). ``role``: ``producer``, ``consumer`` or ``both`` (vLLM's
    ``kv_role`` without its ``kv_`` prefix)."""

    role: str = "both"

    # ---- scheduler side
    def request_finished(self, session, seq, request_id: str):
        """A producer's request finished with its prompt prefilled and its first token sampled: extract the
        sequence's valid positions and :meth:`save` them; returns what names the held state."""
        t0 = time.perf_counter()
        out = self.save(request_id, extract(session, seq, request_id))
        self._timed("kv_save_seconds", time.perf_counter() - t0)
        return out

    def _timed(self, key: str, seconds: float) -> None:
        """Seconds spent in saves (extract + hold) or loads (take + fetch), where the transport counts them."""

    def matched_tokens(self, params) -> int:
        """Prompt positions the remote state holds (0: none; vLLM's ``get_num_new_matched_tokens``)."""
        return 0

    def peek(self, params) -> dict | None:
        """The metadata of the state ``params`` names, without taking it (None: this transport cannot tell)."""
        return None

    def note_take_refused(self) -> None:
        """A request refused against a held state's metadata (the state left held)."""

    # ---- worker side
    @abstractmethod
    def save(self, request_id: str, transfer: KVTransfer):
        """Hold ``transfer`` until a consumer takes it; returns its handle."""

    @abstractmethod
    def start_load(self, params):
        """Begin taking the state ``params`` names; returns a pending load for :meth:`wait_load`."""

    @abstractmethod
    def wait_load(self, pending, timeout: float = LOAD_TIMEOUT) -> KVTransfer:
        """The transfer of a pending load; :class:`~qeff_kv.errors.KVLoadError` when it cannot be had."""

    def load(self, params, timeout: float = LOAD_TIMEOUT, tokens: str | None = None) -> KVTransfer:
        return self.wait_load(self.start_load(params), timeout)

    def get_finished(self) -> tuple[set[str], set[str]]:
        """Request ids whose held state left since the last call (sent) and whose load completed (received)."""
        return set(), set()

    def stats(self) -> dict:
        return {}

    def close(self) -> None:
        pass


class InBandConnector(KVConnector):
    """The handle is the transfer itself: a Ray actor returning it puts it in the object store, and a Ray call
    given the reference gets it there (the in-process disaggregated engine, :mod:`.disagg`)."""

    def save(self, request_id: str, transfer: KVTransfer) -> KVTransfer:
        return transfer

    def start_load(self, params) -> KVTransfer:
        if not isinstance(params, KVTransfer):
            raise KVLoadError(f"expected a KVTransfer, got {type(params).__name__}")
        return params

    def wait_load(self, pending, timeout: float = LOAD_TIMEOUT) -> KVTransfer:
        return pending


# ============================================================================================ Ray, held
class KVHolder:
    """A producer's holder (an async Ray actor, one per producer, named :func:`holder_name`): transfer id ->
    ``([ObjectRef], bytes, request id, metadata)`` (the reference in a list, so that Ray passes the reference, not
    the object), dropped when taken, after its hold time, or (oldest first) past the caps."""

    def __init__(self, max_states: int = MAX_HELD_STATES, max_bytes: int = MAX_HELD_BYTES):
        self._held: dict[str, tuple[list, int, str, dict]] = {}   # insertion order: oldest first
        self.max_states, self.max_bytes = int(max_states), int(max_bytes)
        self.counts = {"held": 0, "taken": 0, "expired": 0, "missed": 0, "evicted": 0, "refused": 0,
                       "take_refused": 0}

    async def hold(self, tid: str, refs: list, seconds: float, nbytes: int, request_id: str,
                   meta: dict | None = None) -> dict:
        """Hold a state; ``{"held": bool, "evicted": n}`` (not held: larger alone than the byte cap)."""
        import asyncio

        if int(nbytes) > self.max_bytes:
            self.counts["refused"] += 1
            return {"held": False, "evicted": 0}
        evicted = 0
        while self._held and (len(self._held) >= self.max_states or
                              sum(h[1] for h in self._held.values()) + int(nbytes) > self.max_bytes):
            self._held.pop(next(iter(self._held)))
            evicted += 1
        self.counts["evicted"] += evicted
        self._held[tid] = (refs, int(nbytes), request_id, dict(meta or {}))
        self.counts["held"] += 1
        asyncio.get_running_loop().call_later(max(0.0, float(seconds)), self._expire, tid)
        return {"held": True, "evicted": evicted}

    def _expire(self, tid: str) -> None:
        if self._held.pop(tid, None) is not None:
            self.counts["expired"] += 1

    async def peek(self, tid: str):
        """The held state's metadata (None: not held); nothing is taken."""
        got = self._held.get(tid)
        return None if got is None else got[3]

    async def take(self, tid: str, tokens: str | None = None):
        """``("taken", refs)``; ``("missed", None)`` when not held; ``("refused", None)`` when ``tokens`` (the
        request's prompt, as the metadata spells it) is not the held state's: left held for its owner."""
        got = self._held.get(tid)
        if got is None:
            self.counts["missed"] += 1
            return "missed", None
        if tokens is not None and got[3].get("tokens") != tokens:
            self.counts["take_refused"] += 1
            return "refused", None
        del self._held[tid]
        self.counts["taken"] += 1
        return "taken", got[0]

    async def stats(self) -> dict:
        return {**self.counts, "holding": len(self._held), "holding_bytes": sum(h[1] for h in self._held.values())}


def _ray():
    try:
        import ray
    except ImportError:
        raise MissingDependencyError("--kv-role needs Ray: pip install 'qeff-kv[ray]'") from None
    return ray


class RayHoldConnector(KVConnector):
    """vLLM's P/D protocol's transport (see the module docstring). Ray must be initialised in this process.

    The handle (``kv_transfer_params`` of a producer's answer): ``do_remote_prefill: true``, ``do_remote_decode:
    false``, ``remote_engine_id`` (the producer's engine id: its holder), ``transfer_id`` (the held state),
    ``remote_block_ids: null`` (no blocks: one state per sequence), ``remote_host``/``remote_port`` (the
    producer's HTTP address, informative), ``num_tokens`` (positions held) and ``transfer_bytes``.
    """

    def __init__(self, role: str = "both", *, engine_id: str | None = None, hold_seconds: float = DEFAULT_HOLD_SECONDS,
                 host: str | None = None, port: int | None = None, max_states: int = MAX_HELD_STATES,
                 max_bytes: int = MAX_HELD_BYTES):
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        self._ray = _ray()
        self.role = role
        self.engine_id = engine_id or uuid.uuid4().hex[:16]
        self.hold_seconds = float(hold_seconds)
        self.host, self.port = host, port
        self._lock = threading.Lock()
        self._sent: set[str] = set()
        self._received: set[str] = set()
        self.counts = {"kv_saves": 0, "kv_save_bytes": 0, "kv_loads": 0, "kv_load_bytes": 0, "kv_load_failures": 0,
                       "kv_load_fallbacks": 0, "kv_save_seconds": 0.0, "kv_load_seconds": 0.0,
                       "kv_hold_evictions": 0, "kv_hold_refusals": 0, "kv_take_refusals": 0}
        #: this connector started Ray in this process (its close() stops it)
        self.owns_ray = False
        self._holder = None
        if role in ("producer", "both"):
            actor = self._ray.remote(KVHolder).options(name=holder_name(self.engine_id), namespace=NAMESPACE,
                                                       num_cpus=0, max_restarts=0, lifetime=None)
            self._holder = actor.remote(max_states, max_bytes)
            self._ray.get(self._holder.stats.remote(), timeout=LOAD_TIMEOUT)   # up before the first answer

    # ---- producer
    def save(self, request_id: str, transfer: KVTransfer) -> dict:
        if self._holder is None:
            raise KVLoadError("this server is a KV consumer: it holds no states (--kv-role producer or both)")
        tid = uuid.uuid4().hex
        ref = self._ray.put(transfer)
        meta = {k: v for k, v in transfer.state.metadata.items() if k != "checksum"}
        meta["serve_lora"] = json.dumps(transfer.lora)   # the adapter a consumer's request must run (pd.py)
        # waited for: the hold is in place before the answer naming it leaves
        held = self._ray.get(self._holder.hold.remote(tid, [ref], self.hold_seconds, transfer.nbytes, request_id,
                                                      meta), timeout=LOAD_TIMEOUT)
        with self._lock:
            self.counts["kv_hold_evictions"] += held["evicted"]
            if not held["held"]:
                self.counts["kv_hold_refusals"] += 1
                raise KVLoadError(f"a state of {transfer.nbytes} bytes is larger than the holder's cap")
            self.counts["kv_saves"] += 1
            self.counts["kv_save_bytes"] += transfer.nbytes
            self._sent.add(request_id)
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
                "remote_block_ids": None, "remote_host": self.host, "remote_port": self.port,
                "transfer_id": tid, "num_tokens": transfer.valid_length, "transfer_bytes": transfer.nbytes}

    # ---- consumer
    def matched_tokens(self, params) -> int:
        n = params.get("num_tokens") if isinstance(params, dict) and params.get("do_remote_prefill") else 0
        return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 0

    def _holder_of(self, params: dict):
        engine = params.get("remote_engine_id")
        try:
            return self._ray.get_actor(holder_name(engine), namespace=NAMESPACE)
        except ValueError:
            raise KVLoadError(f"producer {engine} is gone (no KV holder of that engine in the Ray cluster)") from None

    def peek(self, params: dict, timeout: float = LOAD_TIMEOUT) -> dict:
        """The metadata of the state ``params`` names, read without taking it; KVLoadError when not held."""
        engine, tid = params.get("remote_engine_id"), params.get("transfer_id")
        try:
            meta = self._ray.get(self._holder_of(params).peek.remote(tid), timeout=timeout)
        except KVLoadError:
            raise
        except Exception as exc:   # noqa: BLE001 - Ray's: the holder died, a timeout
            raise KVLoadError(f"state {tid} of producer {engine} could not be read ({type(exc).__name__})") from None
        if meta is None:
            raise KVLoadError(f"producer {engine} holds no state {tid} (taken already, or freed after its hold time)")
        return meta

    def note_take_refused(self) -> None:
        with self._lock:
            self.counts["kv_take_refusals"] += 1

    def start_load(self, params: dict, tokens: str | None = None):
        return params.get("transfer_id"), params.get("remote_engine_id"), \
            self._holder_of(params).take.remote(params.get("transfer_id"), tokens)

    def _timed(self, key: str, seconds: float) -> None:
        with self._lock:
            self.counts[key] += seconds

    def load(self, params, timeout: float = LOAD_TIMEOUT, tokens: str | None = None) -> KVTransfer:
        """Take and fetch the state; with ``tokens`` (the request's prompt as the metadata spells it) the holder
        gives it only when they are the held state's."""
        t0 = time.perf_counter()
        try:
            return self.wait_load(self.start_load(params, tokens), timeout)
        finally:
            self._timed("kv_load_seconds", time.perf_counter() - t0)

    def wait_load(self, pending, timeout: float = LOAD_TIMEOUT) -> KVTransfer:
        ray = self._ray
        tid, engine, taking = pending
        t0 = time.monotonic()
        try:
            status, refs = ray.get(taking, timeout=timeout)
            if status == "refused":
                raise KVLoadError(f"state {tid} of producer {engine} holds another prompt; left for its owner")
            if refs is None:
                raise KVLoadError(f"producer {engine} holds no state {tid} (taken already, or freed after its hold "
                                  "time)")
            transfer = ray.get(refs[0], timeout=max(0.1, timeout - (time.monotonic() - t0)))
        except KVLoadError:
            self._failed()
            raise
        except Exception as exc:   # noqa: BLE001 - Ray's: the holder or the object's owner died, a timeout
            self._failed()
            raise KVLoadError(f"state {tid} of producer {engine} could not be fetched ({type(exc).__name__})") from None
        if not isinstance(transfer, KVTransfer):
            self._failed()
            raise KVLoadError(f"state {tid} of producer {engine} is not a KV transfer")
        with self._lock:
            self.counts["kv_loads"] += 1
            self.counts["kv_load_bytes"] += transfer.nbytes
            self._received.add(transfer.request_id)
        return transfer

    def _failed(self) -> None:
        with self._lock:
            self.counts["kv_load_failures"] += 1

    def note_fallback(self) -> None:
        """A failed load after which the consumer prefilled the prompt itself."""
        with self._lock:
            self.counts["kv_load_fallbacks"] += 1

    def get_finished(self) -> tuple[set[str], set[str]]:
        with self._lock:
            sent, self._sent = self._sent, set()
            received, self._received = self._received, set()
        return sent, received

    def holder_stats(self, timeout: float = 10.0) -> dict:
        """The holder's counts (a Ray call: for tests, the benchmark and scripts, not for HTTP routes)."""
        return self._ray.get(self._holder.stats.remote(), timeout=timeout) if self._holder is not None else {}

    def stats(self) -> dict:
        with self._lock:
            return dict(self.counts)

    def close(self) -> None:
        if self._holder is not None:
            try:
                self._ray.kill(self._holder, no_restart=True)
            except Exception:   # noqa: BLE001 - Ray already gone
                pass
            self._holder = None
        if self.owns_ray and self._ray.is_initialized():
            self._ray.shutdown()
