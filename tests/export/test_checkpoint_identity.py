"""The checkpoint identity of a safetensors folder, record version 2 (issue 51, qeff_kv/export/checkpoint.py): each
tensor's bytes as stored, read from the files, never converted; the same for the streamed and the whole-model
paths (tests/export/test_export_stream.py compares their manifests)."""

from __future__ import annotations

import hashlib
import json
import struct

import pytest

from suite import requires_torch

pytestmark = requires_torch


def _tiny(root, dtype):
    import torch
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    torch.manual_seed(5)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)   # values a bf16 file holds exactly
    out = root / str(dtype).removeprefix("torch.")
    model.to(dtype).save_pretrained(out)
    return out


def _by_hand(folder):
    """The version-2 digest from the file's own layout: header, then one line per tensor in name order."""
    (path,) = folder.glob("*.safetensors")
    raw = path.read_bytes()
    size = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + size])
    header.pop("__metadata__", None)
    h = hashlib.sha256()
    for name in sorted(header):
        a, b = header[name]["data_offsets"]
        one = hashlib.sha256(raw[8 + size + a:8 + size + b]).hexdigest()
        h.update(f"|{name}|{header[name]['dtype']}|{header[name]['shape']}|{one}\n".encode())
    return h.hexdigest(), len(header), sum(v["data_offsets"][1] - v["data_offsets"][0] for v in header.values())


def test_identity_hashes_the_stored_bytes(tmp_path):
    import torch

    from qeff_kv.export import checkpoint
    from qeff_kv.export.weights.checkpoint_store import CheckpointStore

    bf16, f32 = _tiny(tmp_path, torch.bfloat16), _tiny(tmp_path, torch.float32)
    rec = checkpoint.stored_record(CheckpointStore(bf16), "float32")
    digest, count, nbytes = _by_hand(bf16)
    assert rec == {"identity": f"{digest}:float32", "weights_sha256": digest, "dtype": "float32", "tensors": count,
                   "bytes": nbytes, "version": 2, "hashed": "stored"}
    # the same values stored as float32: another checkpoint (version 1 hashed both as the float32 model: equal)
    other = checkpoint.stored_record(CheckpointStore(f32), "float32")
    assert other["weights_sha256"] == _by_hand(f32)[0] != digest and other["bytes"] == 2 * nbytes
    # one stored byte changed: another identity
    (path,) = bf16.glob("*.safetensors")
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1
    path.write_bytes(bytes(raw))
    assert checkpoint.stored_record(CheckpointStore(bf16), "float32")["weights_sha256"] != digest


@pytest.mark.parametrize("dtype,converted", [("float32", False), ("float16", True)])
def test_streamed_identity_reads_without_converting(tmp_path, monkeypatch, dtype, converted):
    """The streamed load stage hashes the bytes as stored: a bf16 checkpoint exported in float32 is never converted
    (no ``chunks`` read) for the identity or the classes of equal tensors; in float16 (bf16 -> fp16 is lossy: two
    stored tensors may become equal) the classes read the converted tensors, as before."""
    import torch

    from qeff_kv.export import options as opt
    from qeff_kv.export import sources
    from qeff_kv.export.weights import stream
    from qeff_kv.export.weights.checkpoint_store import CheckpointStore

    folder = _tiny(tmp_path, torch.bfloat16)
    calls = []
    real = CheckpointStore.chunks

    def counting(self, key, dt, chunk_bytes=None):
        calls.append(key)
        return real(self, key, dt, chunk_bytes)

    monkeypatch.setattr(CheckpointStore, "chunks", counting)
    got = stream.open_streamed(sources.resolve_source(folder), opt.ExportOptions(dtype=dtype), lambda _m: None)
    assert got is not None and got.record["hashed"] == "stored"
    assert got.record["weights_sha256"] == _by_hand(folder)[0]   # the compute dtype is only the identity's suffix
    assert got.record["identity"].endswith(f":{dtype}")
    assert bool(calls) == converted
