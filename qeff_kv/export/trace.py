"""The trace stage: the loaded model, wrapped for its target, through the TorchScript exporter into one raw graph.

:func:`trace_language` reads as its steps: what each layer writes (:func:`~qeff_kv.export.modeling.caches.probe_kv_shapes`)
and so retains (:func:`~qeff_kv.contract.statespec.for_export`), the graph's inputs in the peer's order
(:class:`GraphIO`: token inputs, the vision inputs of :func:`~qeff_kv.export.modeling.vlm.language_inputs`, the KV buffers,
``comp_ctx_lengths``, ``batch_index``), the target (:mod:`qeff_kv.export.targets`) and the wrapper, then
:func:`run_exporter`.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from qeff_kv.support import limits
from qeff_kv.contract import naming, statespec
from qeff_kv.errors import ExportError
from qeff_kv.export.modeling import caches, mla, moe, rope, sparse
from qeff_kv.export.modeling import lora as lora_mod
from qeff_kv.export.adapters.plan import LoraPlan
from qeff_kv.export import targets
from qeff_kv.export.modeling import recurrent as recurrent_mod
from qeff_kv.export import transformers_adapter as hf
from qeff_kv.export import options as opt
from qeff_kv.export.modeling.caches import SlidingPlan
from qeff_kv.export.wrapper import RetainedStateLM, VisionLanguageLM


@dataclass
class GraphIO:
    """The example inputs of the trace, their names, the output names and the dynamic axes."""

    args: list
    in_names: list[str]
    out_names: list[str] = field(default_factory=lambda: ["logits"])
    dyn: dict[str, dict[int, str]] = field(default_factory=dict)


def trace_language(model, options: opt.ExportOptions, path: Path, facts, vision: dict | None = None, *,
                   export_params: bool = True, kv_scales: list | None = None) -> dict:
    """Trace the wrapped model into ``path``; return the export's geometry (``state_spec`` included).
    ``vision``: a vision-language model's geometry (:func:`~qeff_kv.export.modeling.vlm.vision_geometry`).
    ``export_params=False``: the parameters stay graph inputs without data (the streaming export,
    :mod:`.stream`, attaches them from the checkpoint)."""
    text_cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    num_layers = int(text_cfg.num_hidden_layers)
    hf.find_decoder(model)
    kv_shapes = _kv_shapes(model, options, num_layers, facts)
    latent = options.mla_cache == "latent"
    spec = statespec.for_export(kv_shapes, window=facts.sliding_window,
                                ring_layers=facts.ring_layers(options), sliding_layers=facts.sliding_layers,
                                latent_layers=range(num_layers) if latent else (),
                                recurrent=recurrent_mod.state_shapes(facts.recurrent), shared=facts.kv_shared,
                                indexed_layers=facts.indexed_layers)
    io = _token_inputs(options)
    kv = _kv_inputs(spec, options, next(model.parameters()).dtype, io)
    if vision is not None:   # contract section 6: the peer's input and output order
        from qeff_kv.export.modeling import vlm as vlm_mod

        vision = vlm_mod.language_inputs(io, vision, facts, options, next(model.parameters()).dtype)
    io.args += kv
    _trailing_inputs(options, io)
    plan = LoraPlan.of(options)   # the adapters read once for the trace
    routing = _lora_inputs(model, plan, next(model.parameters()).dtype, io)
    wrapper, target = _wrapper(model, options, facts, spec, num_layers, vision, text_cfg)
    wrapper.lora = routing
    target.kv_scales = kv_scales   # --kv-cache-dtype int8: the calibrated scales (kv_quant); the fused target reads them
    target.kv_bits = options.kv_cache_bits or 8
    run_exporter(model, wrapper, target, io, path, num_layers if latent else None, export_params=export_params)
    (n_kv, head_dim), (v_heads, v_dim) = next((s for s in kv_shapes if s is not None), ((None, None),) * 2)[:2]
    geometry = {"num_layers": num_layers, "n_kv_heads": n_kv, "head_dim": head_dim,
                "vocab_size": int(text_cfg.vocab_size), "kv_dtype": options.kv_cache_dtype or options.dtype}
    if (v_heads, v_dim) != (n_kv, head_dim):
        geometry.update(value_heads=v_heads, value_head_dim=v_dim)
    if vision is not None:
        geometry["vision"] = vision
    if latent:   # the geometry of the expanded cache it replaces (``buffers`` reports both)
        geometry["mla"] = {k: int(getattr(text_cfg, k)) for k in ("qk_nope_head_dim", "qk_rope_head_dim",
                                                                 "v_head_dim", "kv_lora_rank")}
        geometry["mla"]["heads"] = int(text_cfg.num_attention_heads)
    geometry.update(sliding_window=facts.sliding_window if facts.sliding_layers else None,
                    sliding_layers=list(facts.sliding_layers), sliding_cache=facts.sliding_cache(options),
                    state_spec=spec)
    if facts.recurrent is not None:
        geometry["recurrent"] = recurrent_mod.geometry(facts.recurrent)
    if routing is not None:
        geometry["lora"] = {"max_rank": plan.max_rank, "modules": sorted({a.module for a in routing.adapted}),
                            "adapters": list(plan.names)}
    return geometry


def _kv_shapes(model, options: opt.ExportOptions, num_layers: int, facts) -> list:
    """Per layer, ``((key_heads, key_dim), (value_heads, value_dim))`` as the model writes them (``None`` for a
    layer that does not attend: a recurrent model's mixer layers, bypassed while probing); refuses (one line) a
    model that does not run through the cache, or probe buffers that cannot fit in memory."""
    rec = facts.recurrent
    try:
        # the experts run as the trace runs them (a streamed skeleton's stand-ins have no grouped_mm strides)
        with contextlib.nullcontext() if rec is None else recurrent_mod.mixers_bypassed(model, rec), \
                moe.static_routing(model):
            kv_shapes = caches.probe_kv_shapes(model, num_layers, facts.cache_writers())
    except ExportError:
        raise
    except Exception as exc:  # a model that does not run through our cache cannot be exported
        raise ExportError(f"{type(model).__name__} does not run with a retained-state cache: "
                          f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None
    indexed = tuple(i for i, s in enumerate(kv_shapes) if s is not None and len(s) > 2)
    if indexed != tuple(facts.indexed_layers):   # the config's facts must say what the model writes
        raise ExportError(f"{type(model).__name__}'s layers {list(indexed)} write indexer keys, its config says "
                          f"{list(facts.indexed_layers)} (index_topk, indexer_types); cannot tell which layers keep "
                          f"them")
    kv_batch = options.full_batch_size if options.continuous_batching else 1
    # The probe KV tensors are allocated at ctx_len: refuse, in one line with their size, what cannot fit.
    limits.require_memory(
        limits.kv_buffer_bytes([s for layer in kv_shapes[:num_layers] if layer for s in layer], ctx_len=options.ctx_len,
                               batch=kv_batch, itemsize=next(model.parameters()).dtype.itemsize),
        f"the probe KV tensors for tracing ({num_layers} layers x ctx_len {options.ctx_len})", error=ExportError)
    return kv_shapes


def _token_inputs(options: opt.ExportOptions) -> GraphIO:
    seq = max(options.prefill_seq_len, 2, (options.speculative_tokens or 0) + 1)
    input_ids = torch.zeros((1, seq), dtype=torch.int64)
    position_ids = torch.arange(seq, dtype=torch.int64).unsqueeze(0)
    return GraphIO(args=[input_ids, position_ids], in_names=["input_ids", "position_ids"],
                   dyn={"input_ids": {0: "batch_size", 1: "seq_len"}, "position_ids": {0: "batch_size", 1: "seq_len"},
                        "logits": {0: "batch_size"}})


def _kv_inputs(spec: statespec.StateSpec, options: opt.ExportOptions, dtype, io: GraphIO) -> list:
    """One zero buffer per retained state of each layer, at its capacity, named and paired with its retained
    output; axis 2 is the layer kind's position dim (``ctx_len`` or ``sliding_window``)."""
    kv_batch = options.full_batch_size if options.continuous_batching else 1
    kv_axis = "full_batch_size" if options.continuous_batching else "batch_size"
    past = []
    for layer in spec.layers:
        if layer.kind == "recurrent":   # static shapes, only the batch axis dynamic (contract section 12)
            past += recurrent_mod.state_inputs(layer, kv_batch, kv_axis, dtype, io)
            continue
        for stem, (heads, dim_name, dim) in zip(layer.stems, layer.shapes):
            past.append(_kv_buffer(options, (kv_batch, heads, layer.capacity_at(options.ctx_len), dim), dtype))
            in_name = naming.kv_input_name(stem, layer.layer)
            out_name = naming.retained_name(in_name)
            io.in_names.append(in_name)
            io.out_names.append(out_name)
            io.dyn[in_name] = io.dyn[out_name] = {0: kv_axis, layer.position_axis: dim_name}
    return past


def _kv_buffer(options: opt.ExportOptions, shape: tuple, dtype):
    """A zero KV buffer: ``dtype``; int8 (``--kv-cache-dtype int8``); or uint8 with two 4-bit values per byte,
    ``[..., head_dim / 2]`` (``int4``: GroupQueryAttention's packed cache, :func:`.modeling.graph_ops.quantize_int4`)."""
    if options.kv_cache_dtype == "int4":
        return torch.zeros((*shape[:-1], shape[-1] // 2), dtype=torch.uint8)
    return torch.zeros(shape, dtype=torch.int8 if options.kv_cache_dtype == "int8" else dtype)


def _trailing_inputs(options: opt.ExportOptions, io: GraphIO) -> None:
    if options.ccl is not None:  # contract section 9: after the KV inputs, before batch_index
        io.args.append(torch.ones(options.ctx_len, dtype=torch.int64))
        io.in_names.append(naming.CCL_INPUT)
        io.dyn[naming.CCL_INPUT] = {0: naming.CCL_INPUT}
    if options.continuous_batching:
        io.args.append(torch.zeros((1, 1), dtype=torch.int64))
        io.in_names.append("batch_index")
        io.dyn["batch_index"] = {0: "batch_size"}
    if options.speculative_tokens is not None:   # last, as QEfficient's TLM; only its length is read
        keep = options.speculative_tokens + 1
        io.args.append(torch.zeros((keep, 1), dtype=torch.int64))
        io.in_names.append(naming.LOGITS_TO_KEEP_INPUT)
        io.dyn[naming.LOGITS_TO_KEEP_INPUT] = {0: naming.LOGITS_TO_KEEP_INPUT}
        io.dyn["logits"] = {0: "batch_size", 1: naming.LOGITS_TO_KEEP_INPUT}
    if options.hidden_states:   # the last output
        io.out_names.append(naming.HIDDEN_STATES_OUTPUT)
        io.dyn[naming.HIDDEN_STATES_OUTPUT] = dict(io.dyn["logits"])


def _lora_inputs(model, plan: LoraPlan | None, dtype, io: GraphIO) -> lora_mod.Routing | None:
    """The adapter inputs, last (:mod:`qeff_kv.contract.lora`): ``lora_ids``, ``lora_scales``, then each adapted
    module's A and B stacks; the routing that adds their delta while tracing. ``None`` without adapters."""
    if plan is None:
        return None
    adapted = lora_mod.find_modules(model, hf.decoder(model), plan.modules, plan.targets)
    io.args += [torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=dtype)]
    io.in_names += [naming.LORA_IDS_INPUT, naming.LORA_SCALES_INPUT]
    io.dyn[naming.LORA_IDS_INPUT] = io.dyn[naming.LORA_SCALES_INPUT] = {0: "batch_size"}
    slots, rank = naming.LORA_SLOTS_DIM, naming.LORA_RANK_DIM
    for item in adapted:
        a_name = naming.lora_input_name("A", item.layer, item.module)
        b_name = naming.lora_input_name("B", item.layer, item.module)
        io.args += [torch.zeros((2, item.in_features, plan.max_rank), dtype=dtype),
                    torch.zeros((2, plan.max_rank, item.out_features), dtype=dtype)]
        io.in_names += [a_name, b_name]
        io.dyn[a_name] = {0: slots, 2: rank}
        io.dyn[b_name] = {0: slots, 1: rank}
    return lora_mod.Routing(adapted)


def _wrapper(model, options: opt.ExportOptions, facts, spec: statespec.StateSpec, num_layers: int,
             vision: dict | None, text_cfg):
    """The target of ``options`` and the wrapper that traces the model through it."""
    # GroupQueryAttention's RoPE caches must cover every position the graph may be run at.
    max_positions = max(options.ctx_len, int(getattr(text_cfg, "max_position_embeddings", 0) or 0))
    # the fused target windows GroupQueryAttention itself and never reads the windowed mask
    sliding = SlidingPlan(num_layers, facts.sliding_window, spec.ring_layers, facts.windowed_layers(options),
                          chunk=facts.attention_chunk if facts.chunked_layers else None,
                          unmasked_types=facts.mixer_layer_types)
    target = targets.get(options.target)(model, facts, sliding, max_positions=max_positions,
                                         continuous_batching=options.continuous_batching,
                                         ccl=options.ccl is not None)
    common = dict(target=target, facts=facts, ccl=options.ccl is not None,
                  speculative=options.speculative_tokens is not None, spec=spec)
    if vision is None:
        return RetainedStateLM(model, num_layers, options.continuous_batching, hidden=options.hidden_states,
                               **common).eval(), target
    if options.hidden_states:
        raise ExportError("--hidden-states is for text decoders; this is a vision-language model")
    return VisionLanguageLM(model, num_layers, options.continuous_batching,
                            image_token_id=facts.image_token_id, single_graph=options.single_graph,
                            image_blocks=facts.bidirectional_images, mrope=facts.mrope,
                            grid=vision.get("grid"), **common).eval(), target


def _sparse_layers(facts) -> int:
    """The layers whose attention :mod:`.sparse` must patch: every layer of a DSA model (``index_topk``), else 0."""
    return facts.num_layers if getattr(facts, "index_topk", None) else 0


def run_exporter(model, wrapper, target, io: GraphIO, path: Path, latent_layers: int | None = None, *,
                 export_params: bool = True) -> None:
    """``torch.onnx.export`` (TorchScript, opset 17) with the target's RoPE, the export symbolics and static MoE
    routing patched in (with ``latent_layers``, the absorbed MLA attention of :mod:`.mla`; DeepSeek sparse attention's
    selection in graph form, :mod:`.sparse`); a failure is one
    line naming the model."""
    latent = contextlib.nullcontext() if latent_layers is None else mla.latent_attention(model, latent_layers)
    with warnings.catch_warnings(), torch.no_grad(), target.rotary(model), rope.export_patches(model), \
            moe.static_routing(model, path), latent, sparse.sparse_attention(model, _sparse_layers(target.facts)):
        warnings.simplefilter("ignore")
        try:
            torch.onnx.export(wrapper, tuple(io.args), str(path), dynamo=False, opset_version=opt.OPSET,
                              export_params=export_params,
                              input_names=io.in_names, output_names=io.out_names, dynamic_axes=io.dyn,
                              do_constant_folding=True, custom_opsets=target.custom_opsets)
        except Exception as exc:  # tracing failures are model-specific; report them in one line
            raise ExportError(f"tracing failed for {type(model).__name__}: {type(exc).__name__}: "
                              f"{str(exc).splitlines()[0] if str(exc) else ''}") from None
