"""An int8 KV cache (``--kv-cache-dtype int8``) in the runtime: the Session keeps int8 state, state files save and
load it exactly, and a state of another KV dtype is refused in one line."""

import numpy as np
import pytest

from families import PROMPTS
from suite import requires_torch

from qeff_kv.errors import StateFileError
from qeff_kv.runtime.session import Session

pytestmark = requires_torch


def _prefilled(onnx_path, prompt):
    session = Session(onnx_path)
    seq = session.add_sequence()
    session.prefill(seq, prompt)
    return session, seq


def test_int8_state_round_trip(int8_kv_export, tmp_path):
    session, seq = _prefilled(int8_kv_export.onnx_path, PROMPTS[0])
    state = session.export_state(seq)
    assert {str(np.asarray(t).dtype) for t in state.tensors.values()} == {"int8"}
    path = session.save_state(seq, tmp_path / "int8.kvstate")
    want = session.decode({seq: 9})[seq]
    other = Session(int8_kv_export.onnx_path)
    loaded = other.load_state(path)
    assert np.array_equal(other.decode({loaded: 9})[loaded], want)


def test_state_of_another_kv_dtype_refused(int8_kv_export, family_exports, tmp_path):
    float_export = family_exports("llama", "onnxruntime-fused")
    f_session, f_seq = _prefilled(float_export.onnx_path, PROMPTS[1])
    q_session, q_seq = _prefilled(int8_kv_export.onnx_path, PROMPTS[1])
    f_path = f_session.save_state(f_seq, tmp_path / "float.kvstate")
    q_path = q_session.save_state(q_seq, tmp_path / "int8.kvstate")
    with pytest.raises(StateFileError) as err:
        Session(int8_kv_export.onnx_path).load_state(f_path)
    assert str(err.value) == (f"{f_path}: its KV cache is float32, this graph's is int8 (set at export by --dtype "
                              f"and --kv-cache-dtype); load it into a graph whose KV cache is float32")
    with pytest.raises(StateFileError) as err:
        Session(float_export.onnx_path).load_state(q_path)
    assert str(err.value) == (f"{q_path}: its KV cache is int8, this graph's is float32 (set at export by --dtype "
                              f"and --kv-cache-dtype); load it into a graph whose KV cache is int8")


def test_int4_state_refused_by_the_int8_graph(int4_kv_export, int8_kv_export, tmp_path):
    """The packed int4 cache (uint8 buffers) saves and loads in its own graph and is refused by the int8 one."""
    session, seq = _prefilled(int4_kv_export.onnx_path, PROMPTS[0])
    path = session.save_state(seq, tmp_path / "int4.kvstate")
    want = session.decode({seq: 9})[seq]
    other = Session(int4_kv_export.onnx_path)
    loaded = other.load_state(path)
    assert np.array_equal(other.decode({loaded: 9})[loaded], want)
    with pytest.raises(StateFileError) as err:
        Session(int8_kv_export.onnx_path).load_state(path)
    assert str(err.value) == (f"{path}: its KV cache is int4, this graph's is int8 (set at export by --dtype "
                              f"and --kv-cache-dtype); load it into a graph whose KV cache is int4")


def _greedy(session, seq, logits, n: int = 6) -> list[int]:
    out = []
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = session.decode({seq: out[-1]})[seq]
    return out


def test_int8_prompt_reuse_equals_fresh_prefill(int8_kv_export):
    """Prompt reuse on an int8 cache: the kept sequence cut back to a shared prefix holds the same int8 KV as a
    fresh prefill of the prompt, and continues to the same greedy tokens."""
    from qeff_kv.runtime.memory.prefix_cache import PrefixCache

    session = Session(int8_kv_export.onnx_path)
    cache = PrefixCache(session)
    kept = cache.fresh()
    session.prefill(kept, PROMPTS[0])
    cache.release(kept)
    prompt = PROMPTS[0][:7] + [60, 61, 2]
    seq, reused = cache.acquire(prompt)
    assert reused == 7 and seq.length == 7
    logits = session.prefill(seq, prompt[reused:])
    fresh = Session(int8_kv_export.onnx_path)
    f_seq = fresh.add_sequence()
    f_logits = fresh.prefill(f_seq, prompt)
    mine, theirs = (s.export_state(q, checksum=False).tensors for s, q in ((session, seq), (fresh, f_seq)))
    assert sorted(mine) == sorted(theirs) and {str(np.asarray(t).dtype) for t in mine.values()} == {"int8"}
    assert all(np.array_equal(np.asarray(mine[k]), np.asarray(theirs[k])) for k in mine)
    tokens = _greedy(session, seq, logits)
    assert tokens == _greedy(fresh, f_seq, f_logits) and len(set(tokens)) > 1
