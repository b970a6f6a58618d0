"""A graph's weights identified independently of how its exporter laid them out: the *fiber* fingerprint.

Two exporters of one checkpoint store its weights differently: transposed (``[in, out]`` or ``[out, in]``), split by
output channels (the peer's DeepSeek splits ``q_b_proj`` into ``q_up``/``q_rope`` and ``kv_b_proj`` per head), packed
(QKV), reshaped. What survives all of these is each weight's **contraction fibers**: the vector of input weights of
one output channel (a column of a MatMul's ``B``, a row of an embedding table). The fingerprint is SHA-256 over the
sorted *set* of their hashes (each fiber hashed in its own order with its dtype), so the same weights give the same
fingerprint whatever the layout, a tied embedding counted once, and any changed weight another.

A batched weight (``[heads, a, b]`` with more than one block: a per-head block is never split further)
contributes its fibers along both of its last two axes, since one exporter may multiply by a block where the other
multiplies by its transpose (MLA's absorbed ``W_uk``). Like the sampled fingerprint, the set does not record which layer a fiber
belongs to: it tells checkpoints apart, not one checkpoint from a reordering of its layers.

Which axis is a fiber follows from the op that reads the initializer (through at most one ``Transpose``):
``MatMul`` input 1 its axis -2 (input 0: -1), ``Gemm`` ``B`` axis -1 with ``transB`` else -2 (``A`` the
converse), ``Gather`` data (axis 0, rank 2: an embedding table) axis -1. Tables gathered by positions (RoPE
``cos``/``sin`` caches: their indices do not come from ``input_ids``) are not checkpoint weights and are left out,
as is anything read otherwise and every initializer under 1024 elements (norm weights, biases). Cost: one load of
the graph and one pass over its weights, in numpy (no torch), once per session, at its first state export or at a
load that the other identities do not settle (:mod:`qeff_kv.runtime.memory.state_file`).
"""

from __future__ import annotations

import hashlib

import numpy as np
import onnx_ir as ir

MIN_ELEMENTS = 1024
_COEF = np.random.default_rng(0x51BE).integers(1, 2**63, size=1 << 16, dtype=np.uint64) | np.uint64(1)


def _reads_tokens(value: ir.Value) -> bool:
    """Whether ``value`` is computed from the graph input ``input_ids`` (an embedding lookup's indices)."""
    stack, seen = [value], set()
    while stack:
        v = stack.pop()
        if v is None or id(v) in seen:
            continue
        seen.add(id(v))
        if v.name == "input_ids" and v.producer() is None:
            return True
        node = v.producer()
        if node is not None and len(seen) < 10_000:
            stack.extend(node.inputs)
    return False


def _fiber_axis(node: ir.Node, idx: int, rank: int) -> int | None:
    if node.domain not in ("", "ai.onnx") or rank < 2:
        return None
    if node.op_type == "MatMul":
        return -2 if idx == 1 else -1
    if node.op_type == "Gemm" and idx in (0, 1):
        trans = node.attributes.get_int("transB" if idx == 1 else "transA", 0)
        return (-1 if trans else -2) if idx == 1 else (-2 if trans else -1)
    if node.op_type == "Gather" and idx == 0 and rank == 2 and node.attributes.get_int("axis", 0) == 0:
        indices = node.inputs[1] if len(node.inputs) > 1 else None
        return -1 if indices is not None and _reads_tokens(indices) else None
    return None


def _readers(value: ir.Value):
    """``(node, input index, axis permutation or None)`` of each op reading ``value``, through one Transpose."""
    for use in value.uses():
        node = use.node
        if node.op_type == "Transpose" and node.domain in ("", "ai.onnx") and node.outputs:
            perm = node.attributes.get_ints("perm", None)
            for inner in node.outputs[0].uses():
                yield inner.node, inner.idx, perm
        else:
            yield node, use.idx, None


def fiber_hashes(arr: np.ndarray, axis: int) -> np.ndarray:
    """One uint64 per fiber of ``arr`` along ``axis``: its bit patterns weighted by position, summed, mixed."""
    n = arr.shape[axis]
    if n > len(_COEF):
        return np.zeros(0, np.uint64)
    bits = np.ascontiguousarray(arr).view(f"u{arr.itemsize}").astype(np.uint64)
    h = np.tensordot(bits, _COEF[:n], axes=([axis % arr.ndim], [0])).reshape(-1)   # wraps mod 2**64
    h ^= np.uint64(arr.itemsize * 0x9E3779B97F4A7C15 % 2**64)
    h ^= h >> np.uint64(31)
    h *= np.uint64(0xBF58476D1CE4E5B9)
    return h ^ (h >> np.uint64(29))


def fingerprint(model: ir.Model) -> str:
    """The fiber fingerprint of ``model``'s weights (see the module docstring)."""
    graph = model.graph
    parts = []
    for value in graph.initializers.values():
        tensor = value.const_value
        if tensor is None or tensor.size < MIN_ELEMENTS:
            continue
        for node, idx, perm in _readers(value):
            rank = len(tensor.shape)
            axis = _fiber_axis(node, idx, rank)
            if axis is None:
                continue
            batched = rank > 2 and int(np.prod(tensor.shape[:-2])) > 1
            axes = [-2, -1] if batched else [axis]   # per-head blocks: either role (absorbed MLA swaps them)
            arr = np.asarray(tensor.numpy())
            for a in axes:
                if perm is not None:           # the reader's axis in the transposed view -> the stored axis
                    a = list(perm)[a % rank]
                parts.append(fiber_hashes(arr, a))
    if not parts:
        return ""
    return hashlib.sha256(np.unique(np.concatenate(parts)).tobytes()).hexdigest()
