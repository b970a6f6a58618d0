"""The runtime on a graph whose last layers keep no state: the matrix's tiny Gemma 4 with shared-KV layers
(``gemma4_text_shared``: layers 2 and 3 read layers 0 and 1, window 6 so layer 0 is a ring on the onnxruntime
target). The session keeps buffers for layers 0 and 1 only, its tokens equal transformers', a state file and the
prefill -> decode hand-off continue exactly. The exports are the family matrix's (``family_exports``)."""

from __future__ import annotations

import pytest

from suite import requires_torch

pytestmark = [requires_torch]

NAME = "gemma4_text_shared"
PROMPT = [5, 17, 42, 99, 13, 7, 101, 64, 3, 77, 21]   # past the window of 6


@pytest.fixture(scope="module")
def reference(family_models):
    from hf_models import hf_greedy

    return hf_greedy(family_models(NAME), PROMPT, 9)


@pytest.mark.parametrize("target,kinds", [("onnxruntime", ["ring", "full"]), ("onnxruntime-fused", ["full", "full"])])
def test_session_state_file_and_handoff_with_shared_layers(target, kinds, family_exports, reference, tmp_path):
    from qeff_kv.runtime import SamplingParams, Session
    from qeff_kv.serve.cluster import transfer

    result = family_exports(NAME, target)
    if isinstance(result, BaseException):
        raise result
    a = Session(result.out_dir, max_sequences=1)
    spec = a.graph.layout.state_spec
    assert [(s.layer, s.kind) for s in spec.layers] == [(0, kinds[0]), (1, kinds[1])]
    assert spec.shared == ((2, 0), (3, 1))
    assert list(a.cache.positional.arrays) == ["past_key.0", "past_value.0", "past_key.1", "past_value.1"]
    assert a.num_layers == 2 and a.inplace
    [g] = a.generate([list(PROMPT)], max_tokens=5, stop_tokens=[])
    assert g.tokens == reference[:5]
    path = a.save_state(g.sequence, tmp_path / "s.safetensors")
    b = Session(result.out_dir, max_sequences=1)
    [x] = b.generate([b.load_state(path)], max_tokens=4, stop_tokens=[])
    assert x.tokens == reference[5:9]
    t = transfer.Prefiller(Session(result.out_dir, max_sequences=1)).run("r", PROMPT, SamplingParams())
    dec = Session(result.out_dir, max_sequences=1)
    [h] = dec.generate([transfer.install(dec, t)], max_tokens=9, stop_tokens=[])
    assert h.tokens == reference
