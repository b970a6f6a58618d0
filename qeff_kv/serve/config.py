"""The options of ``qeff-kv serve`` as one dataclass: the CLI fills it (its click options are named as the
fields), :meth:`ServeConfig.check` refuses bad values and combinations once, before anything is loaded, and
:func:`qeff_kv.serve.server.build_engine` and :func:`qeff_kv.serve.cluster.disagg.start_disaggregated` read it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from qeff_kv.errors import RuntimeInputError
from qeff_kv.runtime.decoding.sampling import DEFAULTED as SAMPLING_DEFAULTED
from qeff_kv.runtime.execution import ep_proofs

#: the options that only the disaggregated engine reads, with their defaults (given otherwise: refused)
DISAGGREGATE_ONLY = {"prefill_export": None, "prefill_replicas": 1, "decode_replicas": 1, "prefill_resources": None,
                     "decode_resources": None, "route": "prefix"}


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
    #: browser origins allowed by CORS ("*": any); None: CORS off. A string is read as a comma-separated list
    allowed_origins: list[str] | str | None = None
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

    def __post_init__(self) -> None:
        if isinstance(self.allowed_origins, str):   # "--allowed-origins a,b": the list
            self.allowed_origins = [o.strip() for o in self.allowed_origins.split(",") if o.strip()] \
                if self.allowed_origins else None

    def sampling_flags(self) -> dict:
        """The sampling defaults given (field -> value, ``None`` where not given): the sampling fields a server
        default fills (:data:`~qeff_kv.runtime.decoding.sampling.DEFAULTED`) and ``max_tokens``."""
        return {k: getattr(self, k) for k in (*SAMPLING_DEFAULTED, "max_tokens")}

    def check(self) -> None:
        """Refuse bad options before anything is loaded (one line each). Creates nothing: the state folder is
        made once the server is about to serve."""
        self._check_disaggregate_only()
        ep_proofs.require(ep_proofs.resolve(self.device, None))   # a device proved for no graph kind: refused now
        if self.state_dir is not None:
            if self.disaggregate:
                raise RuntimeInputError("--state-dir does not go with --disaggregate (slot actions need the local "
                                        "engine)")
            _check_folder_path(Path(self.state_dir))
        if self.api_key is not None:
            check_api_key(self.api_key)
        if self.model_name is not None and (not self.model_name.strip() or len(self.model_name) > 256 or
                                            not self.model_name.isprintable()):
            raise RuntimeInputError(f"--model-name must be 1-256 printable characters, got {self.model_name!r}")
        if not 0 <= self.port <= 65535:
            raise RuntimeInputError(f"--port must be in [0, 65535], got {self.port}")
        if self.max_request_bytes is not None and self.max_request_bytes < 1024:
            raise RuntimeInputError(f"--max-request-bytes must be at least 1024, got {self.max_request_bytes}")
        if self.drain_seconds is not None and not 0 <= self.drain_seconds <= 3600:
            raise RuntimeInputError(f"--drain-seconds must be in [0, 3600], got {self.drain_seconds}")
        if self.speculative is not None and self.disaggregate:
            raise RuntimeInputError("--speculative does not go with --disaggregate (the decode replicas decode "
                                    "plainly)")
        if self.speculative_k is not None and self.speculative is None:
            raise RuntimeInputError("--speculative-k goes with --speculative")
        from qeff_kv.serve.cluster.kv_events import check_options

        check_options(self)
        self._check_kv_role()

    def _check_disaggregate_only(self) -> None:
        if self.disaggregate:
            return
        given = [k for k, default in DISAGGREGATE_ONLY.items() if getattr(self, k) != default]
        if given or (self.ray_address and not self.kv_role):
            raise RuntimeInputError("--prefill-replicas, --decode-replicas, --prefill-export, --ray-address, "
                                    "--route, --prefill-resources and --decode-resources go with --disaggregate "
                                    "(--ray-address also with --kv-role)")

    def _check_kv_role(self) -> None:
        """``--kv-role`` (vLLM's P/D protocol) with its options; not with the in-process disaggregated engine."""
        from qeff_kv.serve.cluster.kv_connector import ROLES

        if self.kv_role is None:
            return
        if self.kv_role not in ROLES:
            raise RuntimeInputError(f"--kv-role must be one of {', '.join(ROLES)}, got {self.kv_role!r}")
        if self.disaggregate:
            raise RuntimeInputError("--kv-role does not go with --disaggregate (a P/D server is one engine; its peer "
                                    "is another qeff-kv serve)")
        if self.speculative is not None:
            raise RuntimeInputError("--kv-role does not go with --speculative")
        if not 0 < self.kv_hold_seconds <= 3600:
            raise RuntimeInputError(f"--kv-hold-seconds must be in (0, 3600], got {self.kv_hold_seconds:g}")


def check_api_key(key: str) -> None:
    """A key a client can send: printable ASCII without leading or trailing spaces (HTTP strips those from the
    header, so such a key could never match)."""
    if not key.strip():
        raise RuntimeInputError("--api-key is empty")
    if key != key.strip() or not key.isascii() or not key.isprintable():
        raise RuntimeInputError("--api-key must be printable ASCII without leading or trailing spaces (an "
                                "Authorization header cannot carry anything else, so it could never match)")


def _check_folder_path(d: Path) -> None:
    """``d`` is a folder, or can be created: its nearest existing ancestor is a folder."""
    for part in [d, *d.parents]:
        if part.exists() or part.is_symlink():
            if not part.is_dir():
                where = "" if part == d else f" ({part} is not a folder)"
                raise RuntimeInputError(f"--state-dir {d}: not a folder{where}")
            return
