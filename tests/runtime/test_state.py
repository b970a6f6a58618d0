"""State files: save/load identity, format, and every refusal (one line, typed).

Runs on our own graphs and on the peer's (``graphs``), each compared with its own reference tokens."""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from qeff_kv.errors import RuntimeInputError, StateFileError
from qeff_kv.runtime import Session, read_state
from qeff_kv.runtime.decoding.sampling import SamplingParams

from suite import PROMPT_A as A


def sess(graphs, name="qeff_llama_vllm.onnx", **kw):
    kw.setdefault("ctx_len", 16)
    kw.setdefault("prefill_seq_len", 8)
    return Session(graphs / name, **kw)


@pytest.fixture
def saved(graphs, tmp_path):
    s = sess(graphs)
    [g] = s.generate([A], max_new_tokens=3, stop_tokens=[])
    path = s.save_state(g.sequence, tmp_path / "kv.safetensors")
    return path


def test_file_layout(saved, graphs):
    header_len = struct.unpack("<Q", saved.read_bytes()[:8])[0]
    header = json.loads(saved.read_bytes()[8:8 + header_len])
    meta = header.pop("__metadata__")
    assert sorted(header) == ["past_key.0_VLLM", "past_key.1_VLLM", "past_value.0_VLLM", "past_value.1_VLLM"]
    for info in header.values():
        assert info["shape"] == [1, 2, 10, 16] and info["dtype"] == "F32"
    assert meta["format"] == "qeff-kv-state" and meta["format_version"] == "1"
    assert meta["prefix"] == "VLLM" and meta["num_layers"] == "2" and meta["dtype"] == "float32"
    assert meta["valid_length"] == "10" and meta["pending_token"] == str(graphs.llama_a[2])
    assert meta["pending_emitted"] == "true" and meta["selection"] == ".*VLLM.*"
    assert json.loads(meta["shapes"])["past_key.0_VLLM"] == [1, 2, 10, 16]
    assert len(meta["kv_fingerprint"]) == 64 and len(meta["checksum"]) == 64
    assert not list(saved.parent.glob(".*tmp*"))  # atomic write left no temporary file


def test_save_load_continues_exactly(graphs, saved):
    s = sess(graphs)
    seq = s.load_state(saved)
    assert seq.length == 10 and seq.pending == graphs.llama_a[2]
    [g] = s.generate([seq], max_new_tokens=5, stop_tokens=[])
    assert g.tokens == graphs.llama_a[3:8]


def test_prefill_only_state(graphs, tmp_path):
    s = sess(graphs)
    [g] = s.generate([A], max_new_tokens=0)
    assert g.tokens == [] and g.finish_reason == "prefill" and g.sequence.pending == graphs.llama_a[0]
    path = s.save_state(g.sequence, tmp_path / "p.safetensors")
    s2 = sess(graphs, "qeff_llama_cb_vllm.onnx", max_sequences=3)
    s2.add_sequence()
    seq = s2.load_state(path)  # another file of the same model and KV contract, another slot
    assert seq.slot == 1
    [g2] = s2.generate([seq], max_new_tokens=8, stop_tokens=[])
    assert g2.tokens == graphs.llama_a


def test_loaded_state_identical_bytes(graphs, saved):
    s = sess(graphs, ctx_len=32)  # a larger capacity is fine
    seq = s.load_state(saved)
    again = s.export_state(seq)
    stored = load_file(str(saved))
    for name, arr in stored.items():
        assert np.array_equal(again.tensors[name], arr)


def test_in_memory_handoff_with_serving_regex(graphs):
    pre = sess(graphs, "qeff_llama_cb_vllm.onnx", max_sequences=2)
    p = SamplingParams(temperature=1.2, top_k=40, seed=5)
    [whole] = pre.generate([A], max_new_tokens=8, sampling=p, stop_tokens=[])
    pre.remove_sequence(whole.sequence)
    [g] = pre.generate([A], max_new_tokens=0, sampling=p)
    state = pre.export_state(g.sequence, select=".*VLLM.*")
    dec = sess(graphs, "qeff_llama_cb_vllm.onnx", max_sequences=2)
    dec.add_sequence()
    seq = dec.import_state(state)
    [rest] = dec.generate([seq], max_new_tokens=8, sampling=p, stop_tokens=[])
    assert rest.tokens == whole.tokens


def test_selection_must_cover_kv_and_only_kv(graphs, tmp_path):
    s = sess(graphs, "qeff_llama_default.onnx")
    [g] = s.generate([A], max_new_tokens=1)
    with pytest.raises(RuntimeInputError, match=r"misses KV buffer 'past_value.0'"):
        s.save_state(g.sequence, tmp_path / "x.safetensors", select=r"past_key\..*")
    with pytest.raises(RuntimeInputError, match="non-KV buffers"):
        s.save_state(g.sequence, tmp_path / "x.safetensors", select=r".*")
    assert not (tmp_path / "x.safetensors").exists()
    # the legacy serving regexes (one per stem) together select it all
    path = s.save_state(g.sequence, tmp_path / "ok.safetensors", select=r"(past_key|past_value)\..*")
    assert sorted(load_file(str(path))) == ["past_key.0", "past_key.1", "past_value.0", "past_value.1"]


# ------------------------------------------------------------------------------------------- refusals
def _refused(session, path, pattern):
    before = session.cache.num_sequences
    with pytest.raises(StateFileError, match=pattern) as info:
        session.load_state(path)
    assert "\n" not in str(info.value)
    assert session.cache.num_sequences == before  # nothing was created


def test_refuses_file_from_graph_with_other_buffers(graphs, saved):
    _refused(sess(graphs, "qeff_llama_default.onnx"), saved,
             r"another KV contract .*'past_key.0_VLLM'.*prefix 'VLLM'.*prefix '\(none\)'")


def test_refuses_file_from_other_model(graphs, saved):
    _refused(sess(graphs, "qeff_qwen2_vllm.onnx"), saved, "saved from another model")


def test_refuses_truncated_file(graphs, saved, tmp_path):
    data = saved.read_bytes()
    for cut in (len(data) - 100, 40, 5):
        bad = tmp_path / f"cut{cut}.safetensors"
        bad.write_bytes(data[:cut])
        _refused(sess(graphs), bad, "truncated")


def test_refuses_edited_tensor_data(graphs, saved, tmp_path):
    data = bytearray(saved.read_bytes())
    data[-7] ^= 0x40
    bad = tmp_path / "edited.safetensors"
    bad.write_bytes(bytes(data))
    _refused(sess(graphs), bad, "checksum mismatch; the file was edited or corrupted")


def test_refuses_edited_metadata(graphs, saved, tmp_path):
    state = read_state(saved)
    meta = dict(state.metadata, pending_token="7")
    bad = tmp_path / "meta.safetensors"
    save_file(state.tensors, str(bad), metadata=meta)
    _refused(sess(graphs), bad, "checksum mismatch")


def test_refuses_state_longer_than_capacity(graphs, saved):
    _refused(sess(graphs, ctx_len=9), saved, r"holds 10 positions; this session's capacity is ctx_len=9")


def test_refuses_foreign_and_future_files(graphs, saved, tmp_path):
    other = tmp_path / "plain.safetensors"
    save_file({"past_key.0_VLLM": np.zeros((1, 2, 3, 16), np.float32)}, str(other))
    _refused(sess(graphs), other, "not a qeff-kv state file")
    state = read_state(saved)
    future = tmp_path / "v2.safetensors"
    save_file(state.tensors, str(future), metadata=dict(state.metadata, format_version="3"))
    _refused(sess(graphs), future, "format version '3'")
    _refused(sess(graphs), tmp_path / "missing.safetensors", "no such state file")


def test_failed_save_keeps_previous_file(graphs, saved):
    before = saved.read_bytes()
    s = sess(graphs)
    [g] = s.generate([A], max_new_tokens=1)
    with pytest.raises(RuntimeInputError):
        s.save_state(g.sequence, saved, select="nothing")
    assert saved.read_bytes() == before
    assert sorted(os.listdir(saved.parent)) == ["kv.safetensors"]


def test_append_to_a_loaded_sequence(graphs, saved):
    """A loaded sequence continued with more tokens: its (already emitted) pending token goes in first."""
    s = sess(graphs, ctx_len=32)
    seq = s.load_state(saved)  # A + 2 tokens in the cache, the third reference token pending and emitted
    [g] = s.generate([(seq, [9, 10])], max_new_tokens=4, stop_tokens=[])
    fresh = sess(graphs, ctx_len=32)
    [ref] = fresh.generate([A + graphs.llama_a[:3] + [9, 10]], max_new_tokens=4, stop_tokens=[])
    assert g.tokens == ref.tokens and g.sequence.length == ref.sequence.length


def test_append_after_prefill_only_replaces_unseen_token(graphs, tmp_path):
    s = sess(graphs, ctx_len=32)
    [g] = s.generate([A], max_new_tokens=0)
    path = s.save_state(g.sequence, tmp_path / "p.safetensors")
    s2 = sess(graphs, ctx_len=32)
    [cont] = s2.generate([(s2.load_state(path), [9, 10])], max_new_tokens=4, stop_tokens=[])
    [ref] = sess(graphs, ctx_len=32).generate([A + [9, 10]], max_new_tokens=4, stop_tokens=[])
    assert cont.tokens == ref.tokens
