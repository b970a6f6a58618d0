"""``check``'s rules on what each layer retains (part of the ``pair-match`` rule): the recorded state spec
(``qeff_kv.state_spec``) describes the graph's buffers, the sliding window is a positive int, a ring layer's
buffers agree with each other and with the window, an MLA layer's latent pair (``compressed_kv.{i}``,
``k_pe.{i}``) shares its batch, head and ctx axes, and a recurrent layer's states (``conv_state.{i}``
``[batch, conv_dim, conv_kernel]``, ``recurrent_state.{i}`` ``[batch, heads, head_dim, d_state]``) have no position
axis: only axis 0 is dynamic; a DSA layer's ``index_key.{i}`` shares its layer's batch and ctx axes. Rules report
through the ``RuleResult`` they are given."""

from __future__ import annotations

from qeff_kv.contract import naming, statespec
from qeff_kv.contract.layout import QUANTIZED_KV_DTYPES, KVLayout, dtype_from_onnx


def _fmt_dim(d) -> str:
    return "?" if d is None else (repr(d) if isinstance(d, str) else str(d))


def _axis2(t) -> object:
    return t.shape[2] if t.shape is not None and len(t.shape) > 2 else None


def sliding_dims(layout: KVLayout, r) -> None:
    """Sliding-window facts: the metadata window is a positive int; a layer's key and value do not mix a
    ``ctx_len`` and a ``sliding_window`` axis; static axis-2 sizes on a sliding layer equal the window."""
    raw = layout.sliding_window_meta
    window = layout.sliding_window
    spec_problem = statespec.problem(layout.metadata, layout.state_pairs)
    if spec_problem is not None:
        r.fail(None, spec_problem)
    spec = layout.state_spec
    if raw is not None and window is None:
        r.fail(None, f"graph metadata {naming.SLIDING_WINDOW_META} is {raw!r}; it must be a positive integer "
                     "(the sliding window)")
    by_layer: dict[int, list] = {}
    for p in layout.pairs:
        if not p.recurrent:
            by_layer.setdefault(p.layer, []).append(p)
    for layer in sorted(by_layer):
        pairs = sorted(by_layer[layer], key=lambda p: naming.KV_STEMS.index(p.stem))
        state = spec.layer(layer)
        if state is None or state.kind != "ring":
            continue
        ctx_named = [p.input_name for p in pairs if isinstance(p.axis2, str) and p.axis2 != naming.SLIDING_DIM]
        sliding_named = [p.input_name for p in pairs if p.axis2 == naming.SLIDING_DIM]
        if ctx_named and sliding_named:
            r.fail(ctx_named[0], f"layer {layer} mixes KV axis 2 {_fmt_dim(_axis2_of(pairs, ctx_named[0]))} "
                                 f"({', '.join(ctx_named)}) and {naming.SLIDING_DIM!r} ({', '.join(sliding_named)}); "
                                 "a layer's buffers hold the same positions")
        if window is None:
            continue
        for p in pairs:  # one violation per pair: its input's size, else its output's
            bad = [(t.name, _axis2(t)) for t in (p.input, p.output)
                   if isinstance(_axis2(t), int) and _axis2(t) != window]
            if bad:
                name, d = bad[0]
                r.fail(p.input_name, f"{name} dim 2 is {d} in sliding-window layer {layer}, but the graph's "
                                     f"sliding window ({naming.SLIDING_WINDOW_META}) is {window}")


def _axis2_of(pairs, name: str):
    return next(p.axis2 for p in pairs if p.input_name == name)


def latent_dims(layout: KVLayout, r) -> None:
    """MLA's latent pair (contract section 11): ``compressed_kv.{i}`` and ``k_pe.{i}`` hold the same sequences and
    positions, so their axes 0-2 (batch, heads, ``ctx_len``) are equal (names or sizes), and they are rank 4.
    That both are present is the ``layers`` rule's (stem groups complete)."""
    latent: dict[int, dict] = {}
    for p in layout.pairs:
        if p.stem in naming.LATENT_STEMS:
            latent.setdefault(p.layer, {})[p.stem] = p
    for layer in sorted(latent):
        pair = latent[layer]
        for p in pair.values():
            if p.input.shape is not None and len(p.input.shape) != 4:
                r.fail(p.input_name, f"{p.input_name} has rank {len(p.input.shape)}; MLA's latent buffers are "
                                     "[batch, heads, ctx_len, dim]")
        if len(pair) != 2:
            continue
        ckv, kpe = (pair[s] for s in naming.LATENT_STEMS)
        if ckv.input.shape is None or kpe.input.shape is None or len(ckv.input.shape) != 4 \
                or len(kpe.input.shape) != 4:
            continue
        for axis, what in ((0, "batch"), (1, "head"), (2, "ctx")):
            da, db = ckv.input.shape[axis], kpe.input.shape[axis]
            if da != db:
                r.fail(kpe.input_name, f"{kpe.input_name} dim {axis} is {_fmt_dim(db)} but {ckv.input_name} dim "
                                       f"{axis} is {_fmt_dim(da)}; a layer's latent pair shares its {what} axis")


def index_dims(layout: KVLayout, r) -> None:
    """DeepSeek sparse attention's indexer keys (``index_key.{i}``, contract section 11) are one more full-length
    buffer of layer ``i``: rank 4 (``[batch, 1, ctx_len, index_head_dim]``), beside the layer's ``past_key.{i}`` /
    ``past_value.{i}``, whose batch and ctx axes they share (the indexer scores the positions attention reads)."""
    by_layer: dict[int, dict] = {}
    for p in layout.pairs:
        by_layer.setdefault(p.layer, {})[p.stem] = p
    for layer in sorted(by_layer):
        index = by_layer[layer].get(naming.INDEX_STEM)
        if index is None or index.input.shape is None:
            continue
        key = by_layer[layer].get("past_key")
        if len(index.input.shape) != 4:
            r.fail(index.input_name, f"{index.input_name} has rank {len(index.input.shape)}; the indexer's keys are "
                                     "[batch, 1, ctx_len, index_head_dim]")
        elif key is None:
            r.fail(index.input_name, f"{index.input_name} has no past_key.{layer}: the indexer's keys come with "
                                     "their layer's cache")
        elif key.input.shape is not None and len(key.input.shape) == 4:
            for axis, what in ((0, "batch"), (2, "ctx")):
                da, db = key.input.shape[axis], index.input.shape[axis]
                if da != db:
                    r.fail(index.input_name, f"{index.input_name} dim {axis} is {_fmt_dim(db)} but "
                                             f"{key.input_name} dim {axis} is {_fmt_dim(da)}; the indexer's keys "
                                             f"share their layer's {what} axis")


#: the ranks each recurrent stem's buffers may have (contract section 12; the peer's Qwen3.5-MoE keeps a
#: ``conv_state`` of rank 4, ``[batch, 2, conv_dim / 2, kernel]``); a recurrent buffer of another stem (the peer's
#: Qwen3.5 dense names its states ``past_key``/``past_value``) has any rank of at least 2
RECURRENT_RANKS = {"conv_state": (3, 4), "recurrent_state": (4,)}


def recurrent_dims(layout: KVLayout, r) -> None:
    """A recurrent state (contract section 12) is overwritten by every token: it has no position axis, so every
    axis but the batch axis (0) is a fixed size, and its rank is one its stem allows (:data:`RECURRENT_RANKS`).
    Which buffers are recurrent follows from shapes (:attr:`KVPair.recurrent`); a layer where that is ambiguous is
    reported here. That a ``recurrent_state`` comes with its ``conv_state`` is the ``layers`` rule's."""
    if layout.kind_problem is not None:
        r.fail(None, layout.kind_problem)
    for p in layout.recurrent_pairs:
        ranks = RECURRENT_RANKS.get(p.stem)
        for t in (p.input, p.output):
            if t.shape is None:
                continue
            if (ranks is not None and len(t.shape) not in ranks) or len(t.shape) < 2:
                want = " or ".join(map(str, ranks)) if ranks else "at least 2"
                r.fail(p.input_name, f"{t.name} has rank {len(t.shape)}; a {p.stem} recurrent buffer has rank {want}")
                break
            dynamic = [(i, d) for i, d in enumerate(t.shape) if i > 0 and not isinstance(d, int)]
            if dynamic:
                i, d = dynamic[0]
                r.fail(p.input_name, f"{t.name} dim {i} is {_fmt_dim(d)}; a recurrent state has no position axis "
                                     f"(only axis 0, the batch, is dynamic)")
                break


def kv_scales(model, layout: KVLayout, r) -> None:
    """A quantized cache's scales (docs/export.md, "A quantized KV cache"): each ``past_key.{i}``/``past_value.{i}``
    of an integer dtype has the float32 initializer :func:`~qeff_kv.contract.naming.kv_scale_name` ``[1, kv_heads, 1,
    head_dim]`` (its heads and channels); without it the int8 values have no meaning. A uint8 buffer that
    GroupQueryAttention reads as its packed 4-bit cache (``kv_cache_bit_width`` 4, two values a byte) holds
    ``head_dim / 2`` bytes a head."""
    inits = model.graph.initializers
    per_byte = 2 if any(n.op_type == "GroupQueryAttention" and n.attributes.get_int("kv_cache_bit_width", 8) == 4
                        for n in model.graph) else 1
    for p in layout.pairs:
        if p.recurrent or p.input.dtype not in QUANTIZED_KV_DTYPES or p.stem not in naming.EXPORT_STEMS:
            continue
        name = naming.kv_scale_name(p.stem, p.layer)
        shape = p.input.shape
        packed = per_byte if p.input.dtype == "uint8" else 1
        want = [1, shape[1], 1, shape[3] * packed if isinstance(shape[3], int) else shape[3]] \
            if shape is not None and len(shape) == 4 else None
        scale = inits.get(name)
        if scale is None:
            r.fail(p.input_name, f"{p.input_name} is {p.input.dtype} but the graph has no initializer {name} (its "
                                 "static scales); re-export with --kv-cache-dtype int8")
            continue
        got = None if scale.shape is None else list(scale.shape.dims)
        dtype = "unknown" if scale.dtype is None else dtype_from_onnx(int(scale.dtype))
        if dtype != "float32" or got != want:
            r.fail(p.input_name, f"{name} is {dtype} {_fmt_shape(got)}, but {p.input_name} needs float32 "
                                 f"{_fmt_shape(want)} (one scale per KV head and channel)")


def _fmt_shape(s) -> str:
    return "unknown" if s is None else "[" + ", ".join(_fmt_dim(d) for d in s) + "]"
