"""Verification at export: run the written graph in onnxruntime and compare it with the PyTorch model.

The probe is a prompt of seeded random token ids (nothing like the all-zero tracing input), sent in
``prefill_seq_len`` chunks whose last one is right-padded with ``position_ids = -1``, followed by decode steps.
The reference is the untouched transformers model's own forward pass (its own cache, its own attention,
logit scaling and soft-capping), computed *before* tracing, so nothing the exporter patches can hide in it.
Decode is teacher-forced with the reference's greedy tokens, so both sides see the same inputs at every step.
A speculative-decoding graph (``--speculative-tokens K``) gets its ``K+1`` (at least 4) decode tokens in one step
and every row of its logits is compared with the reference's logits after that token.

At every compared step (the last prefill chunk and each decode step) the graph must give

* logits within ``tolerance = rtol * max(1, max|reference logits|)`` of the reference (``rtol`` 1e-3 for
  float32, 3e-2 for float16), and
* the same greedy token, where a near-tie is accepted: the graph's argmax must be a token whose reference
  logit is within the tolerance of the reference maximum.

A mismatch raises :class:`~qeff_kv.errors.VerificationError` naming the step and how far off it is; the export
is then not moved into place. The cost is one reference forward pass in PyTorch and one onnxruntime session
over the probe (a fraction of a second for tiny models, seconds for a 135M-parameter one).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from qeff_kv.support import limits
from qeff_kv.contract.chunking import plan_chunks
from qeff_kv.errors import ExportError, VerificationError, VerificationMemoryError
from qeff_kv.export.facts import family
from qeff_kv.export import transformers_adapter as hf
from qeff_kv.export.probe_runner import BlockProbeRunner, BlockRunRefused, ProbeRunner, first_line, \
    forced_block_layers

#: ``int8-kv`` (``--kv-cache-dtype int8``, against the reference with the cache quantization emulated): a value within
#: float32 rounding of a rounding boundary may land one int8 step apart on the two sides (RoPE'd keys differ in the
#: last bit), and attention carries that step on; float16's tolerance bounds it
#: ``int4-kv`` (``--kv-cache-dtype int4``): the same boundary effect with a step 127/7 times an int8 step (1.25 x absmax
#: over 7 codes, not 127): SmolLM2-135M's int4 export differs by up to 1.77 at max|logits| 28.3 (its int8 one by
#: 0.149); the greedy tokens must still be the reference's, and the tiny models' int4 graphs are exact to 1e-5
RTOL = {"float32": 1e-3, "float16": 3e-2, "int8-kv": 3e-2, "int4-kv": 1e-1}
DECODE_STEPS = 4
PROBE_SEED = 1234
#: verification is on by default when twice the weights (PyTorch + onnxruntime copies) plus this margin fit in
#: the memory available now
MEMORY_MARGIN = 1 << 30


@dataclass
class Probe:
    prompt: list[int]
    chunk: int
    decode_steps: int
    slot: int = 0
    #: vision-language models: one seeded random image ``[1, channels, size, size]`` whose rows the prompt's
    #: image tokens take (the image starts inside the first chunk and straddles chunk boundaries)
    pixel_values: np.ndarray | None = None
    image_token: int | None = None
    #: the model's image tokens attend to each other both ways: no prefill chunk splits an image
    image_blocks: bool = False
    #: models that take patch rows (Qwen2.5-VL): the image's patch grid ``[t, h, w]``; their language graph
    #: takes multimodal RoPE rows (:mod:`qeff_kv.contract.mrope`)
    grid: list[int] | None = None
    spatial_merge_size: int | None = None
    #: the language model takes multimodal RoPE rows (Qwen2.5-VL); a patch-row model over 1-D positions
    #: (Exaone4.5's exaone4 text model) does not
    mrope: bool = True
    #: run the graph this many decoder layers at a time (:func:`block_layers_for`), None: whole
    block_layers: int | None = None
    #: why the graph is run by blocks: the whole-graph refusal (None: forced by ``probe_runner.BLOCK_ENV``)
    block_reason: str | None = None

    def rope_rows(self) -> tuple[np.ndarray, int] | None:
        """``(rows [3, len(prompt)], delta)`` of multimodal RoPE, or ``None``."""
        if self.grid is None or not self.mrope:
            return None
        from qeff_kv.contract.mrope import prompt_positions

        return prompt_positions(self.prompt, self.image_token, [self.grid], self.spatial_merge_size)


@dataclass
class Reference:
    """The PyTorch model's logits: after the prompt, then after each teacher-forced decode token."""

    logits: list[np.ndarray]          # each [vocab], float64
    tokens: list[int]                 # greedy token after the prompt and after each decode step
    seconds: float = 0.0


@dataclass
class VerificationResult:
    status: str                                   # "passed" | "skipped"
    reason: str | None = None
    steps: int = 0
    prompt_len: int = 0
    chunk: int = 0
    max_abs_diff: float | None = None
    tolerance: float | None = None
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        if self.status != "passed":
            return {"status": self.status, "reason": self.reason}
        d = asdict(self)
        d.pop("extra")
        d.update(self.extra)
        return {k: v for k, v in d.items() if v is not None}


def make_probe(vocab_size: int, ctx_len: int, prefill_seq_len: int, *, slot: int = 0,
               decode_steps: int = DECODE_STEPS, window: int | None = None, recurrent: bool = False) -> Probe:
    """A prompt of one full chunk plus a padded partial one (when the capacity allows), then decode steps.

    With a sliding ``window`` smaller than ``ctx_len`` the prompt is longer than the window by a chunk and a
    half, so ring buffers wrap, chunks straddle the wrap and decoding runs past it. A ``recurrent`` model's prompt
    is three full chunks and a padded half one, so its states are carried across several chunks."""
    chunk = max(1, prefill_seq_len)
    length = (3 if recurrent else 1) * chunk + max(1, chunk // 2) if chunk > 1 else 3
    if window is not None and window < ctx_len:
        length = max(length, window + length)
    steps = decode_steps
    while length + steps > ctx_len and steps > 1:
        steps -= 1
    length = max(1, min(length, ctx_len - steps))
    rng = np.random.default_rng(PROBE_SEED)
    low = 3 if vocab_size > 8 else 0       # keep clear of the usual pad/bos/eos ids
    prompt = [int(t) for t in rng.integers(low, vocab_size, size=length)]
    return Probe(prompt=prompt, chunk=chunk, decode_steps=steps, slot=slot)


def add_image(probe: Probe, image_token_id: int, vision: dict, ctx_len: int, dtype: str = "float32",
              image_blocks: bool = False, mrope: bool = True) -> Probe:
    """The probe of a vision-language model: three text tokens, the image's ``vision_size`` image tokens, then
    the probe's own text, trimmed to leave room for the decode steps; a seeded random image (or its patch rows
    and grid, for models that take patch rows), and multimodal RoPE rows where the model uses them."""
    rng = np.random.default_rng(PROBE_SEED + 1)
    vision_size = int(vision["vision_size"])
    head = probe.prompt[:3]
    prompt = head + [int(image_token_id)] * vision_size + probe.prompt[3:]
    room = ctx_len - probe.decode_steps
    if len(head) + vision_size >= room:
        raise VerificationError(f"ctx_len {ctx_len} cannot hold one image ({vision_size} image tokens) and the "
                                f"probe's text and {probe.decode_steps} decode steps")
    if "grid" in vision:
        t, h, w = vision["grid"]
        pixels = rng.standard_normal((t * h * w, vision["patch_dim"])).astype(dtype)
    else:
        size, channels = vision["image_size"], vision["channels"]
        pixels = rng.standard_normal((1, channels, size, size)).astype(dtype)
    return Probe(prompt=prompt[:room], chunk=probe.chunk, decode_steps=probe.decode_steps, slot=probe.slot,
                 pixel_values=pixels, image_token=int(image_token_id), image_blocks=image_blocks,
                 grid=list(vision["grid"]) if "grid" in vision else None,
                 spatial_merge_size=vision.get("spatial_merge_size"), mrope=mrope)


def memory_allows(need: int, why: str = "", by_layer: int | None = None) -> tuple[bool, str]:
    """Whether ``need`` bytes fit in the memory available now; else the one-line refusal naming both (and
    ``why``, what makes it that large; ``by_layer``: what verifying a layer at a time would need)."""
    avail = limits.available_memory()
    if avail is None or need <= avail:
        return True, ""
    why += f"; a layer at a time, about {by_layer / 2**30:.1f} GiB" if by_layer else ""
    return False, (f"verification needs about {need / 2**30:.1f} GiB{f' ({why})' if why else ''} and "
                   f"{avail / 2**30:.1f} GiB is available: free memory, or pass --no-verify to export without "
                   f"verification (recorded as skipped)")


#: why a half-precision graph's verification needs its weights twice over (:func:`verification_bytes`)
HALF_ON_CPU = "onnxruntime's CPU kernels hold a float16 graph's weights as float32"
#: a block's layers hold at most this many bytes as float32 (unless it is one layer): bounded, not all there is
BLOCK_LAYER_BYTES = 2 << 30


def layer_bytes(model) -> tuple[int, int, int]:
    """``(layers, the largest layer's bytes, the most any block holds besides its layers)``: the layers are the
    weightiest module list; the other weights all go in one block but for the second largest of them (the
    embedding and an untied head fall in the first and the last block)."""
    import torch

    def size(module) -> int:
        return sum(p.numel() * p.element_size() for p in module.parameters())

    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
    layers = max(lists, key=size) if lists else torch.nn.ModuleList()
    inside = {id(p) for p in layers.parameters()}
    others = sorted((p.numel() * p.element_size() for p in model.parameters() if id(p) not in inside), reverse=True)
    sizes = [size(m) for m in layers] or [0]
    return len(layers), max(sizes), sum(others) - (others[1] if len(others) > 1 and len(layers) > 1 else 0)


def block_layers_for(model, streamed: bool, whole: int, say) -> tuple[int, str]:
    """``(layers per block, the whole-graph refusal)``: a half-precision graph whose whole-graph verification does not
    fit (it needs ``whole`` bytes) is run a block of layers at a time (onnxruntime holds a block's weights as
    float32: twice its bytes), as many layers to a block as fit the memory available now and
    :data:`BLOCK_LAYER_BYTES`; where not even one layer fits, the refusal, saying what block verification needs."""
    n, layer, extra = layer_bytes(model)
    held = 0 if streamed else sum(p.numel() * p.element_size() for p in model.parameters())   # beside the session

    def need(k: int) -> int:
        return 2 * (k * layer + extra) + held + MEMORY_MARGIN

    avail = limits.available_memory()
    k = next((k for k in range(n, 0, -1) if (k == 1 or 2 * k * layer <= BLOCK_LAYER_BYTES)
              and (avail is None or need(k) <= avail)), 0)
    if k == 0 or n < 2:
        raise VerificationMemoryError(memory_allows(whole, HALF_ON_CPU, need(1) if n > 1 else None)[1])
    say(f"verifying {k} layer{'s' if k > 1 else ''} at a time (about {need(k) / 2**30:.1f} GiB; the whole graph "
        f"would need more than the {(avail or 0) / 2**30:.1f} GiB available)")
    return k, memory_allows(whole, HALF_ON_CPU)[1]


def verification_bytes(model, streamed: bool, quantized: bool = False) -> tuple[int, str]:
    """What verification needs beyond the export itself, and why when it is the weights: a model loaded whole is
    held beside onnxruntime's session (two copies of the weights); a streamed model's reference holds one module's
    weights at a time and the session reads the memory-mapped data file (three of the largest tensors). A float16
    or bfloat16 graph (not ``quantized``) is the exception: onnxruntime's CPU execution provider converts its
    weights to float32 when the session loads (measured: 5.1 GB resident for the 2.47 GB of a Llama-3.2-1B-shaped
    float16 graph), so the session alone holds twice the weights' bytes. Plus :data:`MEMORY_MARGIN`."""
    import torch

    params = list(model.parameters())
    sizes = [p.numel() * p.element_size() for p in params]
    half = not quantized and any(p.dtype in (torch.float16, torch.bfloat16) for p in params)
    session = 2 * sum(sizes) if half else (3 * max(sizes, default=0) if streamed else sum(sizes))
    held = 0 if streamed else sum(sizes)   # the model loaded whole, beside the session
    return session + held + MEMORY_MARGIN, HALF_ON_CPU if half else ""


# ------------------------------------------------------------------------------------------- PyTorch side
def reference_run(model, probe: Probe, whole: bool = False) -> Reference:
    """Greedy logits of the untouched transformers model on the probe (its own cache and forward pass).
    ``whole`` (recurrent models): every step is one forward pass over the whole sequence so far, without a cache
    (transformers' own cached steps of some hybrid families do not continue their state exactly)."""
    if whole:
        return _whole_sequence_run(model, probe)
    import torch

    from qeff_kv.export.facts.family import needs_image_sizes

    t0 = time.perf_counter()
    with torch.no_grad():
        ids = torch.tensor([probe.prompt], dtype=torch.int64)
        image = {} if probe.pixel_values is None else {
            "pixel_values": torch.from_numpy(probe.pixel_values).to(next(model.parameters()).dtype)}
        if probe.image_blocks:   # the model's own bidirectional image mask (Gemma3) is built from these
            image["token_type_ids"] = (ids == probe.image_token).to(torch.int64)
        if probe.pixel_values is not None and probe.grid is None and needs_image_sizes(model):   # Mistral3
            image["image_sizes"] = torch.tensor([list(probe.pixel_values.shape[-2:])], dtype=torch.int64)
        if probe.grid is not None:   # Qwen2.5-VL builds its multimodal RoPE rows from these
            image["image_grid_thw"] = torch.tensor([probe.grid], dtype=torch.int64)
            if probe.mrope:
                image["mm_token_type_ids"] = (ids == probe.image_token).to(torch.int64)
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True, **image)
        logits = [out.logits[0, -1].double().numpy().copy()]
        past = hf.returned_cache(out)
        mask_len = len(probe.prompt)
        tokens = [int(np.argmax(logits[-1]))]
        # multimodal RoPE: decode positions are the text position plus the offset the model itself computed for
        # the prompt (transformers' generate passes them the same way)
        deltas = getattr(getattr(model, "model", None), "rope_deltas", None) if probe.rope_rows() else None
        for _ in range(probe.decode_steps):
            mask_len += 1
            step = torch.tensor([[tokens[-1]]], dtype=torch.int64)
            where = {}
            if deltas is not None:
                text = torch.full((1, 1, 1), mask_len - 1, dtype=torch.int64)
                where["position_ids"] = torch.cat([text, (text + deltas.reshape(1, 1, 1)).expand(3, 1, 1)])
            where.update(hf.with_cache(model, past))
            out = model(input_ids=step, attention_mask=torch.ones((1, mask_len), dtype=torch.int64),
                        use_cache=True, **where)
            past = hf.returned_cache(out)
            logits.append(out.logits[0, -1].double().numpy().copy())
            tokens.append(int(np.argmax(logits[-1])))
    return Reference(logits=logits, tokens=tokens, seconds=time.perf_counter() - t0)


def one_pass_run(model, probe: Probe, vocab_size: int, cached: bool = False) -> Reference:
    """:func:`reference_run` in one forward pass, without a cache: the decode tokens are fixed in advance (seeded
    random ids, not the greedy ones), so the prompt and all of them go through the model at once and the logits
    after the prompt and after each decode token are rows of one output. The same comparison (both sides are fed
    the same tokens; each step's logits and greedy token are checked), with each weight read once: a streamed
    checkpoint is read once, not once per step (at 8B each read costs minutes). ``cached``: the pass writes a
    cache and attends over what the cache gives back (a quantized cache's emulation, ``--kv-cache-dtype``, acts on
    cache writes; without a cache the reference would be the float cache's)."""
    import torch

    t0 = time.perf_counter()
    rng = np.random.default_rng(PROBE_SEED + 2)
    low = 3 if vocab_size > 8 else 0
    fed = [int(t) for t in rng.integers(low, vocab_size, size=probe.decode_steps)]
    n = len(probe.prompt)
    with torch.no_grad():
        out = model(input_ids=torch.tensor([probe.prompt + fed], dtype=torch.int64), use_cache=cached)
        logits = [out.logits[0, n - 1 + j].double().numpy().copy() for j in range(len(fed) + 1)]
    return Reference(logits=logits, tokens=fed + [int(np.argmax(logits[-1]))], seconds=time.perf_counter() - t0)


def _whole_sequence_run(model, probe: Probe) -> Reference:
    """:func:`reference_run` without a cache: the prompt, then the prompt and each greedy token, whole."""
    import torch

    t0 = time.perf_counter()
    seq = list(probe.prompt)
    logits, tokens = [], []
    with torch.no_grad():
        for _ in range(probe.decode_steps + 1):
            out = model(input_ids=torch.tensor([seq], dtype=torch.int64), use_cache=False)
            logits.append(out.logits[0, -1].double().numpy().copy())
            tokens.append(int(np.argmax(logits[-1])))
            seq.append(tokens[-1])
    return Reference(logits=logits, tokens=tokens, seconds=time.perf_counter() - t0)


# --------------------------------------------------------------------------------------- onnxruntime side
def _open_runner(onnx_path: Path, probe: Probe, *, ctx_len: int, kv_batch: int, ccl, vision_path) -> ProbeRunner:
    """The probe runner on the graph (with the probe's image, run through ``vision_path``); onnxruntime refusing
    the graph is a failed verification."""
    try:
        runner = ProbeRunner(onnx_path, ctx_len, kv_batch, ccl, float32_kernels=True)
        if probe.pixel_values is not None:
            runner.add_image(probe.pixel_values, vision_path)
    except VerificationError:
        raise
    except Exception as exc:  # onnxruntime refuses the graph: that is a failed verification too
        raise VerificationError(f"verification failed: onnxruntime cannot load the exported graph "
                                f"({first_line(exc)})") from None
    return runner


def _run_probe(runner: ProbeRunner, probe: Probe, ref: Reference, ctx_len: int) -> list[tuple[str, np.ndarray]]:
    """The prompt in chunks, then the reference's decode tokens: ``(label, logits)`` per step compared."""
    prompt, chunk = probe.prompt, probe.chunk
    logits = None
    plan = plan_chunks(prompt, chunk, run_token=probe.image_token, keep_runs_whole=probe.image_blocks,
                       error=VerificationError)
    mrope = probe.rope_rows()
    for start, count in plan:
        part = prompt[start:start + count]
        pad = chunk - len(part) if start + chunk <= ctx_len else 0
        rows = None if mrope is None else mrope[0][:, start:start + count]
        logits = runner.step(part + [0] * pad, list(range(start, start + len(part))) + [-1] * pad, probe.slot,
                             rows)
    steps = [("the prompt", logits)]
    pos = len(prompt)
    if probe.pixel_values is not None:   # decode merges nothing: -1, as qeff-kv's runtime feeds it
        runner.extra["image_idx"] = np.full((1, 1), -1, dtype=np.int64)
    every_row = getattr(runner, "keeps_logits", False)
    if every_row:   # speculative decoding: the decode tokens in one step, every row's logits
        fed = ref.tokens[:probe.decode_steps]
        every = runner.step_rows(fed, list(range(pos, pos + len(fed))), probe.slot, None, keep=len(fed))
        steps += [(f"verification row {k + 1} of {len(fed)}", row) for k, row in enumerate(every)]
    for k in range(0 if every_row else probe.decode_steps):
        rows = None if mrope is None else np.full((3, 1), pos + mrope[1], dtype=np.int64)
        steps.append((f"decode step {k + 1}", runner.step([ref.tokens[k]], [pos], probe.slot, rows)))
        pos += 1
    return steps


def _compare(steps: list, ref: Reference, rtol: float) -> tuple[float, float]:
    """Each step's logits against PyTorch's (finite, within tolerance, the same greedy token); the worst
    difference and its tolerance."""
    worst, worst_tol = 0.0, 0.0
    for (label, got), want in zip(steps, ref.logits):
        tol = rtol * max(1.0, float(np.max(np.abs(want))))
        if not np.all(np.isfinite(got)):
            raise VerificationError(f"verification failed after {label}: the graph's logits are not finite")
        diff = float(np.max(np.abs(got - want)))
        if diff > worst:
            worst, worst_tol = diff, tol
        token = int(np.argmax(got))
        if diff > tol:
            raise VerificationError(
                f"verification failed after {label}: logits differ from PyTorch by up to {diff:.3g} "
                f"(tolerance {tol:.3g}); greedy token {token}, PyTorch {int(np.argmax(want))}")
        if want[token] < float(np.max(want)) - tol:
            raise VerificationError(f"verification failed after {label}: greedy token {token}, PyTorch "
                                    f"{int(np.argmax(want))}")
    return worst, worst_tol


def _steps_by_blocks(onnx_path: Path, probe: Probe, ref: Reference, *, ctx_len: int, kv_batch: int, ccl,
                     extra_feeds: dict | None) -> tuple[list[tuple[str, np.ndarray]], int]:
    """:func:`_run_probe`'s steps (the same feeds), the graph run ``probe.block_layers`` layers at a time; and how
    many blocks. :class:`~.probe_runner.BlockRunRefused` where the graph cannot be cut."""
    runner = BlockProbeRunner(onnx_path, ctx_len, kv_batch, ccl, probe.block_layers)
    runner.extra.update(extra_feeds or {})
    return runner.run_steps(_run_probe(runner, probe, ref, ctx_len)), len(runner.plan)


def _whole_steps(onnx_path: Path, probe: Probe, ref: Reference, *, ctx_len: int, kv_batch: int, ccl,
                 vision_path: Path | None, extra_feeds: dict | None) -> list[tuple[str, np.ndarray]]:
    runner = _open_runner(onnx_path, probe, ctx_len=ctx_len, kv_batch=kv_batch, ccl=ccl, vision_path=vision_path)
    if extra_feeds:
        runner.extra.update(extra_feeds)
    try:
        return _run_probe(runner, probe, ref, ctx_len)
    except Exception as exc:
        raise VerificationError(f"verification failed: onnxruntime could not run the exported graph "
                                f"({first_line(exc)})") from None


def verify_graph(onnx_path: Path, probe: Probe, ref: Reference, *, ctx_len: int, dtype: str,
                 kv_batch: int = 1, ccl=None, vision_path: Path | None = None,
                 extra_feeds: dict | None = None, say=None) -> VerificationResult:
    """Run the graph on the probe and compare with ``ref``; raise :class:`VerificationError` on a mismatch.
    A vision-language probe runs ``vision_path`` (the dual layout's vision graph) on its image first.
    ``extra_feeds``: inputs fed on every step over the runner's own (an adapter's: :mod:`.adapters.proof`).
    ``probe.block_layers``: the graph runs that many layers at a time (recorded as ``blocks``); one that cannot be
    cut is run whole where that was forced, else refused as the whole graph's verification was."""
    t0 = time.perf_counter()
    rtol = RTOL.get(dtype, RTOL["float16"])
    prompt, chunk = probe.prompt, probe.chunk
    steps, blocks = None, None
    if probe.block_layers:
        try:
            if probe.pixel_values is not None:
                raise BlockRunRefused("its probe feeds an image")
            steps, blocks = _steps_by_blocks(onnx_path, probe, ref, ctx_len=ctx_len, kv_batch=kv_batch, ccl=ccl,
                                             extra_feeds=extra_feeds)
        except BlockRunRefused as exc:
            if probe.block_reason is not None:
                raise VerificationMemoryError(f"the graph cannot be verified a block of layers at a time ({exc}), "
                                              f"and {probe.block_reason}") from None
            (say or (lambda _m: None))(f"verifying a block of layers at a time is not possible ({exc}): the whole "
                                       "graph at once")
    if steps is None:
        steps = _whole_steps(onnx_path, probe, ref, ctx_len=ctx_len, kv_batch=kv_batch, ccl=ccl,
                             vision_path=vision_path, extra_feeds=extra_feeds)
    worst, worst_tol = _compare(steps, ref, rtol)
    return VerificationResult(status="passed", steps=len(steps), prompt_len=len(prompt), chunk=chunk,
                              max_abs_diff=float(f"{worst:.3g}"),
                              tolerance=float(f"{(worst_tol or rtol):.3g}"),
                              seconds=round(time.perf_counter() - t0 + ref.seconds, 3),
                              extra={} if blocks is None else {"blocks": blocks})


# ------------------------------------------------------------------------------------- the export's stages
def reference_for_export(model, options, verify: bool | None, say, vision: dict | None = None,
                         streamed: bool = False, one_pass: bool = False):
    """``(probe, reference, why_skipped)``: the probe and the PyTorch reference on it, computed before tracing
    touches the model; or why not. ``vision``: a vision-language model's geometry (the probe then holds an image).
    ``one_pass``: :func:`one_pass_run` (a text model whose weights stream: each step of :func:`reference_run` would
    read the checkpoint again)."""
    if verify is False:
        return None, None, "turned off (--no-verify)"
    facts = family.ModelFacts.from_config(model.config.to_dict())
    blocks, why = forced_block_layers(), None
    if blocks is None:   # on by default at every size; where it cannot fit, blocks of layers or a refusal first
        need, reason = verification_bytes(model, streamed, quantized=one_pass)
        ok, note = memory_allows(need, reason)
        if not ok and verify is None and (reason != HALF_ON_CPU or facts.vision_language):
            raise VerificationMemoryError(note)   # (--verify runs it anyway: the user's choice)
        if not ok and reason == HALF_ON_CPU and not facts.vision_language:   # --verify too
            blocks, why = block_layers_for(model, streamed, need, say)
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    slot = min(1, options.full_batch_size - 1) if options.continuous_batching else 0
    steps = max(DECODE_STEPS, (options.speculative_tokens or 0) + 1)   # a speculative graph verifies K+1 rows at once
    probe = make_probe(int(cfg.vocab_size), options.ctx_len, options.prefill_seq_len, slot=slot,
                       window=facts.sliding_window if facts.sliding_layers else None, decode_steps=steps,
                       recurrent=facts.recurrent is not None)
    if facts.vision_language:
        try:
            probe = add_image(probe, facts.image_token_id, vision, options.ctx_len, options.dtype,
                              image_blocks=facts.bidirectional_images, mrope=facts.mrope)
        except VerificationError as exc:
            raise ExportError(str(exc)) from None
    probe.block_layers, probe.block_reason = blocks, why
    try:
        if one_pass and facts.recurrent is None and not facts.vision_language:
            reference = one_pass_run(model, probe, int(cfg.vocab_size),
                                     cached=bool(getattr(options, "quantized_kv", False)))
        else:
            reference = reference_run(model, probe, whole=facts.recurrent is not None)
    except Exception as exc:
        raise ExportError(f"{type(model).__name__}: the PyTorch reference run for verification failed "
                          f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                          f"--no-verify skips it") from None
    return probe, reference, None


def verify_export(onnx_path: Path, vision_path: Path | None, options, probe, reference, skipped: str | None,
                  say) -> VerificationResult:
    """The verify stage: :func:`verify_graph` on the staged graph, or the record of why it was skipped."""
    if probe is None:
        return VerificationResult(status="skipped", reason=skipped)
    say(f"verifying against PyTorch ({len(probe.prompt)}-token prompt in chunks of {probe.chunk}, "
        f"{probe.decode_steps} decode steps)")
    dtype = f"{options.kv_cache_dtype}-kv" if getattr(options, "quantized_kv", False) else options.dtype
    result = verify_graph(onnx_path, probe, reference, ctx_len=options.ctx_len, dtype=dtype,
                          kv_batch=options.full_batch_size if options.continuous_batching else 1,
                          ccl=options.ccl, vision_path=vision_path, say=say)
    blocks = f" in {result.extra['blocks']} blocks" if "blocks" in result.extra else ""
    say(f"verified{blocks}: max |logit difference| {result.max_abs_diff:.3g} (tolerance {result.tolerance:.3g})")
    return result
