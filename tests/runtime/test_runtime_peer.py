"""The runtime on every graph: reference tokens, chunked prefill, in-place binding, the invalid-index pass.

Tests taking ``graphs`` run on our own exports and on the peer's (QEfficient) graphs of the same names, each
compared with its own reference tokens (transformers on the same weights; the peer's README). Tests taking
``peer_dir``/``peer_graph`` are about the peer's graphs themselves (their INT32_MAX invalid indices, their
padding rows) and skip without them.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from suite import OWN_GRAPHS, PEER_GRAPHS, PROMPT_A, PROMPT_B
from qeff_kv.graph import graphio
from qeff_kv.graph.passes.ort_invalid_index import INVALID_INDEX, OrtInvalidIndexPass
from qeff_kv.runtime import Session


def _open(path, **kw):
    kw.setdefault("ctx_len", 16)
    kw.setdefault("prefill_seq_len", 8)
    if "cb" in path.name:
        kw.setdefault("max_sequences", 2)
    return Session(path, **kw)


@pytest.mark.parametrize("kind, name", [("own", n) for n in OWN_GRAPHS] + [("peer", n) for n in PEER_GRAPHS])
def test_every_graph_reproduces_reference_tokens(request, kind, name):
    """Ours (portable, onnxruntime, onnxruntime-fused; single and continuous batching) against transformers,
    the peer's against its README."""
    graphs = request.getfixturevalue(f"{kind}_graphs")
    path = graphs / name
    s = _open(path)
    assert s.inplace, s.inplace_issues
    if "cb" in name:
        gens = s.generate([PROMPT_A, PROMPT_B], max_new_tokens=8, stop_tokens=[])
        assert [g.tokens for g in gens] == [graphs.llama_a, graphs.llama_b]
        assert {g.sequence.slot for g in gens} == {0, 1}
    else:
        [g] = s.generate([PROMPT_A], max_new_tokens=8, stop_tokens=[])
        assert g.tokens == (graphs.qwen2_a if "qwen2" in name else graphs.llama_a)
        assert g.finish_reason == "length"
        assert g.sequence.length == 8 + 7  # the last token is pending, not in the cache


@pytest.mark.parametrize("chunk", [3, 5, 32])
@pytest.mark.parametrize("name", ["qeff_llama_default.onnx", "qeff_llama_cb_vllm.onnx"])
def test_padded_and_chunked_prefill_gives_reference_tokens(graphs, name, chunk):
    """Chunks of 3 and 5 leave a padded last chunk; 32 pads a single chunk (CB: where the peer's fix gives NaN)."""
    s = _open(graphs / name, prefill_seq_len=chunk)
    reqs = [PROMPT_A, PROMPT_B] if "cb" in name else [PROMPT_A]
    gens = s.generate(reqs, max_new_tokens=8, stop_tokens=[])
    assert [g.tokens for g in gens] == [graphs.llama_a, graphs.llama_b][: len(reqs)]


def test_cb_second_slot_alone(graphs):
    s = _open(graphs / "qeff_llama_cb_default.onnx", max_sequences=2)
    s.add_sequence()  # occupy slot 0, leave it empty
    [g] = s.generate([PROMPT_B], max_new_tokens=8, stop_tokens=[])
    assert g.sequence.slot == 1 and g.tokens == graphs.llama_b


def test_padding_never_fills_last_slot(graphs):
    """Padding rows (of the peer's graphs) write slot ctx_len-1: a padded chunk that also puts a real token
    there gives NaN (test_naive_padding_into_last_slot_gives_nan). The session runs that chunk unpadded instead."""
    prompt = PROMPT_A + [3]  # 9 tokens, ctx_len 9: the last real token lands in slot 8 = ctx_len-1
    s = _open(graphs / "qeff_llama_cb_vllm.onnx", ctx_len=9, prefill_seq_len=5, max_sequences=1)
    assert s._chunks(0, 9) == [(0, 5, False), (5, 4, False)]
    good = s.prefill(s.add_sequence(), prompt)
    assert np.all(np.isfinite(good))
    # A chunk is never padded past the capacity: 5 + 5 > 9, so the 3-token tail goes unpadded too ...
    s2 = _open(graphs / "qeff_llama_cb_vllm.onnx", ctx_len=9, prefill_seq_len=5, max_sequences=1)
    assert s2._chunks(0, 8) == [(0, 5, False), (5, 3, False)]
    assert np.all(np.isfinite(s2.prefill(s2.add_sequence(), PROMPT_A)))
    # ... while with room for the whole padded chunk it is padded (slot 9 stays beyond the valid length).
    s3 = _open(graphs / "qeff_llama_cb_vllm.onnx", ctx_len=10, prefill_seq_len=5, max_sequences=1)
    assert s3._chunks(0, 8) == [(0, 5, False), (5, 3, not s3._own_graph)]   # our exports run it unpadded
    assert np.all(np.isfinite(s3.prefill(s3.add_sequence(), PROMPT_A)))


def test_naive_padding_into_last_slot_gives_nan(peer_dir):
    """Why the session never pads a chunk that fills slot ctx_len-1: on the peer's graphs it gives NaN."""
    prompt = PROMPT_A + [3]
    forced = _open(peer_dir / "qeff_llama_cb_vllm.onnx", ctx_len=9, prefill_seq_len=5, max_sequences=1)
    forced._chunks = lambda start, n: [(0, 5, False), (5, 4, True)]  # what a naive runtime would do
    bad = forced.prefill(forced.add_sequence(), prompt)
    assert not np.all(np.isfinite(bad))


def test_decode_allocates_no_new_kv_buffers(graphs):
    s = _open(graphs / "qeff_llama_cb_vllm.onnx")
    values = dict(s.cache.positional.values)
    ptrs = s.kv_data_pointers()
    arrays = {n: a.__array_interface__["data"][0] for n, a in s.cache.positional.arrays.items()}
    assert ptrs == arrays  # OrtValues share the numpy memory
    events = []
    for ev in s.stream([PROMPT_A, PROMPT_B], max_new_tokens=8, stop_tokens=[]):
        events.append(ev.token)
        assert all(s.cache.positional.values[n] is v for n, v in values.items())
        assert s.kv_data_pointers() == ptrs
        out = s.bound_output_pointers()
        for p in s.layout.pairs:  # each retained output is the very buffer bound as its input
            assert out[p.output_name] == ptrs[p.input_name]
    assert len(events) == 16
    assert s.timings.decode_steps == 7


def test_invalid_index_pass_finds_constants_by_use(peer_graph):
    model = graphio.load(peer_graph)
    p = OrtInvalidIndexPass()
    result = p(model)
    if "subfn" in peer_graph.name:
        assert not result.modified  # this export already carries 0 as its invalid gather index
        return
    assert p.gather_constants == 2  # one per layer
    assert p.scatter_constants == (1 if "cb" in peer_graph.name else 0)
    assert not p.find(result.model)

    def ints(g):
        for node in g:
            if node.op_type == "Constant" and "value" in node.attributes:
                t = node.attributes["value"].value
                if t.size <= 4 and t.dtype.is_integer():
                    yield node, t.numpy()

    # every Constant still holding INT32_MAX (if any) no longer feeds anything
    for node, arr in ints(result.model.graph):
        if np.any(arr == INVALID_INDEX):
            assert not node.outputs[0].uses()
    replaced = [arr for node, arr in ints(result.model.graph) if "_ort_" in (node.name or "")]
    assert sorted(int(a) for a in replaced) == sorted([0] * p.gather_constants + [-1] * p.scatter_constants)


def test_session_never_modifies_the_users_file(peer_dir):
    path = peer_dir / "qeff_llama_cb_vllm.onnx"
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    s = _open(path)
    assert s.invalid_index_patch == {"gather": 2, "scatter": 1}
    s.generate([PROMPT_A], max_new_tokens=2)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before


def test_external_data_graph_runs(graphs, tmp_path):
    """A graph whose weights live in an external file still loads (weights resolved beside it; the peer's
    graph is also patched in memory first)."""
    import onnx

    proto = onnx.load(str(graphs / "qeff_llama_vllm.onnx"))
    out = tmp_path / "ext.onnx"
    onnx.save_model(proto, str(out), save_as_external_data=True, location="ext.data", size_threshold=0)
    assert (tmp_path / "ext.data").stat().st_size > 100_000
    s = Session(out, ctx_len=16, prefill_seq_len=8)
    [g] = s.generate([PROMPT_A], max_new_tokens=8, stop_tokens=[])
    assert g.tokens == graphs.llama_a


def test_scatter_constant_choice_matters_for_padded_cb_prefill(peer_dir, monkeypatch):
    """The peer's workaround (every INT32_MAX -> 0) scatters padding rows' NaN into slot 0 of the sequence;
    ours (-1 for the scatter constant) puts it in slot ctx_len-1, beyond the valid length."""
    import qeff_kv.graph.passes.ort_invalid_index as mod

    s = _open(peer_dir / "qeff_llama_cb_vllm.onnx")
    seq = s.add_sequence()
    assert np.all(np.isfinite(s.prefill(seq, PROMPT_A[:5])))  # 3 padding rows
    layer1 = s.cache.positional.arrays[s.layout.pairs[-1].input_name][seq.slot]
    assert np.all(np.isfinite(layer1[:, :5])) and not np.all(np.isfinite(layer1[:, 15]))

    monkeypatch.setattr(mod, "SCATTER_REPLACEMENT", 0)
    peer_fix = _open(peer_dir / "qeff_llama_cb_vllm.onnx")
    seq = peer_fix.add_sequence()
    assert not np.all(np.isfinite(peer_fix.prefill(seq, PROMPT_A[:5])))


def test_runtime_works_without_torch(graphs):
    """A serving host has no torch/transformers: block their import and run a graph."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None\n"
        "from qeff_kv.runtime import Session\n"
        f"s = Session({str(graphs / 'qeff_llama_cb_vllm.onnx')!r}, ctx_len=16, prefill_seq_len=8)\n"
        f"print(s.generate([{PROMPT_A!r}], max_new_tokens=8, stop_tokens=[])[0].tokens)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(graphs.llama_a)
