"""Mixture-of-experts export (qeff_kv/export/modeling/moe.py): every token is routed at run time, by data.

Per MoE family of tests/helpers/families.py (one tiny seeded model and one export per family for the module):

* greedy tokens equal transformers' ``generate`` on two prompts unlike the tracing input (zeros), so the
  experts the tracing input hit cannot be the ones that decide: proved per family and target by the family
  matrix (tests/export/test_families.py), whose exports these tests share;
* the graph routes by data: no ``Loop``/``NonZero`` (and no ``If`` in the decoder layers), and every stacked
  expert weight ``[num_experts, ...]`` is read by a ``Gather`` (weights selected by the router's expert ids);
* a continuous-batching graph decodes two sequences in one step whose tokens route to different experts,
  each row equal to transformers run on that sequence alone;
* a MoE trace that loops over the experts the tracing input hit is refused, and the model's own experts
  implementation is restored after tracing.
"""

from __future__ import annotations

import numpy as np
import pytest

from suite import requires_torch
from families import CHUNK, CTX, FAMILIES

pytestmark = [requires_torch]

MOE = ["mixtral", "qwen2_moe", "qwen3_moe", "granitemoe", "gpt_oss"]
#: continuous batching: two sequences of different lengths whose decode tokens route to different experts
CB_FAMILIES = ["mixtral", "gpt_oss"]
CB_PROMPTS = [[5, 17, 42, 99, 13, 7], [100, 3, 3, 60, 9, 120, 33, 8, 61]]
CB_STEPS = 3


def _num_experts(name: str) -> int:
    kw = FAMILIES[name].config_kwargs()
    return int(kw.get("num_local_experts") or kw["num_experts"])


@pytest.fixture(scope="module")
def moe_root(tmp_path_factory):
    return tmp_path_factory.mktemp("moe")


@pytest.fixture
def moe_models(family_models):
    return family_models


@pytest.fixture(scope="module")
def _cb_exports():
    return {}


@pytest.fixture
def moe_exports(family_models, family_exports, moe_root, _cb_exports):
    """The shared portable export of a family (the matrix's, verified), or this module's continuous-batching one."""
    from qeff_kv.export import export_model

    def get(name: str, continuous_batching: bool = False):
        if not continuous_batching:
            r = family_exports(name, "portable")
            if isinstance(r, BaseException):
                raise r
            return r
        if name not in _cb_exports:
            _cb_exports[name] = export_model(family_models(name), moe_root / f"{name}-cb", ctx_len=CTX,
                                             prefill_seq_len=CHUNK, target="portable", verify=False,
                                             continuous_batching=True, full_batch_size=2)
        return _cb_exports[name]

    return get


def _hf(model_dir):
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                             attn_implementation="eager").eval()


@pytest.mark.parametrize("name", MOE)
def test_graph_routes_by_data(name, moe_exports):
    import onnx

    graph = onnx.load(str(moe_exports(name).onnx_path), load_external_data=False).graph
    ops = {n.op_type for n in graph.node}
    assert not ops & {"Loop", "NonZero"}, ops & {"Loop", "NonZero"}
    # The wrapper's head may write an ``If`` for a squeeze; nothing inside the decoder layers may.
    in_layers = [n.name for n in graph.node if n.op_type == "If" and "/layers." in n.name]
    assert not in_layers, in_layers
    # Weights as activations: each stacked expert weight is gathered by expert id, never sliced to fixed experts.
    n_exp = _num_experts(name)
    stacked = {t.name for t in graph.initializer if len(t.dims) == 3 and t.dims[0] == n_exp}
    assert stacked, "no stacked expert weights in the graph"
    gathered = {n.input[0] for n in graph.node if n.op_type == "Gather"}
    assert stacked <= gathered, sorted(stacked - gathered)


def _router_choices(model, ids) -> list[list[set[int]]]:
    """Per experts module, per token: the expert ids transformers' router chose (forward pre-hooks)."""
    import torch

    from qeff_kv.export.modeling import moe

    seen: list[list[set[int]]] = []
    hooks = [m.register_forward_pre_hook(lambda _m, args: seen.append([set(r.tolist()) for r in args[1]]))
             for m in moe.experts_modules(model)]
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    return seen


@pytest.mark.parametrize("name", CB_FAMILIES)
def test_continuous_batching_two_rows_one_step(name, moe_models, moe_exports):
    """Two sequences in slots 0 and 1, decoded together in one batch-2 step per token; each row's logits equal
    transformers run on that sequence alone, and the rows' tokens are routed to different experts."""
    import torch

    from hf_models import PlainLoop

    model = _hf(moe_models(name))
    loop = PlainLoop(moe_exports(name, continuous_batching=True).onnx_path, CTX, batch=2)
    seqs = [list(p) for p in CB_PROMPTS]
    for slot, seq in enumerate(seqs):
        logits = loop.prefill(seq, CHUNK, slot=slot)
        seq.append(int(logits[0, -1].argmax()))
    routed_apart = False
    for _ in range(CB_STEPS):
        ids = np.array([[s[-1]] for s in seqs])
        pos = np.array([[len(s) - 1] for s in seqs])
        logits = loop.step(ids, pos, np.array([[0], [1]]))
        assert logits.shape[:2] == (2, 1)
        for row, seq in enumerate(seqs):
            with torch.no_grad():
                want = model(torch.tensor([seq])).logits[0, -1].double().numpy()
            got = logits[row, 0].astype(np.float64)
            assert float(np.abs(got - want).max()) <= 1e-3 * max(1.0, float(np.abs(want).max())), (row, seq)
            assert int(got.argmax()) == int(want.argmax())
        # the decode tokens of the two rows (last position of each sequence) take different experts somewhere
        choices = [_router_choices(model, s) for s in seqs]
        routed_apart |= any(a[-1] != b[-1] for a, b in zip(*choices))
        for row, seq in enumerate(seqs):
            seq.append(int(logits[row, 0].argmax()))
    assert routed_apart, "the two rows were routed to the same experts: the test proves little"


def test_routing_fixed_by_the_tracing_input_is_refused(moe_models, moe_root, monkeypatch):
    """With transformers' ``eager`` experts (a loop over the experts a batch hits) the trace would bake in
    the tracing input's experts: the export refuses it and writes nothing."""
    from qeff_kv.errors import ExportError
    from qeff_kv.export import export_model
    from qeff_kv.export.modeling import moe

    monkeypatch.setattr(moe, "GATHERED_EXPERTS", "eager")
    out = moe_root / "mixtral-eager"
    with pytest.raises(ExportError, match="NonZero") as info:
        export_model(moe_models("mixtral"), out, ctx_len=CTX, prefill_seq_len=CHUNK, verify=False)
    assert "\n" not in str(info.value)
    assert not (out / "manifest.json").exists()


def test_static_routing_restores_the_models_choice(moe_models):
    from qeff_kv.export.modeling import moe

    model = _hf(moe_models("qwen2_moe"))
    modules = moe.experts_modules(model)
    assert len(modules) == FAMILIES["qwen2_moe"].config_kwargs()["num_hidden_layers"]
    before = [m.config._experts_implementation for m in modules]
    with moe.static_routing(model) as patched:
        assert patched == modules
        assert {m.config._experts_implementation for m in modules} == {moe.GATHERED_EXPERTS}
    assert [m.config._experts_implementation for m in modules] == before
    assert moe.is_moe(model)


def test_zero_compute_experts_are_routed_by_data(family_exports):
    """LongcatFlash's experts module loops over the experts hit, its zero-compute experts returning the token: the
    gathered forward computes what it computes (every expert, identity ones included), and the family's graph
    routes by data (the matrix proves its tokens)."""
    import torch
    import transformers
    from transformers.models.longcat_flash.modeling_longcat_flash import LongcatFlashExperts

    from qeff_kv.graph import graphio
    from qeff_kv.export.modeling import moe

    cfg = transformers.LongcatFlashConfig(**FAMILIES["longcat_flash"].config_kwargs())
    torch.manual_seed(0)
    experts = LongcatFlashExperts(cfg)
    for p in (experts.gate_up_proj, experts.down_proj):
        torch.nn.init.normal_(p, std=0.2)
    assert moe.zero_experts_modules(experts) == [experts]
    x = torch.randn(9, cfg.hidden_size)
    index = torch.tensor([[0, 4], [5, 1], [4, 5], [2, 3], [3, 0], [1, 2], [5, 4], [0, 1], [2, 5]])
    weights = torch.rand(9, 2)
    with torch.no_grad():
        want = experts(x, index, weights)
        got = moe.gathered_zero_experts_forward(experts)(x, index, weights)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert torch.allclose(got[2], x[2] * weights[2].sum())            # two identity experts: the token, weighted
    ops = {n.op_type for n in graphio.load(family_exports("longcat_flash", "portable").onnx_path).graph}
    assert not ops & moe.ROUTING_CONTROL_OPS


def test_experts_split_by_python_counts_are_routed_by_data(family_models):
    """JetMoe groups tokens per expert with ``expert_size.tolist()`` in its feed-forward experts and its mixture of
    attention heads: each layer's two modules are found, their gathered methods compute what theirs do on tokens
    routed anew (not the probe's), and the model's own methods are back after tracing."""
    import torch
    import transformers

    from qeff_kv.export.modeling import moe_split

    model = transformers.AutoModelForCausalLM.from_pretrained(family_models("jetmoe"), dtype=torch.float32).eval()
    found = moe_split.split_experts_modules(model)
    assert len(found) == 2 * model.config.num_hidden_layers
    assert {tuple(sorted(methods)) for _, methods in found} == {("forward",), ("map", "reduce")}
    x = torch.randn(1, 7, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        for m, methods in found:
            if "forward" in methods:
                torch.testing.assert_close(methods["forward"](x), m(x), rtol=1e-5, atol=1e-5)
            else:
                q, _, topo = m.map(x)
                q2, _, topo2 = methods["map"](x)
                torch.testing.assert_close(q2, q, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(methods["reduce"](q, topo2), m.reduce(q, topo), rtol=1e-5, atol=1e-5)
    with moe_split.routed_by_data(model):
        assert all("forward" in m.__dict__ or "map" in m.__dict__ for m, _ in found)
    assert not any({"forward", "map", "reduce"} & set(m.__dict__) for m, _ in found)
