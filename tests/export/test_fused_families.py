"""onnxruntime-fused target per family: GroupQueryAttention exactly as the model's own attention, or a refusal.

Each family whose attention needs more than plain GQA is exported once (ctx_len 32, prefill chunks of 4) and
must give transformers' greedy tokens on two prompts unlike the tracing input, both with separate output
buffers and with one buffer bound as input and retained output (in place), and pass every ``qeff-kv check``
rule (in-place safety included).
The GQA nodes are then read back to show *how* each family is expressed:

* RoPE in exactly the config's RoPE layers (``do_rotary`` per node equals ``ModelFacts.rope_layers``):
  SmolLM3's NoPE layers, Exaone4's global layers without RoPE, Gemma3's two RoPE bases (one cos/sin cache
  per layer type), Falcon (its own attention calls torch SDPA, routed to GQA);
* Gemma2's score soft-capping as GQA's ``softcap``; attention sinks (GraniteSWA, GPT-OSS) as ``head_sink``
  (GraniteSWA also has a NoPE layer, ``layer_rope_theta`` 0);
* GPT-2 (no RoPE; its attention module reshapes GQA's output itself).

Families GQA cannot express are refused from the config with one line, and nothing is written. The
onnxruntime target's grouped attention gains the same soft-capping and sinks (checked at the end).
"""

from __future__ import annotations

import pytest

from suite import requires_torch
from families import CHUNK, CTX, NEW, PROMPTS

pytestmark = [requires_torch]

FUSED = "onnxruntime-fused"

#: family -> what its GQA nodes must show: RoPE layers (None: the model rotates itself, GQA never does),
#: softcap, whether head_sink is fed, and the number of distinct cos caches
EXACT = {
    "smollm3": dict(rope=(0, 2), softcap=0.0, sinks=False, caches=1),
    "exaone4": dict(rope=(0, 2), softcap=0.0, sinks=False, caches=1),
    "gemma3_text": dict(rope=(0, 1), softcap=0.0, sinks=False, caches=2),
    "gemma2": dict(rope=(0, 1), softcap=2.0, sinks=False, caches=1),
    "gpt2": dict(rope=None, softcap=0.0, sinks=False, caches=0),
    "falcon_mqa": dict(rope=(0, 1), softcap=0.0, sinks=False, caches=1),
    "falcon_new": dict(rope=(0, 1), softcap=0.0, sinks=False, caches=1),
    "granite_swa": dict(rope=(0,), softcap=0.0, sinks=True, caches=1),     # layer 1: layer_rope_theta 0
    "gpt_oss": dict(rope=None, softcap=0.0, sinks=True, caches=0),
}
REFUSED = {
    "gptj": "--target onnxruntime-fused cannot express GPTJForCausalLM's attention (computed by its own code, not "
            "through transformers' attention interface or SDPA); use --target onnxruntime",
    "deepseek_v3": "--target onnxruntime-fused cannot express DeepseekV3ForCausalLM's multi-head latent attention "
                   "(keys and values of different head sizes); use --target onnxruntime",
    "diffllama": "--target onnxruntime-fused cannot express DiffLlamaForCausalLM's differential attention (two "
                 "attention maps over the two halves of the values, subtracted; GroupQueryAttention attends over "
                 "the cached values once); use --target onnxruntime",
}
#: the onnxruntime target's grouped attention: soft-capping (Gemma2) and sinks (GraniteSWA)
ORT_TARGET = ("gemma2", "granite_swa")


class _Lookup:
    """``fixture[name]`` over a session-shared ``get(name)`` fixture (tests/conftest.py)."""

    def __init__(self, get):
        self.get = get

    def __getitem__(self, name):
        value = self.get(name)
        if isinstance(value, BaseException):
            raise value
        return value


@pytest.fixture
def family_dirs(family_models):
    return _Lookup(family_models)


@pytest.fixture
def refs(family_refs):
    return _Lookup(family_refs)


@pytest.fixture
def exports(family_exports):
    return _Lookup(lambda name: family_exports(name, FUSED))


def _gqa_nodes(model):
    nodes = [n for n in model.graph if n.op_type == "GroupQueryAttention"]
    assert all(n.domain == "com.microsoft" for n in nodes)
    return nodes


def _attr(node, name, default):
    a = node.attributes.get(name)
    return default if a is None else a.value


@pytest.mark.parametrize("name", list(EXACT))
def test_fused_family_matches_transformers_in_place(name, exports, refs):
    from hf_models import PlainLoop
    from qeff_kv.graph import graphio
    from qeff_kv.tools.check import check
    from qeff_kv.graph.inplace import inplace_issues
    from qeff_kv.runtime import Session

    r = exports[name]
    assert len({t for ref in refs[name] for t in ref}) > 2, "greedy tokens do not vary: the parity proves little"
    assert [PlainLoop(r.onnx_path, CTX).greedy(p, NEW, CHUNK) for p in PROMPTS] == refs[name]
    session = Session(r.out_dir)                      # one buffer bound as past and present
    assert session.inplace
    for prompt, ref in zip(PROMPTS, refs[name]):
        [g] = session.generate([prompt], max_new_tokens=NEW, stop_tokens=())  # no stop at eos: all NEW
        assert g.tokens == ref
        session.remove_sequence(g.sequence)
    model = graphio.load(r.onnx_path)
    assert inplace_issues(model, graphio.layout_of(model)) == []
    report = check(r.onnx_path)                       # every CI rule (pairing, shapes and dim names, ...)
    assert report.ok, report.format_text()


@pytest.mark.parametrize("name", list(EXACT))
def test_fused_family_gqa_nodes_express_the_model(name, exports, family_dirs):
    import json

    from qeff_kv.graph import graphio
    from qeff_kv.export.facts.family import ModelFacts

    want = EXACT[name]
    config = json.loads((family_dirs[name] / "config.json").read_text())
    facts = ModelFacts.from_config(config)
    nodes = _gqa_nodes(graphio.load(exports[name].onnx_path))
    assert len(nodes) == facts.num_layers
    rotated = tuple(i for i, n in enumerate(nodes) if _attr(n, "do_rotary", 0) == 1)
    if want["rope"] is None:
        assert rotated == ()
    else:
        assert rotated == want["rope"] == facts.rope_layers       # exactly the config's RoPE layers
    caches = {id(n.inputs[7]) for n in nodes if _attr(n, "do_rotary", 0) == 1}
    assert len(caches) == want["caches"]
    assert {float(_attr(n, "softcap", 0.0)) for n in nodes} == {want["softcap"]}
    if want["sinks"]:
        assert all(len(n.inputs) > 11 and n.inputs[11] is not None and _attr(n, "smooth_softmax", 0) == 1
                   for n in nodes)
    else:
        assert all(len(n.inputs) <= 11 or n.inputs[11] is None for n in nodes)


@pytest.mark.parametrize("name", list(REFUSED))
def test_fused_refusal_is_one_line_from_the_config(name, family_dirs, tmp_path):
    from qeff_kv.errors import ExportError
    from qeff_kv.export import export_model

    out = tmp_path / "out"
    with pytest.raises(ExportError) as err:
        export_model(family_dirs[name], out, ctx_len=CTX, prefill_seq_len=CHUNK, target=FUSED)
    assert str(err.value) == REFUSED[name]
    assert not out.exists()


@pytest.mark.parametrize("name", ORT_TARGET)
def test_onnxruntime_target_soft_capping_and_sinks(name, family_dirs, refs, tmp_path):
    from hf_models import PlainLoop
    from qeff_kv.graph import graphio
    from qeff_kv.export import export_model

    r = export_model(family_dirs[name], tmp_path / name, ctx_len=CTX, prefill_seq_len=CHUNK, target="onnxruntime")
    assert [PlainLoop(r.onnx_path, CTX).greedy(p, NEW, CHUNK) for p in PROMPTS] == refs[name]
    ops = {n.op_type for n in graphio.load(r.onnx_path).graph}
    assert ("Tanh" in ops) == (name == "gemma2") and ("ReduceLogSumExp" in ops) == (name == "granite_swa")
