"""The options of ``qeff-kv serve`` as one dataclass: the CLI fills it, :func:`qeff_kv.serve.server.build_engine`
and :func:`qeff_kv.serve.cluster.disagg.start_disaggregated` read it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ServeConfig:
    #: the export folder (or .onnx file) to serve; the decode engine's model when disaggregated
    export_dir: str
    host: str = "127.0.0.1"
    port: int = 8000
    #: sequences generated at once (slots of a continuous-batching graph, or rows run in lock step); default:
    #: the export's full_batch_size, else 4
    max_sequences: int | None = None
    #: onnxruntime intra-op threads (default: onnxruntime's choice)
    threads: int | None = None
    #: where the graph runs: "cpu", or "cuda" (for the kinds proved there: qeff_kv/runtime/execution/ep_proofs.py)
    device: str = "cpu"
    #: a bearer token every /v1 and /slots request must carry (``Authorization: Bearer KEY``); None: open
    api_key: str | None = None
    #: requests waiting for a sequence slot beyond which new ones get 429
    max_queue: int = 64
    #: request bodies larger than this get a 413 before they are read (None: the default of serve/bodies.py)
    max_request_bytes: int | None = None
    #: after SIGTERM: seconds running requests may take to finish before they are stopped with an error
    drain_seconds: float | None = None
    #: folder of slot state files (POST /slots/{id}?action=save|restore); None: slot actions are refused
    state_dir: str | None = None
    ctx_len: int | None = None
    prefill_seq_len: int | None = None
    #: prompt tokens fed per engine turn, between two decode steps (default: the prefill length), or "auto"
    prefill_chunk: int | str | None = None
    #: keep finished sequences and start new prompts from their longest common prefix
    reuse_prompts: bool = True
    #: recurrent/hybrid graphs: checkpoint the recurrent state every N positions, keep at most N per sequence
    #: (None: the runtime's defaults); prompt reuse returns to checkpoints
    checkpoint_every: int | None = None
    max_checkpoints: int | None = None
    #: the name /v1/models lists and requests give as "model" (default: the export folder's name)
    model_name: str | None = None
    #: speculative decoding on a graph exported with --speculative-tokens K: "lookup" (prompt lookup) or the
    #: folder of a draft export of the same tokenizer; None: plain decoding
    speculative: str | None = None
    #: drafts per sequence and step with ``speculative`` (default and maximum: the graph's K)
    speculative_k: int | None = None
    # ---- sampling defaults for fields a request leaves out (None: generation_config.json, else OpenAI's)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    #: default max_tokens (None: generation_config.json's max_new_tokens, else what the context holds)
    max_tokens: int | None = None
    #: the largest ``n`` (choices per request) accepted (default: the sequences run at once)
    max_n: int | None = None
    #: browser origins allowed by CORS ("*": any); None: CORS off
    allowed_origins: list[str] | None = None
    #: vision-language exports: ``image_url`` parts may name local files under this folder (vLLM's
    #: --allowed-local-media-path); None: data: URLs only
    allowed_local_media_path: str | None = None
    # ---- disaggregated serving (Ray): prefill replicas hand KV states to decode replicas
    disaggregate: bool = False
    prefill_replicas: int = 1
    decode_replicas: int = 1
    #: the prefill replicas' export (default: export_dir); must share the decode export's KV contract/checkpoint
    prefill_export: str | None = None
    #: an existing Ray cluster ("auto", "ray://host:10001"); None: start a local one (listening on 127.0.0.1 only)
    ray_address: str | None = None
    # ---- KV cache events in vLLM's format (serve/kv_events.py): where the ZeroMQ PUB socket binds, or None
    kv_events: str | None = None
    kv_events_block_size: int = 16
    kv_events_topic: str = "kv-events"
    #: where the replay ROUTER socket binds, or None (no replay)
    kv_events_replay: str | None = None
    #: how a request's prefill replica is chosen: "prefix" (the one holding the longest prefix of its prompt, else
    #: the least loaded) or "load" (the least loaded); see qeff_kv.serve.cluster.routing
    route: str = "prefix"
    #: Ray custom resources each prefill / decode replica asks for ({"qeffkv_prefill": 1}): with nodes started with
    #: ``ray start --resources``, this places the replicas on chosen nodes (e.g. prefill and decode on two hosts)
    prefill_resources: dict[str, float] | None = None
    decode_resources: dict[str, float] | None = None
    # ---- vLLM's P/D protocol between separate servers (serve/pd.py): "producer", "consumer" or "both"; None: off
    kv_role: str | None = None
    #: seconds a producer holds a state no consumer took (then Ray frees it)
    kv_hold_seconds: float = 60.0
