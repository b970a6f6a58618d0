"""A checkpoint's tensors under the names and layouts of the parameters transformers builds: per-expert tensors
read as the fused expert parameters, renamed tensors under their new names (issue 51).

Hub MoE checkpoints (Qwen3-MoE, Mixtral, DeepSeek-style...) store one tensor per expert
(``mlp.experts.{e}.gate_proj.weight``, Mixtral's ``block_sparse_moe.experts.{e}.w1.weight``) while transformers 5
builds one stacked parameter per projection (``mlp.experts.gate_up_proj [E, 2I, H]``) and converts at load with
its conversion mapping (``transformers.conversion_mapping``: renamings, then at most one ``WeightConverter`` per
key whose ``operations`` stack the experts, ``MergeModulelist``, and join the gate and up halves,
``Concatenate``). The facts are read from transformers itself (:func:`converted_store`), not re-typed per
family: each checkpoint key is renamed by transformers' own ``rename_source_key``, and the converters' operations
are read (only the stacking and joining ones are streamed, and a lone join of several tensors such as Kimi
Linear's q/k/v convolutions; any other conversion refuses streaming, and the model loads whole as before).

:class:`ConvertedStore` answers for the model's parameter names what :class:`.checkpoint_store.CheckpointStore`
answers for the checkpoint's keys (``keys``, ``shape``, ``array``, ``chunks``): a fused parameter is assembled
from its per-expert tensors when it is read, one fused tensor at a time (never all experts of all layers), and
its ``chunks`` are one expert's slab at a time (the bytes of ``array``, in order, for the identity hash).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


class ConversionRefused(Exception):
    """The checkpoint converts to the model's parameters by an operation that is not streamed (the message)."""


@dataclass(frozen=True)
class Fused:
    """A parameter assembled from per-expert checkpoint tensors: ``parts[p][e]`` is source pattern ``p``'s
    tensor of expert ``e``; the experts are stacked on ``stack_dim`` and the patterns joined on ``cat_dim``.
    ``stack_dim`` ``None``: no experts, one tensor per pattern joined on ``cat_dim`` (Kimi Linear's q/k/v
    convolutions into one ``conv1d.weight``)."""

    parts: tuple[tuple[str, ...], ...]
    stack_dim: int | None
    cat_dim: int
    shape: tuple[int, ...]

    @property
    def inner_cat(self) -> int:
        """The joined axis in one expert's tensor."""
        return self.cat_dim if self.stack_dim is None else self.cat_dim - (self.cat_dim > self.stack_dim)


def conversion_ops(converter) -> tuple[int | None, int]:
    """``(stack_dim, cat_dim)`` of a converter whose operations are ``MergeModulelist`` then (optionally)
    ``Concatenate``, or ``(None, cat_dim)`` for a lone ``Concatenate`` of several tensors; refuses
    (:class:`ConversionRefused`) any other operation."""
    names = [type(op).__name__ for op in converter.operations]
    if names == ["Concatenate"] and len(converter.source_patterns) > 1:
        return None, int(converter.operations[0].dim)
    if names not in (["MergeModulelist"], ["MergeModulelist", "Concatenate"]):
        raise ConversionRefused(f"the checkpoint converts {converter.target_patterns[0]} by "
                                f"{' then '.join(names)}, which is not streamed")
    stack = int(converter.operations[0].dim)
    cat = int(converter.operations[1].dim) if len(names) == 2 else stack
    if len(converter.source_patterns) > 1 and cat == stack:
        raise ConversionRefused(f"the checkpoint joins {converter.target_patterns[0]} on its expert axis, "
                                "which is not streamed")
    return stack, cat


def key_map(model, checkpoint_keys, shape_of) -> tuple[dict[str, str], dict[str, Fused]]:
    """``(renamed, fused)``: model name -> the checkpoint key it reads under another name, and model name ->
    :class:`Fused` for a parameter assembled from per-expert tensors; both empty where transformers converts
    nothing. ``shape_of(key)``: a checkpoint tensor's shape."""
    from qeff_kv.export import transformers_adapter as hf

    renamer = hf.checkpoint_renamer(model)
    if renamer is None:   # no conversion mapping: the checkpoint's names are the model's
        return {}, {}
    rename, sort_key = renamer
    names = set(model.state_dict(keep_vars=True))
    renamed: dict[str, str] = {}
    groups: dict[str, tuple[object, dict[str, list[str]]]] = {}
    for key in sorted(checkpoint_keys, key=sort_key):
        target, converter, pattern = rename(key)
        if target not in names:
            continue
        if converter is None:
            if target != key:
                renamed[target] = key
            continue
        groups.setdefault(target, (converter, {}))[1].setdefault(pattern, []).append(key)
    fused = {target: _fused(target, converter, by_pattern, shape_of)
             for target, (converter, by_pattern) in groups.items()}
    return renamed, fused


def _fused(target: str, converter, by_pattern: dict[str, list[str]], shape_of) -> Fused:
    stack, cat = conversion_ops(converter)
    inner_cat = Fused((), stack, cat, ()).inner_cat
    parts = tuple(tuple(by_pattern.get(p, ())) for p in converter.source_patterns)
    shapes = [{shape_of(k) for k in keys} for keys in parts]
    counts = [len(keys) for keys in parts]
    if min(counts) == 0 or len(set(counts)) > 1 or any(len(s) != 1 for s in shapes) \
            or len({s[:inner_cat] + s[inner_cat + 1:] for (s,) in shapes}) != 1 \
            or (stack is None and counts[0] != 1):
        raise ConversionRefused(f"{target}: the checkpoint's experts do not stack (per pattern {counts} tensors "
                                f"of shapes {[sorted(s) for s in shapes]})")
    first = next(iter(shapes[0]))
    shape = list(first)
    shape[inner_cat] = sum(next(iter(s))[inner_cat] for s in shapes)
    if stack is not None:
        shape.insert(stack, counts[0])
    return Fused(parts, stack, cat, tuple(shape))


class ConvertedStore:
    """The model's view of a :class:`.checkpoint_store.CheckpointStore` (see the module docstring): the
    checkpoint's own keys, plus the model's names of renamed and fused tensors. ``live``/``max_live``/``reads``
    are the underlying store's (a fused array is counted as one tensor while alive, its parts as they are read)."""

    def __init__(self, store, renamed: dict[str, str], fused: dict[str, Fused]):
        self.inner = store
        self.renamed = renamed
        self.fused = fused

    def __getattr__(self, name):   # live, max_live, reads, folder: the underlying store's
        return getattr(self.inner, name)

    def keys(self) -> set[str]:
        return self.inner.keys() | set(self.renamed) | set(self.fused)

    def shape(self, key: str) -> tuple[int, ...]:
        if key in self.fused:
            return self.fused[key].shape
        return self.inner.shape(self.renamed.get(key, key))

    def _slab(self, f: Fused, e: int, dtype, out: np.ndarray) -> None:
        """Expert ``e``'s tensors of every pattern into ``out`` (the fused tensor indexed at ``e`` on its
        stacking axis), joined on the pattern axis."""
        inner_cat = f.inner_cat
        at = 0
        for keys in f.parts:
            part = self.inner.array(keys[e], dtype)
            index = [slice(None)] * out.ndim
            index[inner_cat] = slice(at, at + part.shape[inner_cat])
            out[tuple(index)] = part
            at += part.shape[inner_cat]
            del part

    def array(self, key: str, dtype) -> np.ndarray:
        """:meth:`.checkpoint_store.CheckpointStore.array` of a model name (a fused one assembled expert by
        expert)."""
        f = self.fused.get(key)
        if f is None:
            return self.inner.array(self.renamed.get(key, key), dtype)
        out = self.inner.hold(np.empty(f.shape, dtype=_np_dtype(dtype)))
        if f.stack_dim is None:   # one tensor per pattern, joined
            self._slab(f, 0, dtype, out)
            return out
        for e in range(f.shape[f.stack_dim]):
            self._slab(f, e, dtype, np.moveaxis(out, f.stack_dim, 0)[e])
        return out

    def chunks(self, key: str, dtype, chunk_bytes: int | None = None):
        """:meth:`.checkpoint_store.CheckpointStore.chunks` of a model name (a fused one: one expert's slab at a
        time where the experts are its first axis, else the assembled tensor)."""
        f = self.fused.get(key)
        if f is None:
            yield from self.inner.chunks(self.renamed.get(key, key), dtype, chunk_bytes)
        elif f.stack_dim != 0:
            yield self.array(key, dtype)
        else:
            alive = self.inner.hold(np.empty(0))   # counted as one tensor while iterated, as the store's chunks
            for e in range(f.shape[0]):
                slab = np.empty(f.shape[1:], dtype=_np_dtype(dtype))
                self._slab(f, e, dtype, slab)
                yield slab
            del alive


def _np_dtype(torch_dtype):
    import torch

    return torch.empty((), dtype=torch_dtype).numpy().dtype


def converted_store(store, model):
    """``store`` as the model names its parameters (:class:`ConvertedStore`), or ``store`` itself where the
    checkpoint's names are the model's. Raises :class:`ConversionRefused` for a conversion that is not streamed."""
    renamed, fused = key_map(model, store.keys(), store.shape)
    return ConvertedStore(store, renamed, fused) if renamed or fused else store
