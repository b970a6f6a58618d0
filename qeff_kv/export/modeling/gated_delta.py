"""The gated delta net (Qwen3-Next, Qwen3.5, OLMo-Hybrid) and Kimi delta attention (Kimi Linear, Bailing-Hybrid)
as one traceable step over a chunk of any length.

transformers' torch path runs a prefill chunk as a Python loop over sub-chunks of 64 tokens whose count follows
the prompt, solves each sub-chunk's triangular system with ``torch.linalg.solve_triangular`` (no ONNX op), and
runs a decode token through a second, per-token function. A graph has one dynamic ``seq_len`` (prefill chunks
and decode steps alike), so :func:`gated_delta_step` computes a chunk with no loop over tokens:

* the chunk is cut into sub-chunks of :data:`SUB_CHUNK` tokens by *fixed* slices ``[0, 64)``, ``[64, 128)``...,
  as many as the longest chunk the graph takes (the export's prefill length) needs; at run time a slice past
  the chunk's end is empty and changes nothing (a decode step is one sub-chunk of one token);
* within a sub-chunk, the quadratic form of the rule: ``(I + A)^{-1}`` of the strictly lower triangular ``A``
  (the UT transform of the DeltaNet paper) is the finite series ``I + N + N^2 + ...`` of the nilpotent
  ``N = -A``, computed as ``(I + N)(I + N^2)(I + N^4)...``: ``log2(64) = 6`` matrix products. The sub-chunk
  bounds the series' intermediate growth: over 256 tokens of slowly decaying state the products lose float32
  precision, over 64 they match transformers to ~1e-6;
* the state entering a sub-chunk is read once (``q @ S0``, ``k_cumdecay @ S0``) and the state leaving it is
  ``S0 * exp(sum g) + (k * decay_to_end)^T @ v_new``, transformers' inter-chunk step.

It continues from the peer's buffers (contract section 12): ``conv_state [batch, conv_dim, conv_kernel]`` (the
last ``conv_kernel`` inputs of the depthwise convolution, as transformers' cache keeps them) and
``recurrent_state [batch, v_heads, k_head_dim, v_head_dim]``. Padded positions (``valid`` false, the graph's
``position_ids == -1``; right padding) leave both untouched: their ``beta`` and ``g`` are zero (no write, no
decay) and the new conv state is the last ``conv_kernel`` *valid* inputs of each row; their output repeats
the row's last valid one, as every other layer's does under the exporter's padding contract.

**Kimi delta attention** (Kimi Linear, Bailing-Hybrid; :func:`kda_step`) is the same rule with a *per-channel*
gate: a head's state ``S [Dk, Dv]`` decays by ``exp(g_t)``, ``g_t [Dk]`` one log decay per key channel. Within a
sub-chunk, with ``G`` the running sum of ``g``, the decay from token ``j`` to token ``i >= j`` is
``exp(G_i - G_j)`` per channel: a ``[T, T, Dk]`` tensor whose exponent is masked to ``i >= j`` before the ``exp``
(never positive, so never overflowing); ``A[i, j] = sum_d beta_i k_id k_jd exp(G_id - G_jd)`` (``i > j``) is
inverted by the same series, and the state leaves the sub-chunk as ``S0 * exp(G_T) + (k * exp(G_T - G))^T @
v_new``, the decay per row of ``S``. Its ``conv_state`` is ``[batch, 3 * heads * head_dim, conv_kernel]`` (q, k and
v convolved as one, as transformers' cache keeps them), its ``recurrent_state [batch, heads, head_dim, head_dim]``;
padding as above.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from qeff_kv.export.modeling.short_conv import causal_conv_step, repeat_last_valid

#: tokens per sub-chunk (transformers' own chunk size); the quadratic form runs within one
SUB_CHUNK = 64
#: the longest chunk a step must handle when the caller gives no bound
DEFAULT_MAX_LEN = 64


def is_gated_delta_mixer(module) -> bool:
    """A transformers gated-delta-net mixer: Qwen3-Next's ``in_proj_qkvz``/``in_proj_ba``, Qwen3.5's split
    ``in_proj_qkv``/``in_proj_z``/``in_proj_b``/``in_proj_a`` or OLMo-Hybrid's ``q/k/v/g/a/b_proj`` projections, with
    ``A_log``, ``dt_bias``, ``conv1d``, a gated norm (``norm`` or ``o_norm``) and an output projection."""
    has_proj = (hasattr(module, "in_proj_qkvz") or hasattr(module, "in_proj_qkv")
                or all(hasattr(module, p) for p in ("q_proj", "k_proj", "v_proj", "g_proj", "a_proj", "b_proj")))
    return has_proj and _norm(module) is not None and _out_proj(module) is not None and \
        all(hasattr(module, a) for a in ("A_log", "dt_bias", "conv1d"))


def _norm(mixer):
    return getattr(mixer, "norm", None) or getattr(mixer, "o_norm", None)


def _out_proj(mixer):
    return getattr(mixer, "out_proj", None) or getattr(mixer, "o_proj", None)


def state_shapes(mixer, batch: int = 1) -> dict[str, tuple[int, ...]]:
    """The mixer's two retained states, by stem: ``conv_state`` and ``recurrent_state`` (contract section 12)."""
    return {"conv_state": (batch, int(mixer.conv_dim), int(mixer.conv_kernel_size)),
            "recurrent_state": (batch, int(mixer.num_v_heads), int(mixer.head_k_dim), int(mixer.head_v_dim))}


def _project(mixer, hidden_states: torch.Tensor):
    """``mixed_qkv [B, conv_dim, T]`` (the convolution's input), ``z [B, T, Hv, Dv]``, ``b``, ``a`` ``[B, T, Hv]``:
    the mixer's own projections, in either layout."""
    bsz, seq = hidden_states.shape[:2]
    if hasattr(mixer, "in_proj_qkvz"):   # Qwen3-Next: heads grouped per key head, reordered by the model's own code
        q, k, v, z, b, a = mixer.fix_query_key_value_ordering(mixer.in_proj_qkvz(hidden_states),
                                                              mixer.in_proj_ba(hidden_states))
        mixed = torch.cat([x.reshape(bsz, seq, -1) for x in (q, k, v)], dim=-1)
    elif hasattr(mixer, "q_proj"):       # OLMo-Hybrid: q, k, v, gate, a, b projections
        mixed = torch.cat([mixer.q_proj(hidden_states), mixer.k_proj(hidden_states), mixer.v_proj(hidden_states)],
                          dim=-1)
        z = mixer.g_proj(hidden_states).reshape(bsz, seq, -1, mixer.head_v_dim)
        b, a = mixer.b_proj(hidden_states), mixer.a_proj(hidden_states)
    else:                                # Qwen3.5: one projection each
        mixed = mixer.in_proj_qkv(hidden_states)
        z = mixer.in_proj_z(hidden_states).reshape(bsz, seq, -1, mixer.head_v_dim)
        b, a = mixer.in_proj_b(hidden_states), mixer.in_proj_a(hidden_states)
    return mixed.transpose(1, 2), z, b, a


def _repeat_heads(x: torch.Tensor, rep: int) -> torch.Tensor:
    """``repeat_interleave(rep, dim=2)`` of ``[B, T, H, D]`` as expand + reshape (head ``h`` serves ``h*rep..``)."""
    if rep == 1:
        return x
    b, t, h, d = x.shape
    return x.unsqueeze(3).expand(b, t, h, rep, d).reshape(b, t, h * rep, d)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def unit_lower_inverse(a: torch.Tensor, max_len: int) -> torch.Tensor:
    """``(I + a)^{-1}`` for ``a`` strictly lower triangular ``[..., T, T]`` with ``T <= max_len``: the product
    ``(I + N)(I + N^2)(I + N^4)...`` of ``N = -a`` (``N^T = 0``, so the series ``sum N^k`` is finite)."""
    idx = torch.arange(a.shape[-1], device=a.device)
    eye = (idx.unsqueeze(1) == idx.unsqueeze(0)).to(a.dtype)
    n = -a
    inv = eye + n
    for _ in range(max(0, math.ceil(math.log2(max(max_len, 2)))) - 1):
        n = n @ n
        inv = inv @ (eye + n)
    return inv


def delta_rule(query, key, value, g, beta, state, max_len: int, sub_chunk=None):
    """The gated delta rule over a chunk of up to ``max_len`` tokens, all ``float32``: ``query``/``key``
    ``[B, H, T, Dk]`` (l2-normalised, query scaled), ``value`` ``[B, H, T, Dv]``, ``g`` (log decay) and ``beta``
    ``[B, H, T]``, ``state`` ``[B, H, Dk, Dv]``. Fixed slices of :data:`SUB_CHUNK` tokens, the state carried from
    one to the next, each slice computed by ``sub_chunk`` (:func:`delta_rule_sub_chunk` by default; KDA's
    :func:`kda_sub_chunk`, whose ``g`` is per key channel). Returns the output ``[B, H, T, Dv]`` and the state
    after the chunk."""
    sub_chunk = sub_chunk or delta_rule_sub_chunk
    outs = []
    tracing = torch.jit.is_tracing()
    for start in range(0, max(int(max_len), 1), SUB_CHUNK):
        if not tracing and start >= query.shape[2]:
            break   # eager: the slices past the chunk are empty (a graph keeps them, empty at run time)
        part = slice(start, start + SUB_CHUNK)
        out, state = sub_chunk(query[:, :, part], key[:, :, part], value[:, :, part], g[:, :, part],
                               beta[:, :, part], state)
        outs.append(out)
    return torch.cat(outs, dim=2), state


def delta_rule_sub_chunk(query, key, value, g, beta, state):
    """One sub-chunk (at most :data:`SUB_CHUNK` tokens, possibly none) in the quadratic form; shapes as
    :func:`delta_rule`."""
    seq = query.shape[2]
    idx = torch.arange(seq, device=query.device)
    lower = idx.unsqueeze(1) >= idx.unsqueeze(0)               # i >= j
    strict = idx.unsqueeze(1) > idx.unsqueeze(0)               # i > j
    cum = g.cumsum(dim=-1)                                      # [B, H, T]
    diff = cum.unsqueeze(-1) - cum.unsqueeze(-2)                # cum_i - cum_j
    zero = torch.zeros_like(diff)
    decay = torch.where(lower, torch.exp(torch.where(lower, diff, zero)), zero)
    k_beta = key * beta.unsqueeze(-1)
    v_beta = value * beta.unsqueeze(-1)
    kk = k_beta @ key.transpose(-1, -2)
    ut = torch.where(strict, kk * decay, torch.zeros_like(kk))
    inv = unit_lower_inverse(ut, SUB_CHUNK)
    new_values = inv @ v_beta
    k_cumdecay = inv @ (k_beta * cum.exp().unsqueeze(-1))
    v_new = new_values - k_cumdecay @ state
    intra = (query @ key.transpose(-1, -2)) * decay
    out = (query * cum.exp().unsqueeze(-1)) @ state + intra @ v_new
    total = g.sum(dim=-1, keepdim=True)                         # [B, H, 1]: 0 for an empty sub-chunk
    to_end = torch.exp(total - cum).unsqueeze(-1)               # decay from each token to the sub-chunk's end
    new_state = state * total.exp().unsqueeze(-1) + (key * to_end).transpose(-1, -2) @ v_new
    return out, new_state


def gated_delta_step(mixer, hidden_states: torch.Tensor, conv_state: torch.Tensor, recurrent_state: torch.Tensor,
                     valid: torch.Tensor, max_len: int = DEFAULT_MAX_LEN):
    """One chunk of ``mixer`` (a transformers gated-delta-net module) continuing from its retained states.

    ``hidden_states [B, T, hidden]``, ``valid [B, T]`` bool (false on right padding), ``max_len``: the longest
    chunk the step must be exact for (the export's prefill length). Returns ``(output [B, T, hidden],
    conv_state, recurrent_state)``, the states in their input dtypes; a padded row's output is its row's last
    valid one (:func:`~qeff_kv.export.modeling.short_conv.repeat_last_valid`)."""
    bsz, seq = hidden_states.shape[:2]
    mixed, z, b, a = _project(mixer, hidden_states)
    mixed, new_conv = causal_conv_step(mixed, conv_state, mixer.conv1d.weight.squeeze(1), mixer.conv1d.bias,
                                       valid, activation=mixer.activation)
    mixed = mixed.transpose(1, 2)
    query, key, value = torch.split(mixed, [mixer.key_dim, mixer.key_dim, mixer.value_dim], dim=-1)
    query = query.reshape(bsz, seq, -1, mixer.head_k_dim)
    key = key.reshape(bsz, seq, -1, mixer.head_k_dim)
    value = value.reshape(bsz, seq, -1, mixer.head_v_dim)
    rep = mixer.num_v_heads // mixer.num_k_heads
    query, key = _repeat_heads(query, rep), _repeat_heads(key, rep)

    keep = valid.unsqueeze(-1)
    beta = b.float().sigmoid()
    if getattr(mixer, "allow_neg_eigval", False):   # OLMo-Hybrid: beta in [0, 2]
        beta = beta * 2.0
    beta = torch.where(keep, beta, torch.zeros_like(beta))
    g = -mixer.A_log.float().exp() * F.softplus(a.float() + mixer.dt_bias)
    g = torch.where(keep, g, torch.zeros_like(g))

    query, key, value, beta, g = (x.transpose(1, 2).float() for x in (query, key, value, beta, g))
    query = _l2norm(query) * (query.shape[-1] ** -0.5)
    key = _l2norm(key)
    out, new_state = delta_rule(query, key, value, g, beta, recurrent_state.float(), max_len)

    out = out.transpose(1, 2).to(hidden_states.dtype)          # [B, T, Hv, Dv]
    shape = out.shape
    out = _norm(mixer)(out.reshape(-1, mixer.head_v_dim), z.reshape(-1, mixer.head_v_dim)).reshape(shape)
    out = _out_proj(mixer)(out.reshape(bsz, seq, -1))
    return repeat_last_valid(out, valid), new_conv, new_state.to(recurrent_state.dtype)


# ----------------------------------------------------- Kimi delta attention (per-channel decay)
_KDA_PARTS = ("q_proj", "k_proj", "v_proj", "conv1d", "forget_gate", "b_proj", "o_norm", "o_proj")


def is_kda_mixer(module) -> bool:
    """A transformers KDA mixer (Kimi Linear's ``KimiLinearDeltaAttention``, Bailing-Hybrid's
    ``BailingHybridDeltaAttention``): q/k/v projections into one depthwise convolution, a per-channel
    ``forget_gate``, ``b_proj`` (beta), an output gate (Kimi's low-rank ``g_a_proj``/``g_b_proj``, Bailing's
    ``g_proj``), the gated norm ``o_norm`` and ``o_proj``."""
    gate = hasattr(module, "g_proj") or (hasattr(module, "g_a_proj") and hasattr(module, "g_b_proj"))
    return gate and all(hasattr(module, p) for p in _KDA_PARTS)


def _output_gate(mixer, hidden_states: torch.Tensor) -> torch.Tensor:
    if hasattr(mixer, "g_proj"):
        return mixer.g_proj(hidden_states)
    return mixer.g_b_proj(mixer.g_a_proj(hidden_states))


def kda_geometry(module) -> tuple[int, int, int]:
    """``(conv_dim, conv_kernel, heads)`` of a KDA mixer module."""
    return int(module.conv1d.weight.shape[0]), int(module.conv1d.weight.shape[-1]), int(module.num_heads)


def _kda_l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """transformers' (and FLA's) ``x / sqrt(sum x^2 + eps)``."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def kda_sub_chunk(query, key, value, g, beta, state):
    """One sub-chunk (at most :data:`SUB_CHUNK` tokens, possibly none), all ``float32``: ``query``/``key``
    ``[B, H, T, Dk]`` (normalised, query scaled), ``value [B, H, T, Dv]``, ``g [B, H, T, Dk]`` (log decay per
    channel), ``beta [B, H, T]``, ``state [B, H, Dk, Dv]``. Returns the output ``[B, H, T, Dv]`` and the state."""
    seq = query.shape[2]
    idx = torch.arange(seq, device=query.device)
    lower = (idx.unsqueeze(1) >= idx.unsqueeze(0)).unsqueeze(-1)      # [T, T, 1]: i >= j
    strict = idx.unsqueeze(1) > idx.unsqueeze(0)                      # [T, T]: i > j
    cum = g.cumsum(dim=2)                                              # [B, H, T, Dk]
    diff = cum.unsqueeze(3) - cum.unsqueeze(2)                         # [B, H, T(i), T(j), Dk]: G_i - G_j
    zero = torch.zeros_like(diff)
    decay = torch.where(lower, torch.exp(torch.where(lower, diff, zero)), zero)
    k_beta = key * beta.unsqueeze(-1)
    v_beta = value * beta.unsqueeze(-1)
    kk = (k_beta.unsqueeze(3) * key.unsqueeze(2) * decay).sum(dim=-1)  # [B, H, T, T]
    inv = unit_lower_inverse(torch.where(strict, kk, torch.zeros_like(kk)), SUB_CHUNK)
    new_values = inv @ v_beta
    k_cumdecay = inv @ (k_beta * cum.exp())
    v_new = new_values - k_cumdecay @ state
    intra = (query.unsqueeze(3) * key.unsqueeze(2) * decay).sum(dim=-1)   # zero above the diagonal
    out = (query * cum.exp()) @ state + intra @ v_new
    total = g.sum(dim=2, keepdim=True)                                 # [B, H, 1, Dk]: 0 for an empty sub-chunk
    new_state = state * total.transpose(-1, -2).exp() + (key * torch.exp(total - cum)).transpose(-1, -2) @ v_new
    return out, new_state


def kda_rule(query, key, value, g, beta, state, max_len: int):
    """The KDA rule over a chunk of up to ``max_len`` tokens in fixed slices of :data:`SUB_CHUNK` (shapes as
    :func:`kda_sub_chunk`, ``T`` any length)."""
    return delta_rule(query, key, value, g, beta, state, max_len, sub_chunk=kda_sub_chunk)


def kda_step(mixer, hidden_states: torch.Tensor, conv_state: torch.Tensor, recurrent_state: torch.Tensor,
             valid: torch.Tensor, max_len: int):
    """One chunk of ``mixer`` (transformers' ``KimiLinearDeltaAttention``) continuing from its retained states.

    ``hidden_states [B, T, hidden]``, ``valid [B, T]`` bool (false on right padding), ``max_len``: the longest
    chunk the step must be exact for. Returns ``(output [B, T, hidden], conv_state, recurrent_state)``; a padded
    row's output is its row's last valid one."""
    bsz, seq = hidden_states.shape[:2]
    heads, dim = int(mixer.num_heads), int(mixer.head_dim)
    mixed = torch.cat([mixer.q_proj(hidden_states), mixer.k_proj(hidden_states), mixer.v_proj(hidden_states)],
                      dim=-1).transpose(1, 2)
    mixed, new_conv = causal_conv_step(mixed, conv_state, mixer.conv1d.weight.squeeze(1), mixer.conv1d.bias,
                                       valid, activation=mixer.activation)
    query, key, value = (x.reshape(bsz, seq, heads, dim) for x in torch.split(mixed.transpose(1, 2), heads * dim, -1))
    keep = valid.reshape(bsz, seq, 1)
    g = mixer.forget_gate(hidden_states).float()                       # [B, T, H, Dk]
    g = torch.where(keep.unsqueeze(-1), g, torch.zeros_like(g))
    beta = torch.sigmoid(mixer.b_proj(hidden_states)).float()          # [B, T, H]
    beta = torch.where(keep, beta, torch.zeros_like(beta))
    query, key, value, g, beta = (x.transpose(1, 2).float() for x in (query, key, value, g, beta))
    query = _kda_l2norm(query) * (dim ** -0.5)
    key = _kda_l2norm(key)
    out, new_state = kda_rule(query, key, value, g, beta, recurrent_state.float(), max_len)
    out = out.transpose(1, 2).to(hidden_states.dtype)                  # [B, T, H, Dv]
    gate = _output_gate(mixer, hidden_states).reshape(bsz, seq, heads, dim)
    out = mixer.o_proj(mixer.o_norm(out, gate).reshape(bsz, seq, -1))
    return repeat_last_valid(out, valid), new_conv, new_state.to(recurrent_state.dtype)
