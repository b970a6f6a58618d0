"""Disaggregated prefill/decode on Ray (``qeff-kv serve --disaggregate``; needs the ``[ray]`` extra).

Two kinds of Ray actors (plain actors, restarted by Ray whenever they die, within the per-window budget that
:class:`~.replicas.ReplicaWatch` keeps; a call in flight when one dies fails instead of running again:
``max_task_retries=0``):

* :class:`PrefillWorker`: a :class:`~qeff_kv.runtime.Session` on the prefill export. ``prefill`` prefills a
  prompt, samples the first token with the request's sampling and returns a
  :class:`~qeff_kv.serve.transfer.KVTransfer` (the valid positions of the selected KV buffers) through Ray's
  object store (numpy arrays travel without pickling their data);
* :class:`DecodeWorker` (an async actor): a :class:`~qeff_kv.serve.scheduler.Scheduler` over the decode
  export's session (continuous batching across requests). ``generate`` is a streaming generator: it admits the
  handed-off sequence (``GenerationRequest(state=...)``: imported, not prefilled) and yields its
  :class:`~qeff_kv.serve.engine.TokenOut` / :class:`~qeff_kv.serve.engine.Finished` events.

:class:`DisaggregatedEngine` is the frontend's :class:`~qeff_kv.serve.engine.Engine`: per request it picks the
prefill replica holding the longest prefix of the prompt, else the least loaded (:mod:`.routing`; ``--route
load``: by load alone), and the least-loaded decode replica (ties: round-robin), passes the prefill's result *by
reference* to the decode call (the KV goes from the prefill worker to the decode worker, not through the
frontend), and turns the Ray stream into a :class:`~qeff_kv.serve.engine.RequestHandle`. A replica that dies ends its requests in
flight with ``Finished(finish_reason="error")``; Ray restarts it and the engine keeps serving. The engine's
figures and health come from the watch's last readings: no HTTP route waits on Ray.

The prefill and decode exports may differ (e.g. an fp32 portable prefill and an int4 fused decode) when they
are exports of one checkpoint with one KV contract; a pair that is not is refused at start-up in one line
(:func:`qeff_kv.serve.transfer.pair_refusal`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import os
import threading
import time

from ..errors import MissingDependencyError, QeffKvError, QueueFullError, RuntimeInputError, UnavailableError
from . import routing
from .config import ServeConfig
from .engine import Engine, Finished, GenerationRequest, RequestHandle, check_request
from .kv_connector import InBandConnector
from .replicas import ReplicaWatch
from ..runtime.prefix_cache import MIN_REUSE
from .transfer import Prefiller, facts, pair_refusal

#: seconds to wait for the replicas to load their exports at start-up
START_TIMEOUT = 300.0
#: seconds --ray-address may take to answer a TCP connection before start-up gives up
RAY_CONNECT_TIMEOUT = 5.0
#: seconds start-up waits for the CPUs its replicas need to be free
RESOURCE_WAIT = 20.0
#: seconds a request not yet started waits for a restarting replica before it fails
RESTART_WAIT = 60.0
#: why ``/slots`` is not available with --disaggregate (HTTP 501)
SLOTS_UNSUPPORTED = ("/slots is not available with --disaggregate: sequences live in the Ray replicas (prompts kept "
                     "for reuse on the prefill replicas, running requests on the decode replicas), not in one slot "
                     "table; see /metrics for their figures")
#: the address a local Ray instance started by the engine listens on (never another interface)
LOOPBACK = "127.0.0.1"
#: Ray's switch for a node address on the loopback interface (see :func:`_loopback_node`)
_RAY_LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def _ray():
    try:
        import ray
    except ImportError:
        raise MissingDependencyError("--disaggregate needs Ray: pip install 'qeff-kv[ray]'") from None
    return ray


def _one_line(exc: BaseException) -> str:
    """A failure of a remote call as one line: the remote exception's own message where Ray carries it."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException):
        exc = cause
    text = " ".join(str(exc).split()) or type(exc).__name__
    return f"{type(exc).__name__}: {text[:300]}"


# ============================================================================================ actors
class PrefillWorker:
    """The prefill replica (a Ray actor): one request at a time."""

    def __init__(self, export: str, ctx_len: int | None, prefill_seq_len: int | None, threads: int | None,
                 reuse_prompts: bool = True, kv_events: tuple | None = None, *, checkpoint_every: int | None = None,
                 max_checkpoints: int | None = None):
        from .kv_events import open_publisher
        from .session_from_config import open_prefill_session

        cfg = ServeConfig(export, ctx_len=ctx_len, prefill_seq_len=prefill_seq_len, threads=threads,
                          checkpoint_every=checkpoint_every, max_checkpoints=max_checkpoints)
        session = open_prefill_session(cfg, export)
        # --kv-events: (config, rank): this replica publishes on the endpoint's port + rank
        self.kv_events = open_publisher(*kv_events) if kv_events is not None else None
        self.prefiller = Prefiller(session, reuse=reuse_prompts, kv_events=self.kv_events)
        self.connector = InBandConnector()   # the transfer goes back through Ray's object store as the return value

    def facts(self) -> dict:
        return facts(self.prefiller.session)

    def prefill(self, request_id: str, prompt, sampling):
        return self.connector.save(request_id, self.prefiller.run(request_id, prompt, sampling))

    calls = 0   # prefill_routed calls of this process (orders its reports)

    def prefill_routed(self, request_id: str, prompt, sampling):
        """:meth:`prefill`, and what the replica keeps afterwards for the router (two returns: the transfer goes
        to the decode replica by reference, the report to the frontend; :mod:`.routing`)."""
        out = self.connector.save(request_id, self.prefiller.run(request_id, prompt, sampling))
        self.calls += 1
        return out, routing.report(self.prefiller.prefix_cache, out.cached_tokens, self.calls,
                                   os.getpid())

    def longest_prefix(self, prompt) -> int:
        """The longest prefix of ``prompt`` this replica would reuse (:meth:`Prefiller.longest_prefix`)."""
        return self.prefiller.longest_prefix(prompt)

    def stats(self) -> dict:
        return {"prompt_tokens_reused": self.prefiller.reused_tokens, "pid": os.getpid()}

    def pid(self) -> int:
        return os.getpid()


class DecodeWorker:
    """The decode replica (an async Ray actor): a Scheduler admitting handed-off sequences."""

    def __init__(self, config: ServeConfig, threads: int | None):
        from .scheduler import Scheduler
        from .session_from_config import open_session

        cfg = dataclasses.replace(config, threads=threads)
        self.scheduler = Scheduler(open_session(cfg), max_queue=config.max_queue, reuse_prompts=False)
        self.connector = InBandConnector()
        self.handoffs = {"handoffs": 0, "handoff_bytes": 0, "handoff_prefill_s": 0.0, "handoff_extract_s": 0.0}

    async def facts(self) -> dict:
        return facts(self.scheduler.session)

    async def stats(self) -> dict:
        return {**self.scheduler.stats(), **self.handoffs, "pid": os.getpid()}

    async def pid(self) -> int:
        return os.getpid()

    async def generate(self, req: GenerationRequest, transfer):
        """Admit ``transfer`` (a :class:`~qeff_kv.serve.transfer.KVTransfer`) for ``req``; yield its events."""
        transfer = self.connector.load(transfer)
        self.handoffs["handoffs"] += 1
        self.handoffs["handoff_bytes"] += transfer.nbytes
        self.handoffs["handoff_prefill_s"] += transfer.prefill_s
        self.handoffs["handoff_extract_s"] += transfer.extract_s
        handle = self.scheduler.submit(dataclasses.replace(req, state=transfer.state))
        try:
            async for ev in handle:
                if isinstance(ev, Finished):   # the prompt tokens the prefill replica did not have to prefill
                    ev = dataclasses.replace(ev, cached_tokens=transfer.cached_tokens)
                yield ev
        finally:   # the caller went away (cancelled): free the sequence
            if not handle.finished:
                handle.cancel()

    def close(self) -> None:
        self.scheduler.close()


# ============================================================================================ frontend
@dataclasses.dataclass(eq=False)
class _Flight:
    handle: RequestHandle
    req: GenerationRequest
    prefill: int
    decode: int
    tokens: int = 0
    started: bool = False            # the decode replica has admitted it (first event seen)
    task: object = None              # the asyncio future running it
    ticket: int | None = None        # the router's ticket for its prefill replica, taken when it was picked


class DisaggregatedEngine(Engine):
    """The :class:`Engine` over Ray replicas (see the module docstring). Made by :func:`start_disaggregated`."""

    def __init__(self, prefill_actors: list, decode_actors: list, *, model_name: str, decode_facts: dict,
                 max_queue: int = 64, owns_ray: bool = False, route: str = "prefix"):
        self._ray = _ray()
        self.router = routing.PrefixRouter(len(prefill_actors), min_reuse=MIN_REUSE, mode=route)
        self._learning: set = set()   # the router's tasks awaiting prefill reports
        self._prefill, self._decode = list(prefill_actors), list(decode_actors)
        self.model_name = model_name
        self.ctx_len = int(decode_facts["ctx_len"])
        self.max_sequences = int(decode_facts["max_sequences"]) * len(self._decode)
        self.vocab_size = decode_facts["vocab_size"]
        self.bytes_per_position = int(decode_facts["bytes_per_position"])
        self.max_queue = max_queue
        self._owns_ray = owns_ray
        self._lock = threading.Lock()
        self._flights: dict[int, _Flight] = {}
        self._ids = itertools.count()
        self._rr = {"prefill": itertools.count(), "decode": itertools.count()}   # ties in turn, per kind
        self._closed = False
        self._counts = {"requests": 0, "replica_errors": 0}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="qeff-kv-disagg", daemon=True)
        self._thread.start()
        self.watch = ReplicaWatch(self._ray, {"prefill": self._prefill, "decode": self._decode})
        self._watching = asyncio.run_coroutine_threadsafe(self.watch.run(lambda: self._closed), self._loop)

    # ------------------------------------------------------------------------------------ Engine API
    def submit(self, req: GenerationRequest) -> RequestHandle:
        check_request(req, ctx_len=self.ctx_len, vocab_size=self.vocab_size, state_allowed=False,
                      constraint_refused="structured output and forced tool calls are not supported with "
                                         "--disaggregate (the decode replicas sample without a grammar)")
        if req.sampling.adjusts or req.logprobs is not None:   # the prefill replica samples the first token plainly
            raise RuntimeInputError("logprobs, logit_bias and penalties are not supported with --disaggregate")
        # one seed for both sides: the prefill samples the first token, the decode the rest
        req = dataclasses.replace(req, sampling=req.sampling.resolved())
        with self._lock:
            if self._closed:
                raise UnavailableError("the engine is closed")
            waiting = sum(1 for f in self._flights.values() if not f.started)
            if waiting >= self.max_queue + len(self._prefill):
                raise QueueFullError(f"the queue is full ({waiting} requests waiting); retry later")
            key = next(self._ids)
            flight = _Flight(RequestHandle(req.request_id, on_cancel=lambda h: self._cancel(key)), req,
                             self._pick(lambda f: f.prefill, "prefill", started=False, prompt=req.prompt),
                             self._pick(lambda f: f.decode, "decode"))
            self._flights[key] = flight
            self._counts["requests"] += 1
            flight.ticket = self.router.dispatched(flight.prefill, req.prompt)   # held there from now on
        flight.task = asyncio.run_coroutine_threadsafe(self._run(key, flight), self._loop)
        return flight.handle

    def _pick(self, which, kind: str, started: bool | None = None, avoid: int | None = None,
              prompt=None) -> int:
        """The ``kind`` replica with the fewest requests (``started=False``: not yet past the prefill); ties
        round-robin; ``avoid``: a replica that just refused a call, taken only when it is the only one. A stopped
        replica is never taken; with none left, :class:`UnavailableError`. With ``prompt`` (a prefill replica),
        the router chooses: the replica holding its longest prefix first (:mod:`.routing`)."""
        n = len(self._prefill if kind == "prefill" else self._decode)
        stopped = self.watch.stopped(kind)
        if len(stopped) >= n:
            raise UnavailableError(self.watch.problem() or f"every {kind} replica is stopped")
        load = [0] * n
        for f in self._flights.values():
            if started is None or f.started == started:
                load[which(f)] += 1
        for i in stopped:
            load[i] = 1 << 40
        if avoid is not None and n - len(stopped) > 1:
            load[avoid] = max(load[avoid], 1 << 30)
        start = next(self._rr[kind]) % n
        order = [(i + start) % n for i in range(n)]
        if prompt is not None:
            return self.router.choose(prompt, load, order)
        return min(order, key=lambda i: load[i])

    def _cancel(self, key: int) -> None:
        with self._lock:
            flight = self._flights.get(key)
        if flight is not None and flight.task is not None:
            self._loop.call_soon_threadsafe(flight.task.cancel)

    def _end(self, key: int, f: _Flight, ev: Finished) -> None:
        """The request's last event, once it no longer counts in :meth:`stats`."""
        with self._lock:
            self._flights.pop(key, None)
        f.handle.emit(ev)

    async def _attempt(self, key: int, f: _Flight, streams: list) -> bool:
        """One try: prefill on ``f.prefill``, stream from ``f.decode``; True once the request finished."""
        req = f.req
        transfer = self._prefill_routed(f)
        stream = self._decode[f.decode].generate.options(num_returns="streaming").remote(req, transfer)
        streams[:] = [stream]
        async for ref in stream:
            ev = await ref
            f.started = True
            if isinstance(ev, Finished):
                self._end(key, f, ev)
                return True
            f.tokens += 1
            f.handle.emit(ev)
        return False

    def _prefill_routed(self, f: _Flight):
        """Start ``f``'s prefill on ``f.prefill``; the router learns what that replica holds when it ends. Returns
        the transfer's reference."""
        req, i = f.req, f.prefill
        transfer, report = self._prefill[i].prefill_routed.options(num_returns=2).remote(
            req.request_id, req.prompt, req.sampling)
        ticket = f.ticket if f.ticket is not None else self.router.dispatched(i, req.prompt)   # a retry: anew
        f.ticket = None

        async def learn():
            try:
                self.router.reported(i, ticket, await report)
            except BaseException:   # noqa: BLE001 - the call failed or was cancelled: its prompt is not held
                self.router.dropped(i, ticket)

        task = asyncio.ensure_future(learn())
        self._learning.add(task)
        task.add_done_callback(self._learning.discard)
        return transfer

    async def _run(self, key: int, f: _Flight) -> None:
        ray, req = self._ray, f.req
        streams: list = []
        deadline = time.monotonic() + RESTART_WAIT
        try:
            while True:
                try:
                    if not await self._attempt(key, f, streams):
                        self._end(key, f, Finished("error", len(req.prompt), 0, f.tokens, "the decode replica ended "
                                                   "the stream without finishing the request"))
                    return
                except ray.exceptions.ActorUnavailableError:
                    # a replica restarting refused the call before running it: nothing was generated, try again
                    # (another replica where there is one) until it is back, for at most RESTART_WAIT seconds
                    if f.started or time.monotonic() > deadline:
                        raise
                    with self._lock:
                        f.prefill = self._pick(lambda g: g.prefill, "prefill", started=False, avoid=f.prefill,
                                               prompt=req.prompt)
                        f.decode = self._pick(lambda g: g.decode, "decode", avoid=f.decode)
                    await asyncio.sleep(0.25)
        except asyncio.CancelledError:
            stream = streams[0] if streams else None
            if stream is not None:
                try:
                    ray.cancel(stream)
                except Exception:   # noqa: BLE001 - already finished or the replica is gone
                    pass
            self._end(key, f, Finished("cancelled", len(req.prompt), 0, f.tokens))
        except Exception as exc:   # noqa: BLE001 - a failed or dead replica: this request ends, the rest go on
            where = "decode" if f.started else "prefill or decode"
            with self._lock:
                self._counts["replica_errors"] += 1
            cause = getattr(exc, "cause", None)
            if isinstance(cause, QeffKvError):   # the replica refused the request (one line of ours)
                msg = str(cause)
            else:
                msg = f"{where} replica failed: {_one_line(exc)}"
            self._end(key, f, Finished("error", len(req.prompt), 0, f.tokens, msg))
        finally:
            with self._lock:
                self._flights.pop(key, None)
            if f.ticket is not None:   # cancelled before its prefill was sent: its prompt is held nowhere
                self.router.dropped(f.prefill, f.ticket)

    def stats(self) -> dict:
        with self._lock:
            flights = list(self._flights.values())
            out = {"queue_depth": sum(1 for f in flights if not f.started),
                   "sequences_active": sum(1 for f in flights if f.started),
                   "kv_bytes_used": 0, "prompt_tokens_reused": 0, "max_sequences": self.max_sequences,
                   "prefill_replicas": len(self._prefill), "decode_replicas": len(self._decode), **self._counts,
                   **self.router.stats()}
        self._refresh_outside_event_loops()
        replicas = self.watch.figures()   # the watch's last readings: no route waits on Ray
        for key in ("kv_bytes_used", "kv_bytes_capacity", "handoffs", "handoff_bytes", "handoff_prefill_s",
                    "handoff_extract_s", "decode_steps", "prompt_tokens_reused"):
            vals = [r.get(key, 0) for r in replicas]
            if vals:
                out[key] = sum(vals)
        return out

    def _refresh_outside_event_loops(self) -> None:
        """A caller on a plain thread (a script, a test, the benchmark) gets figures read now; one on an event loop
        (an HTTP route) gets the watch's last reading at once: it never waits on Ray."""
        try:
            asyncio.get_running_loop()
            return
        except RuntimeError:
            pass
        if self._closed:
            return
        try:
            asyncio.run_coroutine_threadsafe(self.watch.read_all(), self._loop).result(timeout=10)
        except Exception:   # noqa: BLE001 - a replica restarting: its figures are missing from this reading
            pass

    def slots(self) -> list[dict]:
        """Not available (``GET /slots`` answers 501): the sequences live in the replicas, not in one slot table."""
        raise NotImplementedError(SLOTS_UNSUPPORTED)

    def health(self) -> str | None:
        if self._closed:
            return "the engine is closed"
        return self.watch.problem()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            tasks = [f.task for f in self._flights.values() if f.task is not None]
        self._watching.cancel()
        for t in tasks:
            self._loop.call_soon_threadsafe(t.cancel)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with self._lock:
                if not self._flights:
                    break
            time.sleep(0.02)
        for a in self._prefill + self._decode:
            try:
                self._ray.kill(a, no_restart=True)
            except Exception:   # noqa: BLE001
                pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        if self._owns_ray and self._ray.is_initialized():
            self._ray.shutdown()

    # ---- for tests and the benchmark
    @property
    def prefill_actors(self) -> list:
        return list(self._prefill)

    @property
    def decode_actors(self) -> list:
        return list(self._decode)


# ============================================================================================ start-up
def start_disaggregated(config: ServeConfig) -> DisaggregatedEngine:
    """Start (or join, ``config.ray_address``) Ray, the prefill and decode replicas, check the pair, and return
    the engine. Without an address a local Ray instance is started and stopped by the engine's ``close()``."""
    from ..limits import positive_int
    from ..runtime.model_files import resolve_model
    from .session_from_config import model_name_of

    ray = _ray()
    for label, n in (("--prefill-replicas", config.prefill_replicas), ("--decode-replicas", config.decode_replicas)):
        positive_int(label, n)
    pre_export = config.prefill_export or config.export_dir
    resolve_model(config.export_dir)   # one-line errors for a bad path before any actor starts
    resolve_model(pre_export)
    owns = _join_or_start(ray, config.ray_address)
    try:
        opts, threads = _replica_options(ray, config)
    except RuntimeInputError:
        if owns:
            ray.shutdown()
        raise
    Pre = ray.remote(PrefillWorker).options(**opts["prefill"])
    Dec = ray.remote(DecodeWorker).options(**opts["decode"])
    pre = [Pre.remote(pre_export, config.ctx_len, config.prefill_seq_len, threads, config.reuse_prompts,
                      kv_events=(config, i) if config.kv_events is not None else None,
                      checkpoint_every=config.checkpoint_every, max_checkpoints=config.max_checkpoints)
           for i in range(config.prefill_replicas)]
    dec = [Dec.remote(config, threads) for _ in range(config.decode_replicas)]

    def give_up(message: str):
        for a in pre + dec:
            ray.kill(a, no_restart=True)
        if owns:
            ray.shutdown()
        raise RuntimeInputError(message)

    try:
        got = ray.get([a.facts.remote() for a in pre + dec], timeout=START_TIMEOUT)
    except Exception as exc:   # noqa: BLE001 - a replica could not load its export
        give_up(f"a replica failed to start: {_one_line(exc)}")
    pre_facts, dec_facts = got[0], got[len(pre)]
    why = pair_refusal(pre_facts, dec_facts)
    if why is not None:
        give_up(why)
    return DisaggregatedEngine(pre, dec, model_name=config.model_name or model_name_of(config.export_dir),
                               decode_facts=dec_facts, max_queue=config.max_queue, owns_ray=owns,
                               route=config.route)


def _replica_options(ray, config: ServeConfig) -> tuple[dict, int]:
    """The Ray actor options of each kind of replica (CPUs, custom resources, restarts) and the onnxruntime threads
    of each, once the cluster has the CPUs free (it waits up to RESOURCE_WAIT seconds) and the custom resources."""
    n_actors = config.prefill_replicas + config.decode_replicas
    cluster = ray.cluster_resources()
    cpus = float(cluster.get("CPU", 1.0))
    share = min(1.0, cpus / n_actors)
    # onnxruntime threads: the cores split between the replicas, so that they do not oversubscribe them
    threads = config.threads or max(1, int(cpus // n_actors))
    opts = dict(num_cpus=share, max_restarts=-1, max_task_retries=0)   # restarts budgeted by ReplicaWatch
    out = {}
    for kind, wanted, n in (("prefill", config.prefill_resources, config.prefill_replicas),
                            ("decode", config.decode_resources, config.decode_replicas)):
        out[kind] = dict(opts, resources=_checked_resources(kind, wanted, n, cluster)) if wanted else dict(opts)
    need = share * n_actors
    deadline = time.monotonic() + RESOURCE_WAIT   # CPUs of replicas just killed come back within moments
    while ray.available_resources().get("CPU", 0.0) + 1e-6 < need:
        if time.monotonic() > deadline:
            free = ray.available_resources().get("CPU", 0.0)
            raise RuntimeInputError(f"the Ray cluster has {free:g} of {cpus:g} CPUs free; {n_actors} replicas "
                                    f"need {need:g}")
        time.sleep(0.1)
    return out, threads


def _checked_resources(kind: str, wanted: dict, replicas: int, cluster: dict) -> dict[str, float]:
    """``--{kind}-resources`` checked against the cluster's resources: one line naming what is missing (Ray would
    leave the replicas pending for ever)."""
    option = f"--{kind}-resources"
    out = {}
    for name, amount in wanted.items():
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not 0 < amount < float("inf"):
            raise RuntimeInputError(f"{option}: the amount of {name!r} must be a positive number, got {amount!r}")
        if name in ("CPU", "GPU", "memory", "object_store_memory"):
            raise RuntimeInputError(f"{option}: {name!r} is not a custom resource (the replicas' CPUs are set by "
                                    "the engine)")
        have = float(cluster.get(name, 0.0))
        if have + 1e-9 < amount * replicas:
            custom = sorted(k for k in cluster if k not in ("CPU", "GPU", "memory", "object_store_memory")
                            and not k.startswith("node:") and not k.startswith("accelerator_type:"))
            raise RuntimeInputError(f"{option}: {replicas} {kind} replica(s) need {amount * replicas:g} of "
                                    f"{name!r}; the Ray cluster has {have:g} (its custom resources: "
                                    f"{', '.join(custom) or 'none'})")
        out[str(name)] = float(amount)
    return out


def _join_or_start(ray, address: str | None) -> bool:
    """Join the cluster at ``address``, or start a local instance (True: this process owns it); nothing when Ray
    already runs in this process."""
    if ray.is_initialized():
        return False
    kw = dict(include_dashboard=False, logging_level="warning", log_to_driver=False)
    if not address:
        with _loopback_node(ray):
            ray.init(num_cpus=os.cpu_count() or 2, _node_ip_address=LOOPBACK, **kw)
        return True
    check_ray_address(address)
    try:
        ray.init(address=address, **kw)
    except Exception as exc:   # noqa: BLE001 - Ray's own errors, many lines: one line of ours
        raise RuntimeInputError(f"--ray-address {address}: cannot join the cluster ({_one_line(exc)})") from None
    return False


@contextlib.contextmanager
def _loopback_node(ray):
    """While a local Ray instance starts: its node address is 127.0.0.1, so that every process it starts listens
    on the loopback interface only.

    Facts of Ray 2.60: the GCS server, the raylet (node manager and object manager) and each worker's gRPC server
    listen on ``127.0.0.1`` when the node's IP address is ``127.0.0.1``, else on every interface; the runtime-env
    and dashboard agents listen on the node's IP address; ``include_dashboard=False`` starts no dashboard. But
    ``ray.init(_node_ip_address="127.0.0.1")`` replaces a loopback address by the machine's own (``services.
    resolve_ip_for_localhost``) unless ``ray_constants.ENABLE_RAY_CLUSTER`` is false, which the environment variable
    ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` sets for this process (read when Ray is imported: set here on the module
    too, then put back) and for the processes Ray starts (they inherit the environment while it is set: the GCS
    server, the raylet and the agents now; the raylet hands its environment to the workers it starts later)."""
    constants = ray._private.ray_constants
    before = os.environ.get(_RAY_LOOPBACK_ENV), constants.ENABLE_RAY_CLUSTER
    os.environ[_RAY_LOOPBACK_ENV] = "0"
    constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        constants.ENABLE_RAY_CLUSTER = before[1]
        if before[0] is None:
            os.environ.pop(_RAY_LOOPBACK_ENV, None)
        else:
            os.environ[_RAY_LOOPBACK_ENV] = before[0]


def check_ray_address(address: str) -> None:
    """A ``host:port`` or ``ray://host:port`` address answers a TCP connection within RAY_CONNECT_TIMEOUT seconds
    (Ray itself retries for minutes); ``auto`` and other forms are left to Ray."""
    import socket

    rest = address[len("ray://"):] if address.startswith("ray://") else address
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isascii() or not port.isdigit() or not host:
        return
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=RAY_CONNECT_TIMEOUT):
            pass
    except OSError as exc:
        raise RuntimeInputError(f"--ray-address {address}: nothing answers there ({exc.strerror or exc}); is the "
                                "Ray cluster running?") from None
