"""What each layer of a retained-state graph keeps between steps: one small description per layer.

A :class:`LayerState` says which buffers a layer retains (``stems``), their shapes after the batch axis (the
position axis written as its dim name), which axis holds positions, how many positions it holds (``capacity``) and
its *kind*, which says how a position maps to a slot and which positions the buffer still holds:

* ``full``: ``ctx_len`` slots, position ``p`` in slot ``p``;
* ``ring``: a sliding-window layer's ring of ``window`` slots, position ``p`` in slot ``p % capacity``
  (contract section 7);
* ``latent``: an MLA layer's compressed pair (``compressed_kv`` ``[batch, 1, ctx_len, kv_lora_rank]`` and ``k_pe``
  ``[batch, 1, ctx_len, qk_rope_head_dim]``, contract section 11): ``ctx_len`` slots, position ``p`` in slot ``p``;
* ``indexed``: a DeepSeek sparse attention layer: its pair plus the indexer's keys (``index_key``
  ``[batch, 1, ctx_len, index_head_dim]``, contract section 11): ``ctx_len`` slots each, position ``p`` in slot ``p``;
* ``recurrent``: a recurrent layer's state (``conv_state``, ``recurrent_state``, contract section 12): no position
  axis, no slots; every token overwrites it, so it is never sliced by position (``sliceable`` is false) and a
  rewind needs a checkpoint of it.

A layer may keep no state at all: a shared-KV layer (Gemma 4's ``num_kv_shared_layers``) attends over the keys and
values an earlier *source* layer wrote in the same step and has no buffer of its own. The spec records it in
:attr:`StateSpec.shared` (``(layer, source)``; in the JSON an entry ``{"layer", "kind": "shared", "source"}``), so
a graph whose layers are not ``0..N-1`` without gaps still describes every layer.

A hybrid model may keep two entries for one layer (Falcon-H1 runs attention and a Mamba2 mixer side by side): one
positional (``full``/``ring``/``latent``) and one ``recurrent``. :meth:`StateSpec.layer` returns the positional one,
:meth:`StateSpec.recurrent` the recurrent one.

The kinds are a registry (:data:`KINDS`): a latent pair (MLA's ``compressed_kv``/``k_pe``) or a recurrent state
(no position axis) is one more :class:`StateKind`, not a branch in every file that reads graphs.

The exporter writes the spec of every graph into its metadata (``qeff_kv.state_spec``, :meth:`StateSpec.dumps`);
:func:`read` returns it, or derives it from the buffer names and shapes for graphs that carry none (peer
graphs, older exports). :class:`~qeff_kv.contract.layout.KVLayout` exposes it as ``layout.state_spec``, which ``check``,
``buffers``, ``compile-config`` and the runtime's ring bookkeeping read. No torch, no onnx here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterable

from qeff_kv.contract import naming
from qeff_kv.errors import ContractError

#: graph metadata key of the spec (JSON, :meth:`StateSpec.dumps`)
META_KEY = naming.STATE_SPEC_META
Dim = "int | str | None"


class StateKind:
    """How a kind of retained state maps positions to slots. One instance per kind in :data:`KINDS`."""

    name: str = ""
    #: the symbolic name of the position axis in exported graphs (``None``: no position axis)
    dim: str | None = None
    #: whether the state can be cut by position (truncate, transfer of ``[0, n)``); recurrent state cannot
    sliceable: bool = True

    def slot(self, position: int, capacity: int) -> int:
        raise NotImplementedError

    def held(self, written: int, capacity: int) -> tuple[int, int]:
        """``[lo, hi)``: the positions a buffer of ``capacity`` slots holds after positions ``[0, written)``."""
        raise NotImplementedError


class FullKind(StateKind):
    name = "full"
    dim = naming.CTX_DIM

    def slot(self, position: int, capacity: int) -> int:
        return position

    def held(self, written: int, capacity: int) -> tuple[int, int]:
        return 0, written


class RingKind(StateKind):
    name = "ring"
    dim = naming.SLIDING_DIM

    def slot(self, position: int, capacity: int) -> int:
        return position % capacity

    def held(self, written: int, capacity: int) -> tuple[int, int]:
        return max(0, written - capacity), written


class LatentKind(FullKind):
    """MLA's compressed cache: a full-length pair of latent stems (contract section 11); slots as ``full``."""

    name = "latent"
    #: the stems of a latent layer, in graph order
    stems: tuple[str, ...] = naming.LATENT_STEMS


class IndexedKind(FullKind):
    """A DeepSeek sparse attention layer: ``past_key``, ``past_value`` and the indexer's ``index_key``, all
    full-length (contract section 11); slots as ``full``."""

    name = "indexed"
    #: the stems of an indexed layer, in graph order
    stems: tuple[str, ...] = naming.INDEXED_STEMS


class RecurrentKind(StateKind):
    """A recurrent layer's state (contract section 12): one state per sequence that every token overwrites. It has
    no slots: :meth:`slot` refuses, and :meth:`held` says the state summarises every position written."""

    name = "recurrent"
    dim = None
    sliceable = False
    #: the stems of a recurrent layer, in graph order (a short-conv layer keeps only ``conv_state``)
    stems: tuple[str, ...] = naming.RECURRENT_STEMS

    def slot(self, position: int, capacity: int) -> int:
        raise ContractError("a recurrent state has no position slots")

    def held(self, written: int, capacity: int) -> tuple[int, int]:
        return 0, written


#: kind name -> its :class:`StateKind`
KINDS: dict[str, StateKind] = {k.name: k for k in (FullKind(), RingKind(), LatentKind(), IndexedKind(),
                                                   RecurrentKind())}


@dataclass(frozen=True)
class LayerState:
    """One layer's retained state."""

    layer: int
    kind: str
    #: the layer's buffers, in graph order (``past_key``, ``past_value``)
    stems: tuple[str, ...]
    #: each buffer's shape after the batch axis, the position axis as its dim name (``(2, "ctx_len", 16)``)
    shapes: tuple[tuple, ...]
    #: the axis of the full buffer shape (batch axis included) that holds positions; ``None``: none
    position_axis: int | None = 2
    #: positions held per sequence when fixed at export (``ctx_len`` or the window); ``None``: bound at run time
    capacity: int | None = None
    #: the attention window of a sliding layer (``None``: attends to every position)
    window: int | None = None

    @property
    def state_kind(self) -> StateKind:
        return KINDS[self.kind]

    def capacity_at(self, ctx_len: int | None = None, window: int | None = None) -> int | None:
        """Positions held per sequence: the recorded capacity, else the run's ``ctx_len`` / ``window``."""
        if self.capacity is not None:
            return self.capacity
        return window if self.kind == "ring" else ctx_len

    def to_json(self) -> dict:
        d = {"layer": self.layer, "kind": self.kind, "stems": list(self.stems),
             "shapes": [list(s) for s in self.shapes], "position_axis": self.position_axis,
             "capacity": self.capacity}
        if self.window is not None:
            d["window"] = self.window
        return d

    @classmethod
    def from_json(cls, d: dict) -> "LayerState":
        try:
            state = cls(layer=int(d["layer"]), kind=str(d["kind"]), stems=tuple(str(s) for s in d["stems"]),
                        shapes=tuple(tuple(s) for s in d["shapes"]), position_axis=d.get("position_axis"),
                        capacity=d.get("capacity"), window=d.get("window"))
        except (KeyError, TypeError, ValueError) as exc:
            raise ContractError(f"graph metadata {META_KEY}: malformed layer entry ({exc})") from None
        if state.kind not in KINDS:
            raise ContractError(f"graph metadata {META_KEY}: layer {state.layer} has unknown kind {state.kind!r} "
                                f"(known: {', '.join(KINDS)})")
        return state


#: the JSON kind of a shared-KV layer's entry (no buffers; not a :class:`StateKind`: nothing to slot)
SHARED_KIND = "shared"


@dataclass(frozen=True)
class StateSpec:
    """Every layer's :class:`LayerState`, in layer order; :attr:`shared`: the layers that keep none."""

    layers: tuple[LayerState, ...]
    #: shared-KV layers, ``(layer, source)``: no buffer; attends over ``source``'s keys/values of the same step
    shared: tuple[tuple[int, int], ...] = ()

    def source_of(self, i: int) -> int | None:
        """The layer whose keys/values shared-KV layer ``i`` reads; ``None``: ``i`` is not shared."""
        return next((src for layer, src in self.shared if layer == i), None)

    def layer(self, i: int) -> LayerState | None:
        """Layer ``i``'s positional state (``full``/``ring``/``latent``); ``None`` if it keeps none."""
        return next((s for s in self.layers if s.layer == i and s.kind != "recurrent"), None)

    def recurrent(self, i: int) -> LayerState | None:
        """Layer ``i``'s recurrent state; ``None`` if it keeps none."""
        return next((s for s in self.layers if s.layer == i and s.kind == "recurrent"), None)

    @property
    def recurrent_layers(self) -> tuple[int, ...]:
        return tuple(s.layer for s in self.layers if s.kind == "recurrent")

    @property
    def has_recurrent(self) -> bool:
        return any(s.kind == "recurrent" for s in self.layers)

    @property
    def ring_layers(self) -> tuple[int, ...]:
        return tuple(s.layer for s in self.layers if s.kind == "ring")

    @property
    def has_ring(self) -> bool:
        return any(s.kind == "ring" for s in self.layers)

    @property
    def latent_layers(self) -> tuple[int, ...]:
        return tuple(s.layer for s in self.layers if s.kind == "latent")

    @property
    def indexed_layers(self) -> tuple[int, ...]:
        return tuple(s.layer for s in self.layers if s.kind == "indexed")

    def to_json(self) -> list[dict]:
        shared = [{"layer": layer, "kind": SHARED_KIND, "source": src} for layer, src in self.shared]
        return sorted([s.to_json() for s in self.layers] + shared, key=lambda d: d["layer"])

    def dumps(self) -> str:
        return json.dumps(self.to_json(), separators=(",", ":"))

    @classmethod
    def loads(cls, text: str) -> "StateSpec":
        try:
            raw = json.loads(text)
        except ValueError:
            raise ContractError(f"graph metadata {META_KEY} is not JSON") from None
        if not isinstance(raw, list):
            raise ContractError(f"graph metadata {META_KEY} must be a list of layers")
        shared = [d for d in raw if isinstance(d, dict) and d.get("kind") == SHARED_KIND]
        try:
            pairs = tuple(sorted((int(d["layer"]), int(d["source"])) for d in shared))
        except (KeyError, TypeError, ValueError) as exc:
            raise ContractError(f"graph metadata {META_KEY}: malformed shared layer entry ({exc})") from None
        states = (LayerState.from_json(d) for d in raw if not (isinstance(d, dict) and d.get("kind") == SHARED_KIND))
        return cls(tuple(sorted(states, key=_order)), shared=pairs)


def _order(state: LayerState) -> tuple[int, int]:
    """Layer order; within a layer the positional entry before the recurrent one."""
    return state.layer, int(state.kind == "recurrent")


def for_export(kv_shapes, *, window: int | None, ring_layers: Iterable[int],
               sliding_layers: Iterable[int] = (), stems: tuple[str, ...] = naming.EXPORT_STEMS,
               latent_layers: Iterable[int] = (), recurrent: dict | None = None,
               shared: Iterable[tuple[int, int]] = (),
               indexed_layers: Iterable[int] = ()) -> StateSpec:
    """The spec of a graph the exporter writes: ``kv_shapes[i]`` holds layer ``i``'s ``(heads, head_dim)`` per
    stem (``None``: the layer does not attend); ring layers keep ``window`` slots (fixed by the model), the others
    ``ctx_len`` (a symbolic axis: bound at run time, ``capacity`` ``None``); sliding layers record their window;
    latent layers (MLA's compressed cache) retain ``compressed_kv`` and ``k_pe``. ``recurrent``: layer -> the shapes
    after the batch axis of its recurrent stems (``conv_state`` ``(conv_dim, conv_kernel)``, then
    ``recurrent_state`` ``(heads, head_dim, d_state)``; a short-conv layer gives only the first): one entry of kind
    ``recurrent`` each, no position axis, all static (only the batch axis is dynamic). A parallel-hybrid layer has
    both entries. Indexed layers (DeepSeek sparse attention) retain ``index_key`` after their pair (``kv_shapes[i]``
    has a third entry). ``shared``: the ``(layer, source)`` shared-KV layers (no entry of their own)."""
    rings, sliding, latent = set(ring_layers), set(sliding_layers), set(latent_layers)
    indexed = set(indexed_layers)
    recurrent = recurrent or {}
    layers = []
    for i in range(max(len(kv_shapes), max(recurrent, default=-1) + 1)):
        shapes = kv_shapes[i] if i < len(kv_shapes) else None
        if shapes is not None:
            kind = KINDS["ring" if i in rings else "latent" if i in latent else "indexed" if i in indexed else "full"]
            layers.append(LayerState(layer=i, kind=kind.name,
                                     stems=tuple(kind.stems if i in latent or i in indexed else stems),
                                     shapes=tuple((h, kind.dim, d) for h, d in shapes), position_axis=2,
                                     capacity=int(window) if i in rings else None,
                                     window=int(window) if window and (i in sliding or i in rings) else None))
        if i in recurrent:
            rec = tuple(tuple(int(d) for d in s) for s in recurrent[i])
            layers.append(LayerState(layer=i, kind="recurrent", stems=RecurrentKind.stems[:len(rec)], shapes=rec,
                                     position_axis=None))
    return StateSpec(tuple(layers), shared=tuple(sorted((int(a), int(b)) for a, b in shared)))


def _has_position_axis(shape: tuple | None) -> bool:
    """Axis 2 of a rank-4 buffer names positions: ``ctx_len``-like or ``sliding_window`` (a symbolic axis)."""
    return (shape is not None and len(shape) == 4 and isinstance(shape[2], str)
            and (shape[2] == naming.SLIDING_DIM or "ctx" in shape[2]))


def _static_after_batch(shape: tuple | None) -> bool:
    return shape is not None and len(shape) >= 2 and all(isinstance(d, int) and not isinstance(d, bool)
                                                         for d in shape[1:])


def recurrent_buffers(pairs: Iterable[tuple[str, int, tuple | None, tuple | None]]) -> set[tuple[str, int]]:
    """The ``(stem, layer)`` buffers that are recurrent state, from shapes and axes rather than the stem alone: a
    recurrent stem, or a buffer of a positional stem with no position axis whose layer shows it is not an
    attention cache (a buffer of rank other than 4, or static rank-4 buffers whose axes 1 and 2 differ, which a
    key and value cache share: the peer's Qwen3.5 names a gated-delta-net layer's ``[batch, conv_dim, kernel]`` and
    ``[batch, heads, k, v]`` states ``past_key.{i}`` and ``past_value.{i}``). A static axis 2 that key and value
    share stays a fixed-length cache. A layer whose positional-stem buffers mix such a state with a position axis
    is refused in one line naming the buffer (:class:`~qeff_kv.errors.ContractError`)."""
    pairs = list(pairs)
    out = {(stem, layer) for stem, layer, _, _ in pairs if stem in naming.RECURRENT_STEMS}
    by_layer: dict[int, list] = {}
    for stem, layer, shape, _ in pairs:
        if stem not in naming.RECURRENT_STEMS:
            by_layer.setdefault(layer, []).append((stem, shape))
    for layer, entries in by_layer.items():
        stateful = [stem for stem, shape in entries if shape is not None and len(shape) != 4]
        static4 = [shape for _, shape in entries if _static_after_batch(shape) and len(shape) == 4]
        if not stateful and len(static4) == len(entries) > 1 and len({s[1:3] for s in static4}) > 1:
            stateful = [stem for stem, _ in entries]   # static key and value of other heads or positions: no cache
        if not stateful:
            continue
        positional = [stem for stem, shape in entries if _has_position_axis(shape)]
        loose = [stem for stem, shape in entries if not _static_after_batch(shape)
                 and not _has_position_axis(shape)]
        if positional or loose:
            bad = stateful[0]
            raise ContractError(
                f"{bad}.{layer} has shape {dict(entries)[bad]} (no position axis: a recurrent state) but "
                f"{(positional or loose)[0]}.{layer} has {dict(entries)[(positional or loose)[0]]}; cannot tell "
                f"what layer {layer} retains")
        out.update((stem, layer) for stem, _ in entries)
    return out


def derive(pairs: Iterable[tuple[str, int, tuple | None, tuple | None]], window: int | None = None) -> StateSpec:
    """The spec of a graph without one, from its KV buffers ``(stem, layer, input shape, output shape)``: a layer
    whose axis 2 is named ``sliding_window`` (input or output) is a ring of ``window`` slots (its static size when
    it has one), a layer of MLA's latent stems is ``latent``, any other attention layer is full-length (capacity: a
    static axis 2, else bound at run time); a layer's recurrent buffers (``conv_state``, ``recurrent_state``, or
    buffers of other stems that :func:`recurrent_buffers` finds have no position axis) are one more entry of kind
    ``recurrent``."""
    pairs = list(pairs)
    try:
        rec = recurrent_buffers(pairs)
    except ContractError:   # the layout reports it (KVLayout.kind_problem); by stem meanwhile
        rec = {(stem, layer) for stem, layer, _, _ in pairs if stem in naming.RECURRENT_STEMS}
    by_layer: dict[tuple[int, bool], list] = {}
    for stem, layer, shape, out_shape in pairs:
        by_layer.setdefault((layer, (stem, layer) in rec), []).append((stem, shape, out_shape))
    layers = []
    for layer, recurrent in sorted(by_layer):
        entries = sorted(by_layer[(layer, recurrent)], key=lambda e: naming.KV_STEMS.index(e[0]))
        stems = tuple(e[0] for e in entries)
        shapes = tuple(tuple(shape[1:]) if shape is not None else () for _, shape, _ in entries)
        if recurrent:
            layers.append(LayerState(layer=layer, kind="recurrent", stems=stems, shapes=shapes, position_axis=None))
            continue
        ring = any(s is not None and len(s) > 2 and s[2] == naming.SLIDING_DIM
                   for _, shape, out in entries for s in (shape, out))
        latent = not ring and any(stem in naming.LATENT_STEMS for stem, _, _ in entries)
        indexed = not ring and not latent and any(stem == naming.INDEX_STEM for stem, _, _ in entries)
        axis2 = [shape[2] for _, shape, _ in entries if shape is not None and len(shape) > 2]
        static = [d for d in axis2 if isinstance(d, int) and not isinstance(d, bool)]
        capacity = min(static) if static else None
        kind = "ring" if ring else "latent" if latent else "indexed" if indexed else "full"
        layers.append(LayerState(layer=layer, kind=kind,
                                 stems=stems, shapes=shapes, position_axis=2, capacity=capacity,
                                 window=window if ring else None))
    return StateSpec(tuple(layers))


def read(metadata: dict, pairs: Iterable[tuple[str, int, tuple | None, tuple | None]],
         window: int | None = None) -> StateSpec:
    """The graph's recorded spec (metadata ``qeff_kv.state_spec``), else :func:`derive`."""
    text = metadata.get(META_KEY)
    if text is None:
        return derive(pairs, window)
    return StateSpec.loads(text)


def mismatch(spec: StateSpec, pairs: Iterable[tuple[str, int, tuple | None, tuple | None]]) -> str | None:
    """Why a recorded spec does not describe the graph's KV buffers (layers, stems, kinds), or ``None``."""
    found = derive(pairs)
    reason = _shared_mismatch(spec, found)
    if reason is not None:
        return reason
    want_keys = [(s.layer, s.kind == "recurrent") for s in spec.layers]
    got_keys = [(s.layer, s.kind == "recurrent") for s in found.layers]
    if sorted(want_keys) != sorted(got_keys):
        return (f"graph metadata {META_KEY} describes layers {_describe(spec)}, the graph's KV buffers are of "
                f"layers {_describe(found)}")
    for want, got in zip(sorted(spec.layers, key=_order), found.layers):
        if sorted(want.stems) != sorted(got.stems):
            return (f"graph metadata {META_KEY}: layer {want.layer} retains {list(want.stems)}, the graph "
                    f"{list(got.stems)}")
        if want.kind != got.kind:
            return f"graph metadata {META_KEY}: layer {want.layer} is {want.kind}, its buffers are {got.kind}"
    return None


def _shared_mismatch(spec: StateSpec, found: StateSpec) -> str | None:
    """A shared-KV layer that has buffers, or whose source keeps no keys/values (``None``: consistent)."""
    buffered = {s.layer for s in found.layers}
    for layer, src in spec.shared:
        if layer in buffered:
            return f"graph metadata {META_KEY}: layer {layer} is shared (reads layer {src}) but has KV buffers"
        if found.layer(src) is None:
            return (f"graph metadata {META_KEY}: layer {layer} reads layer {src}'s keys/values, but layer {src} "
                    f"keeps none")
    return None


def _describe(spec: StateSpec) -> list:
    """Layer numbers, a recurrent entry written ``"i (recurrent)"`` (as ``mismatch`` reports them)."""
    return [s.layer if s.kind != "recurrent" else f"{s.layer} (recurrent)" for s in spec.layers]


def problem(metadata: dict, pairs) -> str | None:
    """What is wrong with a graph's recorded spec (not JSON, malformed, not describing its KV buffers), or
    ``None`` (valid, or none recorded)."""
    text = metadata.get(META_KEY)
    if text is None:
        return None
    pairs = list(pairs)
    try:
        spec = StateSpec.loads(text)
    except ContractError as exc:
        return str(exc)
    return mismatch(spec, pairs)
