"""``--mla-cache latent``: multi-head latent attention over the compressed cache (contract section 11).

DeepSeek-V3's attention (transformers' ``DeepseekV3Attention``) writes its compressed latent ``kv_nope
[B, 1, S, kv_lora_rank]`` (after ``kv_a_layernorm``) and its rotated shared key ``k_pe [B, 1, S, qk_rope_head_dim]``
through the cache, then expands the whole cache through ``kv_b_proj`` into per-head keys and values at every
step. With a latent cache the graph retains exactly that pair under the contract's names (``compressed_kv.{i}``,
``k_pe.{i}``; :class:`~qeff_kv.contract.statespec.LatentKind`) and never expands it: attention is *absorbed*.

With ``W = kv_b_proj.weight`` viewed per head as ``[H, qk_nope + v_head, kv_lora_rank]``, ``W_uk = W[:, :qk_nope]``
(the key half) and ``W_uv = W[:, qk_nope:]`` (the value half):

* scores ``= ((q_nope @ W_uk) @ compressed_kv^T + q_pe @ k_pe^T) * scaling + mask``: the nope query is taken into
  the latent space per head (``[B, H, S, kv_lora_rank]``), so the cache is read as one shared head;
* output ``= (softmax(scores) @ compressed_kv) @ W_uv^T``: values are the attention over the latent times the
  value half, per head.

That is the model's own arithmetic reassociated (``q . (W_uk c) = (q W_uk) . c``), so tokens equal transformers'.
The cache writes go through the target's cache object (:class:`~qeff_kv.export.modeling.caches.RetainedStateCache`:
one ScatterND per buffer by ``position_ids``, rows by ``batch_index``, padded rows repeating the last valid one),
exactly as for ordinary KV. The patch is a context manager around tracing that sets each MLA attention module's
``forward``; the model is left as it was.
"""

from __future__ import annotations

import contextlib

import torch

from qeff_kv.errors import ExportError
from qeff_kv.export import transformers_adapter as hf

#: attributes of transformers' MLA attention modules (DeepSeek-V2/V3) that the absorbed forward reads
_MLA_ATTRS = ("kv_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_lora_rank", "qk_nope_head_dim",
              "qk_rope_head_dim", "v_head_dim", "num_heads", "scaling", "layer_idx", "o_proj")


def _rope(module: torch.nn.Module):
    """The rotary function of the module's modeling file, looked up at call time (so the target's patches of
    ``rotate_half`` / ``apply_rotary_pos_emb`` apply), interleaved when the config says ``rope_interleave``."""
    modeling = hf.modeling_module(module)
    if getattr(module.config, "rope_interleave", False):
        return modeling.apply_rotary_pos_emb_interleave
    return modeling.apply_rotary_pos_emb


def absorbed_projections(module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """``(W_uk [H, qk_nope, kv_lora_rank], W_uv^T [H, kv_lora_rank, v_head])``: the key and value halves of
    ``kv_b_proj`` per head (the value half transposed for the output product)."""
    heads, nope, v = module.num_heads, module.qk_nope_head_dim, module.v_head_dim
    w = module.kv_b_proj.weight.view(heads, nope + v, module.kv_lora_rank)
    return w[:, :nope], w[:, nope:].transpose(1, 2)


def latent_forward(self, hidden_states, position_embeddings, attention_mask, **kwargs):
    """``DeepseekV3Attention.forward`` with attention over the compressed cache (see the module docstring)."""
    cache = hf.attention_cache(kwargs)
    bsz, seq = hidden_states.shape[:-1]
    nope, rope_dim = self.qk_nope_head_dim, self.qk_rope_head_dim
    if getattr(self, "q_lora_rank", None) is None:
        q = self.q_proj(hidden_states)
    else:
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
    q = q.view(bsz, seq, -1, nope + rope_dim).transpose(1, 2)                    # [B, H, S, nope + rope]
    q_nope, q_pe = torch.split(q, [nope, rope_dim], dim=-1)
    kv = self.kv_a_proj_with_mqa(hidden_states)
    latent, k_pe = torch.split(kv, [self.kv_lora_rank, rope_dim], dim=-1)
    latent = self.kv_a_layernorm(latent).view(bsz, 1, seq, self.kv_lora_rank)
    k_pe = k_pe.view(bsz, 1, seq, rope_dim)
    cos, sin = position_embeddings
    q_pe, k_pe = _rope(self)(q_pe, k_pe, cos, sin)
    # the retained pair: compressed_kv [B, 1, T, kv_lora_rank], k_pe [B, 1, T, rope] (T: the slots attended)
    latent, k_pe = cache.update(latent, k_pe, self.layer_idx)
    w_uk, w_uv_t = absorbed_projections(self)
    q_latent = torch.matmul(q_nope, w_uk)                                      # [B, H, S, kv_lora_rank]
    scores = torch.matmul(q_latent, latent.transpose(-1, -2)) + torch.matmul(q_pe, k_pe.transpose(-1, -2))
    scores = scores * self.scaling
    if attention_mask is not None:
        scores = scores + attention_mask
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)                 # [B, H, S, T]
    out = torch.matmul(torch.matmul(probs, latent), w_uv_t)                    # [B, H, S, v_head]
    out = out.transpose(1, 2).reshape(bsz, seq, -1)
    return self.o_proj(out), None


def mla_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's MLA attention modules (those with every attribute the absorbed forward reads)."""
    return [m for m in model.modules() if all(hasattr(m, a) for a in _MLA_ATTRS)]


@contextlib.contextmanager
def latent_attention(model: torch.nn.Module, num_layers: int):
    """Inside: every MLA attention module runs :func:`latent_forward`. Refuses (one line) a model whose layers are
    not all MLA attention this exporter knows (DeepSeek-V3's: rotary through ``apply_rotary_pos_emb``)."""
    found = [m for m in mla_modules(model)
             if hasattr(hf.modeling_module(m), "apply_rotary_pos_emb")]
    if len(found) != num_layers:
        raise ExportError(f"--mla-cache latent: {type(model).__name__}'s attention is not DeepSeek-V3's MLA (rotary "
                          f"through apply_rotary_pos_emb) in every layer ({len(found)} of {num_layers}); it cannot "
                          f"be absorbed")
    with hf.patched_forwards(found, latent_forward):
        yield
