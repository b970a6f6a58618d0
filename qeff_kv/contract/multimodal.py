"""Vision-language graphs in the peer's convention (contract section 6): what kind of graph this is, and whether
its non-KV retained buffers are well formed.

Three kinds, told apart by their inputs and outputs only (peer graphs carry no metadata):

* ``"dual"``: the language graph of the dual layout (KV buffers and a ``vision_embeds`` input, retained as
  ``vision_embeds_RetainedState``);
* ``"single"``: the single layout (KV buffers and a ``pixel_values`` input, retained as
  ``pixel_values_RetainedState``);
* ``"vision-encoder"``: the dual layout's vision graph (``pixel_values`` -> ``vision_embeds``; no KV buffer and
  no retained output).

A text decoder is ``None``. :func:`non_kv_issues` lists what is wrong with a graph's non-KV retained buffers
(``check`` reports them under its ``pairing`` and ``pair-match`` rules; ``rewrite`` refuses on the first
pairing problem). Names come from :mod:`qeff_kv.contract.naming`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from qeff_kv.contract import naming
from qeff_kv.contract.layout import KVLayout, TensorInfo

#: The names come from the naming contract (re-exported here for the graph tools).
VISION_EMBEDS, PIXEL_VALUES = naming.VISION_EMBEDS, naming.PIXEL_VALUES
IMAGE_IDX, IMAGE_IDX_OUTPUT = naming.IMAGE_IDX, naming.IMAGE_IDX_OUTPUT

DUAL, SINGLE, VISION_ENCODER = "dual", "single", "vision-encoder"
#: dtype and shape of ``image_idx`` and ``image_idx_output`` (no dynamic axes)
IMAGE_IDX_DTYPE, IMAGE_IDX_SHAPE = "int64", (1, 1)
_FLOAT_PRECISION = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}

MANIFEST = "manifest.json"


def _has_kv_like(layout: KVLayout) -> bool:
    return any(naming.looks_like_kv(n) or naming.parse_kv_name(n) is not None for n in layout.io_names)


def graph_kind(layout: KVLayout) -> str | None:
    """``"dual"``, ``"single"``, ``"vision-encoder"`` or ``None`` (a text decoder, or something else)."""
    ins = {t.name for t in layout.inputs}
    outs = {t.name for t in layout.outputs}
    if _has_kv_like(layout):
        if VISION_EMBEDS in ins:
            return DUAL
        if PIXEL_VALUES in ins:
            return SINGLE
        return None
    if PIXEL_VALUES in ins and VISION_EMBEDS in outs and not any(naming.is_retained_output(n) for n in outs):
        return VISION_ENCODER
    return None


def describe_kind(kind: str | None) -> str | None:
    return {
        DUAL: f"vision-language graph, dual layout ({VISION_EMBEDS} retained, {IMAGE_IDX} chained)",
        SINGLE: f"vision-language graph, single layout ({PIXEL_VALUES} retained, {IMAGE_IDX} chained)",
        VISION_ENCODER: f"vision encoder graph ({PIXEL_VALUES} -> {VISION_EMBEDS}; no KV buffers, nothing retained)",
    }.get(kind)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Issue:
    """A problem with a non-KV retained buffer: ``rule`` is the ``check`` rule it belongs to."""

    rule: str     # "pairing" or "pair-match"
    buffer: str | None
    message: str


def non_kv_pairs(layout: KVLayout) -> list[tuple[TensorInfo, TensorInfo]]:
    """The non-KV retained buffers that have both their input and their output, in graph order."""
    out = []
    for i, o in layout.non_kv_retained:
        if i is None or o is None:
            continue
        a, b = layout.input(i), layout.output(o)
        if a is not None and b is not None:
            out.append((a, b))
    return out


def _output_for(base: str) -> str:
    return naming.NON_KV_OUTPUT_ALIASES.get(base, naming.retained_name(base))


def non_kv_issues(layout: KVLayout) -> list[Issue]:
    """What is wrong with the non-KV retained buffers of a graph with KV buffers (nothing for other graphs).

    * ``pairing``: a known non-KV retained input (``vision_embeds``, ``pixel_values``, ``image_idx``...) has no
      output (``X_RetainedState``; ``image_idx_output`` for ``image_idx``); a vision-language graph has neither
      ``image_idx`` nor ``image_idx_output`` (no image-index chaining). An output without its input is the
      ``pairing`` rule's own finding (every retained output).
    * ``pair-match``: a pair whose dtype or dims differ; ``image_idx``/``image_idx_output`` not int64 ``[1, 1]``.
    """
    if not _has_kv_like(layout):
        return []
    issues: list[Issue] = []
    outs = {t.name for t in layout.outputs}
    ins = {t.name for t in layout.inputs}
    for t in layout.inputs:
        if t.name in naming.NON_KV_RETAINED and _output_for(t.name) not in outs:
            issues.append(Issue("pairing", t.name, f"non-KV retained input {t.name} has no output "
                                                   f"{_output_for(t.name)}"))
    kind = graph_kind(layout)
    if kind in (DUAL, SINGLE) and IMAGE_IDX not in ins and IMAGE_IDX_OUTPUT not in outs:
        what = VISION_EMBEDS if kind == DUAL else PIXEL_VALUES
        issues.append(Issue("pairing", None, f"vision-language graph (input {what}) has no {IMAGE_IDX} input and "
                                             f"no {IMAGE_IDX_OUTPUT} output: the image index is not chained "
                                             "across prefill chunks"))
    for a, b in non_kv_pairs(layout):
        if a.dtype != b.dtype:
            issues.append(Issue("pair-match", a.name, f"{a.name} is {a.dtype} but {b.name} is {b.dtype}"))
        if a.shape is None or b.shape is None:
            if a.shape != b.shape:
                issues.append(Issue("pair-match", a.name, f"{a.name} has shape {_fmt_shape(a.shape)} but {b.name} "
                                                          f"has {_fmt_shape(b.shape)}"))
        elif len(a.shape) != len(b.shape):
            issues.append(Issue("pair-match", a.name,
                                f"{a.name} has rank {len(a.shape)} but {b.name} has rank {len(b.shape)}"))
        else:
            for i, (da, db) in enumerate(zip(a.shape, b.shape)):
                if da != db:
                    issues.append(Issue("pair-match", a.name, f"{a.name} dim {i} is {_fmt_dim(da)} but {b.name} "
                                                              f"dim {i} is {_fmt_dim(db)}"))
    for t in [layout.input(IMAGE_IDX), layout.output(IMAGE_IDX_OUTPUT)]:
        if t is None:
            continue
        if t.dtype != IMAGE_IDX_DTYPE or t.shape != IMAGE_IDX_SHAPE:
            issues.append(Issue("pair-match", t.name, f"{t.name} is {t.dtype} {_fmt_shape(t.shape)}; {IMAGE_IDX} "
                                                      f"and {IMAGE_IDX_OUTPUT} are {IMAGE_IDX_DTYPE} "
                                                      f"{_fmt_shape(IMAGE_IDX_SHAPE)}"))
    return issues


def first_pairing_problem(layout: KVLayout) -> str | None:
    """The first reason ``rewrite`` refuses a graph's non-KV buffers: an unpaired or prefixed non-KV buffer."""
    in_names = {t.name for t in layout.inputs}
    for t in layout.outputs:  # an output retained against an input the graph does not have
        src = naming.retained_source(t.name)
        if src is not None and naming.parse_kv_name(t.name) is None and src not in in_names \
                and naming.non_kv_retained_base(t.name) is not None:
            return f"retained output {t.name} has no input {src}"
    for issue in non_kv_issues(layout):
        if issue.rule == "pairing":
            return issue.message
    for n in layout.io_names:
        hit = naming.prefixed_non_kv(n)
        if hit is not None:
            base, p = hit
            return f"non-KV retained buffer {n} carries prefix {p!r}; {base} buffers are never prefixed"
    return None


def _fmt_dim(d) -> str:
    return "?" if d is None else (repr(d) if isinstance(d, str) else str(d))


def _fmt_shape(s) -> str:
    return "unknown" if s is None else "[" + ", ".join(_fmt_dim(d) for d in s) + "]"


# ------------------------------------------------------------------------------------------------ compile files
def float_precision(t: TensorInfo) -> str | None:
    """The ``custom_io`` precision of a tensor at its own (the model's) dtype; ``None`` unless a float."""
    return _FLOAT_PRECISION.get(t.dtype)


def custom_io_buffers(layout: KVLayout) -> list[tuple[TensorInfo, TensorInfo]]:
    """Non-KV retained pairs that ``custom_io.yaml`` lists: the float ones (``vision_embeds``, ``pixel_values``,
    ``deepstack_features``), not the int64 ``image_idx`` counter."""
    return [(a, b) for a, b in non_kv_pairs(layout)
            if naming.retained_source(b.name) == a.name and b.name == naming.retained_name(a.name)
            and float_precision(a) is not None]


def static_dim(t: TensorInfo | None, axis: int) -> int | None:
    if t is None or t.shape is None or len(t.shape) <= axis:
        return None
    d = t.shape[axis]
    return d if isinstance(d, int) and not isinstance(d, bool) else None


def vision_rows(path: str | Path, img_size: int) -> int | None:
    """The rows per image (``vision_embeds`` dim 1) the dual layout's vision graph at ``path`` makes for one
    ``img_size`` x ``img_size`` image: ONNX shape inference (with data propagation) after fixing its
    ``pixel_values`` dims; ``None`` when the graph is not such a graph or inference cannot tell. Weights are not
    read."""
    import onnx
    from onnx import shape_inference

    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception:
        return None
    ins = [i for i in model.graph.input if i.name == PIXEL_VALUES]
    outs = [o for o in model.graph.output if o.name == VISION_EMBEDS]
    if len(ins) != 1 or len(outs) != 1 or len(ins[0].type.tensor_type.shape.dim) != 4:
        return None
    for d, v in zip(ins[0].type.tensor_type.shape.dim, (1, None, img_size, img_size)):
        if v is not None:
            d.Clear()
            d.dim_value = v
    outs[0].type.tensor_type.ClearField("shape")
    try:
        inferred = shape_inference.infer_shapes(model, data_prop=True)
    except Exception:
        return None
    out = [o for o in inferred.graph.output if o.name == VISION_EMBEDS][0].type.tensor_type
    dims = out.shape.dim if out.HasField("shape") else []
    if len(dims) != 3 or not dims[1].HasField("dim_value") or dims[1].dim_value < 1:
        return None
    return int(dims[1].dim_value)


def manifest_beside(path: str | Path) -> dict | None:
    """The ``manifest.json`` of the export folder holding ``path`` when it names ``path`` as its ``onnx``
    (the graph holding the KV); else ``None``. An unreadable manifest counts as none."""
    path = Path(path)
    man = path.parent / MANIFEST
    if not man.is_file():
        return None
    try:
        data = json.loads(man.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("onnx") != path.name:
        return None
    return data
