"""One call behind ``qeff-kv generate``: open a session, run the requests, save or load state, report.

The optional tokenizer is :func:`qeff_kv.runtime.text.tokenizer.load_tokenizer`.
"""

from __future__ import annotations

import math
import os
import re
import time
from dataclasses import InitVar, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from qeff_kv.support import fsutil
from qeff_kv.errors import RuntimeInputError
from qeff_kv.runtime.text.chat import chat_prompt_ids, load_chat_template
from qeff_kv.runtime.text.tokenizer import load_tokenizer
from qeff_kv.support.limits import MAX_INT64
from qeff_kv.support import validate
from qeff_kv.support.validate import integer_array
from qeff_kv.runtime.decoding.sampling import FIELDS as SAMPLING_FIELDS, SamplingParams
from qeff_kv.runtime.decoding.stopping import asked_tokens
from qeff_kv.runtime.adapters import adapter_option, describe as describe_adapter
from qeff_kv.runtime.model_files import resolve_model
from qeff_kv.runtime.session import Session, TokenEvent
from qeff_kv.runtime.vision_language import VisionLanguageModel
from qeff_kv.runtime.decoding.speculative import Drafter, DraftModel, PromptLookup, SpeculativeDecoder


def parse_ids(text: str) -> list[int]:
    """``"5,17,42"`` (commas and/or spaces) -> ``[5, 17, 42]``; one-line error otherwise."""
    parts = [p for p in text.replace(",", " ").split() if p]
    if not parts:
        raise RuntimeInputError(f"--prompt-ids {text!r}: no token ids")
    out = []
    for p in parts:
        if not re.fullmatch(r"-?[0-9]+", p):  # int() also takes '١٦', '1_0', '+5'
            raise RuntimeInputError(f"--prompt-ids {text!r}: {p!r} is not an integer (ASCII digits 0-9)")
        v = int(p)
        if v < 0:
            raise RuntimeInputError(f"--prompt-ids {text!r}: token id {v} is negative")
        if v > MAX_INT64:
            raise RuntimeInputError(f"--prompt-ids {text!r}: token id {v} does not fit in 64 bits")
        out.append(v)
    return out


def parse_logit_bias(items) -> tuple[tuple[int, float], ...]:
    """``["15=-100", "7=2.5"]`` (``--logit-bias ID=BIAS``) -> ``((15, -100.0), (7, 2.5))``; one-line error otherwise."""
    out: dict[int, float] = {}
    for item in items:
        tok, sep, bias = str(item).partition("=")
        if not sep or not re.fullmatch(r"[0-9]+", tok.strip()):
            raise RuntimeInputError(f"--logit-bias {item!r}: give ID=BIAS (a token id, e.g. 15=-100)")
        try:
            value = float(bias)
        except ValueError:
            value = float("nan")
        if not -100.0 <= value <= 100.0:
            raise RuntimeInputError(f"--logit-bias {item!r}: the bias must be a number in [-100, 100]")
        out[int(tok)] = value
    return tuple(sorted(out.items()))


@dataclass
class GenerateRequest:
    model: str | os.PathLike
    prompts: list[str] = field(default_factory=list)
    prompt_ids: list[list[int]] = field(default_factory=list)
    #: new tokens per sequence (0: prefill only); ``--max-tokens`` (``--max-new-tokens``: its deprecated alias)
    max_tokens: int = 64
    ctx_len: int | None = None
    prefill_seq_len: int | None = None
    max_sequences: int | None = None
    #: the window of a graph with sliding-window ring buffers that records none (peer graphs)
    sliding_window: int | None = None
    #: a recurrent or hybrid graph's checkpoints of its recurrent state: every N positions, at most N per sequence
    checkpoint_every: int | None = None
    max_checkpoints: int | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_tokens: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    save_state: str | None = None
    load_state: str | None = None
    select: str | None = None
    threads: int | None = None
    #: where the graph runs: "cpu", or "cuda" (for the kinds proved there: runtime/execution/ep_proofs.py)
    device: str = "cpu"
    inplace: bool | None = None
    on_capacity: str = "error"
    #: Format each prompt as a user turn with the folder's chat template (optionally after a system turn).
    chat: bool = False
    system: str | None = None
    #: vision-language exports: the image processor's arrays per prompt (``.npz`` files, in prompt order), or image
    #: files for the one ``--prompt`` (read with the processor in the export folder: transformers and Pillow)
    image_inputs: list[str] = field(default_factory=list)
    images: list[str] = field(default_factory=list)
    #: the image token of another exporter's vision-language graph (ours record it)
    image_token_id: int | None = None
    #: a dual-layout language graph's vision graph, and the geometry, where nothing records them (the peer's graphs)
    vision_graph: str | None = None
    image_size: int | None = None
    vision_size: int | None = None
    #: speculative decoding (a graph exported with --speculative-tokens K): ``"lookup"`` (prompt lookup) or the
    #: path of a draft export (a smaller model of the same tokenizer); see :mod:`qeff_kv.runtime.decoding.speculative`
    speculative: str | None = None
    #: drafts per verification step with ``speculative`` (default and maximum: the graph's K; needed on a graph that
    #: records no K, the peer's target graphs)
    speculative_k: int | None = None
    #: a LoRA adapter every prompt runs with (``PEFT_DIR`` or ``NAME=PEFT_DIR``; docs/lora.md), loaded once, on a
    #: graph exported with adapter inputs; ``lora_scale`` multiplies its delta (default 1)
    lora: str | None = None
    lora_scale: float | None = None
    #: filled in: ``(image, [w, h], [w, h])`` of each ``--image`` resized to an export's fixed image size
    resized: list = field(default_factory=list)
    #: the deprecated name of ``max_tokens`` (one release; a DeprecationWarning, the same count)
    max_new_tokens: InitVar[int | None] = None

    def __post_init__(self, max_new_tokens: int | None) -> None:
        self.max_tokens = asked_tokens(self.max_tokens, max_new_tokens, stacklevel=4)

    @classmethod
    def from_options(cls, **options) -> "GenerateRequest":
        """The request of ``qeff-kv generate``'s options, named as the fields and as the sampling fields
        (:data:`~qeff_kv.runtime.decoding.sampling.FIELDS`): ``--prompt-ids`` and ``--logit-bias`` text parsed
        (one line each), repeated options as lists."""
        options["prompt_ids"] = [parse_ids(p) for p in options.get("prompt_ids", ())]
        sampling = {k: options.pop(k) for k in SAMPLING_FIELDS if k in options}
        sampling["logit_bias"] = parse_logit_bias(sampling.get("logit_bias", ()))
        for key in ("prompts", "image_inputs", "images", "stop_tokens"):
            if key in options:
                options[key] = list(options[key])
        return cls(sampling=SamplingParams(**sampling), **options)


def load_image_inputs(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """The arrays of an ``.npz`` file by name (no pickle); one-line error otherwise."""
    p = Path(path)
    if not p.is_file():
        raise RuntimeInputError(f"--image-inputs {p}: no such file")
    try:
        with np.load(p, allow_pickle=False) as data:
            return {k: np.asarray(data[k]) for k in data.files}
    except Exception as exc:
        raise RuntimeInputError(f"--image-inputs {p}: not a readable .npz file ({' '.join(str(exc).split())[:200]})") \
            from None


def _image_requests(req: GenerateRequest, files, prompts: list[list[int]]) -> tuple[list[list[int]], list]:
    """Prompts and their image inputs (``None`` for text-only) from ``--image-inputs`` / ``--image``."""
    if req.images:
        if req.image_inputs or req.prompt_ids or len(req.prompts) != 1:
            raise RuntimeInputError("--image goes with exactly one --prompt (no --prompt-ids, no --image-inputs); "
                                    "for several prompts give --prompt-ids with one --image-inputs each")
        from qeff_kv.graph import graphio
        from qeff_kv.runtime.multimodal.media import vision_facts
        from qeff_kv.runtime.multimodal.processor import image_prompt, image_sizes_of

        vision = vision_facts(graphio.layout_of(graphio.load(files.onnx_path)), files.manifest)
        # an export traced for one patch grid takes images of one size: resized to it, and said so
        size = int(vision["image_size"]) if "grid" in vision and vision.get("image_size") else None
        if size is not None:
            req.resized = [(p, list(wh), [size, size]) for p, wh in zip(req.images, image_sizes_of(req.images))
                           if tuple(wh) != (size, size)]
        ids, arrays = image_prompt(files.folder, req.prompts[0], req.images, chat=req.chat, system=req.system,
                                   image_size=size, vision=vision)
        return [ids], [arrays]
    loaded = [load_image_inputs(p) for p in req.image_inputs]
    for path, arrays in zip(req.image_inputs, loaded):
        if "input_ids" in arrays:   # token ids are integers: a float or string array is refused, never cut
            ids = integer_array(f"--image-inputs {path}: input_ids", arrays["input_ids"])
            if ids.size and int(ids.min()) < 0:
                raise RuntimeInputError(f"--image-inputs {path}: input_ids holds negative token id {int(ids.min())}")
    if not prompts and len(loaded) == 1 and "input_ids" in loaded[0]:   # the processor's own ids
        ids = np.asarray(loaded[0]["input_ids"])
        prompts = [[int(t) for t in ids.reshape(-1)]] if ids.ndim == 1 or ids.shape[0] == 1 else []
    if len(loaded) != len(prompts):
        raise RuntimeInputError(f"{len(loaded)} --image-inputs files for {len(prompts)} prompts; give one per prompt, "
                                "in order")
    return prompts, loaded


def run_generate(req: GenerateRequest, on_token: Callable[[TokenEvent], None] | None = None) -> dict:
    """Run a :class:`GenerateRequest`; returns the JSON-able result printed by the CLI.

    Every argument is checked before the graph is opened: the selection regex (even when nothing is saved),
    the state file paths, the sampling parameters.
    """
    _check_request(req)
    files = resolve_model(req.model)
    tok, prompts, image_inputs = _prompts(req, files)
    t_open = time.perf_counter()
    session, model = _open_session(req, _max_sequences(req, files, prompts))
    open_s = time.perf_counter() - t_open
    if req.prefill_seq_len is not None and session.fixed_seq_len is None and req.prefill_seq_len > session.ctx_len:
        # The library runs such a chunk (never padded past the capacity); asked for on the command line, it
        # is a contradiction worth one line.
        raise RuntimeInputError(
            f"--prefill-seq-len {req.prefill_seq_len} is larger than the capacity ctx_len {session.ctx_len}")
    stops = [] if req.ignore_eos else list(session.eos_token_ids)
    stops += [t for t in req.stop_tokens if t not in stops]

    adapter = _load_adapter(req, session)
    if req.load_state is not None:
        seq = session.load_state(req.load_state)
        _check_loaded_adapter(req, seq, adapter)
        requests: list = [(seq, prompts[0]) if prompts else seq]
    elif req.images or req.image_inputs:   # a vision-language model was opened
        requests = [model.prompt(p, arrays) for p, arrays in zip(prompts, image_inputs)]
    else:
        requests = prompts
    if adapter is not None and req.load_state is None and req.speculative is None:
        requests = [(session.add_sequence(adapter, _scale(req)), r) for r in requests]   # each with the adapter
    t0 = time.perf_counter()
    spec_stats = None
    if req.speculative is not None:
        results, spec_stats = _speculative(req, session, requests, stops, on_token, adapter)
    else:
        results = session.generate(requests, max_tokens=req.max_tokens, sampling=req.sampling,
                                   stop_tokens=stops, on_capacity=req.on_capacity, callback=on_token)
    wall = time.perf_counter() - t0
    saved = None
    if req.save_state is not None:
        saved = str(session.save_state(results[0].sequence, req.save_state, select=req.select))
    report = _report(req, files, session, tok, results, stops, saved, _timings(session, open_s, wall, spec_stats))
    report["lora"] = None if adapter is None else {**session.lora.summary()[adapter], "scale": _scale(req)}
    return report


def _scale(req: GenerateRequest) -> float:
    return 1.0 if req.lora_scale is None else float(req.lora_scale)


def _load_adapter(req: GenerateRequest, session: Session) -> str | None:
    """``--lora``: the adapter loaded once into ``session`` (refused in one line on a graph without adapter inputs,
    or one it does not fit); its name, or ``None``."""
    if req.lora is None:
        return None
    name, folder = adapter_option(req.lora)
    session.lora.load(name, folder)
    return name


def _check_loaded_adapter(req: GenerateRequest, seq, adapter: str | None) -> None:
    """A state continued with ``--lora`` was computed with that adapter at that scale (one line otherwise; a state
    of an adapter not given is refused by the load itself)."""
    if adapter is not None and (seq.adapter, seq.lora_scale) != (adapter, _scale(req)):
        raise RuntimeInputError(f"--load-state {req.load_state}: computed with "
                                f"{describe_adapter(seq.adapter, seq.lora_scale)}, not with "
                                f"{describe_adapter(adapter, _scale(req))} (--lora, --lora-scale)")


def _check_request(req: GenerateRequest) -> None:
    """Everything about ``req`` that needs no file, refused in one line before the graph is opened."""
    if req.select is not None:
        try:
            re.compile(req.select)
        except (re.error, TypeError) as exc:
            raise RuntimeInputError(f"--select {req.select!r} is not a valid regex ({exc})") from None
        if req.save_state is None:   # a setting that would do nothing
            raise RuntimeInputError("--select chooses the buffers --save-state writes; give --save-state FILE too")
    for label, v in (("chat", req.chat), ("ignore_eos", req.ignore_eos)):
        validate.flag(label, v)
    for label, items in (("prompts", req.prompts), ("image_inputs", req.image_inputs), ("images", req.images)):
        if not isinstance(items, (list, tuple)) or not all(isinstance(x, (str, os.PathLike)) for x in items):
            raise RuntimeInputError(f"{label} must be a list of strings, got {items!r}"[:200])
    if not isinstance(req.sampling, SamplingParams):
        raise RuntimeInputError(f"sampling must be a SamplingParams, got {req.sampling!r}")
    if req.save_state is not None:
        fsutil.check_output_file(req.save_state)
    if req.speculative is not None:
        _check_speculative(req)
    elif req.speculative_k is not None:
        raise RuntimeInputError("--speculative-k goes with --speculative")
    _check_lora(req)


def _check_lora(req: GenerateRequest) -> None:
    """``--lora`` and ``--lora-scale``: their kinds and that the scale goes with an adapter (one line each)."""
    if req.lora is not None:
        if not isinstance(req.lora, (str, os.PathLike)):
            raise RuntimeInputError(f"lora must be a PEFT folder or NAME=PEFT_DIR, got {req.lora!r}")
        adapter_option(req.lora)   # the form, before the graph is opened
    scale = req.lora_scale
    if scale is None:
        return
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise RuntimeInputError(f"--lora-scale must be a finite number, got {scale!r}")
    if req.lora is None:
        raise RuntimeInputError("--lora-scale scales the adapter of --lora; give --lora [NAME=]PEFT_DIR too")


def _prompts(req: GenerateRequest, files) -> tuple[object, list[list[int]], list]:
    """``(tokenizer or None, the prompts' token ids, their image inputs)``: text through the tokenizer (and the chat
    template), ids as given, images through the export's processor or ``.npz`` files."""
    if (req.chat or req.system is not None) and not req.prompts:
        raise RuntimeInputError("--chat formats --prompt text with the chat template; give --prompt TEXT")
    if req.system is not None and not req.chat:
        raise RuntimeInputError("--system is a chat turn; use it with --chat")
    tok = load_tokenizer(files.folder, required=bool(req.prompts))
    if req.images:
        prompts: list[list[int]] = []
    elif req.chat:
        template = load_chat_template(files.folder)
        prompts = [chat_prompt_ids(tok, template, p, req.system) for p in req.prompts]
    else:
        prompts = [list(tok.encode(p).ids) for p in req.prompts] if req.prompts else []
    prompts += [list(p) for p in req.prompt_ids]
    image_inputs: list = []
    if req.images or req.image_inputs:
        if req.load_state is not None:
            raise RuntimeInputError("--load-state continues a sequence; images go with a new prompt")
        prompts, image_inputs = _image_requests(req, files, prompts)
    if req.load_state is None and not prompts:
        raise RuntimeInputError("give --prompt, --prompt-ids or --load-state")
    if req.load_state is not None and len(prompts) > 1:
        raise RuntimeInputError("--load-state continues one sequence: give at most one prompt to append to it")
    return tok, prompts, image_inputs


def _max_sequences(req: GenerateRequest, files, prompts: list[list[int]]) -> int | None:
    """The slots to open: as given, else one per request when the manifest records none."""
    n_requests = max(1, len(prompts))
    if req.save_state is not None and n_requests != 1:
        raise RuntimeInputError(f"--save-state saves one sequence; {n_requests} were requested")
    if req.max_sequences is None and n_requests > 1 and not (files.manifest or {}).get("full_batch_size"):
        return n_requests  # else the manifest's full_batch_size: the slots the graph was exported for
    return req.max_sequences


def _open_session(req: GenerateRequest, max_sequences: int | None) -> tuple[Session, VisionLanguageModel | None]:
    """The session (and the vision-language model around it, when images or a vision graph are involved)."""
    kwargs = dict(ctx_len=req.ctx_len, prefill_seq_len=req.prefill_seq_len, max_sequences=max_sequences,
                  inplace=req.inplace, threads=req.threads, device=req.device, sliding_window=req.sliding_window,
                  image_token_id=req.image_token_id)
    if req.checkpoint_every is not None or req.max_checkpoints is not None:
        kwargs.update(checkpoint_every=req.checkpoint_every, max_checkpoints=req.max_checkpoints)
    if req.images or req.image_inputs or req.vision_graph is not None or req.image_size is not None \
            or req.vision_size is not None:
        model = VisionLanguageModel(req.model, req.vision_graph, image_size=req.image_size,
                                    vision_size=req.vision_size, **kwargs)
        return model.session, model
    return Session(req.model, **kwargs), None


def _timings(session: Session, open_s: float, wall: float, spec_stats: dict | None) -> dict:
    timings = session.timings.to_json()
    timings["open_s"] = round(open_s, 6)
    timings["wall_s"] = round(wall, 6)
    if spec_stats is not None:   # decode time is the loop's wall time, drafting included
        timings.update(decode_s=spec_stats["decode_s"], decode_tokens_per_s=spec_stats["decode_tokens_per_s"],
                       decode_steps=spec_stats["steps"], speculative=spec_stats)
    return timings


def _report(req: GenerateRequest, files, session: Session, tok, results, stops: list[int], saved: str | None,
            timings: dict) -> dict:
    """The JSON-able result the CLI prints."""
    seqs = []
    for g in results:
        item = g.to_json()
        item["text"] = tok.decode(g.tokens) if tok is not None else None
        seqs.append(item)
    return {
        "model": str(files.onnx_path),
        "sequences": seqs,
        "timings": timings,
        "inplace": session.inplace,
        "ctx_len": session.ctx_len,
        "prefill_seq_len": session.prefill_seq_len,
        "sliding_window": session.sliding_window,
        "memory": session.memory(),
        "stop_tokens": stops,
        "saved_state": saved,
        "resized_images": [{"image": str(p), "from": a, "to": b} for p, a, b in req.resized],
        "loaded_state": req.load_state,
    }


def _check_speculative(req: GenerateRequest) -> None:
    """What ``--speculative`` cannot go with, refused in one line before anything is opened."""
    for flag, given in (("--image/--image-inputs", req.images or req.image_inputs), ("--load-state", req.load_state),
                        ("--save-state", req.save_state), ("--on-capacity stop", req.on_capacity == "stop"),
                        ("--logit-bias or a penalty",
                         isinstance(req.sampling, SamplingParams) and req.sampling.adjusts)):
        if given:
            raise RuntimeInputError(f"--speculative does not go with {flag}")
    if len(req.prompts) + len(req.prompt_ids) != 1:
        raise RuntimeInputError("--speculative decodes one sequence: give exactly one --prompt or --prompt-ids")
    if req.max_tokens < 1:
        raise RuntimeInputError("--speculative needs --max-tokens of at least 1")


def _speculative(req: GenerateRequest, session: Session, requests: list, stops: list[int], on_token,
                 adapter: str | None = None):
    """One request decoded speculatively (with ``adapter``, when given): ``([Generation], stats as JSON)``."""
    decoder = SpeculativeDecoder(session, make_drafter(req.speculative, threads=req.threads), k=req.speculative_k)
    gen = decoder.generate(requests[0], max_tokens=req.max_tokens, sampling=req.sampling,
                           stop_tokens=stops, adapter=adapter, lora_scale=_scale(req))
    if on_token is not None:
        for t in gen.tokens:
            on_token(TokenEvent(0, t, gen.sequence))
    return [gen], decoder.stats.to_json()


def make_drafter(spec: str, **session_kwargs) -> Drafter:
    """``"lookup"``: :class:`~.decoding.speculative.PromptLookup`; else the path of a draft export (an export folder
    or ``.onnx``), opened as its own :class:`Session` (``session_kwargs``: e.g. ``threads``) for
    :class:`~.decoding.speculative.DraftModel`."""
    if spec == "lookup":
        return PromptLookup()
    if not Path(spec).exists():
        raise RuntimeInputError(f"--speculative {spec!r}: neither 'lookup' nor an existing draft export "
                                "(folder or .onnx)")
    return DraftModel(Session(spec, **session_kwargs))
