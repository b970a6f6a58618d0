"""Disaggregated prefill/decode (issue 18, part 5): the KV transfer (``qeff_kv/serve/cluster/transfer.py``) and the Ray
engine (``qeff_kv/serve/cluster/disagg.py``).

The transfer moves exactly the valid positions of the selected buffers and the decode side continues with the
tokens of one uninterrupted run (a single-host :class:`~qeff_kv.serve.engine.scheduler.Scheduler`). The Ray tests share
ONE local Ray instance (2 CPUs) for the whole test session (``ray_local``) and skip with a reason where ray does
not import.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from suite import requires_torch

pytestmark = [requires_torch]

PROMPTS = [(5, 17, 42, 99, 130, 7, 201, 64, 3, 8, 11), (250, 3, 88, 19, 160), (1, 2, 3, 4, 5, 6, 7, 8, 9)]
NEW = 6


def _request(rid, prompt, sampling=None, state=None, max_tokens=NEW):
    from qeff_kv.runtime import GREEDY
    from qeff_kv.serve.engine.engine import GenerationRequest

    return GenerationRequest(rid, tuple(prompt), max_tokens, sampling or GREEDY, frozenset(), state)


def _collect(handle, timeout=120):
    from serve_helpers import collect

    return collect(handle, timeout)


@pytest.fixture(scope="module")
def reference(own_cb_graph):
    """Tokens of a single-host Scheduler on the decode export: prompt -> (greedy tokens, seeded tokens)."""
    from qeff_kv.runtime import SamplingParams, Session
    from qeff_kv.serve.engine.scheduler import Scheduler

    sched = Scheduler(Session(own_cb_graph), reuse_prompts=False)
    try:
        out = {}
        for i, p in enumerate(PROMPTS):
            greedy = _collect(sched.submit(_request(f"g{i}", p)))[0]
            seeded = _collect(sched.submit(_request(f"s{i}", p, SamplingParams(temperature=0.9, seed=7 + i))))[0]
            out[p] = (greedy, seeded)
        return out
    finally:
        sched.close()


# ============================================================================================ transfer
def test_transfer_moves_only_the_valid_positions_and_continues_exactly(own_vllm_graph, own_cb_graph, reference):
    """Prefill on the portable export, decode on the continuous-batching one: bytes moved are the valid
    positions' bytes; the decode Scheduler continues with the tokens of a single-host run."""
    from qeff_kv.runtime import SamplingParams, Session
    from qeff_kv.serve.engine.scheduler import Scheduler
    from qeff_kv.serve.cluster.transfer import Prefiller, valid_bytes

    pre = Session(own_vllm_graph)
    prefiller = Prefiller(pre)     # one slot: a prompt run again continues the kept sequence (truncated)
    sched = Scheduler(Session(own_cb_graph), reuse_prompts=False)
    try:
        for i, p in enumerate(PROMPTS):
            for k, sampling in enumerate([None, SamplingParams(temperature=0.9, seed=7 + i)]):
                t = prefiller.run(f"r{i}", p, (sampling or SamplingParams()).resolved())
                assert t.cached_tokens == (len(p) - 1 if k else 0)
                assert sorted(t.state.tensors) == sorted(x.input_name for x in pre.layout.pairs)
                assert all(name.endswith("_VLLM") for name in t.state.tensors)
                assert {a.shape[2] for a in t.state.tensors.values()} == {len(p)}
                assert t.nbytes == sum(a.nbytes for a in t.state.tensors.values())
                assert t.nbytes == len(p) * pre.cache.bytes_per_position
                assert t.slicing == {"Name": ".*VLLM.*", "DimSpecs": ["batch_index", 0, "ctx_start", 0],
                                     "ctx_start": 0, "positions": len(p)}
                assert json.loads(t.state.metadata["tokens"]) == list(p)
                toks, fin = _collect(sched.submit(_request(f"d{i}{k}", p, sampling, state=t.state)))
                assert toks == reference[p][k]
                assert (fin.finish_reason, fin.completion_tokens) == ("length", NEW)
        assert [s.tokens for s in pre.sequences] == [list(PROMPTS[-1])]   # kept for reuse
    finally:
        sched.close()
    pre.remove_sequence(pre.sequences[0])
    seq = pre.add_sequence()
    pre.prefill(seq, PROMPTS[0])
    assert valid_bytes(pre, seq) == len(PROMPTS[0]) * pre.cache.bytes_per_position


def test_in_memory_state_is_checked_by_identity_and_never_read_as_a_file(own_vllm_graph, tmp_path):
    from safetensors.numpy import save

    from qeff_kv.errors import StateFileError
    from qeff_kv.runtime import GREEDY, Session, read_state
    from qeff_kv.runtime.memory.state_file import KVState
    from qeff_kv.serve.cluster.transfer import Prefiller, install

    sess = Session(own_vllm_graph)
    t = Prefiller(sess, reuse=False).run("r", PROMPTS[0], GREEDY)
    assert t.state.metadata["checksum"].startswith("identity:")
    seq = install(sess, t)
    assert (seq.length, seq.tokens, seq.pending) == (len(PROMPTS[0]), list(PROMPTS[0]), t.first_token)
    sess.remove_sequence(seq)
    edited = KVState(dict(t.state.tensors), dict(t.state.metadata, pending_token="3"))
    with pytest.raises(StateFileError) as exc:
        sess.import_state(edited)
    assert str(exc.value) == ("state: identity check failed; the in-memory state's tensors or metadata were "
                              "changed")
    name = sorted(t.state.tensors)[0]
    other = KVState(dict(t.state.tensors, **{name: t.state.tensors[name][:, :, :-1]}), dict(t.state.metadata))
    with pytest.raises(StateFileError, match="identity check failed"):
        sess.import_state(other)
    path = tmp_path / "x.safetensors"
    path.write_bytes(save(t.state.tensors, metadata=t.state.metadata))
    with pytest.raises(StateFileError) as exc:
        read_state(path)
    assert str(exc.value) == (f"{path}: holds an in-memory state's identity check, not a checksum; state files "
                              "are written by save_state")
    assert sess.sequences == []


def test_ring_transfer_moves_the_slots_the_rings_hold(family_exports):
    """A prompt longer than the window: each ring buffer ships its C slots, each full-length buffer n positions."""
    from families import SW
    from qeff_kv.runtime import GREEDY, Session
    from qeff_kv.serve.cluster.transfer import Prefiller, install, valid_bytes

    sess = Session(family_exports("gemma2_sw", "onnxruntime").out_dir)
    prompt = [int(t) for t in np.random.default_rng(3).integers(3, 120, size=3 * SW)]
    t = Prefiller(sess, reuse=False).run("r", prompt, GREEDY)
    rings = sess.rings.capacities
    assert rings and all(t.state.tensors[n].shape[2] == SW for n in rings)
    assert all(a.shape[2] == len(prompt) for n, a in t.state.tensors.items() if n not in rings)
    seq = sess.add_sequence()
    sess.prefill(seq, prompt)
    assert t.nbytes == valid_bytes(sess, seq) < len(prompt) * sess.cache.bytes_per_position
    sess.remove_sequence(seq)
    alone = sess.generate([prompt], max_new_tokens=NEW, stop_tokens=[])[0]
    sess.remove_sequence(alone.sequence)
    [cont] = sess.generate([install(sess, t)], max_new_tokens=NEW, stop_tokens=[])
    assert cont.tokens == alone.tokens


def test_prefill_worker_reuses_kept_prefixes(own_cb_graph):
    """Prompts sharing prefixes: the prefill worker starts each from a kept sequence (truncated, or its prefix
    copied into a free slot) and the decode side continues with the tokens of each prompt run alone."""
    from qeff_kv.runtime import GREEDY, Session
    from qeff_kv.serve.cluster.transfer import Prefiller, install

    pre, dec = Session(own_cb_graph), Session(own_cb_graph)
    prefiller = Prefiller(pre)
    base = list(PROMPTS[0])
    prompts = [base, base + [7, 8, 9], base[:5] + [60, 61], base + [7, 8, 9], [200, 201]]
    cached = []
    for i, p in enumerate(prompts):
        t = prefiller.run(f"r{i}", p, GREEDY)
        cached.append(t.cached_tokens)
        assert t.nbytes == len(p) * pre.cache.bytes_per_position
        [alone] = dec.generate([p], max_new_tokens=NEW, stop_tokens=[])
        dec.remove_sequence(alone.sequence)
        [cont] = dec.generate([install(dec, t)], max_new_tokens=NEW, stop_tokens=[])
        dec.remove_sequence(cont.sequence)
        assert cont.tokens == alone.tokens, p
    # truncate in place (extends it), copy 5 into a free slot, copy 13 into the last slot, then evict the LRU
    assert cached == [0, len(base), 5, len(base) + 2, 0]
    assert prefiller.reused_tokens == sum(cached)
    assert len(pre.sequences) == pre.max_sequences == 3


def test_pair_of_different_checkpoints_refused(own_vllm_graph, own_graphs):
    from qeff_kv.runtime import Session
    from qeff_kv.serve.cluster.transfer import facts, pair_refusal

    llama = facts(Session(own_vllm_graph))
    qwen = facts(Session(own_graphs.export("qeff_qwen2_vllm.onnx").out_dir))
    assert pair_refusal(llama, llama) is None
    why = pair_refusal(qwen, llama)
    assert why.startswith(f"prefill export {qwen['onnx']} and decode export {llama['onnx']} come from different "
                          "checkpoints (")
    assert why.endswith("); a KV state moves only between exports of one checkpoint")


# ============================================================================================ on Ray
@pytest.fixture(scope="session")
def ray_local():
    """ONE local Ray instance (2 CPUs) for the whole test session."""
    ray = pytest.importorskip("ray", reason="disaggregated serving needs the [ray] extra (ray)")
    ray.init(num_cpus=2, include_dashboard=False, logging_level="warning", log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def engines(ray_local, own_vllm_graph, own_cb_graph):
    """``get(decode_export, prefill_export)``: a DisaggregatedEngine (1 prefill + 1 decode replica), at most one
    alive at a time (its two actors take the instance's 2 CPUs)."""
    from qeff_kv.serve.config import ServeConfig
    from qeff_kv.serve.server import build_engine

    live: dict = {}

    def get(decode=None, prefill=None, **kw):
        key = (str(decode or own_cb_graph), str(prefill or own_vllm_graph), tuple(sorted(kw.items())))
        if key not in live:
            for old in live.values():
                old.close()
            live.clear()
            live[key] = build_engine(ServeConfig(key[0], prefill_export=key[1], disaggregate=True, **kw))
        return live[key]

    yield get
    for eng in live.values():
        eng.close()


def test_disaggregated_tokens_equal_a_single_host_run(engines, reference, own_vllm_graph):
    """Greedy and seeded requests, all in flight together: each gets the single-host Scheduler's tokens; the
    hand-offs moved exactly the prompts' valid positions."""
    from qeff_kv.runtime import SamplingParams, Session
    from qeff_kv.serve.cluster.disagg import DisaggregatedEngine

    eng = engines()
    assert isinstance(eng, DisaggregatedEngine) and eng.ctx_len == 64
    before = eng.stats().get("handoff_bytes", 0)
    handles = {}
    for i, p in enumerate(PROMPTS):
        handles[(p, 0)] = eng.submit(_request(f"g{i}", p))
        handles[(p, 1)] = eng.submit(_request(f"s{i}", p, SamplingParams(temperature=0.9, seed=7 + i)))
    for (p, k), h in handles.items():
        toks, fin = _collect(h)
        assert toks == reference[p][k], (p, k)
        assert (fin.finish_reason, fin.prompt_tokens, fin.completion_tokens, fin.error) == ("length", len(p), NEW,
                                                                                            None)
    stats = eng.stats()
    bpp = Session(own_vllm_graph).cache.bytes_per_position
    assert stats["handoff_bytes"] - before == 2 * sum(len(p) for p in PROMPTS) * bpp
    assert stats["queue_depth"] == stats["sequences_active"] == 0


def test_bad_requests_refused_at_submit(engines):
    from qeff_kv.errors import RuntimeInputError

    eng = engines()
    for prompt, msg in [((), "the prompt is empty"), (tuple(range(3, 70)), "the prompt has 67 tokens; the context "
                                                                           "holds 64"),
                        ((5, 256), "token id 256 is outside the vocabulary [0, 256)")]:
        with pytest.raises(RuntimeInputError) as exc:
            eng.submit(_request("x", prompt))
        assert str(exc.value) == msg
    import dataclasses

    from qeff_kv.runtime import SamplingParams

    for req in (dataclasses.replace(_request("x", PROMPTS[0]), logprobs=2),
                _request("x", PROMPTS[0], SamplingParams(presence_penalty=0.5))):
        with pytest.raises(RuntimeInputError, match="not supported with --disaggregate"):
            eng.submit(req)
    with pytest.raises(RuntimeInputError, match=r"^structured output and forced tool calls are not supported with "
                                                r"--disaggregate \(the decode replicas sample without a grammar\)$"):
        eng.submit(dataclasses.replace(_request("x", (5, 6)), constraint=object()))


def test_cancel_mid_stream_stops_the_decode_replica(engines):
    """A request cancelled while it streams ends "cancelled", and its replica stops decoding it and frees it."""
    import time

    from qeff_kv.serve.engine.engine import Finished, TokenOut

    eng = engines(ctx_len=256)
    ray = pytest.importorskip("ray")
    replica = eng.decode_actors[0]
    steps0 = ray.get(replica.stats.remote())["decode_steps"]
    h = eng.submit(_request("stop-me", PROMPTS[1], max_tokens=240))
    events = h.iter_sync(timeout=60)
    assert isinstance(next(events), TokenOut)
    h.cancel()
    rest = list(events)
    assert isinstance(rest[-1], Finished) and rest[-1].finish_reason == "cancelled"
    for _ in range(100):
        st = ray.get(replica.stats.remote())
        if st["sequences_active"] == 0:
            break
        time.sleep(0.05)
    assert st["sequences_active"] == 0
    assert st["decode_steps"] - steps0 < 200          # it did not run to its 240 tokens


def test_killed_decode_replica_fails_its_request_and_the_next_succeeds(engines, reference):
    """ray.kill on the decode replica mid-stream: that request ends with an error (no hang), Ray restarts the
    replica, and the next request gets the single-host tokens."""
    from qeff_kv.serve.engine.engine import Finished, TokenOut

    eng = engines(ctx_len=256)   # room for a long stream, so the kill lands while it runs
    ray = pytest.importorskip("ray")
    h = eng.submit(_request("long", PROMPTS[1], max_tokens=240))
    events = h.iter_sync(timeout=60)
    first = next(events)
    assert isinstance(first, TokenOut)
    ray.kill(eng.decode_actors[0], no_restart=False)
    rest = list(events)
    fin = rest[-1]
    assert isinstance(fin, Finished) and fin.finish_reason == "error", rest[-1]
    assert fin.error.startswith("decode replica failed: ") and fin.completion_tokens < 240
    toks, fin = _collect(eng.submit(_request("after", PROMPTS[0])))
    assert toks == reference[PROMPTS[0]][0] and fin.finish_reason == "length", fin
    assert eng.stats()["replica_errors"] >= 1


def test_fp32_prefill_int4_decode_pair(engines, own_vllm_graph, own_graphs, tmp_path_factory):
    """An fp32 portable prefill handing off to the int4 fused decode export of the same checkpoint."""
    from qeff_kv.export import export_model
    from qeff_kv.runtime import Session

    int4 = export_model(None, tmp_path_factory.mktemp("int4") / "int4", ctx_len=64, prefill_seq_len=8,
                        kv_cache_prefix="VLLM", target="onnxruntime-fused", weights="int4", verify=False)
    eng = engines(decode=int4.out_dir)
    alone = Session(int4.out_dir)
    same = 0
    for i, p in enumerate(PROMPTS):
        toks, fin = _collect(eng.submit(_request(f"q{i}", p)))
        assert fin.finish_reason == "length" and len(toks) == NEW
        [g] = alone.generate([list(p)], max_new_tokens=NEW, stop_tokens=[])
        alone.remove_sequence(g.sequence)
        same += toks == g.tokens
        # the first token comes from the fp32 prefill: that of the fp32 export alone
        assert toks[0] == Session(own_vllm_graph).generate([list(p)], max_new_tokens=1, stop_tokens=[])[0].tokens[0]
    print(f"fp32 prefill + int4 decode: {same}/{len(PROMPTS)} prompts give the int4 export's own tokens")


def test_pair_of_different_checkpoints_refused_at_start_up(ray_local, engines, own_graphs, own_cb_graph):
    from qeff_kv.errors import RuntimeInputError

    qwen = own_graphs.export("qeff_qwen2_vllm.onnx").out_dir
    with pytest.raises(RuntimeInputError) as exc:
        engines(prefill=qwen)
    assert str(exc.value).startswith(f"prefill export {qwen}") and f" and decode export {own_cb_graph}" in str(exc.value)
    assert "come from different checkpoints" in str(exc.value) and "\n" not in str(exc.value)
    assert ray_local.is_initialized()   # a joined instance is left running


def test_through_the_http_app(engines, own_cb_graph):
    """The OpenAI routes over the disaggregated engine answer exactly as over the single-host Scheduler, streamed
    or not; cancelling a request (the client goes away) frees it on the replica."""
    TestClient = pytest.importorskip("fastapi.testclient", reason="needs the [serve] extra").TestClient
    from qeff_kv.runtime import Session
    from qeff_kv.serve.http.app import create_app
    from qeff_kv.serve.config import ServeConfig
    from qeff_kv.serve.engine.scheduler import Scheduler
    from qeff_kv.serve.server import text_facts

    eng = engines()
    text = text_facts(ServeConfig(str(own_cb_graph)))
    local = Scheduler(Session(own_cb_graph), reuse_prompts=False, model_name=eng.model_name)
    answers = []
    try:
        for engine in (eng, local):
            with TestClient(create_app(engine, text=text)) as tc:
                got = []
                for p in PROMPTS:
                    body = {"model": eng.model_name, "prompt": list(p), "max_tokens": NEW, "temperature": 0}
                    r = tc.post("/v1/completions", json=body)
                    assert r.status_code == 200, r.text
                    got.append((r.json()["choices"][0]["text"], r.json()["usage"]))
                    with tc.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
                        chunks = [json.loads(line[6:]) for line in s.iter_lines()
                                  if line.startswith("data: ") and line != "data: [DONE]"]
                    got.append("".join(c["choices"][0]["text"] for c in chunks if c.get("choices")))
                assert tc.get("/health").status_code == 200
            answers.append(got)
    finally:
        local.close()
    assert answers[0] == answers[1]
    assert answers[0][0][1]["completion_tokens"] == NEW

    h = eng.submit(_request("gone", PROMPTS[0], max_tokens=40))
    h.cancel()                                  # at once: the prefill alone takes longer than the cancel
    toks, fin = _collect(h)
    assert fin.finish_reason == "cancelled" and fin.completion_tokens == len(toks) < 40
    stats = eng.stats()
    assert stats["queue_depth"] == stats["sequences_active"] == 0
