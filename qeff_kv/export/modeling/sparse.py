"""DeepSeek sparse attention (DSA: DeepSeek-V3.2, GLM-5's ``glm_moe_dsa``): MLA over the positions a lightning indexer
selects, with the indexer's keys retained (contract section 11, ``index_key.{i}``).

transformers' attention (``DeepseekV32Attention``, ``GlmMoeDsaAttention``) is MLA as DeepSeek-V3's, plus an
*indexer* per layer: it writes its own keys ``[B, S, index_head_dim]`` through ``cache.update_indexer``, scores
every cached position ``t`` for each query ``s`` as ``sum_h w[s, h] * relu(q[s, h] . k[t]) * scale`` (plus the
causal mask), and keeps the ``index_topk`` best; attention then masks every other position to the dtype's minimum.
A GLM-5 ``"shared"`` layer has no indexer and reuses the previous layer's selection.

Traced as transformers computes it, that selection would not be a graph: ``min(index_topk, T)`` is a Python
number fixed at the trace's length, and the boolean ``scatter`` does not trace. :func:`sparse_forward` computes the
same arithmetic with the selection in graph form: transformers' own indexer (its RoPE variant, its scores), whose
final ``topk`` is ``TopK`` over the scored slots with ``k = Min(index_topk, T)`` (:class:`TopKIndices`; ``T``: the
slots read, ``ctx_len`` or the onnxruntime target's valid length), and the selected slots marked by a
``ScatterElements`` of ones. Slots the sequence has not written read as zero keys (the
cache's ``update_indexer``), so they score exactly the mask and are chosen only when fewer than ``k`` positions are
visible; attention keeps them masked (the mask is applied after the selection, as transformers does).

Ties: ONNX ``TopK`` keeps the lower position of two equal scores. torch's CPU ``topk`` keeps no particular one (its
choice changes with the row's length), so transformers itself picks differently for the same scores at another
cache length. Exact ties arise when every indexer head scores two positions below zero (both score exactly 0);
they change the selection only when they straddle the ``index_topk`` boundary, which a trained indexer's many heads
make vanishingly rare (all ``index_n_heads`` of them negative for both positions).
"""

from __future__ import annotations

import contextlib
import types

import torch

from qeff_kv.errors import ExportError
from qeff_kv.export import transformers_adapter as hf

#: attributes of transformers' DSA attention modules that :func:`sparse_forward` reads
_DSA_ATTRS = ("indexer", "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj",
              "o_proj", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank", "scaling", "layer_idx")


class TopKIndices(torch.autograd.Function):
    """``TopK(scores, k = Min(topk, Shape(scores)[-1]), axis -1, largest, sorted)``'s indices: the ``topk`` best
    slots of each row, or every slot of a shorter row (the length is the graph's, not the trace's)."""

    @staticmethod
    def forward(ctx, scores, topk):  # noqa: D401
        return torch.topk(scores, min(int(topk), scores.shape[-1]), dim=-1).indices

    @staticmethod
    def symbolic(g, scores, topk):
        width = g.op("Gather", g.op("Shape", scores), g.op("Constant", value_t=torch.tensor([-1])), axis_i=0)
        k = g.op("Min", width, g.op("Constant", value_t=torch.tensor([int(topk)], dtype=torch.int64)))
        _, indices = g.op("TopK", scores, k, axis_i=-1, largest_i=1, sorted_i=1, outputs=2)
        return indices


@contextlib.contextmanager
def graph_topk(topk: int):
    """Inside: ``Tensor.topk`` (the indexer's last step, ``index_scores.topk(min(index_topk, T))``) is
    :class:`TopKIndices` with ``k = Min(topk, T)`` in the graph, whatever ``k`` the Python code computed."""
    original = torch.Tensor.topk

    def topk_indices(scores, k, dim=-1, largest=True, sorted=True):
        return types.SimpleNamespace(indices=TopKIndices.apply(scores, int(topk)))

    torch.Tensor.topk = topk_indices
    try:
        yield
    finally:
        torch.Tensor.topk = original


def selected_slots(indexer, hidden_states, q_resid, position_embeddings, mask, position_ids, cache) -> torch.Tensor:
    """``[B, S, T]`` bool: the slots the layer's indexer selects for each query (transformers' own indexer, its
    keys written through ``cache.update_indexer``, its ``topk`` in graph form: :func:`graph_topk`)."""
    with graph_topk(indexer.index_topk):
        indices = indexer(hidden_states, q_resid, position_embeddings, mask, position_ids, cache=cache).long()
    hits = torch.zeros_like(mask).scatter(-1, indices, torch.ones_like(indices, dtype=mask.dtype))
    return hits > 0


def sparse_forward(self, hidden_states, position_embeddings, attention_mask, **kwargs):
    """A DSA attention module's forward with the selection in graph form (see the module docstring). Returns what
    the module's own forward returns: ``(output, None)``, and the selection third on a module that passes it on
    to the next layer (GLM-5, whose ``"shared"`` layers reuse it)."""
    cache = hf.attention_cache(kwargs)
    prev = kwargs.pop("prev_topk_indices", None)
    bsz, seq = hidden_states.shape[:-1]
    nope, rope = self.qk_nope_head_dim, self.qk_rope_head_dim
    q_resid = self.q_a_layernorm(self.q_a_proj(hidden_states))
    q = self.q_b_proj(q_resid).view(bsz, seq, -1, nope + rope).transpose(1, 2)
    q_pass, q_rot = torch.split(q, [nope, rope], dim=-1)
    kv_pass, k_rot = torch.split(self.kv_a_proj_with_mqa(hidden_states), [self.kv_lora_rank, rope], dim=-1)
    k_pass = self.kv_a_layernorm(kv_pass).view(bsz, 1, seq, self.kv_lora_rank)
    k_rot = k_rot.view(bsz, 1, seq, rope)
    cos, sin = position_embeddings
    q_rot, k_rot = hf.modeling_module(self).apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin)
    k_pass, k_rot = cache.update(k_pass, k_rot, self.layer_idx)                 # [B, 1, T, rank], [B, 1, T, rope]
    query = torch.cat((q_pass, q_rot), dim=-1)
    kv = self.kv_b_proj(k_pass).view(bsz, k_pass.shape[2], -1, nope + self.v_head_dim).transpose(1, 2)
    k_nope, value = torch.split(kv, [nope, self.v_head_dim], dim=-1)
    key = torch.cat((k_nope, k_rot.expand(-1, k_nope.shape[1], -1, -1)), dim=-1)
    if self.indexer is not None:
        selected = selected_slots(self.indexer, hidden_states, q_resid, position_embeddings, attention_mask[:, 0],
                                  kwargs.pop("position_ids", None), cache)
    else:
        selected = prev
    mask = attention_mask.masked_fill(~selected.unsqueeze(1), torch.finfo(hidden_states.dtype).min)
    attend = hf.attention_function(self)
    out, _ = attend(self, query, key, value, mask, dropout=0.0, scaling=self.scaling)
    out = self.o_proj(out.reshape(bsz, seq, -1))
    return (out, None, selected) if hasattr(self, "skip_topk") else (out, None)


def sparse_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's DSA attention modules (every attribute :func:`sparse_forward` reads)."""
    return [m for m in model.modules() if all(hasattr(m, a) for a in _DSA_ATTRS)]


@contextlib.contextmanager
def sparse_attention(model: torch.nn.Module, num_layers: int = 0):
    """Inside: every DSA attention module of ``model`` runs :func:`sparse_forward` (none: nothing changes).
    ``num_layers`` (the facts say the model has DeepSeek sparse attention): refuses (one line) a model whose layers
    are not all attention this module knows, whose selection would otherwise be traced at the trace's length."""
    found = sparse_modules(model)
    if num_layers and len(found) != num_layers:
        raise ExportError(f"{type(model).__name__}'s attention is not DeepSeek sparse attention this exporter knows "
                          f"(an MLA module with an indexer) in every layer ({len(found)} of {num_layers}); its "
                          f"selection cannot be traced")
    with hf.patched_forwards(found, sparse_forward):
        yield
