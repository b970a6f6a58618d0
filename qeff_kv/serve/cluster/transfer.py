"""The KV transfer (connector) of disaggregated serving: a prefilled sequence from a prefill worker to a decode
worker, without torch, without files.

What moves (:class:`KVTransfer`): the KV buffers the graph's serving regex selects (``.*P.*`` with a prefix,
:func:`qeff_kv.runtime.memory.state_file.default_selection`), each cut to the sequence's **valid positions** ``[0, n)``
along axis 2 and nothing else (the peer's slicing spec ``[batch_index, 0, ctx_start, 0]``: the sequence's row,
every head, positions from ``ctx_start = 0``, every head_dim; no other axis is ever sliced), a sliding-window
ring as the slots it holds (``min(C, written)``, ring order, as state files carry it); and the metadata the
decode side needs: valid length, pending token (the first generated token, sampled by the prefill worker),
token ids, checkpoint identity, KV contract fingerprint, ring facts. Only position axes (``ctx_len``,
``sliding_window``) are ever cut: a recurrent or hybrid graph's recurrent states (``conv_state``,
``recurrent_state``: no position axis) move whole, with their checkpoints, and the slicing spec then lists one entry
per buffer (the peer's form when shapes differ, contract section 13): ``[batch_index, 0, ctx_start, 0]`` for a KV
buffer, ``[batch_index, 0, 0]`` / ``[batch_index, 0, 0, 0]`` for a recurrent state.

It is a :class:`~qeff_kv.runtime.memory.state_file.KVState` made by ``export_state(..., checksum=False)``: the decode side
imports it with every check a state file gets (KV contract, model, shapes, ring capacities, capacity), except
the SHA-256 over every byte, replaced by a cheap identity check that binds the metadata to the tensors (the
checksum costs ~100 ms for a 47 MB state; the object store does not flip bits). Numpy arrays travel through
Ray's object store without pickling their data.

:class:`Prefiller` is the prefill worker's logic (the Ray actor of :mod:`qeff_kv.serve.cluster.disagg` wraps it):
prefill a prompt in a fresh sequence, sample the first token with the request's sampling, extract, free.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

from qeff_kv.errors import RuntimeInputError
from qeff_kv.runtime.memory.prefix_cache import PrefixCache, lora_of
from qeff_kv.runtime.decoding.sampling import sample
from qeff_kv.runtime.memory.state_file import KVState, default_selection, export_state

#: the peer's dims of a KV slice: the sequence's row, every head, positions from ctx_start, every head_dim
DIM_SPECS = ("batch_index", 0, "ctx_start", 0)


@dataclass
class KVTransfer:
    """One prefilled sequence in flight. ``state``: the selected buffers' valid positions and the metadata;
    ``slicing``: the peer-style spec of what was cut (``Name`` regex, ``DimSpecs``, ``ctx_start``, ``positions``);
    ``prefill_s`` / ``extract_s``: the prefill worker's time in the prefill and in cutting the buffers;
    ``cached_tokens``: prompt tokens the prefill worker took from a kept sequence instead of prefilling them;
    ``lora``: the LoRA adapter and scale the KV was computed with (None: the base model), which the decode side
    runs the sequence with (refused where it does not serve that adapter)."""

    request_id: str
    state: KVState
    slicing: dict
    prefill_s: float = 0.0
    extract_s: float = 0.0
    cached_tokens: int = 0
    lora: tuple[str, float] | None = None

    @property
    def valid_length(self) -> int:
        return self.state.valid_length

    @property
    def first_token(self) -> int | None:
        return self.state.pending_token

    @property
    def nbytes(self) -> int:
        """Bytes of KV moved: the tensors' bytes (metadata aside)."""
        return sum(int(a.nbytes) for a in self.state.tensors.values())


def valid_bytes(session, seq) -> int:
    """Bytes of ``seq``'s valid positions across the selected buffers: ``n`` positions of each full-length
    buffer, ``min(C, written)`` slots of a ring: what a transfer of ``seq`` moves."""
    return session.cache.valid_bytes(seq)   # each memory's part (a recurrent state whole, with its checkpoints)


def slicing_spec(session, regex: str, positions: int) -> dict:
    """The peer-style spec of what a transfer cuts: one ``Name``/``DimSpecs`` for a graph whose buffers all have a
    position axis; with recurrent states, one entry per buffer (``Specs``), a recurrent state's dims all 0 after
    ``batch_index`` (never sliced). ``ctx_start`` and ``positions``: the range of positions cut."""
    dims = session.cache.slicing_specs()   # each memory says how its buffers are cut
    spec = {"Name": regex, "DimSpecs": list(DIM_SPECS), "ctx_start": 0, "positions": positions}
    if any(d != list(DIM_SPECS) for d in dims.values()):
        spec["Specs"] = [{"Name": f"^{re.escape(p.input_name)}$", "DimSpecs": dims[p.input_name]}
                         for p in session.layout.pairs]
    return spec


def extract(session, seq, request_id: str = "", select: str | None = None) -> KVTransfer:
    """``seq``'s valid positions and metadata, for a decode worker (see the module docstring)."""
    regex = select if select is not None else default_selection(session)
    t0 = time.perf_counter()
    state = export_state(session, seq, select=regex, checksum=False)
    spec = slicing_spec(session, regex, seq.length)
    return KVTransfer(request_id, state, spec, extract_s=time.perf_counter() - t0, lora=lora_of(seq))


def install(session, transfer: KVTransfer, seq=None):
    """Write ``transfer`` into ``seq`` (default: a new sequence) of ``session``, validated; returns the sequence,
    with its pending token to continue from."""
    if not isinstance(transfer, KVTransfer):
        raise RuntimeInputError(f"expected a KVTransfer, got {type(transfer).__name__}")
    return session.import_state(transfer.state, seq)


# ============================================================================================ the pair
def facts(session) -> dict:
    """What a prefill/decode pair must agree on, as plain data (crosses processes)."""
    return {"onnx": str(session.files.onnx_path), "kv_fingerprint": session.kv_fingerprint,
            "checkpoint": session.checkpoint or "", "model_fingerprint": session.model_fingerprint,
            "prefix": session.prefix or "", "sliding_window": session.sliding_window,
            "capacities": dict(session.rings.capacities), "ctx_len": session.ctx_len,
            "vocab_size": session.vocab_size, "max_sequences": session.max_sequences,
            "eos_token_ids": list(session.eos_token_ids), "bytes_per_position": session.cache.bytes_per_position,
            "lora": session.lora.enabled, "kv_dtype": session.layout.kv_dtype}


def pair_refusal(prefill: dict, decode: dict) -> str | None:
    """Why a prefill export cannot hand its sequences to a decode export (one line), or ``None``: another KV cache
    dtype (an int8 cache against a float one), another KV contract, another checkpoint (checkpoint identities when
    both record one, else sampled weights), another sliding window, a prefill context smaller than the decode one,
    or a vocabulary mismatch. Ring capacities may differ (states convert by position)."""
    pre, dec = prefill["onnx"], decode["onnx"]
    a, b = prefill.get("kv_dtype"), decode.get("kv_dtype")
    if a != b and a is not None and b is not None:
        return (f"prefill export {pre} keeps its KV cache in {a}, decode export {dec} in {b} (set at export by "
                f"--dtype and --kv-cache-dtype); a KV state moves only between exports of one cache dtype")
    if prefill["kv_fingerprint"] != decode["kv_fingerprint"]:
        return (f"prefill export {pre} and decode export {dec} have different KV contracts (prefix "
                f"{prefill['prefix'] or '(none)'!r} vs {decode['prefix'] or '(none)'!r}, or other buffers)")
    a, b = prefill["checkpoint"], decode["checkpoint"]
    if (a and b and a != b) or (not (a and b) and prefill["model_fingerprint"] != decode["model_fingerprint"]):
        return (f"prefill export {pre} and decode export {dec} come from different checkpoints "
                f"({a[:12] or 'sampled'} vs {b[:12] or 'sampled'}); a KV state moves only between exports of one "
                "checkpoint")
    if prefill["sliding_window"] != decode["sliding_window"]:
        return (f"prefill export {pre} has sliding window {prefill['sliding_window']}, decode export {dec} "
                f"{decode['sliding_window']}")
    if int(prefill["ctx_len"]) < int(decode["ctx_len"]):
        return (f"prefill export {pre} holds {prefill['ctx_len']} positions, decode export {dec} {decode['ctx_len']}: "
                "prompts the decode side accepts would not fit the prefill side (give the prefill export at least "
                "the decode context)")
    if prefill["vocab_size"] != decode["vocab_size"]:
        return f"prefill export {pre} has vocabulary {prefill['vocab_size']}, decode export {dec} {decode['vocab_size']}"
    return None


# ============================================================================================ prefill worker
class Prefiller:
    """The prefill worker's logic over one :class:`~qeff_kv.runtime.Session`: one request at a time.

    Prompt reuse (``reuse=True``): a prefilled sequence stays in its slot after its transfer left, and a later
    prompt starts from the longest prefix a kept sequence can give; the rules (at most ``len(prompt) - 1`` tokens,
    at a point the sequence can return to, at least :data:`~qeff_kv.runtime.memory.prefix_cache.MIN_REUSE`; copied into
    another slot when the kept sequence is longer, else truncated; refusals of ring buffers prefill the prompt
    whole) are the local scheduler's: one :class:`~qeff_kv.runtime.memory.prefix_cache.PrefixCache` (:attr:`prefix_cache`).
    ``kv_events``: a listener of what the sequences hold (``--kv-events``), or None.
    """

    def __init__(self, session, reuse: bool = True, kv_events=None):
        self.session = session
        self.reuse = reuse
        self.prefix_cache = PrefixCache(session, reuse=reuse, listener=kv_events)

    @property
    def reused_tokens(self) -> int:
        """Prompt tokens taken from kept sequences instead of prefilled, over every request."""
        return self.prefix_cache.reused_tokens

    def run(self, request_id: str, prompt, sampling, lora: tuple[str, float] | None = None) -> KVTransfer:
        """Prefill ``prompt`` (from a kept sequence's common prefix where there is one, of the same adapter key
        ``lora``) with LoRA adapter ``lora`` (None: the base model), sample the first token with ``sampling``
        (resolved: a seed the decode side shares), and return the transfer."""
        sess, cache = self.session, self.prefix_cache
        prompt = list(prompt)
        if not prompt or len(prompt) > sess.ctx_len:
            raise RuntimeInputError(f"the prompt has {len(prompt)} tokens; the prefill export holds 1 to "
                                    f"{sess.ctx_len}")
        for stale in sess.sequences:   # a request that failed half-way left its sequence
            if stale not in cache:
                cache.remove(stale)
        seq, cached = cache.acquire(prompt, lora=lora)
        try:
            t0 = time.perf_counter()
            logits = sess.prefill(seq, prompt[cached:])
            seq.pending = sample(logits, sampling, seq.length)
            seq.pending_emitted = False
            prefill_s = time.perf_counter() - t0
            out = extract(sess, seq, request_id)
        except BaseException:
            cache.remove(seq)
            raise
        cache.release(seq)
        out.prefill_s, out.cached_tokens = prefill_s, cached
        return out

    def longest_prefix(self, prompt, lora: tuple[str, float] | None = None) -> int:
        """How many leading tokens of ``prompt`` a kept sequence would give :meth:`run` (the question a router
        asks; nothing changes): :meth:`PrefixCache.longest_prefix <qeff_kv.runtime.memory.prefix_cache.PrefixCache.longest_prefix>`.
        A sliding-window export's rings may still refuse it at run time (the prompt is then prefilled whole)."""
        return self.prefix_cache.longest_prefix(list(prompt), lora=lora)
