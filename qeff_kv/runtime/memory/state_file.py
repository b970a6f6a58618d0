"""KV state of one sequence, in memory (:class:`KVState`) and as a safetensors file.

File format (version 1, see ``docs/state-files.md``):

* tensors: one per KV buffer, keyed by the graph's KV **input** name (``past_key.0``, ``past_value.0_VLLM``...),
  shape ``[1, heads, valid_length, head_dim]``: the sequence's slot, cut to its valid positions ``[0, n)``; a
  sliding-window ring buffer of ``C`` slots: its first ``min(C, ring_written)`` slots, in ring order;
* metadata (strings only): ``format`` (``qeff-kv-state``), ``format_version``, ``prefix`` (empty: none),
  ``num_layers``, ``shapes`` (JSON), ``dtype``, ``valid_length``, ``pending_token`` (empty: none),
  ``pending_emitted``, ``kv_fingerprint`` (the graph's KV contract), ``model_fingerprint`` (a sample of its
  weights), ``model_identity`` (``checkpoint`` or ``sampled``: which identity the model is checked by) and
  ``checkpoint`` (the checkpoint identity the export recorded, empty for none), a LoRA adapter's ``lora_adapter``,
  ``lora_scale`` and ``lora_identity`` (version 2: a state computed with an adapter; a base state stays version 1),
  ``selection`` (the regex that
  chose the buffers), ``rope_marks`` (JSON, multimodal RoPE models: each image's positions and the RoPE offset of
  the text after it; absent when there is none), ``ring_written``, ``capacities`` (JSON: ring buffer -> slots) and ``sliding_window`` (the
  ring bookkeeping; files without them are full-length states), ``created_by``, and ``checksum``: SHA-256 over
  every other metadata entry and every tensor's name, dtype, shape and bytes;
* a recurrent or hybrid graph's recurrent buffers (``conv_state.{i}``, ``recurrent_state.{i}``) whole, ``[1, ...]``
  (never cut by position), and their checkpoints as tensors ``checkpoint.{p}.{buffer}`` with the metadata
  ``recurrent_checkpoints`` (JSON: the positions ``p``, ascending) (:mod:`qeff_kv.runtime.memory.recurrent`).

The model check compares like with like: checkpoint identities when the file and the graph both carry one
(so the portable, onnxruntime, fused and quantized exports of one checkpoint accept each other's files), else
the sampled fingerprints (graphs of other exporters; files written before ``model_identity`` existed), else the
``weights_fibers`` fingerprint (:mod:`qeff_kv.runtime.weight_fibers`: each weight's contraction fibers, whatever the
exporter's layout), so a state moves between the peer's graph and ours of one checkpoint when their KV contracts
agree (the peer's MLA latent graph and ``--mla-cache latent``, its speculative target and a plain export).

Loading checks all of it and refuses, with one line, a file that is not a state file, is truncated, was
edited, belongs to another graph or model, comes from a graph with another sliding window or ring capacities,
or holds more positions than the session's capacity. A full-length state loads into ring buffers (each position
``p`` to slot ``p % C``), and a ring state into the full-length buffers of a graph with the same window (by
position, from the lowest position held: the sequence's ``floor``). Files are written atomically. safetensors holds raw tensors and JSON: no pickle anywhere.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from qeff_kv import __version__
from qeff_kv.support import fsutil
from qeff_kv.contract import naming
from qeff_kv.contract.layout import QUANTIZED_KV_DTYPES, cache_dtype
from qeff_kv.errors import RuntimeInputError, StateFileError
from qeff_kv.runtime.memory.hybrid import Sequence, take_adapter
from qeff_kv.graph import graphio
from qeff_kv.runtime import weight_fibers as fibers_mod
from qeff_kv.runtime.memory.base import meta_int
from qeff_kv.runtime.model_files import is_checkpoint_identity

FORMAT = "qeff-kv-state"
FORMAT_VERSION = "1"
#: a state computed with a LoRA adapter (docs/lora.md): version 1 and ``lora_adapter``, ``lora_scale``,
#: ``lora_identity``. A base model's state stays version 1; a reader of version 1 alone refuses an adapter's state
#: instead of continuing it on the base model
ADAPTER_FORMAT_VERSION = "2"
READ_VERSIONS = (FORMAT_VERSION, ADAPTER_FORMAT_VERSION)
_ADAPTER_KEYS = ("lora_adapter", "lora_scale", "lora_identity")
_REQUIRED = ("format", "format_version", "prefix", "num_layers", "shapes", "dtype", "valid_length",
             "pending_token", "pending_emitted", "kv_fingerprint", "model_fingerprint", "checksum")


@dataclass
class KVState:
    """One sequence's KV state: ``tensors`` (KV input name -> ``[1, heads, n, head_dim]``) and metadata."""

    tensors: dict[str, np.ndarray]
    metadata: dict[str, str]

    @property
    def valid_length(self) -> int:
        return int(self.metadata["valid_length"])

    @property
    def pending_token(self) -> int | None:
        v = self.metadata.get("pending_token", "")
        return int(v) if v != "" else None


def _checksum(metadata: dict[str, str], tensors: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    meta = {k: v for k, v in metadata.items() if k != "checksum"}
    h.update(json.dumps(meta, sort_keys=True, separators=(",", ":")).encode())
    for name in sorted(tensors):
        arr = np.ascontiguousarray(tensors[name])
        h.update(f"|{name}|{arr.dtype.str}|{list(arr.shape)}|".encode())
        h.update(arr.tobytes())
    return h.hexdigest()


#: the ``checksum`` of an in-memory state (:func:`export_state` with ``checksum=False``): a cheap identity check
IDENTITY = "identity:"


def _identity(metadata: dict[str, str], tensors: dict[str, np.ndarray]) -> str:
    """SHA-256 over the metadata and every tensor's name, dtype, shape and 64 sampled elements: binds the
    metadata to these tensors without reading every byte (an in-memory hand-off; files carry the full checksum)."""
    h = hashlib.sha256()
    meta = {k: v for k, v in metadata.items() if k != "checksum"}
    h.update(json.dumps(meta, sort_keys=True, separators=(",", ":")).encode())
    for name in sorted(tensors):
        arr = tensors[name]
        h.update(f"|{name}|{arr.dtype.str}|{list(arr.shape)}|".encode())
        flat = arr.reshape(-1)
        h.update(np.ascontiguousarray(flat[::max(1, flat.size // 64)]).tobytes())
    return IDENTITY + h.hexdigest()


def default_selection(session) -> str:
    """The serving regex for this graph: ``.*P.*`` with a prefix, else the exact unprefixed regex (in the graph's
    KV dialect)."""
    if session.prefix is not None:
        return naming.substring_regex(session.prefix)
    return naming.exact_regex(None, session.layout.stems, session.layout.dialect or naming.RETAINED_STATE)


def export_state(session, seq: Sequence, select: str | None = None, *, checksum: bool = True) -> KVState:
    """The state of ``seq``: the KV buffers ``select`` chooses (default :func:`default_selection`).

    The selection must cover every KV input of the graph (a partial state cannot continue exactly) and may
    match nothing else that the runtime would have to carry. ``checksum=False``: an in-memory hand-off, checked
    on import by a cheap identity (:func:`_identity`) instead of a checksum over every byte; such a state is
    never written to a file (:func:`read_state` refuses one).
    """
    seq = session.cache.get(seq)
    regex = select if select is not None else default_selection(session)
    try:
        chosen = naming.select(regex, session.layout.io_names)
    except Exception as exc:
        raise RuntimeInputError(f"invalid selection regex {regex!r}: {exc}") from None
    kv_inputs = [p.input_name for p in session.layout.pairs]
    missing = [n for n in kv_inputs if n not in chosen]
    if missing:
        raise RuntimeInputError(
            f"selection {regex!r} misses KV buffer {missing[0]!r} ({len(missing)} in all); a state must hold every "
            "KV buffer")
    kv_names = set(session.layout.kv_names)
    other = [n for n in chosen if n not in kv_names]
    if other:
        raise RuntimeInputError(f"selection {regex!r} also matches non-KV buffers {other[:3]}")
    tensors, entries = session.cache.state_write(seq, set(chosen))   # each memory's tensors and metadata
    first = next(iter(tensors.values()))
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "prefix": session.prefix or "",
        "num_layers": str(session.num_layers),
        "shapes": json.dumps({n: list(t.shape) for n, t in tensors.items()}, sort_keys=True),
        "dtype": str(first.dtype),
        "valid_length": str(seq.length),
        "pending_token": "" if seq.pending is None else str(int(seq.pending)),
        "pending_emitted": "true" if seq.pending_emitted else "false",
        "kv_fingerprint": session.kv_fingerprint,
        "model_fingerprint": session.model_fingerprint,
        "model_identity": "checkpoint" if session.checkpoint else "sampled",
        "checkpoint": session.checkpoint or "",
        "weights_fibers": weights_fibers(session),
        "selection": regex,
        "saved_ctx_len": str(session.ctx_len),
        **entries,
        "created_by": f"qeff-kv {__version__}",
    }
    meta.update(_adapter_entries(session, seq))
    if all(t >= 0 for t in seq.tokens):   # the token ids, under the checksum (a file) or the identity (a hand-off)
        meta["tokens"] = json.dumps(seq.tokens, separators=(",", ":"))
    meta["checksum"] = _checksum(meta, tensors) if checksum else _identity(meta, tensors)
    return KVState(tensors, meta)


def _adapter_entries(session, seq: Sequence) -> dict[str, str]:
    """The entries of a state computed with a LoRA adapter (none for the base model): the version that says so,
    the adapter's name, scale and weights' identity."""
    if seq.adapter is None:
        return {}
    return {"format_version": ADAPTER_FORMAT_VERSION, "lora_adapter": seq.adapter, "lora_scale": repr(seq.lora_scale),
            "lora_identity": session.lora.identity(seq.adapter)}


def state_adapter(meta: dict[str, str], where: str = "state") -> tuple[str | None, float]:
    """The LoRA adapter a state's metadata says it was computed with (``None``: the base model) and its scale."""
    if meta.get("format_version") != ADAPTER_FORMAT_VERSION:
        if any(k in meta for k in _ADAPTER_KEYS):
            raise StateFileError(f"{where}: malformed state metadata (a version {FORMAT_VERSION} state names an "
                                 "adapter)")
        return None, 1.0
    name, scale = meta.get("lora_adapter"), meta.get("lora_scale", "")
    try:
        value = float(scale)
    except ValueError:
        value = math.nan
    if not name or not math.isfinite(value) or not meta.get("lora_identity"):
        raise StateFileError(f"{where}: malformed state metadata (lora_adapter, lora_scale, lora_identity)")
    return name, value


def _check_adapter(session, meta: dict[str, str], where: str) -> None:
    """A state computed with an adapter continues only where that adapter is loaded, with the same weights."""
    name, scale = state_adapter(meta, where)
    if name is not None:
        session.lora.check_state(name, scale, meta["lora_identity"], where)


#: session -> the fiber fingerprint of its weights (computed once per session: :func:`weights_fibers`)
_FIBERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def weights_fibers(session) -> str:
    """The fiber fingerprint of the session's weights (:mod:`qeff_kv.runtime.weight_fibers`: the same for every
    exporter's layout of one checkpoint; a state file's last model check), computed once per session from its graph
    file."""
    if session not in _FIBERS:
        _FIBERS[session] = fibers_mod.fingerprint(graphio.load(session.files.onnx_path))
    return _FIBERS[session]


def _state_path(path, what: str) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise StateFileError(f"{what} needs a path to a state file, got {type(path).__name__}")
    return Path(path)


def validate(session, state: KVState, where: str = "state") -> list:
    """Check ``state`` against ``session`` without changing anything (what :func:`import_state` checks first);
    returns each memory's checked part (:meth:`~qeff_kv.runtime.memory.hybrid.HybridMemory.state_check`)."""
    return _validate(session, state, where)


def check_metadata(session, meta: dict, where: str = "state") -> None:
    """The checks of :func:`validate` that need no tensors (KV contract, model, capacity): for a state still held
    elsewhere, before it is taken."""
    try:
        _check_dtype(session, meta, where)
        if meta["kv_fingerprint"] != session.kv_fingerprint:
            raise StateFileError(f"{where}: saved from a graph with another KV contract (prefix "
                                 f"{meta.get('prefix') or '(none)'!r}; this graph's prefix is "
                                 f"{session.prefix or '(none)'!r})")
        _check_model(session, meta, where)
        n = meta_int(meta["valid_length"])
    except (KeyError, ValueError, TypeError):
        raise StateFileError(f"{where}: malformed state metadata") from None
    _check_adapter(session, meta, where)
    if n > session.ctx_len:
        raise StateFileError(f"{where}: holds {n} positions; this session's capacity is ctx_len={session.ctx_len}")


def _validate(session, state: KVState, where: str) -> list:
    """The container, the graph, the header; each memory's metadata; the file's own entries; each memory's
    tensors."""
    meta = _check_container(state, where)
    _check_contract(session, meta, state.tensors, where)
    n, shapes, pending_tok = _read_header(meta, where)
    _check_consistent(session, meta, state.tensors, where)
    cache = session.cache
    parts = cache.state_check(meta, n, where)   # ring bookkeeping, RoPE marks, recurrent checkpoints
    _tokens(meta, n, where)
    _check_model(session, meta, where)
    if n > session.ctx_len:
        raise StateFileError(
            f"{where}: holds {n} positions; this session's capacity is ctx_len={session.ctx_len}")
    if sorted(state.tensors) != sorted(cache.state_expected(parts)):
        raise StateFileError(f"{where}: tensors {sorted(state.tensors)[:3]}... do not match the graph's KV inputs")
    cache.state_check_tensors(state.tensors, shapes, parts, where)
    _check_adapter(session, meta, where)
    if pending_tok is not None and (pending_tok < 0 or (session.vocab_size and pending_tok >= session.vocab_size)):
        raise StateFileError(f"{where}: pending token {pending_tok} is outside the vocabulary")
    return parts


def _check_container(state: KVState, where: str) -> dict[str, str]:
    """A :class:`KVState` of this format and version, with every required entry and an intact checksum (a file) or
    identity (an in-memory hand-off); returns its metadata."""
    if not isinstance(state, KVState) or not isinstance(state.tensors, dict) or not isinstance(state.metadata, dict):
        raise StateFileError(f"{where}: expected a KVState (from export_state or read_state), got "
                             f"{type(state).__name__}")
    meta = state.metadata
    if meta.get("format") != FORMAT:
        raise StateFileError(f"{where}: not a qeff-kv state file (its format entry is not {FORMAT!r})")
    if meta.get("format_version") not in READ_VERSIONS:
        raise StateFileError(f"{where}: state format version {meta.get('format_version')!r}; this qeff-kv reads "
                             f"versions {' and '.join(READ_VERSIONS)}")
    missing = [k for k in _REQUIRED if k not in meta]
    if missing:
        raise StateFileError(f"{where}: state metadata lacks {missing[0]!r}")
    if str(meta["checksum"]).startswith(IDENTITY):
        if _identity(meta, state.tensors) != meta["checksum"]:
            raise StateFileError(f"{where}: identity check failed; the in-memory state's tensors or metadata "
                                 "were changed")
    elif _checksum(meta, state.tensors) != meta["checksum"]:
        raise StateFileError(f"{where}: checksum mismatch; the file was edited or corrupted")
    return meta


def _check_contract(session, meta: dict[str, str], tensors: dict, where: str) -> None:
    """Saved from a graph with this session's KV contract."""
    _check_dtype(session, meta, where, tensors)
    if meta["kv_fingerprint"] != session.kv_fingerprint:
        theirs = sorted(tensors)[:2]
        ours = [p.input_name for p in session.layout.pairs][:2]
        raise StateFileError(
            f"{where}: saved from a graph with another KV contract (buffers {theirs}..., prefix "
            f"{meta['prefix'] or '(none)'!r}; this graph has {ours}..., prefix {session.prefix or '(none)'!r})")


def _check_dtype(session, meta: dict[str, str], where: str, tensors: dict | None = None) -> None:
    """A quantized KV cache (an int8 cache, ``--kv-cache-dtype``) against a graph of another KV dtype (or the
    reverse), refused in one line before the contract's fingerprint. Metadata that contradicts its own tensors is
    left to :func:`_check_consistent`; graphs with recurrent states keep their dtypes per tensor (not checked
    here)."""
    theirs = meta.get("dtype")
    if not theirs or (tensors is not None and {str(np.asarray(t).dtype) for t in tensors.values()} != {theirs}):
        return
    pairs = session.layout.pairs
    ours = {str(p.input.dtype) for p in pairs}
    if len(ours) != 1 or theirs in ours or any(p.recurrent for p in pairs):
        return
    mine = ours.pop()
    if theirs in QUANTIZED_KV_DTYPES or mine in QUANTIZED_KV_DTYPES:   # float16 against float32: its fingerprint
        theirs, mine = cache_dtype(theirs), cache_dtype(mine)
        raise StateFileError(f"{where}: its KV cache is {theirs}, this graph's is {mine} (set at export by "
                             f"--dtype and --kv-cache-dtype); load it into a graph whose KV cache is {theirs}")


def _read_header(meta: dict[str, str], where: str) -> tuple[int, dict, int | None]:
    """``(valid length, declared shapes, pending token or None)``, each well formed."""
    try:
        n = meta_int(meta["valid_length"])
        shapes = json.loads(meta["shapes"])
        pending = meta["pending_token"]
        pending_tok = meta_int(pending) if pending != "" else None
    except (ValueError, TypeError, RecursionError):
        raise StateFileError(f"{where}: malformed state metadata") from None
    if meta["pending_emitted"] not in ("true", "false"):
        raise StateFileError(f"{where}: malformed state metadata (pending_emitted)")
    if n < 0:
        raise StateFileError(f"{where}: negative valid length {n}")
    return n, shapes, pending_tok


def _check_consistent(session, meta: dict[str, str], tensors: dict, where: str) -> None:
    """The metadata agrees with the tensors it describes and with itself (a checksum proves the bytes only)."""
    # recurrent states (and their checkpoints) may keep their own dtype: they are checked per tensor
    rec = session.cache.recurrent
    dtypes = sorted({str(np.asarray(t).dtype) for k, t in tensors.items()
                     if not rec or k in session.cache.positional.shapes})
    if dtypes and dtypes != [meta["dtype"]]:
        raise StateFileError(f"{where}: inconsistent state metadata: dtype {meta['dtype']!r}, its tensors are "
                             f"{', '.join(dtypes)}")
    if meta["num_layers"] != str(session.num_layers):
        raise StateFileError(f"{where}: inconsistent state metadata: num_layers {meta['num_layers']!r} for a graph "
                             f"of {session.num_layers} layers")
    if meta["prefix"] != (session.prefix or ""):
        raise StateFileError(f"{where}: inconsistent state metadata: prefix {meta['prefix']!r}, its buffers carry "
                             f"{session.prefix or ''!r}")


def _short(identity: str) -> str:
    digest, _, dtype = identity.partition(":")
    return f"{digest[:12]}:{dtype}"


def _check_model(session, meta: dict[str, str], where: str) -> None:
    """Same model? Checkpoint identities when both sides carry one, else the sampled fingerprints."""
    kind = meta.get("model_identity", "sampled")  # files written before the key existed carry the sampled one
    theirs = meta.get("checkpoint", "")
    if kind not in ("checkpoint", "sampled") or (kind == "checkpoint" and not is_checkpoint_identity(theirs)):
        raise StateFileError(f"{where}: malformed state metadata (model_identity {kind!r})")
    theirs = theirs if kind == "checkpoint" else ""
    ours = session.checkpoint
    if theirs and ours:
        if theirs != ours:
            raise StateFileError(f"{where}: saved from another model (same KV contract, checkpoint {_short(theirs)}; "
                                 f"this graph's checkpoint is {_short(ours)})")
        return
    if meta["model_fingerprint"] == session.model_fingerprint:
        return
    theirs_fibers = meta.get("weights_fibers", "")
    if theirs_fibers and theirs_fibers == weights_fibers(session):
        return   # another exporter's graph of the same weights, laid out otherwise
    why = ""
    if theirs:
        why = "; the file names a checkpoint, this graph records none, so sampled weights were compared"
    elif ours:
        why = "; this graph names a checkpoint, the file records none, so sampled weights were compared"
    raise StateFileError(f"{where}: saved from another model (same KV contract, different weights or structure{why})")


def import_state(session, state: KVState, seq: Sequence | None = None, *, where: str = "state") -> Sequence:
    """Validate ``state`` against ``session`` and copy it into ``seq`` (default: a new sequence), which then runs
    with the state's LoRA adapter (refused in one line when ``seq`` holds positions of another)."""
    parts = _validate(session, state, where)
    adapter, scale = state_adapter(state.metadata, where)
    if seq is not None:
        take_adapter(session.cache.get(seq), adapter, scale, where)
    target = session.cache.create() if seq is None else session.cache.get(seq)
    target.adapter, target.lora_scale = adapter, scale
    n = state.valid_length
    session.cache.state_read(target, state.tensors, parts)   # each memory's rows and bookkeeping
    target.length = n
    target.tokens = _tokens(state.metadata, n, where)  # a file holds none: -1 each
    target.pending = state.pending_token
    target.pending_emitted = state.metadata["pending_emitted"] == "true"
    return target


def _tokens(meta: dict[str, str], n: int, where: str) -> list[int]:
    raw = meta.get("tokens")
    if raw is None:
        return [-1] * n
    try:
        toks = json.loads(raw)
    except (ValueError, RecursionError):
        toks = None
    if (not isinstance(toks, list) or len(toks) != n
            or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in toks)):
        raise StateFileError(f"{where}: malformed state metadata (tokens: expected {n} token ids)")
    return toks


def save_state(session, seq: Sequence, path: str | os.PathLike, select: str | None = None) -> Path:
    """Write ``seq``'s state to ``path`` (safetensors), atomically."""
    from safetensors.numpy import save

    state = export_state(session, seq, select=select)
    path = _state_path(path, "save_state")
    fsutil.check_output_file(path)  # before anything is computed: a folder, FIFO or a path below a file
    data = save(state.tensors, metadata=state.metadata)
    fsutil.write_bytes(path, data)
    return path


def read_state(path: str | os.PathLike) -> KVState:
    """Read a state file without validating it against a graph (format and integrity errors still raise)."""
    path = _state_path(path, "read_state")
    if not path.is_file():
        what = "not a regular file" if path.exists() else "no such state file"
        raise StateFileError(f"{path}: {what}")
    return parse_state(path.read_bytes(), str(path))


def parse_state(data: bytes, where: str) -> KVState:
    """A state file's bytes as a :class:`KVState` (format and integrity errors raise naming ``where``; no message
    repeats the file's bytes or a number read from them)."""
    from safetensors import SafetensorError
    from safetensors.numpy import load

    if len(data) < 8:
        raise StateFileError(f"{where}: truncated or not a safetensors file ({len(data)} bytes)")
    header_len = int.from_bytes(data[:8], "little")
    if header_len <= 0 or 8 + header_len > len(data):
        raise StateFileError(f"{where}: truncated or not a safetensors file (its header length does not fit the "
                             f"file of {len(data)} bytes)")
    try:
        header = json.loads(data[8:8 + header_len])
    except (ValueError, RecursionError):
        raise StateFileError(f"{where}: truncated or not a safetensors file (header is not JSON)") from None
    if not isinstance(header, dict):
        raise StateFileError(f"{where}: not a safetensors file (header is not an object)")
    meta = header.get("__metadata__") or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise StateFileError(f"{where}: safetensors metadata must be strings")
    try:
        tensors = load(data)
    except (SafetensorError, Exception):
        raise StateFileError(f"{where}: truncated or corrupted safetensors data") from None
    if str(meta.get("checksum", "")).startswith(IDENTITY):
        raise StateFileError(f"{where}: holds an in-memory state's identity check, not a checksum; state files "
                             "are written by save_state")
    return KVState(dict(tensors), dict(meta))


def load_state(session, path: str | os.PathLike, seq: Sequence | None = None) -> Sequence:
    """Read, validate and import a state file into ``seq`` (default: a new sequence)."""
    state = read_state(path)
    return import_state(session, state, seq=seq, where=str(path))
