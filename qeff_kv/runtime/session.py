"""An onnxruntime session over a retained-state decoder graph, with a persistent in-place KV cache.

Works with any graph that follows the retained-state contract — ours, and the peer's (QEfficient), prefixed
or not, continuous-batching (a ``batch_index`` input) or not. KV pairs come from
:class:`qeff_kv.contract.layout.KVLayout` (the naming contract), never from hard-coded names.

What the graph is (its batching mode, memory kinds, media, speculation, sizes, in-place binding) is resolved once
when the session opens it, with every refusal: :attr:`Session.graph`, a
:class:`~qeff_kv.runtime.graph_description.GraphDescription`. ``prefill`` and ``decode`` ask it and its batching
strategy (:mod:`qeff_kv.runtime.decoding.batching`) rather than flags of their own.

Positions: a sequence of length ``n`` holds its tokens at cache positions ``[0, n)`` (half-open; every
range in this package is half-open). Feeding ``k`` tokens writes positions ``[n, n + k)``.

How a run is bound (IOBinding, through the executor seam :mod:`qeff_kv.runtime.execution.executor`; every buffer from the
session's device, :mod:`qeff_kv.runtime.execution.device`; only execution providers :mod:`qeff_kv.runtime.execution.ep_proofs` proves
exact for the graph's kind are accepted (CPU: every kind; CUDA: our targets), refused in one line otherwise first):

* one buffer per KV pair, allocated once at ``[max_sequences, heads, capacity, head_dim]`` (``ctx_len``, or a
  sliding-window ring's ``C``: see :mod:`qeff_kv.runtime.memory.ring`); if the graph is in-place safe
  (:func:`qeff_kv.graph.inplace.inplace_issues`), the same ``OrtValue`` is bound as the input ``X`` and the output
  ``X_RetainedState`` (``ScatterND`` updates the cache where it is); otherwise the outputs go to a second set of
  buffers and the sets swap after each run (correct, slower: :attr:`Session.inplace`);
* ``logits`` and the small inputs (``input_ids``, ``position_ids``, ``batch_index``) are buffers of their own,
  bound once per shape; a step only writes a few integers into them, and never copies the state.

Prefill runs in chunks of the graph's prefill length. Our own graphs run a short last chunk at its length (no
padding: every index they meet stays in range and no scatter writes a slot twice, as the ONNX spec asks;
``tests/runtime/test_ep_conformance.py``) unless the graph fixes ``seq_len``. The peer's graphs are right-padded with
``position_ids = -1`` as its runner pads them: padding rows write slot ``ctx_len - 1`` of their own row (with the
CPU-only patch :mod:`qeff_kv.graph.passes.ort_invalid_index`, applied for onnxruntime's CPU EP only), so a padded chunk
never fills that slot (such a chunk runs unpadded). With ring buffers a chunk holds at most the smallest ring
capacity; the peer's ring graphs run unpadded chunks that never wrap the ring (:func:`.ring.within_ring`).
A recurrent state the graph replaces whole (not updated in place: the peer's) gets a second buffer.

The language graph of a vision-language model also takes its image buffer and ``image_idx``
(:mod:`qeff_kv.runtime.multimodal.media`, bound in place; the images come from :mod:`qeff_kv.runtime.multimodal.vision`) and, with
multimodal RoPE, ``position_ids [4, batch, seq_len]`` (:mod:`qeff_kv.runtime.multimodal.positions`).

The session feeds the graph (``prefill``, ``decode``); its cache verbs are one call to ``session.cache``
(:class:`~qeff_kv.runtime.memory.hybrid.HybridMemory`) or :mod:`~qeff_kv.runtime.memory.state_file`; its adapter
verbs (``load_adapter`` ...) one call to :mod:`~qeff_kv.runtime.adapters`. Two collaborators do the rest:

* ``session.binding`` (:class:`~qeff_kv.runtime.execution.binding.GraphBinding`): the executor and every value
  bound to it, and the run;
* ``session.generation`` (:class:`~qeff_kv.runtime.decoding.decode_loop.GenerationLoop`): requests and the
  generation loop (``stream``, ``generate``, ``warm_up``).
"""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence as Seq

import numpy as np
import onnx_ir as ir

from qeff_kv.graph import graphio
from qeff_kv.contract import naming
from qeff_kv.errors import RuntimeInputError
from qeff_kv.graph.passes.ort_invalid_index import OrtInvalidIndexPass
from qeff_kv.runtime import arguments
from qeff_kv.runtime.adapters import SessionAdapters
from qeff_kv.runtime.arguments import check_session_args
from qeff_kv.runtime import ccl as ccl_mod
from qeff_kv.runtime.execution import device as device_mod
from qeff_kv.runtime.execution import ep_proofs
from qeff_kv.runtime.execution import executor as exec_mod
from qeff_kv.runtime.multimodal import media as media_mod
from qeff_kv.runtime.multimodal import positions as pos_mod
from qeff_kv.runtime.memory import recurrent as rec_mod
from qeff_kv.runtime.memory import ring as ring_mod
from qeff_kv.runtime.decoding.batching import BATCH_INDEX
from qeff_kv.runtime.memory import state_file as state_mod
from qeff_kv.runtime.memory.hybrid import HybridMemory, Sequence
from qeff_kv.runtime.memory.registry import Settings, require_memory
from qeff_kv.runtime.graph_description import DEFAULT_PREFILL_SEQ_LEN, GraphDescription, Memory, Requested  # noqa: F401
from qeff_kv.runtime.model_files import checkpoint_identity, kv_fingerprint, model_fingerprint, resolve_model
from qeff_kv.runtime.decoding.decode_loop import GenerationLoop
from qeff_kv.runtime.decoding.sampling import SamplingParams
from qeff_kv.runtime.decoding.stopping import DEFAULT_MAX_TOKENS, asked_tokens
from qeff_kv.runtime.execution.binding import GraphBinding
from qeff_kv.runtime.results import Generation, Timings, TokenEvent  # noqa: F401  (Generation, TokenEvent: re-exported)

class Session:
    """Run a retained-state graph with a persistent KV cache.

    Args:
        model: an ``.onnx`` file or an export folder (``manifest.json``).
        ctx_len: cache capacity in positions; required when neither the graph nor the manifest fixes it.
        prefill_seq_len: prefill chunk length (default: graph, manifest, else 32).
        max_sequences: slots of a continuous-batching graph (default: graph, manifest, else 1). A graph
            without ``batch_index`` holds one sequence.
        inplace: ``None`` (default) binds in place when the graph is in-place safe; ``False`` forces separate
            output buffers; ``True`` refuses a graph that is not safe.
        threads: onnxruntime intra-op threads (default: onnxruntime's choice).
        sliding_window: the window ``W`` of a graph with sliding-window ring buffers (axis ``sliding_window``)
            when neither its metadata nor its manifest records it.
        image_token_id: the image token of a vision-language graph whose metadata and manifest do not record it
            (another exporter's); images themselves come from :class:`qeff_kv.runtime.vision_language.VisionLanguageModel`.
        checkpoint_every, max_checkpoints: a recurrent or hybrid graph's checkpoints of its recurrent state: every
            this many positions (0: only at prompt boundaries) and at most this many per sequence (0: none, so a
            rewind goes to 0 only); see :mod:`qeff_kv.runtime.memory.recurrent`.
        device: ``"cpu"`` (default) or ``"cuda"``; providers: onnxruntime execution providers instead. Only the
            ones :mod:`qeff_kv.runtime.execution.ep_proofs` proves exact for the graph's kind are accepted (CPU:
            all; CUDA: ours): any other is refused in one line (:class:`~qeff_kv.errors.ProviderError`) first.
        executor: ``"onnxruntime"`` (default), or ``"reference"``: onnx's reference evaluator with strict index
            checks (:class:`~qeff_kv.runtime.execution.executor.ReferenceExecutor`; slow, for conformance proofs).
    """

    def __init__(self, model: str | os.PathLike, *, ctx_len: int | None = None,
                 prefill_seq_len: int | None = None, max_sequences: int | None = None,
                 inplace: bool | None = None, threads: int | None = None,
                 providers: Seq[str] | None = None, sliding_window: int | None = None,
                 image_token_id: int | None = None, checkpoint_every: int | None = None,
                 max_checkpoints: int | None = None, device: str | None = None, executor: str = "onnxruntime"):
        # arguments first: nothing is read before they are valid, no EP is used that is not proved
        self.providers = check_session_args(model=model, ctx_len=ctx_len, prefill_seq_len=prefill_seq_len,
                                            max_sequences=max_sequences, inplace=inplace, threads=threads,
                                            providers=providers, sliding_window=sliding_window,
                                            image_token_id=image_token_id, device=device, executor=executor)
        self.executor = executor
        asked = Requested(ctx_len=ctx_len, prefill_seq_len=prefill_seq_len, max_sequences=max_sequences,
                          inplace=inplace, sliding_window=sliding_window, image_token_id=image_token_id,
                          checkpoints=rec_mod.CheckpointPolicy.of(checkpoint_every, max_checkpoints))
        self.files = resolve_model(model)
        source, external = self._read_graph(asked)
        # what runs the graph: onnxruntime on the (proved) providers, or onnx's strict reference evaluator
        io, executor_session = exec_mod.open_executor(
            executor, source, self.files.onnx_path, external=external, threads=threads, providers=self.providers,
            index_limits={"position_ids": self.ctx_len, BATCH_INDEX: self.max_sequences})
        del source
        self._allocate()
        # the collaborators, each with its own state and this session: what is bound and run, the generation loop
        self.binding = GraphBinding(self, io, executor_session)
        self.binding.bind()
        self.lora = SessionAdapters(self)   # the LoRA adapters (runtime/adapters.py)
        self.generation = GenerationLoop(self)

    # ------------------------------------------------------------------------------------ construction
    def _read_graph(self, asked: Requested) -> tuple[bytes | str, bool]:
        """Resolve the graph's description, record its identity, refuse what does not fit in memory; returns what
        onnxruntime loads (the graph patched in memory, or its path) and whether its weights are external. The
        inspected graph is freed on return: peak memory is one copy of the weights, not two."""
        ir_model = graphio.load(self.files.onnx_path)
        self._describe(ir_model, asked)
        self.graph_kind = ep_proofs.kind_of(ir_model.metadata_props.get(naming.TARGET_META))
        ep_proofs.require(self.providers, self.graph_kind)   # before onnxruntime sees the graph
        arguments.require_available(self.providers)
        self.device = device_mod.for_providers(self.providers)   # where every bound value lives
        self.invalid_index_patch = {"gather": 0, "scatter": 0}
        if self.executor != "onnxruntime" or self.providers != [ep_proofs.CPU]:
            return str(self.files.onnx_path), False   # the patch below is for the CPU kernels only
        fix = OrtInvalidIndexPass()
        modified = fix(ir_model).modified
        self.invalid_index_patch = {"gather": fix.gather_constants, "scatter": fix.scatter_constants}
        if not modified:
            return str(self.files.onnx_path), False
        ir_model.meta.pop(naming.SOURCE_PATH_META, None)
        proto = ir.serde.serialize_model(ir_model)
        external = bool(graphio.external_tensors(ir_model))
        del ir_model
        if proto.ir_version > graphio.MAX_ORT_IR_VERSION:
            proto.ir_version = graphio.MAX_ORT_IR_VERSION
        return proto.SerializeToString(), external

    def _describe(self, ir_model: ir.Model, asked: Requested) -> None:
        """The description (every refusal of the graph and the arguments), the identity of the file as given
        (before any in-memory patch), the memory refusal, the in-place warning."""
        self.graph = GraphDescription.resolve(ir_model, self.files.manifest, self.files.onnx_path.name, asked)
        self.kv_fingerprint = kv_fingerprint(self.graph.layout)
        self.model_fingerprint = model_fingerprint(ir_model)  # sampled: the fallback identity
        self.checkpoint = checkpoint_identity(ir_model, self.files.manifest)  # recorded at export, or None
        self._require_memory()
        if self.inplace_issues:
            warnings.warn(f"{self.files.onnx_path.name} is not in-place safe ({self.inplace_issues[0]}); "
                          "running with separate output buffers", RuntimeWarning, stacklevel=4)

    def _memories(self, device=None) -> tuple[dict, Settings]:
        """The cache's pairs by state kind and its settings (at the graph's ``ctx_len``; lock step then keeps each
        row's last slot)."""
        mem = self.graph.memory
        return ({"full": list(mem.positional), "recurrent": list(mem.recurrent)},
                Settings(self.max_sequences, self.graph.dims.ctx_len, self.graph.double_buffered, self.rings, mem.checkpoints,
                         self.graph.swaps_buffers, device))

    def _require_memory(self) -> None:
        """Refuse (one line, with the size) buffers that do not fit, before onnxruntime or numpy allocate."""
        require_memory(*self._memories())

    def _allocate(self) -> None:
        """The cache (:meth:`.HybridMemory.open`, from the memory registry), the timings, the CCL feeder."""
        self.cache = HybridMemory.open(*self._memories(self.device))
        self.cache.ctx_len = self.ctx_len   # lock step: idle rows write the last slot (see runtime/lockstep.py)
        self.timings = Timings()
        # comp_ctx_lengths (contract section 9), ours or the peer's: fed at the smallest allowed length
        self.ccl = ccl_mod.CCLFeeder(self.ctx_len, self.graph.ccl_listed) if self.graph.ccl else None

    # ------------------------------------------------------------------------------------ the description
    # What the graph is (runtime/graph_description.py), read where it always was.
    layout = property(lambda self: self.graph.layout)
    prefix = property(lambda self: self.graph.layout.prefix)
    num_layers = property(lambda self: self.graph.layout.num_layers)
    #: a vision-language language graph's image inputs (runtime/media.py), or None
    media = property(lambda self: self.graph.media)
    continuous_batching = property(lambda self: self.graph.batching.continuous_batching)
    #: several sequences in a graph without batch_index: prefill by rows, decode every row together
    lockstep = property(lambda self: self.graph.batching.lockstep)
    rings = property(lambda self: self.graph.memory.rings)
    sliding_window = property(lambda self: self.graph.memory.rings.window)
    #: the graph keeps recurrent state (conv_state/recurrent_state): rewinds need checkpoints
    recurrent = property(lambda self: self.graph.recurrent)
    #: position_ids [4, batch, seq_len]: text positions, then multimodal RoPE rows (runtime/positions.py)
    mrope = property(lambda self: self.graph.mrope)
    ctx_len = property(lambda self: self.graph.ctx_len)
    prefill_seq_len = property(lambda self: self.graph.dims.prefill_seq_len)
    fixed_seq_len = property(lambda self: self.graph.dims.fixed_seq_len)
    max_sequences = property(lambda self: self.graph.dims.max_sequences)
    inplace = property(lambda self: self.graph.inplace)
    inplace_issues = property(lambda self: list(self.graph.inplace_issues))
    vocab_size = property(lambda self: self.graph.vocab_size)
    logits_dtype = property(lambda self: self.graph.logits_dtype)
    eos_token_ids = property(lambda self: list(self.graph.eos_token_ids))
    #: exported by qeff-kv (its target recorded in the graph): short chunks are not padded
    _own_graph = property(lambda self: self.graph.own_graph)
    _pad_ring = property(lambda self: self.graph.memory.pad_ring)

    def _redescribe(self, **memory_or_graph) -> None:
        """Replace fields of the description (what a test does to run the graph as another kind would be)."""
        mem = {k: v for k, v in memory_or_graph.items() if k in Memory.__dataclass_fields__}
        rest = {k: v for k, v in memory_or_graph.items() if k not in mem}
        self.graph = replace(self.graph, memory=replace(self.graph.memory, **mem), **rest)

    #: a speculative-decoding graph (``num_logits_to_keep``): :func:`qeff_kv.runtime.decoding.speculative.score` verifies
    #: drafted tokens in one step; ``speculative_tokens`` is its ``K`` (graph metadata or manifest, else None)
    speculative = property(lambda self: self.graph.speculative,
                           lambda self, v: self._redescribe(speculative=bool(v)))
    speculative_tokens = property(lambda self: self.graph.speculative_tokens,
                                  lambda self, v: self._redescribe(speculative_tokens=v))
    #: rings of another exporter (not our ring export): prefill chunks never wrap them (ring.within_ring)
    _ring_within = property(lambda self: self.graph.memory.ring_within,
                            lambda self, v: self._redescribe(ring_within=bool(v)))

    # ------------------------------------------------------------------------------------ runs
    def _run(self, rows: int, seq_len: int, last_index: np.ndarray, needed: int | None = None,
             keep: int = 1) -> np.ndarray:
        """Every run of :meth:`prefill` and :meth:`decode` (:meth:`.GraphBinding.run`: the logits); one door, so that
        a test can watch each run of the session."""
        return self.binding.run(rows, seq_len, last_index, needed, keep)

    # ------------------------------------------------------------------------------------ sequences
    def _chunks(self, start: int, n: int, plan: list[tuple[int, int]] | None = None) -> list[tuple[int, int, bool]]:
        """(offset, count, padded) for feeding ``n`` tokens from ``start`` (:func:`.arguments.chunk_padding`)."""
        return arguments.chunk_padding(start, n, plan, seq_len=self.prefill_seq_len,
                                       fixed_seq_len=self.fixed_seq_len, ctx_len=self.ctx_len,
                                       pad_short=self.graph.pad_short, pad_ring=self._pad_ring)

    def prefill(self, seq: Sequence, tokens: Seq[int], images: media_mod.Images | None = None, *,
                checkpoint: bool | Seq[int] = True) -> np.ndarray:
        """Append ``tokens`` to ``seq``'s cache (positions ``[length, length + len(tokens))``) in prefill chunks.

        ``images``: the prompt's images, for a vision-language graph (:mod:`qeff_kv.runtime.multimodal.vision`); their count
        of image rows must equal the prompt's image tokens. Returns the logits ``[vocab]`` after the last token.
        Clears any pending token. With recurrent state, chunks end at multiples of ``checkpoint_every`` (each takes
        a checkpoint) and at the prompt boundary: ``checkpoint=True`` takes one at the end of this call and one
        token before it; ``False`` none; positions (a caller feeding one prompt in several calls gives the prompt's
        ``(end - 1, end)``) take one at each position inside this call.
        """
        seq = self.cache.get(seq)
        toks = self._check_prefill(seq, tokens, images)
        end = seq.length + len(toks)
        marks = (((end - 1, end) if checkpoint is True else tuple(int(m) for m in checkpoint or ()))
                 if self.cache.recurrent.policy.at_prompts else ())   # prompt-boundary checkpoints
        plan = self._prefill_plan(seq, toks, images, marks)
        rope = None if images is None or images.rope is None else images.rope + seq.length + pos_mod.delta(seq.rope_marks)
        if self.media is not None:
            self.media.begin(self.binding.io, self.binding.bind_out, images)
        t0 = time.perf_counter()
        # lock step: the graph's batch-1 buffers are this sequence's row of ours
        self.binding.use_kv(self.graph.batching.prefill_views(self.binding.rows, seq))
        logits = self._prefill_chunks(seq, toks, plan, rope, marks)
        if self.media is not None:
            self.media.end()
            seq.rope_marks.extend(self.media.marks(images, seq.length, pos_mod.delta(seq.rope_marks)))
        seq.length += len(toks)
        seq.tokens.extend(toks)
        seq.pending = None
        seq.pending_emitted = False
        self.timings.prefill_s += time.perf_counter() - t0
        self.timings.prefill_tokens += len(toks)
        return logits

    def _check_prefill(self, seq: Sequence, tokens: Seq[int], images) -> list[int]:
        """The prompt's token ids (:func:`.arguments.check_prefill`)."""
        return arguments.check_prefill(seq, tokens, vocab_size=self.vocab_size, ctx_len=self.ctx_len, images=images,
                                       text_only=self.media is None)

    def _prefill_plan(self, seq: Sequence, toks: list[int], images, marks: tuple[int, ...]
                      ) -> list[tuple[int, int, bool]]:
        """The chunks ``(offset, count, padded)``: where the images' runs allow (media), ending at the recurrent
        state's checkpoints, never wrapping another exporter's rings."""
        n, rec, S = len(toks), self.cache.recurrent, self.prefill_seq_len
        if self.media is not None:
            plan = self._chunks(seq.length, n, self.media.check(toks, images, S))
        elif rec:   # chunks end at checkpoint positions
            plan = self._chunks(seq.length, n, rec.boundaries(
                seq.length, [(o, min(S, n - o)) for o in range(0, n, S)], marks))
        else:
            plan = self._chunks(seq.length, n)
        if self._ring_within:   # another exporter's rings: no chunk wraps them
            plan = self._chunks(seq.length, n, ring_mod.within_ring([(o, c) for o, c, _ in plan],
                                                                    seq.length, self.rings.capacity))
        return plan

    def _prefill_chunks(self, seq: Sequence, toks: list[int], plan: list[tuple[int, int, bool]], rope,
                        marks: tuple[int, ...]) -> np.ndarray:
        """Run the chunks of ``plan`` (``seq.length`` not yet advanced); the logits after the last one."""
        rec, logits = self.cache.recurrent, None
        for off, cnt, padded in plan:
            width = self.prefill_seq_len if padded else cnt
            if self.fixed_seq_len is not None:
                width = self.fixed_seq_len
            arrays = self.binding.bind_small(1, width)
            ids, pos = arrays["input_ids"], arrays["position_ids"]
            ids.fill(0)
            pos_mod.clear(pos)
            ids[0, :cnt] = toks[off:off + cnt]
            pos_mod.write(pos, 0, seq.length + off, cnt, None if rope is None else rope[:, off:off + cnt],
                          pos_mod.delta(seq.rope_marks))
            self.graph.batching.fill_prefill(arrays, seq)
            self.binding.adapt_rows(arrays, ((0, seq),))
            logits = self._run(1, width, np.array([cnt - 1]), needed=seq.length + off + cnt)[0]
            self.timings.prefill_runs += 1
            self.cache.positional.wrote(seq, seq.length + off + cnt)
            if rec and (rec.due(seq.length + off + cnt) or seq.length + off + cnt in marks):
                rec.snapshot(seq, seq.length + off + cnt)
            if self.media is not None:
                self.media.chain()
        assert logits is not None
        return logits

    def decode(self, feeds: dict[Sequence, int] | Seq[tuple[Sequence, int]]) -> dict[Sequence, np.ndarray]:
        """One step: feed one token to each given sequence (all together, each at its own position).

        Returns each sequence's logits ``[vocab]``.
        """
        items = list(feeds.items()) if isinstance(feeds, dict) else list(feeds)
        if not items:
            return {}
        seqs, toks = self._check_decode(items)
        batching = self.graph.batching
        rows = batching.decode_rows(seqs, self.max_sequences)
        width = self.fixed_seq_len or 1
        if width > 1 and any(s.length == self.ctx_len - 1 for s in seqs):
            raise RuntimeInputError(
                f"the graph fixes seq_len={width}, so a decode step carries padding, which must not share "
                f"position {self.ctx_len - 1} with a real token; the usable capacity is {self.ctx_len - 1}")
        t0 = time.perf_counter()
        # lock step: the rows in use
        self.binding.use_kv(batching.decode_views(self.binding.rows, rows, self.max_sequences, seqs))
        arrays = self.binding.bind_small(rows, width)
        if width != 1:
            arrays["input_ids"].fill(0)
            pos_mod.clear(arrays["position_ids"])
        batching.fill_decode(arrays, seqs, toks, self.cache.sequences)
        self.binding.adapt_rows(arrays, ((batching.logits_row(r, s, rows), s) for r, s in enumerate(seqs)))
        logits = self._run(rows, width, np.zeros(rows, np.int64), needed=max(s.length for s in seqs) + 1)
        out = {}
        for r, (s, t) in enumerate(zip(seqs, toks)):
            s.length += 1
            self.cache.positional.wrote(s, s.length)
            if self.cache.recurrent.due(s.length):
                self.cache.recurrent.snapshot(s, s.length)
            s.tokens.append(t)
            s.pending = None
            s.pending_emitted = False
            out[s] = logits[batching.logits_row(r, s, rows)]
        self.timings.decode_s += time.perf_counter() - t0
        self.timings.decode_steps += 1
        self.timings.decode_rows += rows
        return out

    def _check_decode(self, items: list) -> tuple[list[Sequence], list[int]]:
        """The step's sequences and tokens, refused in one line when malformed, repeated, empty or out of room."""
        if not all(isinstance(it, tuple) and len(it) == 2 for it in items):
            raise RuntimeInputError("decode takes {sequence: token} or [(sequence, token), ...]")
        seqs = [self.cache.get(s) for s, _ in items]
        if len({s.id for s in seqs}) != len(seqs):
            raise RuntimeInputError("a sequence appears twice in one decode step")
        empty = [s.id for s in seqs if s.length == 0]
        if empty:
            raise RuntimeInputError(
                f"sequence {empty[0]} is empty: prefill it first (decode continues a sequence by one token)")
        toks = arguments.check_tokens((t for _, t in items), self.vocab_size)
        self.cache.check_room(seqs, 1)
        return seqs, toks

    # ------------------------------------------------------------------------------------ the generation loop
    def stream(self, prompts: Seq[Seq[int] | Sequence | tuple[Sequence, Seq[int]]], *,
               max_tokens: int = DEFAULT_MAX_TOKENS, sampling: SamplingParams | None = None,
               stop_tokens: Iterable[int] | None = None, on_capacity: str = "error",
               results: list[Generation] | None = None, max_new_tokens: int | None = None) -> Iterator[TokenEvent]:
        """Generate for several requests together, yielding each token as made (:meth:`.GenerationLoop.stream`)."""
        return self.generation.stream(prompts, max_tokens=asked_tokens(max_tokens, max_new_tokens), sampling=sampling,
                                      stop_tokens=stop_tokens, on_capacity=on_capacity, results=results)

    def generate(self, prompts, *, max_tokens: int = DEFAULT_MAX_TOKENS, sampling: SamplingParams | None = None,
                 stop_tokens: Iterable[int] | None = None, on_capacity: str = "error",
                 callback: Callable[[TokenEvent], None] | None = None,
                 max_new_tokens: int | None = None) -> list[Generation]:
        """Run :meth:`stream` to the end; one :class:`Generation` per request (:meth:`.GenerationLoop.generate`)."""
        return self.generation.generate(prompts, max_tokens=asked_tokens(max_tokens, max_new_tokens),
                                        sampling=sampling, stop_tokens=stop_tokens, on_capacity=on_capacity,
                                        callback=callback)

    def warm_up(self) -> None:
        """Pay onnxruntime's first-run costs before the first requests (:meth:`.GenerationLoop.warm_up`)."""
        self.generation.warm_up()

    # ------------------------------------------------------------------------------------ the cache verbs
    # one hop: each verb is the cache's (runtime/memory/hybrid.py) or the state-file module's
    def add_sequence(self, adapter: str | None = None, lora_scale: float = 1.0) -> Sequence:
        """A new empty sequence in a free slot; ``adapter``: the LoRA adapter it runs with (``session.lora``)."""
        return self.lora.new_sequence(adapter, lora_scale)

    def remove_sequence(self, seq: Sequence) -> None:
        self.cache.destroy(seq)

    sequences = property(lambda self: self.cache.sequences)

    def truncate(self, seq: Sequence, n: int) -> None:
        """Rewind ``seq`` to positions ``[0, n)`` in O(1), or refuse in one line (:meth:`.HybridMemory.truncate`)."""
        self.cache.truncate(seq, n)

    def rewind_points(self, seq: Sequence) -> list[int] | None:
        """The positions a recurrent or hybrid sequence can be rewound to (:meth:`.HybridMemory.rewind_points`)."""
        return self.cache.rewind_points(seq)

    def reusable(self, seq: Sequence, n: int) -> int:
        """The longest prefix of at most ``n`` positions ``seq`` can return to (:meth:`.HybridMemory.reusable`)."""
        return self.cache.reusable(seq, n)

    def memory(self) -> dict:
        """Bytes the cache holds (:meth:`.HybridMemory.memory`)."""   # the adapters' bytes: session.lora.nbytes()
        return self.cache.memory()

    def copy(self, src: Sequence, dst: Sequence, n: int) -> None:
        """Copy ``src``'s first ``n`` positions into ``dst`` in place (:meth:`.HybridMemory.copy`)."""
        self.cache.copy(src, dst, n)

    def relocate(self, seq: Sequence, slot: int) -> Sequence | None:
        """Move ``seq`` into ``slot``, exchanging with the sequence there, returned (:meth:`.HybridMemory.relocate`)."""
        return self.cache.relocate(seq, slot)

    def export_state(self, seq: Sequence, select: str | None = None, *, checksum: bool = True) -> state_mod.KVState:
        """The in-memory state of ``seq`` (for hand-off; :func:`.state_file.export_state`)."""
        return state_mod.export_state(self, seq, select, checksum=checksum)

    def import_state(self, state: state_mod.KVState, seq: Sequence | None = None) -> Sequence:
        return state_mod.import_state(self, state, seq)

    def save_state(self, seq: Sequence, path: str | os.PathLike, select: str | None = None) -> Path:
        return state_mod.save_state(self, seq, path, select)

    def load_state(self, path: str | os.PathLike, seq: Sequence | None = None) -> Sequence:
        return state_mod.load_state(self, path, seq)

    def describe(self) -> dict:
        """What the session runs: the graph, its sizes, how it is bound, its memories (for diagnostics)."""
        rec = self.cache.recurrent
        return {
            "onnx": str(self.files.onnx_path), "prefix": self.prefix, "num_layers": self.num_layers,
            "ctx_len": self.ctx_len, "prefill_seq_len": self.prefill_seq_len,
            "continuous_batching": self.continuous_batching, "lockstep": self.lockstep,
            "max_sequences": self.max_sequences, "inplace": self.inplace, "inplace_issues": self.inplace_issues[:3],
            "invalid_index_patch": self.invalid_index_patch,
            naming.CCL_INPUT: None if self.ccl is None else list(self.ccl.lengths),
            "memory_capacity": self.cache.memory_capacity,
            "sliding_window": self.sliding_window, "ring_capacities": dict(self.rings.capacities),
            "vision_language": None if self.media is None else self.media.kind,
            "recurrent_states": list(rec.shapes), "recurrent_double_buffered": rec.double_buffer,
            "checkpoint_every": rec.policy.every if rec else None, "max_checkpoints": rec.policy.keep if rec else None,
            "lora": None if self.graph.lora is None else {**self.graph.lora.to_json(), "loaded": self.lora.names}}

    def kv_data_pointers(self) -> dict[str, int]:
        """Address of every KV input buffer currently bound (for tests and diagnostics)."""
        return self.binding.kv_data_pointers()

    def bound_output_pointers(self) -> dict[str, int]:
        """Address of every retained output after the last run."""
        return self.binding.bound_output_pointers()


def open_session(model: str | os.PathLike, **kwargs) -> Session:
    """Shorthand for :class:`Session`."""
    return Session(model, **kwargs)
