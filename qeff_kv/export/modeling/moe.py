"""Mixture-of-experts blocks in a traced graph: every token is routed at run time, by data.

transformers (5.x) keeps a MoE block's experts as one module of stacked weights (``gate_up_proj`` /
``up_proj``, ``down_proj`` ``[num_experts, ...]``, optional biases, the family's gate/activation in
``_apply_gate`` / ``act_fn``) whose forward dispatches on ``config._experts_implementation`` (the
``@use_experts_implementation`` decorator, ``transformers.integrations.moe``). Of its implementations:

* ``grouped_mm`` (the default) sorts the (token, slot) pairs by expert and counts them with ``aten::histc``,
  which has no ONNX form: tracing crashes;
* ``eager`` loops over the experts the current tokens hit (``nonzero``): a trace records only the experts the
  *tracing input* hit, a silently wrong graph;
* ``batched_mm`` gathers, for every (token, top-k slot) pair, that expert's weights by the router's expert id
  (``Gather`` of the stacked weights: "weights as activations"), runs batched MatMuls, weights each slot by
  its routing weight and sums the k slots in a fixed order. No loop, sort, histc or nonzero: every shape
  follows the number of tokens only, and which experts run is data. This is what the graph uses.

Why gathering the top-k experts rather than running every expert densely and masking: decode (one token per
sequence) is the steady state and is bandwidth-bound. A decode step of B sequences gathers B*k expert matrices
(the Gather copies each, the MatMul reads the copy: about 2*B*k experts' worth of traffic); dense reads all E
experts every step. For B=1 that is E/(2k) times less traffic on the MoE layers (Mixtral 2x, GPT-OSS-20B 4x,
Qwen3-30B-A3B 8x; estimates from the shapes, not measurements). The price is on prefill: a chunk of T tokens
materialises T*k expert matrices per MoE layer while that layer runs (T*k*3*I*H values), where dense would
compute E/k times the FLOPs but read each weight once in place; ``--prefill-seq-len`` bounds that transient.

Experts modules outside that interface whose extra experts compute nothing (LongcatFlash's zero-compute experts:
the token itself, weighted) loop over the experts hit (``nonzero``); their forward is replaced while tracing by
the same gather over the routed experts, an identity expert's slot taking the token instead
(:func:`gathered_zero_experts_forward`), after checking on a probe that hits every expert that it computes what
theirs does.

Routers (top-k, softmax before/after it, ``norm_topk_prob``, shared experts and their sigmoid gates) are the
model's own code and trace as they are.

:func:`static_routing` selects ``batched_mm`` on every experts module while tracing (restoring the model's
own choice after) and, once the graph is written, refuses one that still routes by control flow (a MoE block
outside transformers' experts interface would loop over the experts the tracing input hit).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from qeff_kv.errors import ExportError
from qeff_kv.export import transformers_adapter as hf

#: transformers' experts implementation that traces into a data-independent graph
GATHERED_EXPERTS = "batched_mm"

#: ONNX ops that mean a traced MoE graph routes by control flow or data-dependent shapes. A loop over the
#: experts a batch hits traces into ``NonZero`` (``nonzero()``, ``torch.where(mask)``) with the loop unrolled
#: over the tracing input's experts; a scripted loop would be a ``Loop``. (An ``If`` is not a sign of it: the
#: TorchScript exporter writes ``squeeze`` of a dynamic dimension as one.)
ROUTING_CONTROL_OPS = frozenset({"Loop", "NonZero"})

#: config fields giving a (text) config's number of routed experts
_EXPERT_COUNT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def experts_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules whose forward transformers' experts interface dispatches (``@use_experts_implementation``)."""
    return [m for m in model.modules()
            if hasattr(m, "has_gate") and hasattr(m, "is_transposed") and hasattr(m, "_is_expert_parallel")
            and hasattr(getattr(m, "config", None), "_experts_implementation")]


def is_moe(model: torch.nn.Module) -> bool:
    """The model has routed experts: an experts-interface module, or an expert count in its config."""
    if experts_modules(model):
        return True
    cfg = model.config
    configs = [cfg] + [getattr(cfg, k, None) for k in getattr(cfg, "sub_configs", {}) or {}]
    for c in configs:
        for key in _EXPERT_COUNT_FIELDS:
            value = getattr(c, key, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return True
    return False


#: attributes of an experts module with zero-compute (identity) experts after its routed ones (LongcatFlash's
#: ``LongcatFlashExperts``: ids ``>= num_routed_experts`` return the token itself, weighted), whose own forward
#: loops over the experts the tokens hit
_ZERO_EXPERT_ATTRS = ("zero_expert_num", "num_routed_experts", "gate_up_proj", "down_proj", "act_fn")


def gathered_zero_experts_forward(module: torch.nn.Module):
    """The forward of an experts module with zero-compute experts, routed by data: for every (token, top-k slot)
    pair, the routed expert's weights are gathered by its id (an identity expert's id is clamped to a real one
    and its output replaced by the token), each slot weighted by its routing weight, the k slots summed."""
    def forward(hidden_states, top_k_index, top_k_weights):
        routed = int(module.num_routed_experts)
        is_zero = (top_k_index >= routed).unsqueeze(-1)                            # [T, K, 1]
        idx = top_k_index.clamp(max=routed - 1)                                      # [T, K]
        x = hidden_states.unsqueeze(1).unsqueeze(-1)                                 # [T, 1, H, 1]
        gate_up = torch.matmul(module.gate_up_proj[idx], x).squeeze(-1)             # [T, K, 2I]
        gate, up = gate_up.chunk(2, dim=-1)
        h = (module.act_fn(gate) * up).unsqueeze(-1)                                # [T, K, I, 1]
        out = torch.matmul(module.down_proj[idx], h).squeeze(-1)                     # [T, K, H]
        out = torch.where(is_zero, hidden_states.unsqueeze(1).to(out.dtype), out)
        out = out * top_k_weights.unsqueeze(-1)
        return out.sum(dim=1).to(hidden_states.dtype)

    return forward


def zero_experts_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Experts modules with zero-compute experts (:data:`_ZERO_EXPERT_ATTRS`) outside transformers' experts
    interface, whose gathered forward computes what their own does on a probe (measured, not assumed)."""
    interface = {id(m) for m in experts_modules(model)}
    found = []
    for m in model.modules():
        if id(m) in interface or not all(getattr(m, a, None) is not None for a in _ZERO_EXPERT_ATTRS):
            continue
        routed, zero = int(m.num_routed_experts), int(m.zero_expert_num)
        if routed < 1 or zero < 1:
            continue
        total = routed + zero
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(total, int(m.down_proj.shape[1]), generator=gen, dtype=m.down_proj.dtype)
        first = torch.arange(total)
        index = torch.stack((first, (first + 1) % total), dim=1)                    # every expert in both slots
        weights = torch.rand(total, 2, generator=gen, dtype=x.dtype)
        with torch.no_grad():
            want = m(x, index, weights)
            got = gathered_zero_experts_forward(m)(x, index, weights)
        if torch.allclose(got, want, rtol=1e-4, atol=1e-5):
            found.append(m)
    return found


@contextlib.contextmanager
def static_routing(model: torch.nn.Module, graph_path: Path | str | None = None):
    """While tracing, every experts module runs :data:`GATHERED_EXPERTS`, every experts module with
    zero-compute experts its gathered forward (:func:`gathered_zero_experts_forward`) and every module whose
    experts split tokens by Python counts its gathered methods (:mod:`.moe_split`: JetMoe); on exit the model's own
    choice is restored. When the block exits normally and ``graph_path`` names the traced graph of a MoE model,
    the graph is checked for routing by control flow (:func:`require_data_routing`)."""
    from qeff_kv.export.modeling.moe_split import routed_by_data

    with _zero_experts_routed(model), routed_by_data(model):
        with _static_experts(model, graph_path) as modules:
            yield modules


@contextlib.contextmanager
def _zero_experts_routed(model: torch.nn.Module):
    patched = zero_experts_modules(model)
    for m in patched:
        m.forward = gathered_zero_experts_forward(m)
    try:
        yield
    finally:
        for m in patched:
            del m.forward


@contextlib.contextmanager
def _static_experts(model: torch.nn.Module, graph_path: Path | str | None):
    implementation = GATHERED_EXPERTS
    modules = experts_modules(model)
    if modules and not hf.experts_implementation_available(implementation):
        raise ExportError(f"{type(model).__name__}: transformers has no '{implementation}' experts "
                          f"implementation, which the exporter needs to route tokens in the graph")
    saved: dict[int, tuple[object, object]] = {}
    for m in modules:
        cfg = m.config
        if id(cfg) not in saved:
            saved[id(cfg)] = (cfg, cfg._experts_implementation_internal)
            cfg._experts_implementation_internal = implementation
    try:
        yield modules
    finally:
        for cfg, previous in saved.values():
            cfg._experts_implementation_internal = previous
    if graph_path is not None and (modules or is_moe(model)):
        require_data_routing(graph_path, type(model).__name__)


def require_data_routing(graph_path: Path | str, name: str = "model") -> None:
    """Refuse a traced MoE graph with a :data:`ROUTING_CONTROL_OPS` node: its trace baked in the experts that
    the tracing input happened to hit."""
    import onnx

    graph = onnx.load(str(graph_path), load_external_data=False).graph
    found = sorted({n.op_type for n in graph.node if n.op_type in ROUTING_CONTROL_OPS})
    if found:
        raise ExportError(f"{name}: its mixture-of-experts block traced into {'/'.join(found)} nodes (routing "
                          f"fixed by the tracing input, not by the tokens); only experts that use transformers' "
                          f"experts interface are exported")
