"""The *checkpoint identity* of an export: which weights it was made from, independent of the graph.

The exporter hashes the PyTorch model's ``state_dict`` right after loading (before tracing touches anything):
SHA-256 over every tensor's name, dtype, shape and bytes, in name order, a tensor shared by several names
(tied embeddings / output head) counted once under its first name. With the dtype the graph computes in it is
recorded in the manifest (``checkpoint``) and in the graph's ``metadata_props`` (:data:`METADATA_KEY`), so that
the portable, onnxruntime, fused and quantized exports of one checkpoint accept each other's KV state files
(their weight layouts differ: packed QKV, fused norms, int4 blocks), and exports of another checkpoint do not.
See ``docs/state-files.md``.

A streamed export (:mod:`.stream`) hashes the same bytes reading each tensor from the checkpoint in turn (the
skeleton's stand-ins resolved one at a time), so both paths record the same identity.

Cost: one SHA-256 pass over the weights in memory, nothing copied (each tensor's bytes are hashed through a
view): 0.35 s for SmolLM2-135M's 538 MB in fp32 (about 1.5 GB/s on the 2-core test machine).
"""

from __future__ import annotations

import hashlib

import numpy as np

from qeff_kv.contract.naming import CHECKPOINT_META as METADATA_KEY  # noqa: F401 (the runtime reads the same key)


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
            "tensors": count, "bytes": nbytes}
