"""The gated-delta-net and short-conv families exported end to end (``tests/helpers/families.py`` RECURRENT_FAMILIES).

Each cell: the export verifies at export (a prompt of three chunks and a padded half one against transformers'
whole-sequence forward), two prompts longer than three prefill chunks with padding in the last chunk give
transformers' greedy tokens, the recurrent buffers are named exactly ``conv_state.{i}`` / ``recurrent_state.{i}``
on the mixer layers (``past_key``/``past_value`` on the attention layer), and ``check`` passes. Continuous batching
runs two sequences of different lengths in one graph; a prefix names the recurrent buffers too.
Qwen3.5-MoE, LFM2-MoE and LFM3 come with the same mixers (their MoE and gated attention are transformers' code);
Kimi Linear and Bailing-Hybrid run Kimi delta attention (per-channel decay) beside MLA attention, which the fused
target refuses from the config (``RECURRENT_EXPECT``).
"""

from __future__ import annotations

import numpy as np
import pytest

from suite import requires_torch
from families import CTX, NEW, RECURRENT_EXPECT, RECURRENT_FAMILIES, TARGETS

pytestmark = [requires_torch]

CHUNK = 4
#: longer than three chunks of CHUNK, the last chunk padded (15 = 3 * 4 + 3, 13 = 3 * 4 + 1)
PROMPTS = [[5, 17, 42, 99, 13, 7, 101, 64, 3, 77, 21, 9, 33, 54, 2], [100, 3, 3, 60, 9, 88, 14, 71, 26, 45, 8, 19, 93]]
CELLS = [(n, t) for n in RECURRENT_FAMILIES for t in TARGETS if RECURRENT_EXPECT[n][t] == "exact"]
REFUSED = [(n, t) for n in RECURRENT_FAMILIES for t in TARGETS if RECURRENT_EXPECT[n][t] != "exact"]


@pytest.fixture(scope="module")
def recurrent_refs(family_models):
    from hf_models import hf_greedy

    cache: dict = {}

    def get(name):
        if name not in cache:
            cache[name] = [hf_greedy(family_models(name), p, NEW) for p in PROMPTS]
        return cache[name]

    return get


def _names(result):
    import onnx

    graph = onnx.load(str(result.onnx_path), load_external_data=False).graph
    return [i.name for i in graph.input], [o.name for o in graph.output]


def _expected_buffers(name: str, prefix: str = "") -> list[str]:
    """The family's ``layer_types``: mixer layers keep ``conv_state`` (and the gated delta net's
    ``recurrent_state``), attention layers (full or sliding) ``past_key``/``past_value``."""
    mixer = ["conv_state"] if name.startswith("lfm") else ["conv_state", "recurrent_state"]
    types = RECURRENT_FAMILIES[name].config_kwargs()["layer_types"]
    sfx = f"_{prefix}" if prefix else ""
    return [f"{s}.{i}{sfx}" for i, t in enumerate(types)
            for s in (["past_key", "past_value"] if t.endswith("attention") and t != "linear_attention" else mixer)]


@pytest.mark.parametrize("name,target", CELLS, ids=[f"{n}-{t}" for n, t in CELLS])
def test_recurrent_family_exact(name, target, family_exports, recurrent_refs):
    from hf_models import PlainLoop
    from qeff_kv.tools.check import check

    result = family_exports(name, target)
    if isinstance(result, BaseException):
        raise result
    ver = result.manifest["verification"]
    window = RECURRENT_FAMILIES[name].config_kwargs().get("sliding_window") or CTX   # a window: that much longer
    assert ver["status"] == "passed" and ver["prompt_len"] == 3 * CHUNK + CHUNK // 2 + (window if window < CTX else 0)
    ins, outs = _names(result)
    want = _expected_buffers(name)
    assert ins == ["input_ids", "position_ids", *want]
    assert outs == ["logits", *[f"{b}_RetainedState" for b in want]]
    refs = recurrent_refs(name)
    assert len(set(refs[0])) > 1 or len(set(refs[1])) > 1
    got = [PlainLoop(result.onnx_path, CTX).greedy(p, NEW, CHUNK) for p in PROMPTS]
    assert got == refs
    report = check(result.onnx_path)
    assert report.ok, report.format_text()
    _assert_sliding_capacity(name, target, result)


def _assert_sliding_capacity(name: str, target: str, result) -> None:
    """A sliding layer's buffer is a ring (axis ``sliding_window``) on the ScatterND targets (the window binds: CTX
    is larger), as long as a full layer's on the fused one (GroupQueryAttention windows it)."""
    import onnx

    fam = RECURRENT_FAMILIES[name].config_kwargs()
    graph = onnx.load(str(result.onnx_path), load_external_data=False).graph
    slots = {i.name: i.type.tensor_type.shape.dim[2].dim_param for i in graph.input if i.name.startswith("past_key")}
    for i, t in enumerate(fam["layer_types"]):
        if t == "sliding_attention":
            assert fam["sliding_window"] < CTX
            full = slots[f"past_key.{fam['layer_types'].index('full_attention')}"]
            assert full != "sliding_window"
            assert slots[f"past_key.{i}"] == (full if target == "onnxruntime-fused" else "sliding_window"), slots


@pytest.mark.parametrize("name,target", REFUSED, ids=[f"{n}-{t}" for n, t in REFUSED])
def test_recurrent_family_refused(name, target, family_models, tmp_path):
    """The cell's one-line refusal, from the config before the weights are read; nothing written."""
    from qeff_kv.errors import ExportError
    from qeff_kv.export import export_model

    out = tmp_path / "out"
    with pytest.raises(ExportError) as err:
        export_model(family_models(name), out, ctx_len=CTX, prefill_seq_len=CHUNK, target=target,
                     progress=lambda line: pytest.fail(f"progress before the refusal: {line}"))
    assert str(err.value).startswith(RECURRENT_EXPECT[name][target][len("refused: "):])
    assert "\n" not in str(err.value) and not out.exists()


@pytest.mark.parametrize("name", ["qwen3_5_text", "lfm2"])
def test_continuous_batching_two_sequences_at_different_lengths(name, family_models, recurrent_refs, tmp_path):
    """Slot 1 prefilled with a 15-token prompt, slot 0 with a 13-token one, then both decoded in one batch:
    each sequence gives transformers' tokens (its state rows gathered and scattered by ``batch_index``)."""
    from hf_models import PlainLoop
    from qeff_kv.export import export_model

    r = export_model(family_models(name), tmp_path / "cb", ctx_len=CTX, prefill_seq_len=CHUNK,
                     target="onnxruntime", continuous_batching=True, full_batch_size=2)
    assert r.manifest["verification"]["status"] == "passed"
    loop = PlainLoop(r.onnx_path, CTX, batch=2)
    slots = {1: PROMPTS[0], 0: PROMPTS[1]}
    toks = {s: [int(loop.prefill(p, CHUNK, slot=s)[0, -1].argmax())] for s, p in slots.items()}
    pos = {s: len(p) for s, p in slots.items()}
    while len(toks[0]) < NEW:
        logits = loop.step(np.array([[toks[0][-1]], [toks[1][-1]]]), np.array([[pos[0]], [pos[1]]]),
                           np.array([[0], [1]]))
        for s in (0, 1):
            toks[s].append(int(logits[s, -1].argmax()))
            pos[s] += 1
    refs = recurrent_refs(name)
    assert toks[1] == refs[0] and toks[0] == refs[1]


def test_prefix_names_the_recurrent_buffers(family_models, tmp_path):
    from qeff_kv.export import export_model

    r = export_model(family_models("qwen3_5_text"), tmp_path / "p", ctx_len=CTX, prefill_seq_len=CHUNK,
                     kv_cache_prefix="VLLM", verify=False)
    ins, outs = _names(r)
    want = _expected_buffers("qwen3_5_text", "VLLM")
    assert ins == ["input_ids", "position_ids", *want]
    assert outs == ["logits", *[f"{b}_RetainedState" for b in want]]
    assert "conv_state.0_VLLM" in ins and "recurrent_state.2_VLLM_RetainedState" in outs


@pytest.mark.parametrize("name", ["qwen3_next", "lfm2"])
def test_runtime_generate_equals_transformers(name, family_exports, recurrent_refs):
    """qeff-kv's runtime (``qeff-kv generate``: in-place buffers, recurrent rows zeroed for a new sequence) on the
    export gives transformers' tokens."""
    from click.testing import CliRunner

    from qeff_kv_cli.main import main

    result = family_exports(name, "onnxruntime")
    ids = ",".join(str(t) for t in PROMPTS[0])
    res = CliRunner().invoke(main, ["generate", str(result.onnx_path.parent), "--prompt-ids", ids,
                                    "--max-new-tokens", str(NEW)])
    assert res.exit_code == 0, res.output
    lines = [ln for ln in res.output.strip().splitlines() if ln and ln.split()[0].isdigit()]
    assert [int(t) for t in lines[-1].split()] == recurrent_refs(name)[0]
