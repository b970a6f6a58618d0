"""The KV layout of a graph: which inputs and outputs are KV buffers, and how they pair.

Built from plain I/O descriptors (name, dtype, shape), so the same code serves an ONNX file read with
onnx_ir, an onnxruntime session, and a manifest. Names are interpreted only through :mod:`qeff_kv.contract.naming`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from qeff_kv.contract import naming, statespec
from qeff_kv.errors import ContractError

Dim = int | str | None

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

    @property
    def input_name(self) -> str:
        return self.input.name

    @property
    def output_name(self) -> str:
        return self.output.name

    @property
    def axis2(self) -> Dim:
        """Axis 2 of the KV input (the positions axis of attention KV buffers), ``None`` if unknown."""
        shape = self.input.shape
        return shape[2] if shape is not None and len(shape) > 2 else None

    @property
    def is_sliding(self) -> bool:
        """A sliding-window ring buffer: axis 2 of its input or retained output is named ``sliding_window``."""
        return any(t.shape is not None and len(t.shape) > 2 and t.shape[2] == naming.SLIDING_DIM
                   for t in (self.input, self.output))

    def capacity(self, ctx_len: int | None = None, sliding_window: int | None = None) -> int | None:
        """Positions this buffer holds per sequence (its axis 2): ``ctx_len`` for an axis named like the context
        axis (``ctx_len``...), ``sliding_window`` for an axis named ``sliding_window`` (a ring buffer), the int of
        a static axis; ``None`` when unknown (no axis 2, another name, or the value not given) or for a recurrent
        state (no position axis)."""
        if self.recurrent:
            return None
        return _dim_value(self.axis2, ctx_len, sliding_window)

    def bytes_per_sequence(self, ctx_len: int | None = None, sliding_window: int | None = None) -> int | None:
        """Bytes of one sequence's slice (all dims but the batch axis): ``ctx_len`` stands for symbolic dims
        named like the context axis, ``sliding_window`` for dims named ``sliding_window``. ``None`` if a dim is
        unknown."""
        shape = self.input.shape
        if shape is None or len(shape) < 1:
            return None
        total = itemsize(self.input.dtype)
        for d in shape[1:]:
            v = _dim_value(d, ctx_len, sliding_window)
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

    # ----------------------------------------------------------------------------------------- build
    @classmethod
    def from_io(cls, inputs: Sequence[TensorInfo], outputs: Sequence[TensorInfo],
                metadata: dict[str, str] | None = None) -> "KVLayout":
        lay = cls(list(inputs), list(outputs), metadata=dict(metadata or {}))
        in_by_name = {t.name: t for t in inputs}
        out_by_name = {t.name: t for t in outputs}
        paired_outputs: set[str] = set()
        for t in inputs:
            parsed = naming.parse_kv_name(t.name)
            if parsed is None or parsed.retained:
                continue
            out_name = naming.retained_name(t.name)
            out = out_by_name.get(out_name)
            if out is None:
                lay.unpaired_inputs.append(t.name)
                continue
            paired_outputs.add(out_name)
            lay.pairs.append(KVPair(parsed.stem, parsed.layer, parsed.prefix, t, out))
        for t in outputs:
            parsed = naming.parse_kv_name(t.name)
            if parsed is not None and parsed.retained and t.name not in paired_outputs:
                lay.unpaired_outputs.append(t.name)
        try:   # what each buffer is, from shapes and axes (a refusal is kept: check reports it, require_valid raises)
            rec = statespec.recurrent_buffers(lay.state_pairs)
        except ContractError as exc:
            rec, lay.kind_problem = set(), str(exc)
        lay.pairs = [dataclasses.replace(p, recurrent=(p.stem, p.layer) in rec) for p in lay.pairs]
        # Non-KV retained buffers, by the contract's list (never by a "past_" prefix).
        seen: set[str] = set()
        for t in list(inputs) + list(outputs):
            base = naming.non_kv_retained_base(t.name)
            if base is None or base in seen:
                continue
            seen.add(base)
            out_name = None
            for cand in (naming.retained_name(base), naming.NON_KV_OUTPUT_ALIASES.get(base)):
                if cand is not None and cand in out_by_name:
                    out_name = cand
            lay.non_kv_retained.append((base if base in in_by_name else None, out_name))  # type: ignore[arg-type]
        return lay

    # ----------------------------------------------------------------------------------------- queries
    @property
    def prefixes(self) -> list[str | None]:
        """Distinct prefixes among KV buffers (inputs and outputs), in order of first appearance."""
        out: list[str | None] = []
        for t in self.inputs + self.outputs:
            parsed = naming.parse_kv_name(t.name)
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
        """Every KV input and output name (paired or not), inputs first, in graph order."""
        return [t.name for t in self.inputs + self.outputs if naming.parse_kv_name(t.name) is not None]

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
        return [(p.stem, p.layer, p.input.shape, p.output.shape) for p in self.pairs]

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
            raise ContractError("graph has no KV buffers (no input or output named like past_key.<i>)")
        if self.unpaired_inputs:
            n = self.unpaired_inputs[0]
            raise ContractError(f"KV input {n!r} has no output {naming.retained_name(n)!r}")
        if self.unpaired_outputs:
            n = self.unpaired_outputs[0]
            raise ContractError(f"KV output {n!r} has no input {naming.retained_source(n)!r}")
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
