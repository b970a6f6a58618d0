"""``qeff-kv compile-config``'s from-graph half: ``custom_io.yaml``/``specializations.json`` for an existing graph.

:func:`write_compile_config_for_graph` checks the arguments (nothing read yet), then the graph (every ``check``
rule must pass), then what the graph asks for (continuous batching, CCL, a sliding window, vision settings), and
writes the files through :func:`qeff_kv.tools.compile_config.write_compile_config`, named after the graph's own
prefix.
"""

from __future__ import annotations

import os
from pathlib import Path

from qeff_kv.contract import multimodal, naming
from qeff_kv.contract.ccl import parse_ccl
from qeff_kv.contract.layout import KVLayout
from qeff_kv.errors import ContractError, RuntimeInputError
from qeff_kv.graph import graphio
from qeff_kv.support import validate
from qeff_kv.tools.compile_config import (SpecFormat, check_precision, check_sliding_window, check_vision_precision,
                                          resolve_sliding_window, specializations, write_compile_config)
from qeff_kv.tools.lora_inputs import check_lora_settings


def write_compile_config_for_graph(path: str | os.PathLike, out_dir: str | os.PathLike, *,
                                   prefill_seq_len: int, ctx_len: int, batch_size: int = 1,
                                   full_batch_size: int | None = None, fmt: SpecFormat = "flat",
                                   precision: str | None = None, ccl=None,
                                   sliding_window: int | None = None, img_size: int | None = None,
                                   vision_size: int | None = None, vision_batch_size: int = 1,
                                   max_num_images: int | None = None, vision_precision: str | None = None,
                                   vision_model: str | os.PathLike | None = None,
                                   speculative_tokens: int | None = None, lora_slots: int | None = None,
                                   lora_rank: int | None = None) -> list[Path]:
    """``custom_io.yaml`` and ``specializations.json`` for the graph at ``path``, named after its own prefix.

    A continuous-batching graph (KV batch axis ``full_batch_size``) needs ``full_batch_size``; a graph
    without it refuses one. A graph with a ``comp_ctx_lengths`` input needs ``ccl`` (the compute-context
    lengths, or ``"auto"``); a graph without it refuses one. A graph with sliding-window ring buffers (a KV axis 2
    named ``sliding_window``) needs its window: ``sliding_window`` or the graph metadata ``qeff_kv.sliding_window``
    (refused in one line when neither is there, or when they differ); a graph without that axis refuses
    ``sliding_window``.

    A vision-language graph (contract section 6) takes ``img_size`` and, in the dual layout, ``vision_size``
    (default: the export's ``manifest.json`` beside it when it names this graph, else a static graph axis; refused
    in one line when unknown), ``vision_batch_size`` (default 1) and ``max_num_images``; ``vision_model`` is the
    dual layout's vision graph (default: the manifest's ``vision_onnx``), which adds ``custom_io_vision.yaml``
    and ``specializations_vision.json``. A vision encoder graph given as ``path`` is refused (give the language
    graph, and this one as ``vision_model``); a text graph refuses the vision settings. A speculative-decoding
    graph (a ``num_logits_to_keep`` input) takes ``speculative_tokens`` ``K`` (default: its metadata): its decode
    specialization runs ``K+1`` tokens. A graph with LoRA adapter inputs takes ``lora_slots`` (default: 1 + the
    adapters its export was proved with, or 1 + 1) and ``lora_rank`` (default: its metadata's max_rank); a graph
    without them refuses both.
    """
    # Arguments first (nothing read yet), then the graph: compile files are written only for a graph that
    # passes every check rule.
    vision_args = {"img_size": img_size, "vision_size": vision_size, "vision_batch_size": vision_batch_size,
                   "max_num_images": max_num_images}
    _check_paths_and_precisions(path, out_dir, vision_model, precision, vision_precision, vision_args)
    ccl = parse_ccl(ccl, ctx_len, prefill_seq_len=prefill_seq_len if isinstance(prefill_seq_len, int) else None)
    check_sliding_window(sliding_window)
    check_lora_settings(lora_slots, lora_rank)
    specializations(prefill_seq_len, ctx_len, batch_size=batch_size, full_batch_size=full_batch_size, fmt=fmt,
                    ccl=ccl, sliding_window=sliding_window)
    layout = _checked_layout(path)
    _check_batching_and_ccl(path, layout, full_batch_size, ccl)
    _check_sliding(path, layout, sliding_window, prefill_seq_len, ctx_len)
    vision, vision_model = _vision_settings(path, layout, vision_model=vision_model,
                                            vision_precision=vision_precision, **vision_args)
    return write_compile_config(layout, out_dir, prefill_seq_len=prefill_seq_len, ctx_len=ctx_len,
                                batch_size=batch_size, full_batch_size=full_batch_size, fmt=fmt,
                                precision=precision, ccl=ccl, sliding_window=sliding_window, vision=vision,
                                vision_graph=vision_model, vision_batch_size=vision_batch_size,
                                max_num_images=max_num_images, vision_precision=vision_precision,
                                speculative_tokens=speculative_tokens, lora_slots=lora_slots, lora_rank=lora_rank)


def _check_paths_and_precisions(path, out_dir, vision_model, precision, vision_precision, vision_args: dict) -> None:
    validate.path_like("path", path)
    validate.path_like("out_dir", out_dir)
    validate.path_like("vision_model", vision_model, optional=True)
    check_precision(precision)
    check_vision_precision(vision_precision)
    for label, v in vision_args.items():
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise RuntimeInputError(f"{label} must be a positive integer, got {v!r}")


def _checked_layout(path) -> KVLayout:
    """The layout of a graph that is no vision encoder and passes every ``check`` rule (else a one-line refusal)."""
    from qeff_kv.tools import check as _check

    layout = graphio.layout_of(graphio.load(path))
    if multimodal.graph_kind(layout) == multimodal.VISION_ENCODER:
        raise ContractError(f"{path} is a {multimodal.describe_kind(multimodal.VISION_ENCODER)}; give the language "
                            "graph as MODEL and this one as --vision-model")
    report = _check.check(path)
    if not report.ok:
        rule = report.rule(report.failed[0])
        first = rule.violations[0].message if rule.violations else "failed"
        raise ContractError(f"{path} fails check rule {rule.id!r} ({first}); run 'qeff-kv check {path}'; "
                            "no compile files written")
    layout = graphio.layout_of(graphio.load(path))
    layout.require_valid()
    return layout


def _kv_batch_dim(layout: KVLayout) -> str | int | None:
    for p in layout.pairs:
        if p.input.shape:
            return p.input.shape[0]
    return None


def _check_batching_and_ccl(path, layout: KVLayout, full_batch_size, ccl) -> None:
    cb = _kv_batch_dim(layout) == "full_batch_size"
    if cb and full_batch_size is None:
        raise RuntimeInputError(
            f"{path} is a continuous-batching graph (KV batch axis 'full_batch_size'); give --full-batch-size")
    if not cb and full_batch_size is not None:
        raise RuntimeInputError(
            f"{path} is not a continuous-batching graph (no KV batch axis 'full_batch_size'); "
            "--full-batch-size does not apply")
    has_ccl = any(t.name == naming.CCL_INPUT for t in layout.inputs)
    if has_ccl and ccl is None:
        raise RuntimeInputError(f"{path} takes {naming.CCL_INPUT}: give --ccl L1,L2,... (or auto) for its "
                                "compute-context-length specializations")
    if ccl is not None and not has_ccl:
        raise RuntimeInputError(f"{path} has no {naming.CCL_INPUT} input; --ccl does not apply")
    if full_batch_size is not None and (not isinstance(full_batch_size, int) or full_batch_size < 1):
        raise RuntimeInputError(f"full_batch_size must be a positive integer, got {full_batch_size!r}")


def _check_sliding(path, layout: KVLayout, sliding_window, prefill_seq_len: int, ctx_len: int) -> None:
    if sliding_window is not None and not layout.has_sliding:
        raise RuntimeInputError(f"{path} has no sliding-window KV buffers (axis {naming.SLIDING_DIM!r}); "
                                "--sliding-window does not apply")
    window = resolve_sliding_window(layout, sliding_window, required=True)
    if window is not None and layout.has_sliding:
        # the ring holds `window` slots: a longer prefill chunk cannot be written to it, and a capacity below the
        # window would make the ring larger than the whole context
        if prefill_seq_len > window:
            raise RuntimeInputError(f"prefill_seq_len {prefill_seq_len} is larger than the sliding window {window} of "
                                    f"{path}'s ring buffers: a prefill chunk must fit in the ring; give "
                                    f"--prefill-seq-len {window} or less")
        if ctx_len < window:
            raise RuntimeInputError(f"ctx_len {ctx_len} is smaller than the sliding window {window} of {path}'s ring "
                                    f"buffers; give --ctx-len {window} or more")


def _vision_settings(path, layout: KVLayout, *, img_size, vision_size, vision_batch_size, max_num_images,
                     vision_precision, vision_model) -> tuple[dict | None, object]:
    """The vision symbols and the vision graph of a vision-language graph (the manifest beside it fills what is
    not given); a text graph refuses every vision setting."""
    kind = multimodal.graph_kind(layout)
    if kind is None:
        if img_size is not None or vision_size is not None or vision_model is not None or max_num_images is not None:
            raise RuntimeInputError(f"{path} has no {multimodal.VISION_EMBEDS} or {multimodal.PIXEL_VALUES} input: "
                                    "it is not a vision-language graph, so --img-size/--vision-size/--vision-model/"
                                    "--max-num-images do not apply")
        if vision_precision is not None or vision_batch_size != 1:
            raise RuntimeInputError(f"{path} is not a vision-language graph; --vision-precision/--vision-batch-size "
                                    "do not apply")
        return None, vision_model
    man = multimodal.manifest_beside(path) or {}
    mvis = man.get("vision") if isinstance(man.get("vision"), dict) else {}
    for label, given, key in (("img_size", img_size, "image_size"), ("vision_size", vision_size, "vision_size")):
        if given is not None and mvis.get(key) is not None and given != mvis[key]:
            raise RuntimeInputError(f"{label} {given} differs from the export's {multimodal.MANIFEST} "
                                    f"vision.{key} = {mvis[key]} (the graph was traced for it)")
    vision = {k: v for k, v in (("image_size", img_size if img_size is not None else mvis.get("image_size")),
                                ("vision_size", vision_size if vision_size is not None else mvis.get("vision_size")),
                                ("grid", mvis.get("grid"))) if v is not None}
    if vision_model is None and kind == multimodal.DUAL and isinstance(man.get("vision_onnx"), str):
        vision_model = Path(path).parent / man["vision_onnx"]
    return vision, vision_model
