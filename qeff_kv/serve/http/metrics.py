"""Prometheus metrics of one app, in its own ``CollectorRegistry`` (two apps in one process never collide).

Counters and histograms are updated by the frontend as requests run (so they mean the same for every engine);
the gauges read :meth:`Engine.stats` at scrape time.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

#: seconds; TTFT spans queueing and prefill, ITL one decode step
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
OUTCOMES = ("stop", "length", "cancelled", "error", "rejected")

#: gauge name -> (Engine.stats() key, help)
GAUGES = {
    "qeff_kv_queue_depth": ("queue_depth", "Requests waiting for a sequence slot."),
    "qeff_kv_sequences_active": ("sequences_active", "Sequences prefilling or decoding."),
    "qeff_kv_sequences_cached": ("sequences_cached", "Finished sequences kept for prompt reuse."),
    "qeff_kv_kv_bytes_used": ("kv_bytes_used", "KV cache bytes holding valid positions (active and cached sequences)."),
    "qeff_kv_kv_bytes_capacity": ("kv_bytes_capacity", "KV cache bytes allocated."),
    "qeff_kv_lora_adapters": ("lora_adapters", "LoRA adapters served."),
}


#: counter name -> (Engine.stats() key, help), when the engine does it: speculative decoding (``--speculative``),
#: routing across prefill replicas (``--disaggregate``)
COUNTERS = {
    "qeff_kv_speculative_draft_tokens": ("speculative_drafted", "Drafted tokens verified (speculative decoding)."),
    "qeff_kv_speculative_accepted_tokens": ("speculative_accepted",
                                            "Drafted tokens accepted (equal to plain decoding's pick)."),
    "qeff_kv_speculative_verifications": ("speculative_verifications", "Decode steps that verified drafts."),
    # LoRA adapters (serve/engine/lora.py)
    "qeff_kv_lora_mixed_decode_steps": ("lora_mixed_steps",
                                        "Decode steps whose rows ran more than one adapter (the base model counts)."),
    # --kv-events (serve/kv_events.py)
    "qeff_kv_kv_events_batches": ("kv_events_batches", "KV event batches queued for the ZeroMQ publisher."),
    "qeff_kv_kv_events_dropped": ("kv_events_dropped",
                                  "KV event batches dropped, oldest first, because the publisher's queue was full."),
    # ---- routing across prefill replicas (--disaggregate; qeff_kv.serve.cluster.routing)
    "qeff_kv_route_prefix_hits": ("route_prefix_hits",
                                  "Requests sent to a prefill replica holding a prefix of their prompt."),
    "qeff_kv_route_prefix_misses": ("route_prefix_misses",
                                    "Requests sent to a prefill replica holding no prefix of their prompt (by load)."),
    "qeff_kv_route_prefix_tokens_reused": ("route_tokens_reused",
                                           "Prompt tokens reused by the prefill replicas requests were routed to "
                                           "(prefix hits)."),
    "qeff_kv_route_decision_seconds": ("route_decision_s", "Time spent choosing prefill replicas."),
    # disaggregated serving (--disaggregate): what went from the prefill replicas to the decode replicas
    "qeff_kv_handoffs": ("handoffs", "KV states handed from a prefill replica to a decode replica."),
    "qeff_kv_handoff_bytes": ("handoff_bytes", "Bytes of the KV states handed off (the valid positions only)."),
    # vLLM's P/D protocol (--kv-role, serve/pd.py)
    "qeff_kv_kv_saves": ("kv_saves", "Prefilled sequences held for a consumer (producer)."),
    "qeff_kv_kv_save_bytes": ("kv_save_bytes", "Bytes of KV held for consumers: valid positions only (producer)."),
    "qeff_kv_kv_loads": ("kv_loads", "Held sequences taken from a producer and imported (consumer)."),
    "qeff_kv_kv_load_bytes": ("kv_load_bytes", "Bytes of KV taken from producers (consumer)."),
    "qeff_kv_kv_load_failures": ("kv_load_failures", "Held states a consumer could not get (timed out, gone)."),
    "qeff_kv_kv_load_fallbacks": ("kv_load_fallbacks", "Requests whose state could not be had, prefilled here."),
    "qeff_kv_kv_save_seconds": ("kv_save_seconds", "Seconds holding states: extract, object store, hold (producer)."),
    "qeff_kv_kv_load_seconds": ("kv_load_seconds", "Seconds taking states: find, take, fetch (consumer)."),
    "qeff_kv_kv_hold_evictions": ("kv_hold_evictions",
                                  "Held states dropped, oldest first, to keep the holder's count and byte caps."),
    "qeff_kv_kv_hold_refusals": ("kv_hold_refusals", "States not held: larger alone than the holder's byte cap."),
    "qeff_kv_kv_take_refusals": ("kv_take_refusals",
                                 "Consumer requests refused against a held state's facts (left held for its owner)."),
}


class _EngineGauges:
    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        stats = self.engine.stats()
        for name, (key, doc) in GAUGES.items():
            if key in stats:
                g = GaugeMetricFamily(name, doc)
                g.add_metric([], float(stats[key]))
                yield g
        for name, (key, doc) in COUNTERS.items():
            if key in stats:
                yield CounterMetricFamily(name, doc, value=float(stats[key]))


class Metrics:
    def __init__(self, engine, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter("qeff_kv_requests", "Requests by outcome (finish reason, or rejected before running).",
                                ["outcome"], registry=r)
        for o in OUTCOMES:
            self.requests.labels(o)
        self.prompt_tokens = Counter("qeff_kv_prompt_tokens", "Prompt tokens of requests that ran.", registry=r)
        self.generated_tokens = Counter("qeff_kv_generation_tokens", "Tokens generated.", registry=r)
        self.reused_tokens = Counter("qeff_kv_prompt_tokens_reused",
                                     "Prompt tokens taken from kept sequences instead of being prefilled.", registry=r)
        self.ttft = Histogram("qeff_kv_time_to_first_token_seconds", "From request arrival to its first token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("qeff_kv_inter_token_latency_seconds", "Between two tokens of one request.",
                             buckets=ITL_BUCKETS, registry=r)
        r.register(_EngineGauges(engine))

    def finished(self, fin) -> None:
        self.requests.labels(fin.finish_reason).inc()
        self.prompt_tokens.inc(fin.prompt_tokens)
        self.generated_tokens.inc(fin.completion_tokens)
        self.reused_tokens.inc(fin.cached_tokens)

    def rejected(self) -> None:
        self.requests.labels("rejected").inc()
