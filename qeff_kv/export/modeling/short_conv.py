"""Causal depthwise convolution continuing from a retained ``conv_state``, and LFM2's short-conv mixer on it.

transformers keeps a convolution's state as the last ``conv_kernel`` inputs (``[batch, channels, kernel]``,
contract section 12: ``conv_state.{i}``) and runs a prefill chunk and a decode token through two code paths
(``causal_conv1d_fn`` on a fresh sequence, ``causal_conv1d_update`` per token). One step serves both here: the
chunk is appended to the state, convolved without padding, and the new state is the last ``kernel`` inputs that
were *valid* in each row, so right padding (``position_ids == -1``) leaves the state as it was.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qeff_kv.export import transformers_adapter as hf


def causal_conv_step(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias, valid: torch.Tensor,
                     activation: str | None = None):
    """``x [B, C, T]`` convolved causally after ``conv_state [B, C, K]`` with the depthwise ``weight [C, K]``.

    ``valid [B, T]`` bool marks each row's tokens (a prefix of the row). Returns ``(y [B, C, T], new_state)``:
    ``y`` as transformers' convolution (then ``activation``), ``new_state`` the last ``K`` valid inputs."""
    kernel = conv_state.shape[-1]
    full = torch.cat([conv_state.to(x.dtype), x], dim=-1)          # [B, C, K + T]
    y = F.conv1d(full, weight.unsqueeze(1).to(x.dtype), bias, groups=x.shape[1])[..., 1:]
    if activation is not None:
        y = hf.activation(activation)(y)
    # the valid inputs of row b end at K + n_b in ``full``; keep the K before that
    n_valid = valid.to(torch.int64).sum(dim=-1)                     # [B]
    offsets = torch.arange(kernel, device=x.device)
    index = (n_valid.unsqueeze(-1) + offsets).unsqueeze(1).expand(-1, full.shape[1], -1)
    new_state = torch.gather(full, 2, index).to(conv_state.dtype)
    return y, new_state


def repeat_last_valid(out: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``out [B, T, H]`` with each padded row replaced by its row's last valid one. The exporter's padding
    contract: a padded position repeats its sequence's last valid token (id, position, every hidden state), so
    the attention layer after a recurrent one writes the same key and value into the same slot; a recurrent
    mixer's own output at a padded row (its state untouched) would differ and overwrite that slot."""
    last = torch.clamp(valid.to(torch.int64).sum(dim=-1) - 1, min=0)             # [B]
    rows = torch.gather(out, 1, last.reshape(-1, 1, 1).expand(-1, 1, out.shape[-1]))
    return torch.where(valid.unsqueeze(-1), out, rows)


def is_short_conv_mixer(module) -> bool:
    """LFM2's short-conv mixer (``in_proj`` to ``B, C, x``, depthwise ``conv``, ``out_proj``)."""
    conv = getattr(module, "conv", None)
    return (isinstance(conv, torch.nn.Conv1d) and hasattr(module, "in_proj") and hasattr(module, "out_proj")
            and hasattr(module, "conv_kernel_size"))


def state_shapes(mixer, batch: int = 1) -> dict[str, tuple[int, ...]]:
    """The short-conv layer's one retained state: ``conv_state [batch, hidden, L_cache]``."""
    return {"conv_state": (batch, int(mixer.conv.in_channels), int(mixer.conv_kernel_size))}


def short_conv_step(mixer, hidden_states: torch.Tensor, conv_state: torch.Tensor, valid: torch.Tensor):
    """One chunk of LFM2's short-conv ``mixer`` continuing from ``conv_state``: ``out_proj(C * conv(B * x))``.
    Returns ``(output [B, T, hidden], conv_state)``; a padded row's output is its row's last valid one
    (:func:`repeat_last_valid`)."""
    bcx = mixer.in_proj(hidden_states).transpose(-1, -2)
    b, c, x = bcx.chunk(3, dim=-2)
    y, new_state = causal_conv_step(b * x, conv_state, mixer.conv.weight.squeeze(1), mixer.conv.bias, valid)
    out = mixer.out_proj((c * y).transpose(-1, -2).contiguous())
    return repeat_last_valid(out, valid), new_state
