"""The traced wrapper: a transformers causal LM as ``(input_ids, position_ids, *past, [comp_ctx_lengths],
[batch_index]) -> (logits, *retained)``.

One generic mechanism for every architecture, through transformers' own interfaces: the export target
(:mod:`qeff_kv.export.targets`) gives the cache object (whose ``update()`` writes each layer's new
keys/values into its retained buffer) and the ready 4D attention mask; the wrapper splits the graph inputs, calls
the decoder, and takes the logits only at the last valid position of each row (``[batch, 1, vocab]``), through the
model's own output head and its logit scaling/soft-capping. A speculative-decoding graph
(``speculative=True``, the "target language model" of QEfficient) takes a last input ``num_logits_to_keep``
``[n, 1]`` and returns the logits of the ``n`` rows ending at each row's last valid one (``[batch, n, vocab]``;
the first row clamped at 0): ``n = 1`` for prefill, ``n = K+1`` to verify ``K`` drafted tokens in one step.
:class:`VisionLanguageLM` is the same step for a vision-language model: the image rows merged into the
embeddings (:mod:`qeff_kv.export.modeling.vlm`) before the decoder runs.

This module imports torch; nothing outside :mod:`qeff_kv.export` imports it.
"""

from __future__ import annotations

import contextlib

import torch

from qeff_kv.export.modeling import recurrent, vlm
from qeff_kv.export import transformers_adapter as hf
from qeff_kv.export.modeling.caches import SlidingPlan
from qeff_kv.export.modeling.graph_ops import HeadGemm, LengthOf
from qeff_kv.export.modeling.masks import fill_padding_rows
from qeff_kv.export.targets.base import StepInputs, Target


def output_head(head: torch.nn.Module, hidden_last: torch.Tensor, rows: bool = False) -> torch.Tensor:
    """``[B, 1, H] -> [B, 1, V]`` through the model's output head; a plain ``nn.Linear`` head becomes one
    ``Gemm(transB=1)`` on ``[B, H]`` (see :class:`~qeff_kv.export.modeling.graph_ops.HeadGemm`), any other head module is
    called as is. ``rows``: ``[B, n, H] -> [B, n, V]`` (the Gemm on ``[B*n, H]``)."""
    if type(head) is torch.nn.Linear:
        if rows:
            flat = HeadGemm.apply(hidden_last.reshape(-1, hidden_last.shape[-1]), head.weight, head.bias)
            return flat.reshape(hidden_last.shape[0], -1, flat.shape[-1])
        return HeadGemm.apply(hidden_last[:, 0], head.weight, head.bias).unsqueeze(1)   # no If: static index
    return head(hidden_last)


def kept_rows(last: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``[B, n]``: the ``n = len(keep)`` row indices ending at each row's last valid one ``last [B, 1]``, the first
    clamped at 0 (``keep``: the ``num_logits_to_keep`` input, ``[n, 1]``; only its length is read)."""
    steps = torch.cumsum(torch.ones_like(keep[:, 0]), 0) - 1                    # [n] = 0..n-1, from Shape(keep)
    count = steps.shape[0]
    first = torch.clamp(last + 1 - count, min=0)                              # [B, 1]
    return first + steps.unsqueeze(0)


class RetainedStateLM(torch.nn.Module):
    """``(input_ids, position_ids, *past, [comp_ctx_lengths], [batch_index]) -> (logits, *retained)`` around a
    causal LM, for one :class:`~qeff_kv.export.targets.base.Target`."""

    def __init__(self, model: torch.nn.Module, num_layers: int, continuous_batching: bool, *, target: Target,
                 facts, ccl: bool = False, speculative: bool = False, spec=None, hidden: bool = False):
        super().__init__()
        #: what each layer retains (:class:`~qeff_kv.contract.statespec.StateSpec`), in graph order: how the KV inputs split
        #: into attention pairs and recurrent states (``None``: one key/value pair per layer)
        self.spec = spec
        #: the recurrent mixers' facts (:class:`~qeff_kv.export.facts.recurrent_facts.RecurrentFacts`), ``None`` without
        self.recurrent = facts.recurrent
        self.lm = model
        self.num_layers = num_layers
        self.continuous_batching = continuous_batching
        #: the graph takes ``comp_ctx_lengths`` (after the KV inputs, before ``batch_index``) and attends over
        #: its length only (onnxruntime target: the smaller of that and the valid length)
        self.ccl = ccl
        self.target = target
        #: the graph takes ``num_logits_to_keep`` last and returns that many rows of logits
        self.speculative = speculative
        #: one more output, last: ``hidden_last`` (the final hidden state at the logits' rows; embeddings)
        self.hidden = hidden
        # What the model's own forward does to the head's output (see ModelFacts): Cohere multiplies by
        # logit_scale, Granite divides by logits_scaling, Gemma2 soft-caps.
        self.logit_scale = facts.logit_scale
        self.logits_scaling = facts.logits_scaling
        self.softcap = facts.final_logit_softcapping
        #: LoRA adapters mixed per row (:class:`~qeff_kv.export.modeling.lora.Routing`): its inputs come last
        self.lora = None

    @property
    def sliding(self) -> SlidingPlan:
        return self.target.sliding

    def forward(self, input_ids, position_ids, *rest):
        return self.run(input_ids, position_ids, rest)

    def run(self, input_ids, position_ids, rest, inputs_embeds=None, blocks=None, rope_rows=None):
        """The traced step: ``rest`` is the KV inputs (then ``comp_ctx_lengths``, then ``batch_index``).
        ``inputs_embeds`` ``[B, S, H]`` (vision-language graphs: text embeddings with image rows merged in)
        replaces the embedding of ``input_ids``; a padded row takes its sequence's last valid row's, as its id
        and position do (:func:`~qeff_kv.export.modeling.masks.fill_padding`). ``blocks [B, S]``: bidirectional image
        blocks for every mask (:func:`~qeff_kv.export.modeling.masks.build_attention_mask`). ``rope_rows [3, B, S]``:
        multimodal RoPE positions; the decoder then gets ``position_ids [4, B, S]`` (the text positions first, as
        transformers' Qwen2.5-VL takes them), padded rows repeating their sequence's last valid row."""
        pad_rows = self.target.fills_padding
        rest, adapters = self._adapter_inputs(list(rest))
        if rope_rows is not None and pad_rows:
            rope_rows = fill_padding_rows(rope_rows.permute(1, 2, 0), position_ids).permute(2, 0, 1)
        rest = list(rest)
        keep = rest.pop() if self.speculative else None
        if self.continuous_batching:
            *flat, batch_index = rest
        else:
            flat, batch_index = list(rest), None
        ccl_length = LengthOf.apply(flat.pop()) if self.ccl else None    # [L] = Shape(comp_ctx_lengths)
        past, states = self._split(flat)
        last = position_ids.argmax(dim=1, keepdim=True)                          # [B, 1] last valid row
        # the activations' dtype: the KV buffers', or the model's where they are int8 (--kv-cache-dtype int8)
        dtype = flat[0].dtype if flat[0].is_floating_point() else next(self.lm.parameters()).dtype
        is_pad = position_ids < 0
        if inputs_embeds is not None and pad_rows:
            inputs_embeds = fill_padding_rows(inputs_embeds, position_ids)
        step = self.target.begin(StepInputs(input_ids, position_ids, past, flat, batch_index, ccl_length, is_pad,
                                            dtype, blocks))
        cache = step.cache
        base = hf.decoder(self.lm)
        rec = None if self.recurrent is None else recurrent.RecurrentStep(states, is_pad, batch_index, self.recurrent)
        mixers = contextlib.nullcontext() if rec is None else recurrent.mixers_routed(self.lm, rec)
        with self.target.tracing(cache), mixers, adapters:
            tokens = dict(input_ids=step.input_ids) if inputs_embeds is None else dict(inputs_embeds=inputs_embeds)
            model_pos = step.position_ids if rope_rows is None else torch.cat([step.position_ids.unsqueeze(0),
                                                                               rope_rows])
            out = base(**tokens, position_ids=model_pos, attention_mask=step.mask, use_cache=True,
                       **hf.with_cache(base, cache))
        self.target.finish(cache)
        hidden = out[0] if isinstance(out, tuple) else out.last_hidden_state
        if keep is None:
            idx = last.unsqueeze(-1).expand(hidden.shape[0], 1, hidden.shape[-1])
        else:
            idx = kept_rows(last, keep).unsqueeze(-1).expand(-1, -1, hidden.shape[-1])
        hidden_last = torch.gather(hidden, 1, idx)                              # [B, 1 or n, H]
        logits = output_head(self.lm.get_output_embeddings(), hidden_last, rows=keep is not None)
        if self.logit_scale is not None:
            logits = logits * self.logit_scale
        if self.logits_scaling is not None:
            logits = logits / self.logits_scaling
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return (logits, *self._retained(cache, rec), *((hidden_last,) if self.hidden else ()))

    def _adapter_inputs(self, rest: list) -> tuple[list, contextlib.AbstractContextManager]:
        """``rest`` without the adapter inputs (the last ones: ``lora_ids``, ``lora_scales``, then A and B per
        adapted module), and the context in which the adapted modules add their per-row delta."""
        if self.lora is None:
            return rest, contextlib.nullcontext()
        n = 2 + 2 * len(self.lora)
        ids, scales, *weights = rest[-n:]
        return rest[:-n], self.lora.active(ids, scales, weights)

    def _split(self, flat: list) -> tuple[list, dict]:
        """The KV inputs as ``past[layer] = (key, value)`` (``None`` for a layer that does not attend) and
        ``states[layer] = (conv_state, recurrent_state)``, in the state spec's graph order."""
        if self.spec is None:
            return [(flat[2 * i], flat[2 * i + 1]) for i in range(self.num_layers)], {}
        past: list = [None] * self.num_layers
        states: dict = {}
        k = 0
        for layer in self.spec.layers:
            bufs = tuple(flat[k:k + len(layer.stems)])
            k += len(layer.stems)
            if layer.kind == "recurrent":
                states[layer.layer] = bufs
            else:
                past[layer.layer] = bufs
        return past, states

    def _retained(self, cache, rec) -> list:
        """The retained outputs in the order of the inputs."""
        layers = self.spec.layers if self.spec is not None else []
        retained = []
        if self.spec is None:
            for i, kv in enumerate(cache.retained):
                if kv is None:
                    raise RuntimeError(f"layer {i} did not update its cache")
                retained.extend(kv)
            return retained
        for layer in layers:
            if layer.kind == "recurrent":
                retained.extend(rec.outputs(layer.layer))
                continue
            kv = cache.retained[layer.layer]
            if kv is None:
                raise RuntimeError(f"layer {layer.layer} did not update its cache")
            retained.extend(kv)
        return retained


class VisionLanguageLM(RetainedStateLM):
    """The language graph of a vision-language model (dual layout), or the whole model (``single_graph``).

    Inputs in the peer's order: dual ``(input_ids, vision_embeds, position_ids, image_idx, *KV, [batch_index])``,
    single ``(input_ids, position_ids, pixel_values, image_idx, *KV, [batch_index])``. Outputs: ``(logits,
    vision_embeds | pixel_values, image_idx_output, *KV_RetainedState)``."""

    def __init__(self, model: torch.nn.Module, num_layers: int, continuous_batching: bool, *, image_token_id: int,
                 single_graph: bool = False, image_blocks: bool = False, mrope: bool = False, grid=None, **kwargs):
        super().__init__(model, num_layers, continuous_batching, **kwargs)
        self.image_token_id = int(image_token_id)
        self.single_graph = single_graph
        #: image tokens attend to each other both ways within an image (Gemma3)
        self.image_blocks = image_blocks
        #: ``position_ids [4, B, S]``: text positions, then the multimodal RoPE rows (Qwen2.5-VL)
        self.mrope = mrope
        #: the single graph's fixed patch grid (see :class:`~qeff_kv.export.modeling.vlm.VisionEncoder`)
        self.grid = grid

    def forward(self, input_ids, first, second, *rest):
        if self.single_graph:
            position_ids, pixel_values = first, second
            image_idx, *rest = rest
            vision_embeds = vlm.image_features(self.lm, pixel_values, vlm.grid_tensor(self.grid))
            retained_input = pixel_values
        else:
            vision_embeds, position_ids = first, second
            image_idx, *rest = rest
            retained_input = vision_embeds
        rope_rows = None
        if self.mrope:
            position_ids, rope_rows = position_ids[0], position_ids[1:]
        text = self.lm.get_input_embeddings()(input_ids)
        merged, image_idx_out = vlm.merge_image_rows(text, input_ids, position_ids, vision_embeds, image_idx,
                                                     self.image_token_id)
        blocks = vlm.image_blocks(input_ids, position_ids, self.image_token_id) if self.image_blocks else None
        logits, *kv = self.run(input_ids, position_ids, rest, inputs_embeds=merged, blocks=blocks,
                               rope_rows=rope_rows)
        return (logits, retained_input, image_idx_out, *kv)
