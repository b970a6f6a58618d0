"""The KV layout of a graph: which inputs and outputs are KV buffers, and how they pair.

Built from plain I/O descriptors (name, dtype, shape), so the same code serves an ONNX file read with
onnx_ir, an onnxruntime session, and a manifest. Names are interpreted only through :mod:`qeff_kv.contract.naming`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from qeff_kv.contract import naming
from qeff_kv.contract import statespec
from qeff_kv.contract.lora import LoraGeometry
from qeff_kv.errors import ContractError

Dim = int | str | None
#: the one line every tool says of a graph whose KV buffers it cannot name
NO_KV = ("graph has no KV buffers (no input or output named like past_key.<i>, past_key_values.<i>.key or "
         "key_cache.<i>, and no inference_metadata.yaml or genai_config.json beside it that names them)")

# ONNX TensorProto element types -> numpy dtype names (the subset that occurs in decoder graphs).
_ONNX_TO_NAME = {
    1: "float32", 2: "uint8", 3: "int8", 4: "uint16", 5: "int16", 6: "int32", 7: "int64", 9: "bool",
    10: "float16", 11: "float64", 12: "uint32", 13: "uint64", 16: "bfloat16",
}
_ORT_TO_NAME = {
    "tensor(float)": "float32", "tensor(float16)": "float16", "tensor(bfloat16)": "bfloat16",
    "tensor(double)": "float64", "tensor(int64)": "int64", "tensor(int32)": "int32", "tensor(int8)": "int8",
    "tensor(uint8)": "uint8", "tensor(bool)": "bool", "tensor(int16)": "int16", "tensor(uint16)": "uint16",
}
_ITEMSIZE = {"bfloat16": 2}
#: KV dtypes of a quantized cache (``--kv-cache-dtype int8``), read through static scales (``naming.kv_scale_name``)
QUANTIZED_KV_DTYPES = ("int8", "uint8", "int4", "uint4")
#: a KV buffer's element type -> the cache dtype it holds: a uint8 KV buffer is GroupQueryAttention's packed 4-bit
#: cache (``--kv-cache-dtype int4``: two values per byte, each stored as value + 8)
_CACHE_DTYPE = {"uint8": "int4"}


def cache_dtype(dtype: str) -> str:
    """The cache dtype a KV buffer of element type ``dtype`` holds (``uint8`` -> ``int4``; others as they are)."""
    return _CACHE_DTYPE.get(dtype, dtype)


def dtype_from_onnx(elem_type: int) -> str:
    return _ONNX_TO_NAME.get(int(elem_type), f"onnx:{int(elem_type)}")


def dtype_from_ort(type_str: str) -> str:
    return _ORT_TO_NAME.get(type_str, type_str)


def itemsize(dtype: str) -> int:
    if dtype in _ITEMSIZE:
        return _ITEMSIZE[dtype]
    return np.dtype(dtype).itemsize


@dataclass(frozen=True)
class TensorInfo:
    """One graph input or output: name, dtype name (numpy spelling) and shape (ints, dim names or None)."""

    name: str
    dtype: str
    shape: tuple[Dim, ...] | None

    def to_json(self) -> dict:
        return {"name": self.name, "dtype": self.dtype,
                "shape": None if self.shape is None else list(self.shape)}


@dataclass(frozen=True)
class KVPair:
    """A KV buffer: its graph input and the output retained against it."""

    stem: str
    layer: int
    prefix: str | None
    input: TensorInfo
    output: TensorInfo
    #: recurrent state (no position axis), from its shapes and its layer's, not its stem alone
    #: (:func:`qeff_kv.contract.statespec.recurrent_buffers`)
    recurrent: bool = False
    #: the dialect its names are spelled in (:data:`qeff_kv.contract.naming.DIALECTS`); ``None``: names that only a
    #: metadata sidecar beside the graph declares
    dialect: str | None = naming.RETAINED_STATE

    @property
    def input_name(self) -> str:
        return self.input.name

    @property
    def output_name(self) -> str:
        return self.output.name

    @property
    def packed(self) -> bool:
        """A static cache's rank-3 ``[batch, capacity, heads*head_dim]`` buffer (positions on axis 1): the same
        memory as ``[batch, 1, capacity, heads*head_dim]``, which is how everything else sees it
        (:meth:`view_shape`)."""
        return self.input.shape is not None and len(self.input.shape) == 3 and self.dialect == naming.STATIC_CACHE

    @property
    def seq_axis(self) -> int:
        """The graph's positions axis of this buffer: 1 for a :attr:`packed` static cache, else 2."""
        return 1 if self.packed else 2

    def view_shape(self, shape: tuple[Dim, ...] | None) -> tuple[Dim, ...] | None:
        """``shape`` (the input's or the output's) as ``[batch, heads, positions, head_dim]``: a packed buffer gets a
        head axis of 1; any other shape is as the graph writes it."""
        if self.packed and shape is not None and len(shape) == 3:
            return (shape[0], 1, shape[1], shape[2])
        return shape

    @property
    def axis2(self) -> Dim:
        """The positions axis of the KV input (axis 2; axis 1 of a packed static cache), ``None`` if unknown."""
        shape = self.view_shape(self.input.shape)
        return shape[2] if shape is not None and len(shape) > 2 else None

    @property
    def is_sliding(self) -> bool:
        """A sliding-window ring buffer: the positions axis of its input or output is named ``sliding_window``."""
        return any(t is not None and len(t) > 2 and t[2] == naming.SLIDING_DIM
                   for t in (self.view_shape(self.input.shape), self.view_shape(self.output.shape)))

    def capacity(self, ctx_len: int | None = None, sliding_window: int | None = None) -> int | None:
        """Positions this buffer holds per sequence (its axis 2): ``ctx_len`` for an axis named like the context
        axis (``ctx_len``...), ``sliding_window`` for an axis named ``sliding_window`` (a ring buffer), the int of
        a static axis; ``None`` when unknown (no axis 2, another name, or the value not given) or for a recurrent
        state (no position axis)."""
        if self.recurrent:
            return None
        if self.grows:   # the runtime keeps a growing past in buffers of ctx_len positions
            return ctx_len
        return _dim_value(self.axis2, ctx_len, sliding_window)

    @property
    def grows(self) -> bool:
        """A past/present pair whose output has more positions than its input (present = concat(past, new))."""
        a, b = self.input.shape, self.output.shape
        return (self.dialect == naming.PAST_PRESENT and a is not None and b is not None and len(a) > 2
                and len(b) > 2 and a[2] != b[2])

    def bytes_per_sequence(self, ctx_len: int | None = None, sliding_window: int | None = None) -> int | None:
        """Bytes of one sequence's slice (all dims but the batch axis): ``ctx_len`` stands for symbolic dims
        named like the context axis (and a growing pair's positions axis), ``sliding_window`` for dims named
        ``sliding_window``. ``None`` if a dim is unknown."""
        shape = self.input.shape
        if shape is None or len(shape) < 1:
            return None
        total = itemsize(self.input.dtype)
        for i, d in enumerate(shape[1:], start=1):
            v = ctx_len if self.grows and i == 2 else _dim_value(d, ctx_len, sliding_window)
            if v is None:
                return None
            total *= v
        return total

    def to_json(self, ctx_len: int | None = None, sliding_window: int | None = None) -> dict:
        return {
            "layer": self.layer, "kind": self.stem, "input": self.input_name, "retained": self.output_name,
            "dtype": self.input.dtype, "shape": None if self.input.shape is None else list(self.input.shape),
            "capacity": self.capacity(ctx_len, sliding_window),
            "bytes_per_sequence": self.bytes_per_sequence(ctx_len, sliding_window),
        }


def _dim_value(d: Dim, ctx_len: int | None, sliding_window: int | None) -> int | None:
    if isinstance(d, int) and not isinstance(d, bool):
        return d
    if isinstance(d, str):
        if d == naming.SLIDING_DIM:
            return sliding_window
        if "ctx" in d:
            return ctx_len
    return None


def parse_sliding_window(value: object) -> int | None:
    """The window of graph metadata ``qeff_kv.sliding_window`` (a decimal string of a positive int), else
    ``None`` (absent or not a positive integer: ``check`` reports the latter)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value if value > 0 else None
    if not isinstance(value, str):
        return None
    text = value.strip()
    if not text.isascii() or not text.isdigit():
        return None
    v = int(text)
    return v if v > 0 else None


@dataclass
class KVLayout:
    """What the naming contract makes of a graph's inputs and outputs.

    Tolerant: it records problems (unpaired buffers, mixed prefixes) instead of raising, so ``check`` can
    report them. :meth:`require_valid` raises the first problem as a :class:`ContractError`.
    """

    inputs: list[TensorInfo]
    outputs: list[TensorInfo]
    pairs: list[KVPair] = field(default_factory=list)
    unpaired_inputs: list[str] = field(default_factory=list)
    unpaired_outputs: list[str] = field(default_factory=list)
    non_kv_retained: list[tuple[str, str | None]] = field(default_factory=list)  # (input, output) by name
    #: the graph's ``metadata_props`` (empty when built from a session or a manifest)
    metadata: dict[str, str] = field(default_factory=dict)
    #: retained outputs whose exporter-made symbolic dims nothing matched to the inputs: name -> axes
    #: (:mod:`qeff_kv.graph.madeup_dims`; empty when built from a session or a manifest)
    made_up: dict[str, tuple[int, ...]] = field(default_factory=dict)
    #: why the buffers' kinds cannot be told from their shapes (:func:`qeff_kv.contract.statespec.recurrent_buffers`), or None
    kind_problem: str | None = None
    #: ports a sidecar declares that the graph does not have
    declared_missing: list[str] = field(default_factory=list)
    #: where the pairs came from: ``names`` (a dialect's names, :mod:`qeff_kv.contract.naming`), or the sidecar file
    #: that declared them (``inference_metadata.yaml``, ``genai_config.json``)
    source: str = "names"
    #: the dialects the KV names are spelled in, in order of first appearance (more than one: ``check`` fails it)
    dialects: list[str] = field(default_factory=list)

    # ----------------------------------------------------------------------------------------- build
    @classmethod
    def from_io(cls, inputs: Sequence[TensorInfo], outputs: Sequence[TensorInfo],
                metadata: dict[str, str] | None = None, *, declared: Sequence[tuple[str, str, str, int]] | None = None,
                source: str | None = None) -> "KVLayout":
        """The layout of a graph with ``inputs`` and ``outputs``. Its KV pairs come from the names of any dialect;
        a graph whose names are no dialect's takes ``declared`` pairs ``(input, output, stem, layer)`` that a
        metadata sidecar ``source`` names (a declared port the graph lacks is left unpaired)."""
        lay = cls(list(inputs), list(outputs), metadata=dict(metadata or {}))
        out_by_name = {t.name: t for t in outputs}
        paired_outputs: set[str] = set()
        for t in inputs:
            parsed = naming.parse_any_kv_name(t.name)
            if parsed is None or parsed.retained:
                continue
            if parsed.dialect not in lay.dialects:
                lay.dialects.append(parsed.dialect)
            out = out_by_name.get(parsed.output)
            if out is None:
                lay.unpaired_inputs.append(t.name)
                continue
            paired_outputs.add(parsed.output)
            lay.pairs.append(KVPair(parsed.stem, parsed.layer, parsed.prefix, t, out, dialect=parsed.dialect))
        for t in outputs:
            parsed = naming.parse_any_kv_name(t.name)
            if parsed is not None and parsed.retained and t.name not in paired_outputs:
                lay.unpaired_outputs.append(t.name)
                if parsed.dialect not in lay.dialects:
                    lay.dialects.append(parsed.dialect)
        if not lay.kv_names and declared:
            lay._declare(declared, source or "sidecar")
        try:   # what each buffer is, from shapes and axes (a refusal is kept: check reports it, require_valid raises)
            rec = statespec.recurrent_buffers(lay.state_pairs)
        except ContractError as exc:
            rec, lay.kind_problem = set(), str(exc)
        lay.pairs = [dataclasses.replace(p, recurrent=(p.stem, p.layer) in rec) for p in lay.pairs]
        lay._non_kv(inputs, out_by_name)
        return lay

    def _declare(self, declared: Sequence[tuple[str, str, str, int]], source: str) -> None:
        """The pairs a sidecar declares, on names no dialect spells."""
        self.source = source
        in_by_name = {t.name: t for t in self.inputs}
        out_by_name = {t.name: t for t in self.outputs}
        for inp, out, stem, layer in declared:
            if inp in in_by_name and out in out_by_name:
                self.pairs.append(KVPair(stem, int(layer), None, in_by_name[inp], out_by_name[out], dialect=None))
                continue
            self.declared_missing.extend(n for n, have in ((inp, in_by_name), (out, out_by_name)) if n not in have)
            if inp in in_by_name:
                self.unpaired_inputs.append(inp)
            if out in out_by_name:
                self.unpaired_outputs.append(out)

    def _non_kv(self, inputs: Sequence[TensorInfo], out_by_name: dict[str, TensorInfo]) -> None:
        """Non-KV retained buffers, by the contract's list (never by a "past_" prefix)."""
        in_by_name = {t.name: t for t in inputs}
        seen: set[str] = set()
        for t in list(inputs) + list(out_by_name.values()):
            base = naming.non_kv_retained_base(t.name)
            if base is None or base in seen:
                continue
            seen.add(base)
            out_name = None
            for cand in (naming.retained_name(base), naming.NON_KV_OUTPUT_ALIASES.get(base)):
                if cand is not None and cand in out_by_name:
                    out_name = cand
            self.non_kv_retained.append((base if base in in_by_name else None, out_name))  # type: ignore[arg-type]

    # ----------------------------------------------------------------------------------------- queries
    @property
    def lora(self) -> "LoraGeometry | None":
        """The graph's LoRA adapter inputs (:mod:`qeff_kv.contract.lora`), ``None`` without."""
        return LoraGeometry.from_io(self.inputs, self.metadata)

    @property
    def prefixes(self) -> list[str | None]:
        """Distinct prefixes among KV buffers (inputs and outputs), in order of first appearance."""
        out: list[str | None] = []
        for t in self.inputs + self.outputs:
            parsed = naming.parse_any_kv_name(t.name)
            if parsed is not None and parsed.prefix not in out:
                out.append(parsed.prefix)
        return out

    @property
    def prefix(self) -> str | None:
        """The single prefix of the graph's KV buffers (``None`` if unprefixed). Raises if mixed."""
        ps = self.prefixes
        if len(ps) > 1:
            raise ContractError(f"KV buffers carry mixed prefixes: {_fmt_prefixes(ps)}")
        return ps[0] if ps else None

    @property
    def kv_names(self) -> list[str]:
        """Every KV input and output name (paired or not; any dialect's, or a sidecar's), inputs first, in graph
        order."""
        declared = set(self.unpaired_inputs + self.unpaired_outputs) | {
            n for p in self.pairs for n in (p.input_name, p.output_name)} if self.source != "names" else set()
        return [t.name for t in self.inputs + self.outputs
                if t.name in declared or naming.parse_any_kv_name(t.name) is not None]

    @property
    def dialect(self) -> str | None:
        """The dialect the KV names are spelled in (the first, when mixed: ``check`` fails that); ``None`` without
        KV buffers, or for names only a sidecar declares."""
        return self.dialects[0] if self.dialects else None

    @property
    def quantized_kv(self) -> str | None:
        """The dtype of a quantized KV cache (``int8``, ``int4``: :data:`QUANTIZED_KV_DTYPES`, :func:`cache_dtype`),
        else ``None``."""
        return next((cache_dtype(p.input.dtype) for p in self.pairs
                     if not p.recurrent and p.input.dtype in QUANTIZED_KV_DTYPES), None)

    @property
    def kv_dtype(self) -> str | None:
        """The KV cache's dtype: :attr:`quantized_kv`, else the first position-cut buffer's (``float32``...); None
        without one (what a router and the two sides of a hand-off compare)."""
        return self.quantized_kv or next((p.input.dtype for p in self.pairs if not p.recurrent), None)

    @property
    def grows(self) -> bool:
        """A past/present graph whose outputs grow by concatenation (``present`` has more positions than ``past``:
        not retained state); a shared-buffer one keeps the same positions axis."""
        return any(p.grows for p in self.pairs)

    @property
    def update(self) -> str | None:
        """How the graph updates its cache: ``in-place`` (retained state), ``shared-buffer`` (past/present on one
        fixed buffer), ``grows`` (past/present by concatenation), ``indexed-scatter`` (a static cache written by
        ``TensorScatter``), ``declared`` (a sidecar's ports); ``None`` without KV buffers."""
        if not self.pairs:
            return None
        if self.dialect is None:
            return "declared"
        if self.dialect == naming.PAST_PRESENT:
            return "grows" if self.grows else "shared-buffer"
        return "indexed-scatter" if self.dialect == naming.STATIC_CACHE else "in-place"

    def output_for(self, input_name: str) -> str | None:
        """The output a KV input pairs with, by its dialect's rule (``None``: not a KV input name)."""
        parsed = naming.parse_any_kv_name(input_name)
        return None if parsed is None or parsed.retained else parsed.output

    def input_for(self, output_name: str) -> str | None:
        """The input a KV output pairs with, by its dialect's rule (``None``: not a KV output name)."""
        parsed = naming.parse_any_kv_name(output_name)
        return None if parsed is None or not parsed.retained else parsed.base

    @property
    def io_names(self) -> list[str]:
        return [t.name for t in self.inputs] + [t.name for t in self.outputs]

    @property
    def num_layers(self) -> int:
        return len({p.layer for p in self.pairs})

    @property
    def stems(self) -> list[str]:
        return sorted({p.stem for p in self.pairs}, key=naming.KV_STEMS.index)

    @property
    def state_spec(self) -> statespec.StateSpec:
        """What each layer retains (:mod:`qeff_kv.contract.statespec`): the graph metadata's spec, else derived from the
        buffers' names and shapes (a KV axis 2 named ``sliding_window`` is a ring). A recorded spec that is
        malformed or does not describe the buffers is ignored here (``check`` reports it)."""
        pairs = self.state_pairs
        if statespec.problem(self.metadata, pairs) is not None:
            return statespec.derive(pairs, self.sliding_window)
        return statespec.read(self.metadata, pairs, self.sliding_window)

    @property
    def state_pairs(self) -> list[tuple]:
        """``(stem, layer, input shape, output shape)`` of every KV pair: what :mod:`qeff_kv.contract.statespec` reads."""
        return [(p.stem, p.layer, p.view_shape(p.input.shape), p.view_shape(p.output.shape)) for p in self.pairs]

    @property
    def has_sliding(self) -> bool:
        """Whether some layer keeps a sliding-window ring buffer (its state spec's kind is ``ring``)."""
        return self.state_spec.has_ring

    @property
    def sliding_layers(self) -> list[int]:
        """Layers with a sliding-window ring buffer, ascending."""
        return list(self.state_spec.ring_layers)

    @property
    def sliding_window_meta(self) -> str | None:
        """The raw graph metadata ``qeff_kv.sliding_window`` (``None`` if absent)."""
        return self.metadata.get(naming.SLIDING_WINDOW_META)

    @property
    def sliding_window(self) -> int | None:
        """``W`` from graph metadata ``qeff_kv.sliding_window`` when it is a positive int, else ``None``."""
        return parse_sliding_window(self.sliding_window_meta)

    @property
    def speculative(self) -> bool:
        """The graph takes ``num_logits_to_keep``: a speculative-decoding ("target language model") graph whose
        steps return the logits of that many last rows."""
        return self.input(naming.LOGITS_TO_KEEP_INPUT) is not None

    @property
    def speculative_tokens(self) -> int | None:
        """``K`` from graph metadata ``qeff_kv.speculative_tokens`` (decode steps of up to ``K+1`` tokens) when it
        is a positive int on a speculative graph, else ``None``."""
        meta = self.metadata.get(naming.SPECULATIVE_META)
        return int(meta) if self.speculative and meta is not None and meta.isdigit() and int(meta) > 0 else None

    @property
    def state_kinds(self) -> dict[tuple[str, int], str]:
        """``(stem, layer)`` -> the state kind of that buffer (``full``, ``ring``, ``latent``, ``recurrent``), from
        :attr:`state_spec`: what ``buffers``, ``check``, ``compile-config`` and the runtime all read."""
        return {(stem, s.layer): s.kind for s in self.state_spec.layers for stem in s.stems}

    @property
    def recurrent_pairs(self) -> list[KVPair]:
        """The pairs that hold recurrent state (no position axis), in graph order."""
        return [p for p in self.pairs if p.recurrent]

    def pair(self, stem: str, layer: int) -> KVPair:
        for p in self.pairs:
            if p.stem == stem and p.layer == layer:
                return p
        raise KeyError((stem, layer))

    def input(self, name: str) -> TensorInfo | None:
        return next((t for t in self.inputs if t.name == name), None)

    def output(self, name: str) -> TensorInfo | None:
        return next((t for t in self.outputs if t.name == name), None)

    def require_valid(self) -> "KVLayout":
        """Raise :class:`ContractError` unless the graph has KV buffers, all paired, with one prefix."""
        if not self.kv_names:
            raise ContractError(NO_KV)
        if len(self.dialects) > 1:
            raise ContractError(f"KV buffers mix dialects ({', '.join(self.dialects)}); one graph speaks one")
        if self.declared_missing:
            raise ContractError(f"{self.source} names port {self.declared_missing[0]!r}, which the graph does not have")
        if self.unpaired_inputs:
            n = self.unpaired_inputs[0]
            raise ContractError(f"KV input {n!r} has no output {self.output_for(n)!r}")
        if self.unpaired_outputs:
            n = self.unpaired_outputs[0]
            raise ContractError(f"KV output {n!r} has no input {self.input_for(n)!r}")
        _ = self.prefix
        if self.kind_problem is not None:
            raise ContractError(self.kind_problem)
        return self

    def to_json(self, ctx_len: int | None = None, sliding_window: int | None = None) -> dict:
        """``sliding_window`` defaults to the graph metadata's window; each pair carries its ``state`` kind."""
        if sliding_window is None:
            sliding_window = self.sliding_window
        kinds = self.state_kinds
        return {
            "prefix": self.prefix if len(self.prefixes) <= 1 else None,
            "num_layers": self.num_layers,
            "pairs": [{**p.to_json(ctx_len, sliding_window), "state": kinds.get((p.stem, p.layer))}
                      for p in sorted(self.pairs, key=lambda p: (p.layer, naming.KV_STEMS.index(p.stem)))],
            "non_kv_retained": [{"input": i, "retained": o} for i, o in self.non_kv_retained],
        }


def _fmt_prefixes(ps: Iterable[str | None]) -> str:
    return ", ".join("(none)" if p is None else repr(p) for p in ps)
