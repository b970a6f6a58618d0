"""Kimi delta attention (Kimi Linear's KDA) as one traceable step over a chunk of any length.

KDA is the gated delta rule with a *per-channel* gate: the state ``S [Dk, Dv]`` of a head decays by
``exp(g_t)`` with ``g_t [Dk]`` one log decay per key channel (the gated delta net has one per head). transformers'
torch path (``chunk_kimi_delta_attention``) loops in Python over sub-chunks of 64 tokens whose count follows the
prompt and, within one, over its rows to invert the triangular system; a decode token goes through a second,
per-token function. :func:`kda_step` computes a chunk with no loop over tokens, in the form of
:mod:`.gated_delta`:

* fixed sub-chunk slices ``[0, 64)``, ``[64, 128)``... as many as the export's prefill length needs (a slice
  past the chunk's end is empty at run time);
* within a sub-chunk, with ``G`` the running sum of ``g`` (``[T, Dk]``), the decay from token ``j`` to token
  ``i >= j`` is ``exp(G_i - G_j)`` per channel: a ``[T, T, Dk]`` tensor whose exponent is masked to ``i >= j``
  before the ``exp`` (so it is ``<= 0`` and never overflows). ``A[i, j] = sum_d beta_i k_id k_jd exp(G_id - G_jd)``
  (``i > j``) and ``(I + A)^{-1}`` is :func:`~qeff_kv.export.modeling.gated_delta.unit_lower_inverse` (no
  ``solve_triangular``);
* the state entering a sub-chunk is read through ``q * exp(G)`` and ``k_cumdecay``; the state leaving it is
  ``S0 * exp(G_T) + (k * exp(G_T - G))^T @ v_new``, transformers' inter-chunk step with the decay per row of ``S``.

State (contract section 12): ``conv_state [batch, 3 * heads * head_dim, conv_kernel]`` (the q, k and v
convolutions' inputs concatenated, as transformers' cache keeps them) and ``recurrent_state [batch, heads,
head_dim, head_dim]``. Padded positions (``valid`` false) leave both untouched: their ``beta`` and ``g`` are zero;
their output repeats the row's last valid one.
"""

from __future__ import annotations

import torch

from qeff_kv.export.modeling.gated_delta import SUB_CHUNK, unit_lower_inverse
from qeff_kv.export.modeling.short_conv import causal_conv_step, repeat_last_valid

_MIXER_PARTS = ("q_proj", "k_proj", "v_proj", "conv1d", "forget_gate", "b_proj", "o_norm", "o_proj")


def is_kda_mixer(module) -> bool:
    """A transformers KDA mixer (Kimi Linear's ``KimiLinearDeltaAttention``, Bailing-Hybrid's
    ``BailingHybridDeltaAttention``): q/k/v projections into one depthwise convolution, a per-channel
    ``forget_gate``, ``b_proj`` (beta), an output gate (Kimi's low-rank ``g_a_proj``/``g_b_proj``, Bailing's
    ``g_proj``), the gated norm ``o_norm`` and ``o_proj``."""
    gate = hasattr(module, "g_proj") or (hasattr(module, "g_a_proj") and hasattr(module, "g_b_proj"))
    return gate and all(hasattr(module, p) for p in _MIXER_PARTS)


def _output_gate(mixer, hidden_states: torch.Tensor) -> torch.Tensor:
    if hasattr(mixer, "g_proj"):
        return mixer.g_proj(hidden_states)
    return mixer.g_b_proj(mixer.g_a_proj(hidden_states))


def geometry(module) -> tuple[int, int, int]:
    """``(conv_dim, conv_kernel, heads)`` of a KDA mixer module."""
    return int(module.conv1d.weight.shape[0]), int(module.conv1d.weight.shape[-1]), int(module.num_heads)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
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
    outs = []
    tracing = torch.jit.is_tracing()
    for start in range(0, max(int(max_len), 1), SUB_CHUNK):
        if not tracing and start >= query.shape[2]:
            break   # eager: the slices past the chunk are empty (a graph keeps them, empty at run time)
        part = slice(start, start + SUB_CHUNK)
        out, state = kda_sub_chunk(query[:, :, part], key[:, :, part], value[:, :, part], g[:, :, part],
                                   beta[:, :, part], state)
        outs.append(out)
    return torch.cat(outs, dim=2), state


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
    query = _l2norm(query) * (dim ** -0.5)
    key = _l2norm(key)
    out, new_state = kda_rule(query, key, value, g, beta, recurrent_state.float(), max_len)
    out = out.transpose(1, 2).to(hidden_states.dtype)                  # [B, T, H, Dv]
    gate = _output_gate(mixer, hidden_states).reshape(bsz, seq, heads, dim)
    out = mixer.o_proj(mixer.o_norm(out, gate).reshape(bsz, seq, -1))
    return repeat_last_valid(out, valid), new_conv, new_state.to(recurrent_state.dtype)
