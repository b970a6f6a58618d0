"""The *checkpoint identity* of an export: which weights it was made from, independent of the graph.

A safetensors folder (record version 2, issue 51): SHA-256 over every tensor of its files exactly as stored, read
from the files a chunk at a time (nothing converted, nothing loaded): in name order, one line per tensor of its
name, stored dtype, shape and the SHA-256 of its bytes (so each byte is hashed once, and the per-tensor digests
are what the streaming exporter merges equal tensors by). The streamed and the whole-model paths of one folder
compute it the same way, before anything is traced, so they record the same identity. The bundled model and GGUF
files (whose tensors are not safetensors) hash the loaded PyTorch model's ``state_dict`` instead (every tensor's
name, dtype, shape and bytes in name order, a tensor shared by several names counted once): unchanged since
version 1. Version 1 hashed a folder's loaded model too, converted to the compute dtype: the same folder has
another digest from version 2 on.

With the dtype the graph computes in it is recorded in the manifest (``checkpoint``) and in the graph's
``metadata_props`` (:data:`METADATA_KEY`), so that the portable, onnxruntime, fused and quantized exports of one
checkpoint accept each other's KV state files (their weight layouts differ: packed QKV, fused norms, int4 blocks),
and exports of another checkpoint do not. See ``docs/state-files.md``.

Cost: one SHA-256 pass over the checkpoint's bytes as stored (a bf16 checkpoint: half the bytes of its float32
copy, and no conversion).
"""

from __future__ import annotations

import hashlib

import numpy as np

from qeff_kv.contract.naming import CHECKPOINT_META as METADATA_KEY  # noqa: F401 (the runtime reads the same key)


#: the ``version`` of the manifest's ``checkpoint`` record (see the module docstring)
RECORD_VERSION = 2
#: (stored dtype, export dtype) pairs converted exactly and one to one: equal converted tensors are equal stored
_ONE_TO_ONE = {("BF16", "bfloat16"), ("F16", "float16"), ("F32", "float32"), ("F64", "float64"),
               ("BF16", "float32"), ("F16", "float32")}


def identity_string(weights_sha256: str, dtype: str) -> str:
    """``<weights sha256>:<compute dtype>``, the value the runtime compares."""
    return f"{weights_sha256}:{dtype}"


def weights_sha256(model, resolve=None, digests: dict | None = None) -> tuple[str, int, int]:
    """``(hex digest, tensors hashed, bytes hashed)`` of ``model.state_dict()`` (tied tensors once).

    ``resolve(name, tensor)``: the real tensor behind ``tensor`` (a streaming export's stand-in, read from the
    checkpoint one at a time; see :mod:`.stream`), else ``tensor`` itself. ``digests``: receives, per name
    hashed, a digest of the tensor's dtype, shape and bytes (equal tensors, equal digests)."""
    import torch

    state = model.state_dict(keep_vars=False)
    seen: set[tuple] = set()
    h = hashlib.sha256()
    count = nbytes = 0
    for name in sorted(state):
        t = state[name]
        if not isinstance(t, torch.Tensor):
            continue
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype) \
            if t.numel() else None
        if key is not None and key in seen:  # tied: the same memory under another name
            continue
        if key is not None:
            seen.add(key)
        header = f"|{str(t.dtype).removeprefix('torch.')}|{list(t.shape)}|"
        size = t.numel() * t.element_size()
        h.update(f"|{name}{header}".encode())
        one = hashlib.sha256(header.encode()) if digests is not None else None
        for part in _byte_parts(resolve(name, t) if resolve is not None else t):
            h.update(part)
            if one is not None:
                one.update(part)
            del part
        if one is not None:
            digests[name] = one.hexdigest()
        count += 1
        nbytes += size
    return h.hexdigest(), count, nbytes


def _byte_parts(t):
    """The bytes of ``t`` as memoryviews, in order: a tensor's own (a view, nothing copied when contiguous), or
    those of each array of an iterable of arrays (a streamed checkpoint's tensor read a few rows at a time:
    :meth:`.weights.CheckpointStore.chunks`; the same bytes, never the whole tensor at once)."""
    import torch

    if isinstance(t, torch.Tensor):
        flat = t.detach().contiguous().reshape(-1)
        if flat.numel():
            yield memoryview(flat.view(torch.uint8).numpy())
        return
    for arr in t:
        if arr.size:
            yield memoryview(arr.reshape(-1).view(np.uint8))


def checkpoint_record(model, dtype: str, resolve=None, digests: dict | None = None) -> dict:
    """What the manifest records under ``checkpoint``: the identity and its parts (``resolve``, ``digests``:
    see :func:`weights_sha256`)."""
    digest, count, nbytes = weights_sha256(model, resolve, digests)
    return {"identity": identity_string(digest, dtype), "weights_sha256": digest, "dtype": dtype,
            "tensors": count, "bytes": nbytes, "version": RECORD_VERSION, "hashed": "loaded model"}


def stored_sha256(store, step=None) -> tuple[str, int, int, dict]:
    """``(hex digest, tensors, bytes, {key: SHA-256 of its stored bytes})`` of every tensor of ``store`` (a
    :class:`.weights.checkpoint_store.CheckpointStore`) as the files hold it; ``step(nbytes)`` after each."""
    h = hashlib.sha256()
    per: dict[str, str] = {}
    nbytes = 0
    for key in sorted(store.keys()):
        one = hashlib.sha256()
        for part in store.stored_bytes(key):
            one.update(part)
        per[key] = one.hexdigest()
        h.update(f"|{key}|{store.stored_dtype(key)}|{list(store.shape(key))}|{per[key]}\n".encode())
        nbytes += store.stored_size(key)
        if step is not None:
            step(store.stored_size(key))
    return h.hexdigest(), len(per), nbytes, per


def stored_record(store, dtype: str, step=None, digests: dict | None = None) -> dict:
    """The manifest's ``checkpoint`` record of a safetensors folder (``store``): :func:`stored_sha256`.
    ``digests``: receives each key's digest."""
    digest, count, nbytes, per = stored_sha256(store, step)
    if digests is not None:
        digests.update(per)
    return {"identity": identity_string(digest, dtype), "weights_sha256": digest, "dtype": dtype,
            "tensors": count, "bytes": nbytes, "version": RECORD_VERSION, "hashed": "stored"}


def tensor_classes(store, keys, digests: dict, torch_dtype) -> dict[str, int]:
    """``key -> class`` for the checkpoint ``keys``: tensors equal as the export's ``torch_dtype`` holds them share a
    class. By their stored digests (and shapes) where that decides it (one stored dtype converted exactly and one
    to one: the same dtype, or bf16/fp16 widened to fp32), else by digests of the converted bytes (read again, a
    few rows at a time: a lossy conversion may make two stored tensors equal)."""
    keys = sorted(keys)
    name = str(torch_dtype).removeprefix("torch.")
    stored = {store.stored_dtype(k) for k in keys if k in digests}   # (a fused or renamed key: by its bytes)
    exact = len(stored) == 1 and (next(iter(stored)), name) in _ONE_TO_ONE
    out: dict[str, int] = {}
    seen: dict[tuple, int] = {}
    for key in keys:
        shape = store.shape(key)
        if exact and key in digests:
            digest = digests[key]
        else:
            one = hashlib.sha256()
            for arr in store.chunks(key, torch_dtype):
                one.update(memoryview(arr.reshape(-1).view(np.uint8)))
            digest = one.hexdigest()
        out[key] = seen.setdefault((shape, digest), len(seen))
    return out
