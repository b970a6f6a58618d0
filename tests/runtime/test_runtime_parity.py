"""Token parity of our exports, run by the Session, with transformers ``generate`` (greedy, same weights).

Every architecture the exporter supports (``tests/helpers/hf_models.py``): a prompt longer than one prefill chunk,
and three sequences of different lengths decoding together on a continuous-batching export.
"""

from __future__ import annotations

import numpy as np
import pytest

from suite import requires_torch
from qeff_kv.runtime import Session

pytestmark = requires_torch

LONG = [5, 17, 42, 99, 11, 7, 101, 64, 33, 120, 3, 88, 19]  # 13 tokens: two prefill chunks of 8
MID = [120, 3, 88, 19, 60, 45, 12, 122, 1]
SHORT = [9, 8, 7, 6, 5]
NEW = 10


@pytest.fixture(scope="module")
def archs():
    from hf_models import ARCHS

    return list(ARCHS)


@pytest.fixture(scope="module")
def built(tmp_path_factory, archs):
    """Per architecture: the HF folder, a continuous-batching export, and HF reference tokens."""
    from hf_models import hf_greedy, make_model_dir

    from qeff_kv.export import export_model

    root = tmp_path_factory.mktemp("parity")
    out = {}
    for i, arch in enumerate(archs):
        src = make_model_dir(arch, root / "hf", seed=i)
        # half the architectures with the onnxruntime target (valid-length attention), half portable
        target = "onnxruntime" if i % 2 else "portable"
        cb = export_model(src, root / f"{arch}-cb", ctx_len=32, prefill_seq_len=8, continuous_batching=True,
                          full_batch_size=3, kv_cache_prefix="vllmKvCache", target=target).out_dir
        ref = [hf_greedy(src, p, NEW) for p in (LONG, MID, SHORT)]
        out[arch] = (src, cb, ref)
    return out


def test_every_architecture(built):
    for arch, (_, cb, ref) in built.items():
        s = Session(cb)
        assert s.continuous_batching and s.max_sequences == 3 and s.inplace, (arch, s.inplace_issues)
        assert (s.ctx_len, s.prefill_seq_len, s.prefix) == (32, 8, "vllmKvCache")
        # a prompt longer than one prefill chunk, alone
        [g] = s.generate([LONG], max_new_tokens=NEW, stop_tokens=[])
        assert g.tokens == ref[0], arch
        s.remove_sequence(g.sequence)
        # three sequences of different lengths, prefilled one by one into slots, decoding together
        gens = s.generate([LONG, MID, SHORT], max_new_tokens=NEW, stop_tokens=[])
        assert [x.tokens for x in gens] == ref, arch
        assert [x.sequence.length for x in gens] == [len(p) + NEW - 1 for p in (LONG, MID, SHORT)]


def test_non_batching_export_and_rewind(built, tmp_path):
    from qeff_kv.export import export_model

    src, _, ref = built["llama"]
    single = export_model(src, tmp_path / "llama", ctx_len=32, prefill_seq_len=8).out_dir
    s = Session(single)
    assert not s.continuous_batching and s.inplace and s.eos_token_ids == [2]
    [g] = s.generate([LONG], max_new_tokens=NEW, stop_tokens=[])
    assert g.tokens == ref[0]
    s.truncate(g.sequence, 9)  # rewind into the prompt, then re-decode: same tokens as the fresh run
    [again] = s.generate([(g.sequence, LONG[9:])], max_new_tokens=NEW, stop_tokens=[])
    assert again.tokens == ref[0]


def test_float16_export_runs(built, tmp_path):
    from qeff_kv.export import export_model

    src, _, _ = built["llama"]
    d = export_model(src, tmp_path / "fp16", ctx_len=32, prefill_seq_len=8, dtype="float16").out_dir
    s = Session(d)
    assert all(a.dtype == np.float16 for a in s.cache.positional.arrays.values())
    [g] = s.generate([LONG], max_new_tokens=NEW, stop_tokens=[])
    assert len(g.tokens) == NEW
    state = s.export_state(g.sequence)
    assert next(iter(state.tensors.values())).dtype == np.float16
