"""Disaggregated prefill/decode on Ray (``qeff-kv serve --disaggregate``; needs the ``[ray]`` extra).

Two kinds of Ray actors (plain actors, restarted by Ray whenever they die, within the per-window budget that
:class:`~.replicas.ReplicaWatch` keeps; a call in flight when one dies fails instead of running again:
``max_task_retries=0``):

* :class:`PrefillWorker`: a :class:`~qeff_kv.runtime.Session` on the prefill export. ``prefill`` prefills a
  prompt, samples the first token with the request's sampling and returns a
  :class:`~qeff_kv.serve.cluster.transfer.KVTransfer` (the valid positions of the selected KV buffers) through Ray's
  object store (numpy arrays travel without pickling their data);
* :class:`DecodeWorker` (an async actor): a :class:`~qeff_kv.serve.engine.scheduler.Scheduler` over the decode
  export's session (continuous batching across requests). ``generate`` is a streaming generator: it admits the
  handed-off sequence (``GenerationRequest(state=...)``: imported, not prefilled) and yields its
  :class:`~qeff_kv.serve.engine.engine.TokenOut` / :class:`~qeff_kv.serve.engine.engine.Finished` events.

:class:`DisaggregatedEngine` is the frontend's :class:`~qeff_kv.serve.engine.engine.Engine`: per request it picks the
prefill replica holding the longest prefix of the prompt, else the least loaded (:mod:`.routing`; ``--route
load``: by load alone), and the least-loaded decode replica (ties: round-robin), passes the prefill's result *by
reference* to the decode call (the KV goes from the prefill worker to the decode worker, not through the
frontend), and turns the Ray stream into a :class:`~qeff_kv.serve.engine.engine.RequestHandle`. A replica that dies ends its requests in
flight with ``Finished(finish_reason="error")``; Ray restarts it and the engine keeps serving. The engine's
figures and health come from the watch's last readings: no HTTP route waits on Ray.

LoRA adapters (``--lora-modules``): every replica loads them at start (the same ids everywhere); a request's adapter
goes with it to its prefill replica (a sequence of that adapter, reusing only that adapter's prompts) and its decode
replica (the handed-off sequence runs with it). They are not loaded or unloaded at run time here.

The prefill and decode exports may differ (e.g. an fp32 portable prefill and an int4 fused decode) when they
are exports of one checkpoint with one KV contract; a pair that is not is refused at start-up in one line
(:func:`qeff_kv.serve.cluster.transfer.pair_refusal`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import threading
import time

from qeff_kv.errors import QeffKvError, QueueFullError, RuntimeInputError, UnavailableError
from qeff_kv.serve.cluster import routing
from qeff_kv.serve.cluster.disagg_config import DisaggregateSection
from qeff_kv.serve.cluster.kv_events import KVEventsSection
from qeff_kv.serve.engine.session_from_config import EngineSection, ServedModel
from qeff_kv.serve.engine.engine import Engine, Finished, GenerationRequest, RequestHandle, check_request
from qeff_kv.serve.engine.lora import LoraSection, open_adapters, served_table
from qeff_kv.serve.cluster.kv_connector import InBandConnector
from qeff_kv.serve.cluster.ray_cluster import join_or_start, one_line, ray_module, replica_options
from qeff_kv.serve.cluster.replicas import ReplicaWatch
from qeff_kv.runtime.memory.prefix_cache import MIN_REUSE
from qeff_kv.serve.cluster.transfer import Prefiller, facts, pair_refusal

#: seconds to wait for the replicas to load their exports at start-up
START_TIMEOUT = 300.0
#: seconds a request not yet started waits for a restarting replica before it fails
RESTART_WAIT = 60.0
#: why ``/slots`` is not available with --disaggregate (HTTP 501)
SLOTS_UNSUPPORTED = ("/slots is not available with --disaggregate: sequences live in the Ray replicas (prompts kept "
                     "for reuse on the prefill replicas, running requests on the decode replicas), not in one slot "
                     "table; see /metrics for their figures")




# ============================================================================================ actors
class PrefillWorker:
    """The prefill replica (a Ray actor): one request at a time."""

    def __init__(self, model: ServedModel | str, engine: EngineSection, reuse_prompts: bool = True,
                 kv_events: tuple | None = None, lora: LoraSection | None = None):
        from qeff_kv.serve.cluster.kv_events import open_publisher
        from qeff_kv.serve.engine.session_from_config import open_prefill_session

        session = open_prefill_session(engine, model)
        adapters = open_adapters(lora or LoraSection(), session, _name(model))
        # --kv-events: (section, rank): this replica publishes on the endpoint's port + rank
        self.kv_events = (open_publisher(*kv_events, kv_dtype=session.layout.kv_dtype) if kv_events is not None
                          else None)
        if self.kv_events is not None and adapters is not None:
            self.kv_events.lora_ids = adapters.lora_id
        self.prefiller = Prefiller(session, reuse=reuse_prompts, kv_events=self.kv_events)
        self.connector = InBandConnector()   # the transfer goes back through Ray's object store as the return value

    def facts(self) -> dict:
        return facts(self.prefiller.session)

    def prefill(self, request_id: str, prompt, sampling, lora=None):
        return self.connector.save(request_id, self.prefiller.run(request_id, prompt, sampling, lora))

    calls = 0   # prefill_routed calls of this process (orders its reports)

    def prefill_routed(self, request_id: str, prompt, sampling, lora=None):
        """:meth:`prefill`, and what the replica keeps afterwards for the router (two returns: the transfer goes
        to the decode replica by reference, the report to the frontend; :mod:`.routing`)."""
        out = self.connector.save(request_id, self.prefiller.run(request_id, prompt, sampling, lora))
        self.calls += 1
        return out, routing.report(self.prefiller.prefix_cache, out.cached_tokens, self.calls,
                                   os.getpid())

    def longest_prefix(self, prompt) -> int:
        """The longest prefix of ``prompt`` this replica would reuse (:meth:`Prefiller.longest_prefix`)."""
        return self.prefiller.longest_prefix(prompt)

    def stats(self) -> dict:
        return {"prompt_tokens_reused": self.prefiller.reused_tokens, "pid": os.getpid()}


def _name(model: ServedModel | str) -> str:
    return model if isinstance(model, str) else model.name

    def pid(self) -> int:
        return os.getpid()


class DecodeWorker:
    """The decode replica (an async Ray actor): a Scheduler admitting handed-off sequences."""

    def __init__(self, model: ServedModel | str, engine: EngineSection, lora: LoraSection | None = None):
        from qeff_kv.serve.engine.scheduler import Scheduler
        from qeff_kv.serve.engine.session_from_config import open_session

        session = open_session(engine, model)
        self.scheduler = Scheduler(session, max_queue=engine.max_queue, reuse_prompts=False,
                                   adapters=open_adapters(lora or LoraSection(), session, _name(model)))
        self.connector = InBandConnector()
        self.handoffs = {"handoffs": 0, "handoff_bytes": 0, "handoff_prefill_s": 0.0, "handoff_extract_s": 0.0}

    async def facts(self) -> dict:
        return facts(self.scheduler.session)

    async def stats(self) -> dict:
        return {**self.scheduler.stats(), **self.handoffs, "pid": os.getpid()}

    async def pid(self) -> int:
        return os.getpid()

    async def generate(self, req: GenerationRequest, transfer):
        """Admit ``transfer`` (a :class:`~qeff_kv.serve.cluster.transfer.KVTransfer`) for ``req``; yield its events."""
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
        self._ray = ray_module()
        self.router = routing.PrefixRouter(len(prefill_actors), min_reuse=MIN_REUSE, mode=route)
        self._learning: set = set()   # the router's tasks awaiting prefill reports
        self._prefill, self._decode = list(prefill_actors), list(decode_actors)
        self.model_name = model_name
        self.ctx_len = int(decode_facts["ctx_len"])
        self.kv_cache_dtype = decode_facts.get("kv_dtype")
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
            req.request_id, req.prompt, req.sampling, req.lora)
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
                msg = f"{where} replica failed: {one_line(exc)}"
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
def start_disaggregated(model: ServedModel, engine: EngineSection, section: DisaggregateSection,
                        events: KVEventsSection | None = None, lora: LoraSection | None = None) -> DisaggregatedEngine:
    """Start (or join, ``section.ray_address``) Ray, the prefill and decode replicas of ``model`` (the decode
    export; the prefill replicas': ``section.prefill_export``, else the same), check the pair, and return the
    engine. Without an address a local Ray instance is started and stopped by the engine's ``close()``."""
    from qeff_kv.support.limits import positive_int
    from qeff_kv.serve.engine.session_from_config import served_model

    ray = ray_module()
    for label, n in (("--prefill-replicas", section.prefill_replicas), ("--decode-replicas", section.decode_replicas)):
        positive_int(label, n)
    pre_model = served_model(section.prefill_export) if section.prefill_export else model   # a bad path: one line
    owns = join_or_start(ray, section.ray_address)
    try:
        opts, threads = replica_options(ray, section, engine.threads)
    except RuntimeInputError:
        if owns:
            ray.shutdown()
        raise
    engine = dataclasses.replace(engine, threads=threads)
    Pre = ray.remote(PrefillWorker).options(**opts["prefill"])
    Dec = ray.remote(DecodeWorker).options(**opts["decode"])
    pre = [Pre.remote(pre_model, engine, engine.reuse_prompts, kv_events=(events, i) if events is not None else None,
                      lora=lora) for i in range(section.prefill_replicas)]
    dec = [Dec.remote(model, engine, lora) for _ in range(section.decode_replicas)]

    def give_up(message: str):
        for a in pre + dec:
            ray.kill(a, no_restart=True)
        if owns:
            ray.shutdown()
        raise RuntimeInputError(message)

    try:
        got = ray.get([a.facts.remote() for a in pre + dec], timeout=START_TIMEOUT)
    except Exception as exc:   # noqa: BLE001 - a replica could not load its export
        give_up(f"a replica failed to start: {one_line(exc)}")
    pre_facts, dec_facts = got[0], got[len(pre)]
    why = pair_refusal(pre_facts, dec_facts)
    if why is not None:
        give_up(why)
    eng = DisaggregatedEngine(pre, dec, model_name=model.name, decode_facts=dec_facts, max_queue=engine.max_queue,
                              owns_ray=owns, route=section.route)
    eng.adapters = served_table(lora or LoraSection(), model.name) if dec_facts.get("lora") else None
    return eng
