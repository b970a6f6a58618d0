"""Experts that group their tokens by counts taken to Python: routed by data while tracing.

JetMoe's feed-forward experts (``JetMoeMoE``) and its mixture of attention heads (``JetMoeMoA``: each token's
query projection and output projection come from its top-k routed experts, over shared key/value heads) sort the
(token, slot) pairs by expert and split them with ``expert_size.tolist()`` (``JetMoeParallelExperts``): a trace
bakes in the tracing input's counts, a silently wrong graph. While tracing, each such module computes the same
thing by gathering, per (token, top-k slot), that expert's weight ``[E, out, in]`` by the router's expert id
(as :mod:`.moe` does for transformers' experts interface), weighting each slot by its gate and summing the k slots.

A module is patched only after its replacement was measured to compute what its own forward does on a probe that
routes tokens to every expert (:func:`split_experts_modules`); the model is left as it was on exit.
"""

from __future__ import annotations

import contextlib

import torch


def _gather_linear(experts: torch.nn.Module, index: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``F.linear(x[t, k], experts.weight[index[t, k]])`` for every pair: ``index [T, K]``, ``x [T, K, in]`` or
    ``[T, 1, in]`` -> ``[T, K, out]``."""
    return torch.matmul(experts.weight[index], x.unsqueeze(-1)).squeeze(-1)


def _route(module: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's top-k expert ids ``[T, K]`` and gates (softmax over the top-k logits), as JetMoe's gating."""
    router = module.router
    logits = router.layer(x).float()
    top_logits, index = logits.topk(router.top_k, dim=1)
    return index, torch.softmax(top_logits, dim=1).type_as(x)


def gathered_moe_forward(module: torch.nn.Module):
    """``JetMoeMoE.forward`` routed by data: ``[B, S, H] -> [B, S, H]``."""
    def forward(layer_input):
        bsz, length, emb = layer_input.shape
        x = layer_input.reshape(-1, emb)
        index, gates = _route(module, x)
        gate, up = _gather_linear(module.input_linear, index, x.unsqueeze(1)).chunk(2, dim=-1)
        out = _gather_linear(module.output_linear, index, module.activation(gate) * up)
        out = (out * gates.unsqueeze(-1)).sum(dim=1)
        return (out.reshape(bsz, length, emb) + module.bias).to(layer_input.dtype)

    return forward


def gathered_moa_map(module: torch.nn.Module):
    """``JetMoeMoA.map`` routed by data: each token's query through each of its top-k experts ``[B, S, K, hidden]``,
    the router logits, and ``(index, gates)`` for :func:`gathered_moa_reduce`."""
    def map_(layer_input):
        bsz, length, emb = layer_input.shape
        x = layer_input.reshape(-1, emb)
        logits = module.router.layer(x).float()
        index, gates = _route(module, x)
        queries = _gather_linear(module.input_linear, index, x.unsqueeze(1))
        return queries.reshape(bsz, length, module.top_k, -1), logits, (index, gates)

    return map_


def gathered_moa_reduce(module: torch.nn.Module):
    """``JetMoeMoA.reduce`` routed by data: each slot's attention output through its expert's output projection,
    weighted by its gate, the k slots summed, plus the bias: ``[B, S, K, hidden] -> [B, S, H]``."""
    def reduce(layer_input, topo_info):
        bsz, length, k, hidden = layer_input.shape
        index, gates = topo_info
        out = _gather_linear(module.output_linear, index, layer_input.reshape(-1, k, hidden))
        out = (out * gates.unsqueeze(-1)).sum(dim=1)
        return (out.reshape(bsz, length, -1) + module.bias).to(layer_input.dtype)

    return reduce


def _split_experts(m: torch.nn.Module) -> bool:
    parallel = [getattr(m, n, None) for n in ("input_linear", "output_linear")]
    return all(p is not None and isinstance(getattr(p, "weight", None), torch.Tensor) and p.weight.dim() == 3
               and hasattr(p, "num_experts") for p in parallel) and hasattr(getattr(m, "router", None), "layer") \
        and hasattr(m.router, "top_k") and hasattr(m, "bias")


def _probe(m: torch.nn.Module) -> torch.Tensor:
    """Tokens (``[1, T, H]``) that the router spreads over all its experts: the router's own weight rows."""
    rows = m.router.layer.weight.detach()                                          # [E, H]
    return torch.cat([rows, -rows, rows.flip(0) * 0.5], dim=0).unsqueeze(0).to(m.bias.dtype)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(torch.allclose(a, b, rtol=1e-4, atol=1e-5))


def split_experts_modules(model: torch.nn.Module) -> list[tuple[torch.nn.Module, dict]]:
    """Each module whose experts split tokens by Python counts, with the methods that replace its own
    (``forward`` for feed-forward experts, ``map``/``reduce`` for mixture of attention), kept only where they
    compute what the module's own methods compute on :func:`_probe`."""
    found = []
    for m in model.modules():
        if not _split_experts(m):
            continue
        x = _probe(m)
        with torch.no_grad():
            if callable(getattr(m, "map", None)) and callable(getattr(m, "reduce", None)):
                new = {"map": gathered_moa_map(m), "reduce": gathered_moa_reduce(m)}
                q, _, topo = m.map(x)
                q2, _, topo2 = new["map"](x)
                attn = torch.randn(q.shape, generator=torch.Generator().manual_seed(0), dtype=q.dtype)
                ok = _close(q2, q) and _close(new["reduce"](attn, topo2), m.reduce(attn, topo))
            else:
                new = {"forward": gathered_moe_forward(m)}
                ok = _close(new["forward"](x), m(x))
        if ok:
            found.append((m, new))
    return found


@contextlib.contextmanager
def routed_by_data(model: torch.nn.Module):
    """Inside: every module of :func:`split_experts_modules` runs its gathered methods."""
    patched = split_experts_modules(model)
    for m, methods in patched:
        for name, fn in methods.items():
            setattr(m, name, fn)
    try:
        yield
    finally:
        for m, methods in patched:
            for name in methods:
                m.__dict__.pop(name, None)
