"""What a retained-state graph is to the runtime, resolved once when a :class:`~qeff_kv.runtime.session.Session`
opens it: :class:`GraphDescription`.

It is read from the graph (its inputs and outputs, its state spec, its metadata), its manifest and the caller's
arguments (:class:`Requested`), validated, and every contradiction refused in one line, before anything is
allocated. It says

* the **batching mode**, as a strategy object (:mod:`.batching`): one sequence, continuous batching
  (``batch_index``) or lock step (several sequences in a graph without ``batch_index``);
* the **memory** (:class:`Memory`): the positional pairs (full, latent, rings: ours, padded, or another
  exporter's, fed within the ring) and the recurrent states (updated in place, or replaced whole: the peer's),
  with the checkpoint policy;
* the **dimensions** (:class:`Dims`): the buffers' ``ctx_len``, the prefill chunk, a fixed ``seq_len``, the slots;
* the **KV dialect**'s control inputs (:mod:`.execution.dialect_feeds`: a static cache's ``write_indices`` and
  ``nonpad_kv_seqlen``, a past/present graph's ``attention_mask``); a growing past/present graph fed from the
  fixed buffers (:attr:`GraphDescription.grows`, :mod:`.execution.growing`);
* **media** (a vision-language graph's image inputs, :class:`~qeff_kv.runtime.multimodal.media.LanguageMedia`), multimodal
  RoPE, **speculation** (``num_logits_to_keep`` and its ``K``), ``comp_ctx_lengths``, the logits, and whether the
  buffers are bound **in place**.

The session's methods ask it (and its batching strategy) instead of keeping flags of their own. A new graph kind
is a field here, resolved in :meth:`GraphDescription.resolve`, with its refusals beside it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from qeff_kv.graph import graphio
from qeff_kv.contract import naming
from qeff_kv.errors import ContractError, RuntimeInputError
from qeff_kv.graph.inplace import inplace_issues
from qeff_kv.contract.layout import KVLayout, KVPair
from qeff_kv.support.limits import positive_int
from qeff_kv.runtime import ccl as ccl_mod
from qeff_kv.runtime.decoding import lockstep as lockstep_mod
from qeff_kv.runtime.multimodal import media as media_mod
from qeff_kv.runtime.memory import recurrent as rec_mod
from qeff_kv.runtime.memory import ring as ring_mod
from qeff_kv.runtime.decoding.batching import BATCH_INDEX, ContinuousBatching, LockStep, OneSequence
from qeff_kv.runtime.execution import dialect_feeds as feeds_mod

#: Prefill chunk length used when neither the graph, its manifest nor the caller fixes one.
DEFAULT_PREFILL_SEQ_LEN = 32


@dataclass(frozen=True)
class Requested:
    """The caller's arguments that shape the description (already checked by
    :func:`~qeff_kv.runtime.arguments.check_session_args`); ``None``: the graph's or the manifest's value."""

    ctx_len: int | None = None
    prefill_seq_len: int | None = None
    max_sequences: int | None = None
    inplace: bool | None = None
    sliding_window: int | None = None
    image_token_id: int | None = None
    checkpoints: rec_mod.CheckpointPolicy = field(default_factory=rec_mod.CheckpointPolicy)


@dataclass(frozen=True)
class Memory:
    """The graph's memory kinds: what :class:`~qeff_kv.runtime.memory.hybrid.HybridMemory` allocates and how it is fed."""

    positional: tuple[KVPair, ...]   # full, latent and ring buffers (a position axis)
    recurrent: tuple[KVPair, ...]    # recurrent states (conv_state/recurrent_state: none)
    rings: ring_mod.RingSpec         # the sliding-window rings and their capacities
    #: another exporter's rings (not our ``qeff_kv.sliding_cache=ring`` export): no prefill chunk wraps them
    #: (:func:`~qeff_kv.runtime.memory.ring.within_ring`), and no chunk into them is padded
    ring_within: bool
    #: recurrent states the graph replaces whole (the peer's): they get a second buffer, the rest stays in place
    replaced_states: bool
    checkpoints: rec_mod.CheckpointPolicy
    #: the state kinds the graph's layers retain (``full``, ``ring``, ``latent``, ``recurrent``), sorted
    kinds: tuple[str, ...] = ()

    @property
    def pad_ring(self) -> bool:
        """Whether a short prefill chunk may be padded where rings are (always, without rings)."""
        return not self.ring_within


@dataclass(frozen=True)
class Dims:
    """The sizes a session runs at."""

    ctx_len: int                  # positions each full-length buffer holds (allocated)
    prefill_seq_len: int          # the prefill chunk (capped at the smallest ring)
    fixed_seq_len: int | None     # a graph whose input_ids fixes seq_len
    max_sequences: int            # slots (KV rows)
    batch_dim: object = None      # the KV buffers' batch axis as the graph writes it (int, name or None)


@dataclass(frozen=True)
class GraphDescription:
    """One graph, resolved (see the module's docstring)."""

    name: str                     # the graph's file name, for messages
    layout: KVLayout
    batching: OneSequence
    memory: Memory
    dims: Dims
    media: media_mod.LanguageMedia | None
    mrope: bool                   # position_ids [4, batch, seq_len] (runtime/positions.py)
    speculative: bool             # num_logits_to_keep: drafted tokens verified in one step
    speculative_tokens: int | None   # its K (graph metadata or manifest), else None
    ccl: bool                     # a comp_ctx_lengths input (contract section 9)
    ccl_listed: object            # the manifest's ``ccl`` lengths, or None
    own_graph: bool               # exported by qeff-kv (its target recorded): short chunks are not padded
    inplace: bool
    inplace_issues: tuple[str, ...]
    vocab_size: int | None
    logits_dtype: np.dtype
    eos_token_ids: tuple[int, ...]
    #: the KV dialect's control inputs (``write_indices``, ``nonpad_kv_seqlen``, ``attention_mask``), fed each run
    feeds: feeds_mod.DialectFeeds = field(default_factory=feeds_mod.DialectFeeds)
    #: a past/present graph that grows by concatenation: each run is fed the held past (a copy of the fixed
    #: buffers' positions) and its present's new positions are copied back (:mod:`.execution.growing`)
    grows: bool = False
    #: the graph's LoRA adapter inputs (:mod:`qeff_kv.contract.lora`; fed by
    #: :class:`~qeff_kv.runtime.execution.adapter_feeds.AdapterFeeds`), ``None`` without
    lora: object = None

    @property
    def pad_short(self) -> bool:
        """Whether a short prefill chunk is padded to the prefill length (``position_ids = -1``): another
        exporter's retained-state graph, as its runner pads; never ours (no padding needed), nor another dialect's
        (:attr:`~qeff_kv.runtime.execution.dialect_feeds.DialectFeeds.pads`)."""
        return not self.own_graph and self.feeds.pads

    @property
    def ctx_len(self) -> int:
        """Positions a sequence may hold (lock step keeps each row's last slot for idle rows' writes)."""
        return self.batching.usable_ctx_len(self.dims.ctx_len)

    @property
    def rings(self) -> ring_mod.RingSpec:
        return self.memory.rings

    @property
    def recurrent(self) -> bool:
        """The graph keeps recurrent state: rewinds need checkpoints."""
        return bool(self.memory.recurrent)

    @property
    def swaps_buffers(self) -> bool:
        """Some buffer has a spare that takes the outputs (not in place, or recurrent states the graph replaces
        whole): the two swap after each run, so the buffers are bound again before each."""
        return self.double_buffered or self.memory.replaced_states

    @property
    def double_buffered(self) -> bool:
        """A second set of positional buffers takes the outputs: not in place, unless the graph grows (its presents
        are copied back into the one set)."""
        return not self.inplace and not self.grows

    @classmethod
    def resolve(cls, ir_model: ir.Model, manifest: dict | None, name: str,
                asked: Requested = Requested()) -> "GraphDescription":
        """Read, validate and refuse (one line each, in this order): the decoder's inputs and outputs, media,
        rings, dimensions, slots, in-place binding, the batching mode."""
        man = manifest or {}
        layout = graphio.layout_of(ir_model)
        layout.require_valid()
        _require_dialect(layout, name)
        media = _media(layout, man, asked.image_token_id, name)
        names_in = _require_decoder_io(layout, media, feeds_mod.CONTROL_INPUTS.get(layout.dialect, ()))
        rings = ring_mod.resolve(layout, man, asked.sliding_window)
        positional, recurrent = rec_mod.split_pairs(layout)
        _require_growable(layout, name, media=media, rings=rings, recurrent=recurrent, names_in=names_in,
                          inplace=asked.inplace)
        speculative = layout.speculative
        speculative_tokens = layout.speculative_tokens or (man.get("speculative_tokens") if speculative else None)
        dims = _dims(ir_model, layout, man, asked, names_in, positional, rings)
        feeds = feeds_mod.resolve(layout, names_in, dims.ctx_len)
        _require_unpadded(feeds, dims, name)
        inplace, issues, replaced = _inplace(ir_model, layout, asked.inplace)
        batching = _batching("batch_index" in names_in, dims, inplace=inplace or layout.grows, rings=rings,
                             media=media, recurrent=bool(recurrent))
        memory = Memory(tuple(positional), tuple(recurrent), rings, ring_within=_ring_within(ir_model, rings),
                        replaced_states=replaced, checkpoints=asked.checkpoints,
                        kinds=tuple(sorted(set(layout.state_kinds.values()))))
        vocab_size, logits_dtype = _logits(layout)
        eos = man.get("eos_token_id")
        return cls(name=name, layout=layout, batching=batching, memory=memory, dims=dims, media=media,
                   mrope=len(names_in["position_ids"].shape or ()) == 3, speculative=speculative,
                   speculative_tokens=speculative_tokens, ccl=ccl_mod.INPUT in names_in, ccl_listed=man.get("ccl"),
                   own_graph=naming.TARGET_META in ir_model.metadata_props, inplace=inplace,
                   inplace_issues=tuple(issues), vocab_size=vocab_size, logits_dtype=logits_dtype,
                   eos_token_ids=tuple([eos] if isinstance(eos, int) else list(eos or [])), feeds=feeds,
                   grows=layout.grows, lora=layout.lora)


# ============================================================================================ the steps of resolve
def _require_dialect(layout: KVLayout, name: str) -> None:
    """The dialects the runtime feeds (one line otherwise, never run wrongly): retained state, a shared-buffer
    past/present graph (shared-buffer or growing) and a static cache (their control inputs:
    :mod:`.execution.dialect_feeds`); a sidecar's ports say nothing of how they are fed."""
    if layout.pairs and layout.dialect is None:
        raise ContractError(f"{name} is a sidecar-declared graph ({layout.update}): the runtime cannot tell how to "
                            "feed its ports; convert it with qeff-kv rewrite --to retained-state")
    if len(layout.dialects) > 1:
        raise ContractError(f"{name} mixes KV dialects ({', '.join(layout.dialects)}); the runtime runs one")


def _require_growable(layout: KVLayout, name: str, *, media, rings, recurrent, names_in: dict,
                      inplace: bool | None) -> None:
    """A growing past/present graph is fed the held past of one length per run (:mod:`.execution.growing`): one
    line for what that cannot feed exactly (slots named per row, rings, recurrent state, image positions that are
    not slots) and for ``inplace=True`` (its present is a new tensor)."""
    if not layout.grows:
        return
    why = ("it has batch_index (continuous batching)" if BATCH_INDEX in names_in
           else "it has sliding-window rings" if rings
           else "it keeps recurrent state" if recurrent
           else "it is a vision-language graph (its positions are not its cache slots)" if media is not None
           else "inplace=True was asked (its present is a new tensor, copied back)" if inplace else None)
    if why is not None:
        raise ContractError(f"{name} grows by concatenation and {why}: the runtime cannot feed it exactly")


def _require_unpadded(feeds: feeds_mod.DialectFeeds, dims: Dims, name: str) -> None:
    """A graph that fixes ``seq_len`` (> 1) needs padding; a dialect whose padding is not exact refuses it."""
    if not feeds.pads and (dims.fixed_seq_len or 1) > 1:
        raise ContractError(f"{name} fixes seq_len={dims.fixed_seq_len}, so its chunks would carry padding, which its "
                            "KV dialect's writes and attention do not mask exactly; export it with a dynamic seq_len")


def _media(layout: KVLayout, man: dict, image_token_id: int | None, name: str) -> media_mod.LanguageMedia | None:
    """A vision-language language graph's image inputs, or None; an image token for a text decoder is refused."""
    media = media_mod.LanguageMedia.resolve(layout, man, image_token_id)
    if image_token_id is not None and media is None:   # a setting that would do nothing
        raise RuntimeInputError(f"image_token_id applies to vision-language graphs; {name} is a text decoder")
    return media


def _require_decoder_io(layout: KVLayout, media, control: tuple[str, ...] = ()) -> dict:
    """The graph's inputs by name, once it is known to be a decoder whose every input the runtime feeds
    (``control``: its dialect's control inputs)."""
    names_in = {t.name: t for t in layout.inputs}
    for req in ("input_ids", "position_ids"):
        if req not in names_in:
            raise ContractError(f"graph has no {req!r} input; not a decoder graph of the retained-state contract")
    if layout.output("logits") is None:
        raise ContractError("graph has no 'logits' output")
    kv_inputs = {p.input_name for p in layout.pairs}
    extra = [n for n in names_in if n not in kv_inputs
             and n not in ("input_ids", "position_ids", BATCH_INDEX, ccl_mod.INPUT, naming.LOGITS_TO_KEEP_INPUT)
             and n not in control and not naming.is_lora_input(n)
             and (media is None or n not in media.input_names)]
    if extra:
        raise ContractError(f"graph has inputs the runtime does not know how to feed: {extra}")
    return names_in


def dim(what: str, graph_value, given, manifest_value, default: int | None = None) -> int:
    """A size the graph fixes (a different one given is refused), else the caller's, the manifest's or
    ``default``; none of them: a one-line refusal naming the option."""
    if isinstance(graph_value, int):
        if given is not None and given != graph_value:
            raise RuntimeInputError(f"the graph fixes {what}={graph_value}; {given} was requested")
        return graph_value
    value = given if given is not None else manifest_value if manifest_value is not None else default
    if value is None:
        raise RuntimeInputError(f"the graph leaves {what} symbolic ({graph_value!r}); give it (--{what.replace('_', '-')} N)")
    return positive_int(what, value)


def _dims(ir_model: ir.Model, layout: KVLayout, man: dict, asked: Requested, names_in: dict,
          positional: list[KVPair], rings: ring_mod.RingSpec) -> Dims:
    """ctx_len from a full-length buffer (rings hold their own capacity, recurrent states none), the prefill chunk,
    a fixed seq_len (refused with another exporter's rings), the slots."""
    full = [p.view_shape(p.input.shape) or () for p in positional if not p.is_sliding]
    first = full[0] if full else ((positional or layout.pairs)[0].input.shape or ())
    ctx_len = dim("ctx_len", first[2] if full and len(first) == 4 else None, asked.ctx_len, man.get("ctx_len"))
    seq_dim = (names_in["input_ids"].shape or (None, None))[1]
    fixed_seq_len = seq_dim if isinstance(seq_dim, int) else None
    prefill_seq_len = dim("prefill_seq_len", fixed_seq_len, asked.prefill_seq_len, man.get("prefill_seq_len"),
                          default=DEFAULT_PREFILL_SEQ_LEN)
    prefill_seq_len = ring_mod.cap_chunk(rings, fixed_seq_len, prefill_seq_len)
    if _ring_within(ir_model, rings) and (fixed_seq_len or 1) > 1:
        raise RuntimeInputError(f"the graph fixes seq_len={fixed_seq_len} and has another exporter's "
                                "sliding-window rings, which are exact only fed one token at a time past the ring")
    batch_dim = first[0] if first else None
    max_sequences = _max_sequences("batch_index" in names_in, batch_dim, asked.max_sequences, man)
    return Dims(ctx_len=ctx_len, prefill_seq_len=prefill_seq_len, fixed_seq_len=fixed_seq_len,
                max_sequences=max_sequences, batch_dim=batch_dim)


def _ring_within(ir_model: ir.Model, rings: ring_mod.RingSpec) -> bool:
    """Rings of another exporter (not our ring export): prefill chunks never wrap them."""
    return bool(rings) and ir_model.metadata_props.get(naming.SLIDING_CACHE_META) != "ring"


def _max_sequences(continuous: bool, batch_dim, given: int | None, man: dict) -> int:
    """The slots: a continuous-batching graph's (at most the manifest's ``full_batch_size``); without
    ``batch_index``, the caller's (several: lock step, checked by :func:`_batching`) on a KV batch that is not fixed."""
    if continuous:
        max_sequences = dim("max_sequences", batch_dim, given, man.get("full_batch_size"), default=1)
        exported = man.get("full_batch_size")
        if isinstance(exported, int) and not isinstance(exported, bool) and max_sequences > exported:
            raise RuntimeInputError(f"the graph was exported for full_batch_size={exported} slots (manifest); "
                                    f"{max_sequences} sequences were requested")
        return max_sequences
    if isinstance(batch_dim, int) and batch_dim != 1:
        raise ContractError(f"graph without batch_index has a fixed KV batch of {batch_dim}; the runtime runs such a "
                            "graph with one sequence (batch 1)")
    return 1 if given is None else int(given)


def _logits(layout: KVLayout) -> tuple[int | None, np.dtype]:
    """The vocabulary (the logits' last axis, if static) and the logits' dtype."""
    logits = layout.output("logits")
    shape = logits.shape if logits is not None else None
    vocab_size = shape[-1] if shape and isinstance(shape[-1], int) else None
    dtype = np.dtype(logits.dtype) if logits is not None and logits.dtype != "unknown" else np.float32
    return vocab_size, dtype


def _inplace(ir_model: ir.Model, layout: KVLayout, asked: bool | None) -> tuple[bool, list[str], bool]:
    """``(bind in place, why not (the graph's in-place issues), recurrent states replaced whole)``:
    ``asked=None`` binds in place when the graph is safe, ``False`` never, ``True`` refuses an unsafe graph."""
    if layout.grows:   # fed a copy of the held past; the present copied back (execution/growing.py)
        return False, ["it grows by concatenation: its past is a copy of the buffers, its present copied back"], False
    issues = inplace_issues(ir_model, layout)
    messages = [i.message for i in issues if not i.replaced]
    safe = not messages
    if asked is True and not safe:
        raise ContractError(f"graph is not in-place safe: {messages[0]}")
    return (safe if asked is None else (bool(asked) and safe)), messages, any(i.replaced for i in issues)


def _batching(continuous: bool, dims: Dims, *, inplace: bool, rings: ring_mod.RingSpec, media, recurrent: bool
              ) -> OneSequence:
    """The batching mode: ``batch_index`` -> continuous batching; several sequences without it -> lock step
    (refused where it cannot be exact); else one sequence."""
    if continuous:
        return ContinuousBatching()
    if dims.max_sequences <= 1:
        return OneSequence()
    why = lockstep_mod.refusal(inplace=inplace, rings=rings or None, batch_dim=dims.batch_dim,
                               images=media is not None, recurrent=recurrent)
    if why is not None:
        raise RuntimeInputError(f"graph has no batch_index input: max_sequences={dims.max_sequences} needs "
                                f"lock-step batching, which is not possible: {why}")
    return LockStep()
