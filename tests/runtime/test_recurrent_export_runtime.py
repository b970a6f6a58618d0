"""Recurrent memory on a real hybrid export: a tiny seeded Bamba (layers 0 and 2 run the Mamba2 mixer and keep
``conv_state``/``recurrent_state``, layer 1 attends), exported once with continuous batching. The session's tokens
equal transformers'; a rewind to a checkpoint equals a fresh run to that point (state bytes and tokens) and is
refused elsewhere; copy-then-diverge equals independent runs; a state file and the hand-off continue exactly; the
scheduler reuses a prompt up to a checkpoint.
"""

from __future__ import annotations

import pytest

from suite import requires_torch

pytestmark = [requires_torch]

PROMPT = [5, 17, 42, 99, 7, 3, 11, 23, 64, 12, 90, 31, 8]   # 13 tokens, chunks of 8


@pytest.fixture(scope="module")
def bamba(tmp_path_factory):
    """(model folder, export folder)."""
    import torch
    import transformers

    from qeff_kv.export import export_model

    root = tmp_path_factory.mktemp("bamba")
    cfg = transformers.BambaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1,
        mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16, max_position_embeddings=128,
        initializer_range=0.15, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    cfg.architectures = ["BambaForCausalLM"]
    torch.manual_seed(0)
    transformers.BambaForCausalLM(cfg).eval().save_pretrained(root / "tiny-bamba", safe_serialization=True)
    res = export_model(str(root / "tiny-bamba"), root / "export", ctx_len=64, prefill_seq_len=8,
                       continuous_batching=True, full_batch_size=3)
    return root / "tiny-bamba", res.out_dir


def _session(export, **kw):
    from qeff_kv.runtime import Session

    return Session(export, **{"checkpoint_every": 8, "max_checkpoints": 4, **kw})


def _state(s, seq):
    rec = {n: a[seq.slot].tobytes() for n, a in s.cache.recurrent.arrays.items()}
    kv = {n: a[seq.slot, :, :seq.length].tobytes() for n, a in s.cache.positional.arrays.items()}
    return rec, kv


def _gen(s, prompt, n):
    [g] = s.generate([list(prompt)], max_new_tokens=n, stop_tokens=[])
    return g


def test_session_runs_the_hybrid_export_with_checkpoints(bamba):
    from hf_models import hf_greedy

    model, export = bamba
    s = _session(export)
    assert s.recurrent and s.inplace
    assert list(s.cache.recurrent.shapes) == ["conv_state.0", "recurrent_state.0", "conv_state.2", "recurrent_state.2"]
    assert list(s.cache.positional.arrays) == ["past_key.1", "past_value.1"]
    g = _gen(s, PROMPT, 10)
    assert g.tokens == hf_greedy(model, PROMPT, 10)
    assert s.rewind_points(g.sequence) == [0, 8, 12, 13, 16, 22]
    one = (128 + 2 * 8) * 4 + 8 * 16 * 8   # conv_state [conv_dim, 4] + recurrent_state [8, 16, 8] per mixer layer
    assert s.memory()["checkpoint_bytes"] == 2 * one * 4
    assert s.memory()["per_sequence"][g.sequence.id]["bytes"] == 4 * 2 * one * 4


def test_rewind_copy_and_refusal_on_the_export(bamba):
    from qeff_kv.errors import RewindError

    _, export = bamba
    s = _session(export)
    g = _gen(s, PROMPT, 10)
    seq = g.sequence
    generated = seq.tokens[len(PROMPT):]
    with pytest.raises(RewindError, match=r"^cannot rewind sequence 0 to 10 positions: its recurrent state has no "
                                          r"checkpoint there; it can return to 0, 8, 12, 13, 16 or 22$"):
        s.truncate(seq, 10)
    # fork at the checkpoint of the prompt's end, then diverge
    fork = s.add_sequence()
    s.copy(seq, fork, 13)
    ref = s.add_sequence()
    s.prefill(ref, PROMPT)
    assert _state(s, fork) == _state(s, ref)
    s.remove_sequence(ref)
    # rewind to the checkpoint at 16 (taken while decoding): a fresh run to 16 by the same calls
    s.truncate(seq, 16)
    ref = s.add_sequence()
    s.prefill(ref, PROMPT)
    for t in generated[:3]:
        s.decode({ref: t})
    assert _state(s, seq) == _state(s, ref)
    a, b, c = s.generate([(seq, [70, 71]), (ref, [70, 71]), (fork, [33])], max_new_tokens=6, stop_tokens=[])
    assert a.tokens == b.tokens
    alone = _session(export, max_sequences=1)
    x = alone.add_sequence()
    alone.prefill(x, PROMPT)
    [r] = alone.generate([(x, [33])], max_new_tokens=6, stop_tokens=[])
    assert c.tokens == r.tokens


def test_state_file_and_handoff_on_the_export(bamba, tmp_path):
    from qeff_kv.runtime import SamplingParams
    from qeff_kv.serve.cluster import transfer

    _, export = bamba
    a = _session(export, max_sequences=1)
    g = _gen(a, PROMPT, 5)
    path = a.save_state(g.sequence, tmp_path / "s.safetensors")
    b = _session(export, max_sequences=1)
    seq = b.load_state(path)
    assert _state(b, seq) == _state(a, g.sequence)
    assert b.rewind_points(seq) == a.rewind_points(g.sequence) == [0, 8, 12, 13, 16, 17]
    [x] = b.generate([seq], max_new_tokens=5, stop_tokens=[])
    [y] = a.generate([g.sequence], max_new_tokens=5, stop_tokens=[])
    assert x.tokens == y.tokens
    pre = transfer.Prefiller(_session(export, max_sequences=2))
    t = pre.run("r", PROMPT, SamplingParams())
    assert [s["DimSpecs"] for s in t.slicing["Specs"]] == [
        ["batch_index", 0, 0], ["batch_index", 0, 0, 0], ["batch_index", 0, "ctx_start", 0],
        ["batch_index", 0, "ctx_start", 0], ["batch_index", 0, 0], ["batch_index", 0, 0, 0]]
    dec = _session(export)
    [h] = dec.generate([transfer.install(dec, t)], max_new_tokens=8, stop_tokens=[])
    assert h.tokens == _gen(_session(export, max_sequences=1), PROMPT, 8).tokens


def test_scheduler_reuse_on_the_export(bamba):
    from qeff_kv.runtime import SamplingParams
    from qeff_kv.serve.engine.engine import Finished, GenerationRequest
    from qeff_kv.serve.engine.scheduler import Scheduler

    _, export = bamba

    def run(sched, i, prompt, n):
        evs = list(sched.submit(GenerationRequest(str(i), tuple(prompt), n, SamplingParams(),
                                                  frozenset())).iter_sync(timeout=120))
        assert isinstance(evs[-1], Finished)
        return [e.token for e in evs[:-1]], evs[-1]

    sched = Scheduler(_session(export))
    try:
        t0, f0 = run(sched, 0, PROMPT, 4)
        other = PROMPT[:10] + [44, 45, 46]
        t1, f1 = run(sched, 1, other, 4)
        t2, f2 = run(sched, 2, PROMPT, 4)
    finally:
        sched.close()
    alone = _session(export, max_sequences=1)
    assert (f0.cached_tokens, f1.cached_tokens, f2.cached_tokens) == (0, 8, 12)
    assert t1 == _gen(alone, other, 4).tokens and t2 == t0
