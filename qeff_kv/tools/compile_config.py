"""Accelerator compile artifacts for a retained-state graph: ``custom_io.yaml`` and ``specializations.json``.

Shared by ``qeff-kv export`` and ``qeff-kv compile-config``. Buffer names come from the graph's
:class:`~qeff_kv.contract.layout.KVLayout`, so the files follow whatever prefix the graph carries.

A graph with sliding-window ring buffers (a KV axis 2 named ``sliding_window``) gets the symbol
``sliding_window`` = ``str(W)`` in every specialization (flat and named formats, with or without CCL), as the
peer writes; ``custom_io.yaml`` lists every pair whatever its capacity. ``W`` comes from the caller
(``sliding_window=``, ``--sliding-window N``) or the graph metadata ``qeff_kv.sliding_window``; a graph with the
axis and no known ``W`` is refused in one line.

Vision-language graphs (contract section 6; :mod:`qeff_kv.contract.multimodal`):

* ``custom_io.yaml`` lists the vision/multimodal retained buffers (``vision_embeds`` and
  ``vision_embeds_RetainedState`` in the dual layout's language graph, ``pixel_values`` and
  ``pixel_values_RetainedState`` in the single layout) at the model dtype (the buffer's own dtype in the graph,
  or ``vision_precision``), before the KV buffers at the KV precision. ``image_idx`` (int64) is not listed.
* every specialization carries ``img_size``, ``vision_size`` (dual layout only: the single layout has no such
  axis, and the peer drops it there too; where neither the manifest nor a static axis gives it, ONNX shape
  inference of the vision graph at ``img_size`` does, as the peer computes ``(img_size / patch)^2`` for Llava)
  and ``vision_batch_size`` after ``ctx_len`` (and ``sliding_window``), plus ``max_num_images`` when given or
  when a graph axis has that name.
* the dual layout's vision graph gets ``custom_io_vision.yaml`` (``pixel_values`` in, ``vision_embeds`` out, at the
  model dtype) and ``specializations_vision.json``: one entry (``batch_size`` = ``vision_batch_size``,
  [``max_num_images``], ``img_size``), named ``Vision`` in the named format, as the peer names its vision program.

A graph with LoRA adapter inputs (docs/lora.md) gets ``lora_slots`` and ``lora_rank`` in every specialization (its
dynamic adapter axes; :mod:`qeff_kv.tools.lora_inputs`); ``custom_io.yaml`` lists the KV alone, never an adapter input.
Other graphs' files are as they were.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Literal, Sequence as Seq

from qeff_kv.support import fsutil
from qeff_kv.graph import graphio
from qeff_kv.contract import multimodal, naming
from qeff_kv.errors import ContractError, RuntimeInputError
from qeff_kv.contract.ccl import ccl_below_prefill
from qeff_kv.contract.layout import KVLayout
from qeff_kv.support.limits import positive_int
from qeff_kv.tools.lora_inputs import lora_symbols

SpecFormat = Literal["flat", "named"]
CUSTOM_IO_FILE = "custom_io.yaml"
SPECIALIZATIONS_FILE = "specializations.json"
#: The dual layout's vision program: its own custom_io and specializations, beside the language graph's.
CUSTOM_IO_VISION_FILE = "custom_io_vision.yaml"
SPECIALIZATIONS_VISION_FILE = "specializations_vision.json"
#: Precisions the vision/multimodal buffers may be given (floats: they hold image data, not a cache).
VISION_PRECISIONS = ("float16", "bfloat16", "float32")
#: Specialization symbols of a vision-language graph (the peer's names).
IMG_SIZE, VISION_SIZE, VISION_BATCH_SIZE, MAX_NUM_IMAGES = "img_size", "vision_size", "vision_batch_size", "max_num_images"
#: The named format's entry for the vision program.
VISION_SPEC_NAME = "Vision"
#: The patch-row axis of ``pixel_values`` in models that take patch rows (Qwen2.5-VL).
GRID_HEIGHT = "grid_height"
#: Precisions a compiler accepts for the KV buffers in ``custom_io.yaml``.
PRECISIONS = ("float16", "bfloat16", "float32", "mxint8", "int8")


def check_precision(precision: str | None) -> str | None:
    """``None`` (the default: :func:`kv_precision`) or one of :data:`PRECISIONS` (one-line error otherwise)."""
    if precision is None:
        return None
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise RuntimeInputError(f"unknown KV precision {precision!r}; use one of {', '.join(PRECISIONS)}")
    return precision


def kv_precision(layout: KVLayout, precision: str | None) -> str:
    """The KV buffers' precision in ``custom_io.yaml``: ``precision``; by default ``float16`` for a float cache and
    a quantized cache's own dtype (``int8``: ``--kv-cache-dtype int8``). A quantized cache at another precision is
    refused in one line (its buffers hold that dtype's values, read through its scales)."""
    check_precision(precision)
    quantized = layout.quantized_kv
    if precision is None:
        return quantized or "float16"
    if quantized is not None and precision != quantized:
        raise RuntimeInputError(f"KV precision {precision} for a graph whose KV cache is {quantized} (exported with "
                                f"--kv-cache-dtype {quantized}): its buffers hold {quantized} values; use --precision "
                                f"{quantized} (its default)")
    return precision


def check_vision_precision(precision: str | None) -> str | None:
    """``None`` (the model dtype) or one of :data:`VISION_PRECISIONS` (one-line :class:`RuntimeInputError`)."""
    if precision is not None and (not isinstance(precision, str) or precision not in VISION_PRECISIONS):
        raise RuntimeInputError(f"unknown vision precision {precision!r}; vision buffers take one of "
                                f"{', '.join(VISION_PRECISIONS)} (default: the model dtype)")
    return precision


def _io_yaml(inputs: "list[tuple[str, str]]", outputs: "list[tuple[str, str]]") -> str:
    lines = ["# Model Inputs", ""]
    for name, prec in inputs:
        lines += [f" - IOName: {name}", f"   Precision: {prec}", ""]
    lines += ["# Model Outputs", ""]
    for name, prec in outputs:
        lines += [f" - IOName: {name}", f"   Precision: {prec}", ""]
    return "\n".join(lines)


def custom_io_yaml(layout: KVLayout, precision: str | None = None, *, vision_precision: str | None = None) -> str:
    """`` - IOName: X`` / ``   Precision: <precision>`` for every KV input and its retained output (default:
    :func:`kv_precision`, ``float16`` or a quantized cache's own dtype).

    A vision-language graph's float non-KV retained buffers (``vision_embeds``, ``pixel_values``...) come first, at
    ``vision_precision`` or, by default, their own dtype in the graph (the model dtype)."""
    check_vision_precision(vision_precision)
    layout.require_valid()
    precision = kv_precision(layout, precision)
    pairs = sorted(layout.pairs, key=lambda p: (p.layer, p.stem))
    extra = multimodal.custom_io_buffers(layout)
    ins = [(a.name, vision_precision or multimodal.float_precision(a)) for a, _ in extra]
    outs = [(b.name, vision_precision or multimodal.float_precision(b)) for _, b in extra]
    ins += [(p.input_name, precision) for p in pairs]
    outs += [(p.output_name, precision) for p in pairs]
    return _io_yaml(ins, outs)  # type: ignore[arg-type]


def custom_io_vision_yaml(vision_layout: KVLayout, vision_precision: str | None = None) -> str:
    """The dual layout's vision graph: ``pixel_values`` in, ``vision_embeds`` out, at ``vision_precision`` or
    their own dtype (the model dtype)."""
    check_vision_precision(vision_precision)
    require_vision_encoder(vision_layout)
    ins = [(t.name, vision_precision or multimodal.float_precision(t)) for t in vision_layout.inputs
           if multimodal.float_precision(t) is not None]
    outs = [(t.name, vision_precision or multimodal.float_precision(t)) for t in vision_layout.outputs
            if multimodal.float_precision(t) is not None]
    return _io_yaml(ins, outs)  # type: ignore[arg-type]


def require_vision_encoder(vision_layout: KVLayout, name: str = "vision graph") -> KVLayout:
    if multimodal.graph_kind(vision_layout) != multimodal.VISION_ENCODER:
        raise ContractError(f"{name} is not a vision encoder graph ({multimodal.PIXEL_VALUES} -> "
                            f"{multimodal.VISION_EMBEDS}, no KV buffers, nothing retained)")
    return vision_layout


def check_sliding_window(value) -> int | None:
    """``None``, or ``value`` as a positive int (one-line :class:`RuntimeInputError` otherwise)."""
    if value is None:
        return None
    return positive_int(naming.SLIDING_DIM, value)


def resolve_sliding_window(layout: KVLayout, sliding_window=None, *, required: bool = False) -> int | None:
    """The window ``W`` of ``layout``'s ring buffers: ``sliding_window`` when given (a positive int), else the graph
    metadata ``qeff_kv.sliding_window``. A given window that differs from the metadata's is refused; with
    ``required``, a graph with ring buffers (axis ``sliding_window``) and no known window is refused too."""
    sliding_window = check_sliding_window(sliding_window)
    meta = layout.sliding_window
    if sliding_window is not None and meta is not None and sliding_window != meta:
        raise RuntimeInputError(f"sliding window {sliding_window} differs from the graph's own "
                                f"{naming.SLIDING_WINDOW_META} = {meta}")
    window = sliding_window if sliding_window is not None else meta
    if required and window is None and layout.has_sliding:
        raise RuntimeInputError(f"graph has sliding-window KV buffers (axis {naming.SLIDING_DIM!r}); "
                            "give --sliding-window N")
    return window


def resolve_speculative(layout: KVLayout, speculative_tokens=None) -> int | None:
    """``K`` of a speculative-decoding graph (a ``num_logits_to_keep`` input): the given value, else the graph
    metadata ``qeff_kv.speculative_tokens``; refused in one line when neither is there, or when given for a graph
    without that input. ``None`` for other graphs."""
    if speculative_tokens is not None:
        positive_int("speculative_tokens", speculative_tokens)
    if not layout.speculative:
        if speculative_tokens is not None:
            raise RuntimeInputError(f"the graph has no {naming.LOGITS_TO_KEEP_INPUT} input (not a speculative-"
                                    "decoding graph); --speculative-tokens does not apply")
        return None
    recorded = layout.speculative_tokens
    if speculative_tokens is not None and recorded is not None and int(speculative_tokens) > int(recorded):
        raise RuntimeInputError(f"--speculative-tokens {speculative_tokens} is larger than the K={recorded} the graph "
                                "was exported for (its decode verifies at most K drafts)")
    if speculative_tokens is None:
        speculative_tokens = recorded
    if speculative_tokens is None:
        raise RuntimeInputError(f"the graph takes {naming.LOGITS_TO_KEEP_INPUT} (speculative decoding) and records "
                                "no K; give --speculative-tokens K")
    return int(speculative_tokens)


def specializations(prefill_seq_len: int, ctx_len: int, *, batch_size: int = 1,
                    full_batch_size: int | None = None, fmt: SpecFormat = "flat",
                    ccl: "Seq[int] | None" = None, sliding_window: int | None = None,
                    vision_symbols: "dict[str, int] | None" = None, speculative_tokens: int | None = None,
                    lora: "dict[str, int] | None" = None) -> dict:
    """Prefill (``seq_len`` = prefill length) and decode (``seq_len`` = 1) specializations.

    ``flat`` is the format every compiler release reads; ``named`` is the newer
    ``{"specializations": [{"name": ..., "symbols": {...}}]}`` form. Values are strings, as the peer writes.
    Under continuous batching, prefill runs one sequence (``batch_size`` 1) and decode runs
    ``full_batch_size`` rows.

    With ``ccl`` (compute-context lengths, contract section 9): one prefill per value, then one decode per
    value, each with the symbol ``comp_ctx_lengths``; named entries are ``Prefill_ccl<L>`` / ``Decode_ccl<L>``.

    With ``sliding_window`` (the window ``W`` of a graph with ring buffers, axis ``sliding_window``): every entry
    carries ``"sliding_window": str(W)`` after ``ctx_len``.

    With ``vision_symbols`` (a vision-language graph's ``max_num_images``, ``img_size``, ``vision_size``,
    ``vision_batch_size``, from :func:`vision_symbols`): every entry carries them after ``ctx_len`` (and
    ``sliding_window``).

    With ``speculative_tokens`` ``K`` (a speculative-decoding graph, QEfficient's TLM): every entry carries
    ``num_logits_to_keep`` (1 for prefill) and decode runs ``seq_len = K+1`` with ``num_logits_to_keep = K+1``.

    With ``lora`` (a graph with LoRA adapter inputs: ``lora_slots`` and ``lora_rank`` of its dynamic adapter axes,
    :func:`qeff_kv.tools.lora_inputs.lora_symbols`): every entry carries them (before ``comp_ctx_lengths``).
    """
    _check_spec_arguments(prefill_seq_len, ctx_len, batch_size, full_batch_size, sliding_window, fmt)
    prefill, decode = _prefill_and_decode(prefill_seq_len, ctx_len, batch_size, full_batch_size)
    if sliding_window is not None:
        prefill, decode = (_after_ctx_len(d, naming.SLIDING_DIM, str(sliding_window)) for d in (prefill, decode))
    if vision_symbols:
        after = naming.SLIDING_DIM if sliding_window is not None else "ctx_len"
        vis = {k: str(positive_int(k, v)) for k, v in vision_symbols.items()}
        prefill, decode = (_insert_after(d, after, vis) for d in (prefill, decode))
    if speculative_tokens is not None:
        width = str(positive_int("speculative_tokens", speculative_tokens) + 1)
        if int(width) > ctx_len:
            raise RuntimeInputError(f"speculative_tokens {speculative_tokens}: a decode step of K+1 = {width} "
                                    f"positions does not fit ctx_len {ctx_len}")
        prefill = {**prefill, naming.LOGITS_TO_KEEP_INPUT: "1"}
        decode = {**decode, "seq_len": width, naming.LOGITS_TO_KEEP_INPUT: width}
    if lora:
        syms = {k: str(positive_int(k, v)) for k, v in lora.items()}
        prefill, decode = {**prefill, **syms}, {**decode, **syms}
    entries = _ccl_entries(prefill, decode, ccl, prefill_seq_len) if ccl else [("Prefill", prefill), ("Decode", decode)]
    if fmt == "flat":
        return {"specializations": [sym for _, sym in entries]}
    return {"specializations": [{"name": name, "symbols": sym} for name, sym in entries]}


def _check_spec_arguments(prefill_seq_len, ctx_len, batch_size, full_batch_size, sliding_window, fmt) -> None:
    for label, v in (("prefill_seq_len", prefill_seq_len), ("ctx_len", ctx_len), ("batch_size", batch_size)):
        positive_int(label, v)
    if full_batch_size is not None:
        positive_int("full_batch_size", full_batch_size)
    check_sliding_window(sliding_window)
    if prefill_seq_len > ctx_len:
        raise RuntimeInputError(f"prefill_seq_len {prefill_seq_len} is larger than ctx_len {ctx_len}")
    if fmt not in ("flat", "named"):
        raise RuntimeInputError(f"unknown specializations format {fmt!r}; use 'flat' or 'named'")


def _prefill_and_decode(prefill_seq_len: int, ctx_len: int, batch_size: int,
                        full_batch_size: int | None) -> tuple[dict, dict]:
    """The two base entries; under continuous batching prefill runs one sequence, decode ``full_batch_size``."""
    if full_batch_size is not None:
        prefill = {"batch_size": "1", "seq_len": str(prefill_seq_len), "ctx_len": str(ctx_len),
                   "full_batch_size": str(full_batch_size)}
        decode = {"batch_size": str(full_batch_size), "seq_len": "1", "ctx_len": str(ctx_len),
                  "full_batch_size": str(full_batch_size)}
    else:
        prefill = {"batch_size": str(batch_size), "seq_len": str(prefill_seq_len), "ctx_len": str(ctx_len)}
        decode = {"batch_size": str(batch_size), "seq_len": "1", "ctx_len": str(ctx_len)}
    return prefill, decode


def _ccl_entries(prefill: dict, decode: dict, ccl, prefill_seq_len: int) -> list[tuple[str, dict]]:
    """One prefill per compute-context length, then one decode per length, each with ``comp_ctx_lengths``."""
    for v in ccl:
        positive_int(naming.CCL_INPUT, v)
    if min(ccl) < prefill_seq_len:
        raise RuntimeInputError(ccl_below_prefill(min(ccl), prefill_seq_len))
    entries = [(f"Prefill_ccl{v}", {**prefill, naming.CCL_INPUT: str(v)}) for v in ccl]
    entries += [(f"Decode_ccl{v}", {**decode, naming.CCL_INPUT: str(v)}) for v in ccl]
    return entries


def _after_ctx_len(d: dict, key: str, value: str) -> dict:
    return _insert_after(d, "ctx_len", {key: value})


def _insert_after(d: dict, after: str, items: dict) -> dict:
    out: dict = {}
    for k, v in d.items():
        out[k] = v
        if k == after:
            out.update(items)
    return out


def vision_symbols(kind: str, *, img_size: int, vision_size: int | None = None, vision_batch_size: int = 1,
                   max_num_images: int | None = None) -> dict[str, int]:
    """The vision symbols of a ``"dual"`` or ``"single"`` language graph's specializations, in the peer's order:
    [``max_num_images``], ``img_size``, ``vision_size`` (dual only), ``vision_batch_size``."""
    out: dict[str, int] = {}
    if max_num_images is not None:
        out[MAX_NUM_IMAGES] = positive_int(MAX_NUM_IMAGES, max_num_images)
    out[IMG_SIZE] = positive_int(IMG_SIZE, img_size)
    if kind == multimodal.DUAL:
        if vision_size is None:
            raise RuntimeInputError("the dual layout's language graph needs vision_size (image rows per image); "
                                    "give --vision-size N")
        out[VISION_SIZE] = positive_int(VISION_SIZE, vision_size)
    out[VISION_BATCH_SIZE] = positive_int(VISION_BATCH_SIZE, vision_batch_size)
    return out


def vision_specializations(*, img_size: int, vision_batch_size: int = 1, max_num_images: int | None = None,
                           fmt: SpecFormat = "flat", extra: "dict[str, int] | None" = None) -> dict:
    """The dual layout's vision program: one entry, ``batch_size`` (images per run: ``vision_batch_size``),
    [``max_num_images``], ``img_size``; named ``Vision`` in the named format."""
    if fmt not in ("flat", "named"):
        raise RuntimeInputError(f"unknown specializations format {fmt!r}; use 'flat' or 'named'")
    sym = {"batch_size": str(positive_int(VISION_BATCH_SIZE, vision_batch_size))}
    if max_num_images is not None:
        sym[MAX_NUM_IMAGES] = str(positive_int(MAX_NUM_IMAGES, max_num_images))
    sym[IMG_SIZE] = str(positive_int(IMG_SIZE, img_size))
    for k, v in (extra or {}).items():
        sym[k] = str(positive_int(k, v))
    if fmt == "flat":
        return {"specializations": [sym]}
    return {"specializations": [{"name": VISION_SPEC_NAME, "symbols": sym}]}


def _given_or_graph(label: str, given, graph_value: int | None, where: str, flag: str) -> int:
    if given is not None:
        given = positive_int(label, given)
        if graph_value is not None and given != graph_value:
            raise RuntimeInputError(f"{label} {given} differs from the graph's own {where} = {graph_value}")
        return given
    if graph_value is None:
        raise RuntimeInputError(f"the vision-language graph's {label} is unknown (axis {where} is symbolic); "
                                f"give {flag} N")
    return graph_value


def _axis_named(layouts, name: str) -> bool:
    return any(t.shape is not None and name in t.shape for lay in layouts for t in lay.inputs + lay.outputs)


def _resolve_vision(layout: KVLayout, vision: dict | None, single_graph: bool | None,
                    vision_layout: KVLayout | None, vision_batch_size: int, max_num_images: int | None,
                    vision_path: Path | None = None):
    """(kind, language-graph symbols, vision-program settings or None) of ``layout``; refusals in one line."""
    kind = multimodal.graph_kind(layout)
    if kind == multimodal.VISION_ENCODER:
        raise ContractError(f"graph is a {multimodal.describe_kind(kind)}; give the language graph (the vision graph "
                            "is its vision_graph / --vision-model)")
    if kind is None:
        if vision is not None or vision_layout is not None or max_num_images is not None:
            raise RuntimeInputError(f"graph has no {multimodal.VISION_EMBEDS} or {multimodal.PIXEL_VALUES} input: "
                                    "it is not a vision-language graph, so vision settings do not apply")
        return None, None, None
    if single_graph is not None and bool(single_graph) != (kind == multimodal.SINGLE):
        raise RuntimeInputError(f"single_graph={bool(single_graph)} but the graph is the "
                                f"{'single' if kind == multimodal.SINGLE else 'dual'} layout")
    if kind == multimodal.SINGLE and vision_layout is not None:
        raise RuntimeInputError("the single layout has no vision graph (the vision encoder is inside it)")
    vision = dict(vision or {})
    pix = layout.input(multimodal.PIXEL_VALUES)
    emb = layout.input(multimodal.VISION_EMBEDS)
    graph_img = multimodal.static_dim(pix, 2)
    if vision_layout is not None:
        require_vision_encoder(vision_layout)
        graph_img = graph_img or multimodal.static_dim(vision_layout.input(multimodal.PIXEL_VALUES), 2)
    img_size = _given_or_graph(IMG_SIZE, vision.get("image_size", vision.get(IMG_SIZE)), graph_img,
                               f"{multimodal.PIXEL_VALUES} dim 2", "--img-size")
    vision_size = None
    if kind == multimodal.DUAL:
        rows = multimodal.static_dim(emb, 1)
        if rows is None and vision.get(VISION_SIZE) is None and vision_path is not None:
            rows = multimodal.vision_rows(vision_path, img_size)   # the vision graph's shapes at img_size
        vision_size = _given_or_graph(VISION_SIZE, vision.get(VISION_SIZE), rows,
                                      f"{multimodal.VISION_EMBEDS} dim 1", "--vision-size")
    layouts = [layout] + ([vision_layout] if vision_layout is not None else [])
    if max_num_images is None and _axis_named(layouts, MAX_NUM_IMAGES):
        max_num_images = 1
    syms = vision_symbols(kind, img_size=img_size, vision_size=vision_size, vision_batch_size=vision_batch_size,
                          max_num_images=max_num_images)
    # Patch-row models (Qwen2.5-VL) take pixel_values [grid_height, patch_dim]: grid_height = t * h * w patches.
    grid = vision.get("grid")
    grid_syms = {}
    if grid and _axis_named(layouts, GRID_HEIGHT):
        grid_syms[GRID_HEIGHT] = int(math.prod(int(g) for g in grid))
        if kind == multimodal.SINGLE:
            syms.update(grid_syms)
    vis = None
    if vision_layout is not None:
        vis = {"img_size": img_size, "vision_batch_size": vision_batch_size, "max_num_images": max_num_images,
               "extra": grid_syms}
    return kind, syms, vis


def write_compile_config(layout: KVLayout, out_dir: str | Path, *, prefill_seq_len: int, ctx_len: int,
                         batch_size: int = 1, full_batch_size: int | None = None, fmt: SpecFormat = "flat",
                         precision: str | None = None, ccl: "Seq[int] | None" = None,
                         sliding_window: int | None = None, vision: dict | None = None,
                         single_graph: bool | None = None, vision_graph: "KVLayout | str | Path | None" = None,
                         vision_batch_size: int = 1, max_num_images: int | None = None,
                         vision_precision: str | None = None, speculative_tokens: int | None = None,
                         lora_slots: int | None = None, lora_rank: int | None = None) -> list[Path]:
    """Write both files into ``out_dir`` atomically; return their paths.

    ``sliding_window``: the model's window ``W`` (default: the graph metadata ``qeff_kv.sliding_window``). It
    lands in the specializations only when the graph has ring buffers (a KV axis 2 named ``sliding_window``);
    such a graph without a known window is refused in one line (:class:`RuntimeInputError`), nothing written.

    A vision-language graph (told by its inputs: :func:`qeff_kv.contract.multimodal.graph_kind`): ``vision`` holds its
    ``image_size`` and ``vision_size`` (the manifest's ``vision`` dict; a static graph axis is used when it is
    absent, and must agree when both are there); ``single_graph``, when given, must match the graph's layout;
    ``vision_graph`` (a layout or a path) is the dual layout's vision graph (given as a path, its shapes at
    ``img_size`` give ``vision_size`` where nothing else does: the peer's graphs), which adds
    ``custom_io_vision.yaml`` and ``specializations_vision.json`` (returned after the other two).
    ``vision_precision``: the vision buffers' precision (default: the model dtype, their own dtype in the graph).
    ``speculative_tokens``: ``K`` of a speculative-decoding graph (default: its metadata; :func:`resolve_speculative`).
    ``lora_slots``/``lora_rank``: a graph with LoRA adapter inputs has its dynamic ``lora_slots`` and ``lora_rank``
    axes given values (default: 1 + the adapters its export was proved with, or 1 + 1; the metadata's max_rank:
    :func:`qeff_kv.tools.lora_inputs.lora_symbols`); ``custom_io.yaml`` never lists the adapter inputs (not KV).
    """
    out_dir = Path(out_dir)
    check_precision(precision)
    check_vision_precision(vision_precision)
    vision_path = None
    if vision_graph is not None and not isinstance(vision_graph, KVLayout):
        vision_path = Path(vision_graph)
        vision_graph = graphio.layout_of(graphio.load(vision_graph))
    window = resolve_sliding_window(layout, sliding_window, required=True)
    kind, syms, vis = _resolve_vision(layout, vision, single_graph, vision_graph, vision_batch_size, max_num_images,
                                      vision_path)
    spec = specializations(prefill_seq_len, ctx_len, batch_size=batch_size,
                           full_batch_size=full_batch_size, fmt=fmt, ccl=ccl,
                           sliding_window=window if layout.has_sliding else None, vision_symbols=syms,
                           speculative_tokens=resolve_speculative(layout, speculative_tokens),
                           lora=lora_symbols(layout, lora_slots, lora_rank))
    text = custom_io_yaml(layout, precision, vision_precision=vision_precision)
    files = [(out_dir / CUSTOM_IO_FILE, text), (out_dir / SPECIALIZATIONS_FILE, json.dumps(spec, indent=2) + "\n")]
    if vis is not None:
        assert isinstance(vision_graph, KVLayout)
        vspec = vision_specializations(img_size=vis["img_size"], vision_batch_size=vis["vision_batch_size"],
                                       max_num_images=vis["max_num_images"], fmt=fmt, extra=vis["extra"])
        files += [(out_dir / CUSTOM_IO_VISION_FILE, custom_io_vision_yaml(vision_graph, vision_precision)),
                  (out_dir / SPECIALIZATIONS_VISION_FILE, json.dumps(vspec, indent=2) + "\n")]
    for path, content in files:  # everything computed first: a refusal writes nothing
        fsutil.write_text(path, content)
    return [p for p, _ in files]
