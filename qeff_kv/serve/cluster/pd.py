"""vLLM's disaggregated prefill/decode protocol between separate ``qeff-kv serve`` processes (``--kv-role``).

A proxy (vLLM's ``toy_proxy_server.py``, the vLLM router, Ray Serve's P/D, ``tests/helpers/pd_proxy.py``) sends a request
to a **producer** with ``max_tokens: 1``, ``stream: false`` and ``"kv_transfer_params": {"do_remote_decode": true,
...}``; the producer prefills, samples the first token, and its KV connector (:class:`~.kv_connector.RayHoldConnector`)
holds the sequence's valid positions in Ray's object store; its answer carries a top-level ``kv_transfer_params``
naming the held state (``do_remote_prefill: true``, ``remote_engine_id``, ``transfer_id``, ...). The proxy copies it
into the original request and sends that to a **consumer**, which takes the state through Ray, checks it as a state
file is checked (KV contract, model, shapes, capacity: a state of another checkpoint is refused in one line, 400),
checks it holds this request's prompt (all of it, from the held state's metadata, before the state is taken: a
refused request leaves it held for the request it was made for, and the holder gives it only to a request of
the same prompt tokens), imports it into a free slot, reports the prompt as cached
(``usage.prompt_tokens_details.cached_tokens``) and continues, streamed or not, from the producer's first token.

A consumer that cannot get the state (the hold timed out, the producer is gone, the state was taken already)
prefills the prompt itself and says so: ``cached_tokens`` 0, the top-level ``kv_transfer_params`` of its answer
``{"kv_load": "recomputed", "kv_load_error": "..."}``, the counter ``kv_load_fallbacks`` (``/health``,
``qeff_kv_kv_load_fallbacks`` in ``/metrics``); with ``"kv_load_failure_policy": "fail"`` in the request's
``kv_transfer_params`` (vLLM's name for the same choice) it answers **410** (``code: kv_transfer_unavailable``).

Here: the P/D section of the serve options (:class:`PDSection`), the start of the connector for a server
(:func:`start_connector`), the consumer's load before a request is
submitted (:func:`prepare`, run off the event loop), and the answer's field (:func:`answer_field`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from qeff_kv.errors import KVLoadError, RuntimeInputError, StateFileError
from qeff_kv.serve.wire.openai_io import APIError, Params, bad


@dataclass
class KVAsk:
    """What a request's ``kv_transfer_params`` became: ``params`` for the engine (None: a plain request), ``state``
    (a consumer's loaded hand-off), ``answer`` (what the answer's ``kv_transfer_params`` says, e.g. a fallback)."""

    params: dict | None = None
    state: object | None = None
    answer: dict | None = None


@dataclass
class PDSection:
    """The P/D section of the serve options (a section of :class:`qeff_kv.serve.config.ServeConfig`; present with
    ``--kv-role``): vLLM's P/D protocol between separate servers."""
    #: "producer", "consumer" or "both"
    kv_role: str
    #: the Ray cluster both servers join ("auto", "ray://host:10001"); None: a local one (on 127.0.0.1 only)
    ray_address: str | None = None
    #: seconds a producer holds a state no consumer took (then Ray frees it)
    kv_hold_seconds: float = 60.0

    #: the field whose value turns the section on
    SWITCH = "kv_role"

    @staticmethod
    def refuse_without(given: list[str]) -> None:
        """Options of the section given while it is absent: ``--kv-hold-seconds`` is left unread (``--ray-address``
        is the disaggregation section's refusal)."""

    def check(self) -> None:
        from qeff_kv.serve.cluster.kv_connector import ROLES

        if self.kv_role not in ROLES:
            raise RuntimeInputError(f"--kv-role must be one of {', '.join(ROLES)}, got {self.kv_role!r}")
        if not 0 < self.kv_hold_seconds <= 3600:
            raise RuntimeInputError(f"--kv-hold-seconds must be in (0, 3600], got {self.kv_hold_seconds:g}")


def start_connector(section: PDSection, host: str, port: int):
    """The server's KV connector for ``section.kv_role``: Ray joined at ``section.ray_address`` (a cluster on
    127.0.0.1 joined as such), or a local instance started with the disaggregated engine's settings (stopped by the
    connector's ``close()``); ``host`` and ``port``: where this server listens (the address peers are given)."""
    from qeff_kv.serve.cluster.kv_connector import RayHoldConnector
    from qeff_kv.serve.cluster.ray_cluster import join_or_start, ray_module

    ray = ray_module()
    owns = join_or_start(ray, section.ray_address)
    try:
        connector = RayHoldConnector(section.kv_role, hold_seconds=section.kv_hold_seconds, host=host, port=port)
    except BaseException:
        if owns:
            ray.shutdown()
        raise
    connector.owns_ray = owns
    return connector


def prepare(engine, p: Params, ids: list[int], structured: bool = False, lora=None) -> KVAsk | None:
    """The request's ``kv_transfer_params`` (checked by :mod:`~qeff_kv.serve.wire.openai_io`) made ready for the engine: a producer's
    is passed on (the scheduler holds the sequence when it ends); a consumer's state is loaded (blocking: call it
    off the event loop), checked and given as the request's state, or the fallback of the module docstring.
    ``lora``: the LoRA adapter and scale the request runs with; a held state computed with another is refused (a
    400 before it is taken)."""
    kvp = p.kv_transfer_params
    if not kvp or not (kvp.get("do_remote_decode") or kvp.get("do_remote_prefill")):
        return None
    if kvp.get("do_remote_decode"):
        return KVAsk(params=kvp)
    if structured:
        raise bad("structured output and forced tool calls do not go with kv_transfer_params.do_remote_prefill",
                  "kv_transfer_params")
    connector = engine.connector
    held = connector.matched_tokens(kvp)   # vLLM's get_num_new_matched_tokens, from the params alone
    if held and held != len(ids):
        raise bad(f"kv_transfer_params names a state of {held} positions; this request's prompt has {len(ids)} "
                  "tokens", "kv_transfer_params")
    tokens = json.dumps(list(ids), separators=(",", ":"))   # as the state's metadata spells them
    try:
        meta = connector.peek(kvp)   # nothing taken: a refusal below leaves the state for its owner
        _check_held(engine.session, meta, tokens, len(ids), kvp, connector, lora)
        transfer = connector.load(kvp, tokens=tokens)
    except KVLoadError as exc:
        if kvp.get("kv_load_failure_policy") == "fail":
            raise APIError(f"kv_transfer_params: {exc}", status=410, param="kv_transfer_params",
                           code="kv_transfer_unavailable") from None
        connector.note_fallback()
        return KVAsk(answer={"kv_load": "recomputed", "kv_load_error": str(exc)})
    _check_state(engine.session, transfer.state, ids, kvp)
    _check_lora(transfer.lora, lora, kvp)
    return KVAsk(params=kvp, state=transfer.state)


def _where(kvp: dict) -> str:
    return f"kv_transfer_params (state {kvp['transfer_id']} of producer {kvp['remote_engine_id']})"


def _check_lora(held, lora, kvp: dict) -> None:
    """The held state's adapter key (``held``: JSON-decoded, or a transfer's) is the request's ``lora``."""
    held = tuple(held) if held is not None else None
    want = tuple(lora) if lora is not None else None
    if held != want:
        def say(key):
            return "the base model" if key is None else f"LoRA adapter {key[0]!r} at scale {key[1]:g}"
        raise bad(f"{_where(kvp)} was prefilled with {say(held)}; this request runs {say(want)}",
                  "kv_transfer_params")


def _check_held(session, meta: dict | None, tokens: str, n: int, kvp: dict, connector, lora=None) -> None:
    """The held state's metadata (None: the connector cannot read it without taking it) against this server's
    graph and this request's prompt: a 400 before anything is taken."""
    from qeff_kv.runtime.memory.state_file import check_metadata

    if meta is None:
        return
    try:
        check_metadata(session, meta, _where(kvp))
        if meta.get("tokens") != tokens:
            held = json.loads(meta.get("tokens") or "null")
            raise StateFileError(f"{_where(kvp)} holds another prompt ({len(held) if isinstance(held, list) else 0} "
                                 f"tokens) than this request's ({n} tokens)")
        if "serve_lora" in meta:
            _check_lora(json.loads(meta["serve_lora"]), lora, kvp)
    except (StateFileError, ValueError, RecursionError) as exc:
        connector.note_take_refused()
        raise bad(str(exc) if isinstance(exc, StateFileError) else f"{_where(kvp)}: malformed state metadata",
                  "kv_transfer_params") from None


def _check_state(session, state, ids: list[int], kvp: dict) -> None:
    """The loaded state goes into this server's graph (every check of a state file) and holds this prompt."""
    from qeff_kv.runtime.memory.state_file import validate

    where = _where(kvp)
    try:
        validate(session, state, where)
    except StateFileError as exc:
        raise bad(str(exc), "kv_transfer_params") from None
    held = json.loads(state.metadata.get("tokens", "null"))
    if held != list(ids):
        n = len(held) if isinstance(held, list) else 0
        raise bad(f"{where} holds another prompt ({n} tokens) than this request's ({len(ids)} tokens)",
                  "kv_transfer_params")


def answer_field(engine, runs, kv: KVAsk | None) -> dict:
    """The top-level ``kv_transfer_params`` of a non-streamed answer on a server with a KV role (``{}`` on one
    without: its answers are unchanged): a producer's held state, a consumer's fallback, else None."""
    if getattr(engine, "connector", None) is None:
        return {}
    final = runs[0].final if runs else None
    held = getattr(final, "kv_transfer_params", None)
    return {"kv_transfer_params": held if held is not None else (kv.answer if kv is not None else None)}
