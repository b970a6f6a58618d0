"""An int8 KV cache (``--kv-cache-dtype int8``) in serving: a P/D hand-off between an int8-cache export and a
float-cache one is refused in one line (at start-up and at the transfer), KV events salt a quantized cache's block
hashes with its dtype (float caches keep vLLM's hashes), and the engine tells a router its cache dtype."""

import hashlib
import struct

import pytest

from families import PROMPTS
from suite import requires_torch

from qeff_kv.errors import StateFileError
from qeff_kv.serve.cluster.kv_events import BlockTable, block_hash, block_hashes

pytestmark = requires_torch


def test_transfer_between_cache_dtypes_refused(int8_kv_export, family_exports):
    from qeff_kv.runtime.session import Session
    from qeff_kv.serve.cluster import transfer

    q, f = Session(int8_kv_export.onnx_path), Session(family_exports("llama", "onnxruntime-fused").onnx_path)
    qf, ff = transfer.facts(q), transfer.facts(f)
    assert (qf["kv_dtype"], ff["kv_dtype"]) == ("int8", "float32")
    assert transfer.pair_refusal(qf, ff) == (
        f"prefill export {qf['onnx']} keeps its KV cache in int8, decode export {ff['onnx']} in float32 (set at "
        "export by --dtype and --kv-cache-dtype); a KV state moves only between exports of one cache dtype")
    assert transfer.pair_refusal(ff, qf).startswith(f"prefill export {ff['onnx']} keeps its KV cache in float32,")
    assert transfer.pair_refusal(qf, dict(qf)) is None
    seq = q.add_sequence()
    q.prefill(seq, PROMPTS[0])
    moving = transfer.extract(q, seq, "r1")
    with pytest.raises(StateFileError) as err:
        transfer.install(f, moving)
    assert str(err.value) == ("state: its KV cache is int8, this graph's is float32 (set at export by --dtype and "
                              "--kv-cache-dtype); load it into a graph whose KV cache is int8")
    back = transfer.install(Session(int8_kv_export.onnx_path), moving)   # the same dtype: accepted
    assert back.length == len(PROMPTS[0])


def _salted(tokens, dtype: str, base: bytes = b"\x00") -> int:
    """The documented first-block hash of a quantized cache, written out again."""
    head = b"\x03" + struct.pack(">I", len(dtype)) + dtype.encode("ascii") + base
    return int.from_bytes(hashlib.sha256(head + b"".join(t.to_bytes(4, "big") for t in tokens)).digest()[:8],
                          "big", signed=True)


def test_kv_events_salt_a_quantized_cache_only():
    toks = list(range(10, 18))
    plain = block_hashes(toks, 4)
    assert block_hashes(toks, 4, kv_dtype="float32") == block_hashes(toks, 4, kv_dtype="float16") == plain
    int8 = block_hashes(toks, 4, kv_dtype="int8")
    assert int8[0] == _salted(toks[:4], "int8") and int8[1] == block_hash(int8[0], toks[4:])
    assert not set(int8) & set(plain)                      # the same tokens in int8 are other blocks
    lora = ("sql", 1.0)
    lora_head = b"\x02" + struct.pack(">I", 3) + b"sql" + struct.pack(">d", 1.0)
    assert block_hashes(toks, 4, lora=lora, kv_dtype="int8")[0] == _salted(toks[:4], "int8", lora_head)
    assert block_hashes(toks, 4, lora=lora, kv_dtype="int8")[0] not in (int8[0], block_hashes(toks, 4, lora=lora)[0])
    stored = BlockTable(4, "int8").holds(1, toks)
    assert stored == [["BlockStored", int8, None, toks, 4, None, "GPU"]]
    assert BlockTable(4, "float32").holds(1, toks)[0][1] == plain


def test_engine_tells_its_cache_dtype(int8_kv_export):
    from qeff_kv.runtime.session import Session
    from qeff_kv.serve.engine.scheduler import Scheduler

    engine = Scheduler(Session(int8_kv_export.onnx_path))
    try:
        assert engine.kv_cache_dtype == "int8"
    finally:
        engine.close()
