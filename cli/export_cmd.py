"""``qeff-kv export``: thin front end over :func:`qeff_kv.export.export_model`: the options named as the fields of
:class:`~qeff_kv.export.options.ExportOptions` fill it (checked there, once); the others run the export."""

from __future__ import annotations

import time

import click

from qeff_kv.graph import graphio
from qeff_kv.tools.buffers import format_buffer_table
from qeff_kv.export import ExportOptions, export_model
from qeff_kv.export import options as opt
from qeff_kv.export.schemes import SCHEMES

from .params import ACCURACY_LEVEL, DIM


def _progress(msg: str, _t0=[None]) -> None:  # noqa: B006 - start time kept across calls
    if _t0[0] is None:
        _t0[0] = time.monotonic()
    click.echo(f"[{time.monotonic() - _t0[0]:6.1f}s] {msg}", err=True)


@click.command("export")
@click.argument("model", required=False, type=click.Path(file_okay=True, dir_okay=True))
@click.option("-o", "--output", "out_dir", type=click.Path(file_okay=False),
              help="Output folder. Default: the export cache $QEFF_KV_HOME/<arch>/<name>-<hash>/ "
                   "(an identical earlier export is reused).")
@click.option("--kv-cache-prefix", metavar="P",
              help="Prefix for the KV buffers only: past_key.{i}_P / past_key.{i}_P_RetainedState. "
                   "1-64 ASCII letters or digits.")
@click.option("--ctx-len", type=DIM, metavar="N",
              help="KV capacity (context length) recorded in the manifest and compile files. "
                   "Default: min(max_position_embeddings, 4096). The graph keeps ctx_len symbolic.")
@click.option("--prefill-seq-len", type=DIM, default=32, show_default=True, metavar="N",
              help="Prefill chunk length (the prefill specialization).")
@click.option("--dtype", type=click.Choice(opt.DTYPES), default="float32", show_default=True,
              help="Weights, activations and KV cache dtype.")
@click.option("--kv-cache-dtype", type=click.Choice(opt.KV_CACHE_DTYPES), default=None,
              help="The KV cache's dtype (default: --dtype). int8: a quarter of the float32 cache's bytes per token, "
                   "static per-channel scales calibrated at export (GroupQueryAttention's quantized cache on "
                   "onnxruntime-fused; quantize/dequantize around the cache update on portable and onnxruntime); "
                   "verified against PyTorch with the same quantization emulated. int4: an eighth, two values per "
                   "byte (onnxruntime-fused only).")
@click.option("--continuous-batching", is_flag=True,
              help="Add input batch_index [batch_size, 1]; the KV batch axis becomes full_batch_size.")
@click.option("--full-batch-size", type=DIM, metavar="N",
              help="Number of KV slots (sequences) with --continuous-batching.")
@click.option("--specializations-format", type=click.Choice(["flat", "named"]), default="flat",
              show_default=True, help="flat: readable by every compiler release; named: Prefill/Decode entries.")
@click.option("--target", type=click.Choice(opt.TARGETS), default="portable",
              show_default=True,
              help="portable: standard ops, static-shape friendly, for accelerator compilers. onnxruntime: standard "
                   "ops, attention follows the valid length (decode time does not grow with capacity). "
                   "onnxruntime-fused: onnxruntime's GroupQueryAttention appends to the retained buffers in place "
                   "(fastest in onnxruntime; no continuous batching). All keep the names, pairing and in-place "
                   "safety.")
@click.option("--ccl", metavar="L1,L2,...|auto",
              help="Compute-context lengths (the peer's CCL): the graph takes comp_ctx_lengths and attends over "
                   "its length only; one prefill and one decode specialization per value. 'auto': powers of two "
                   "from min(ctx_len, 512) up to ctx_len. Not with --target onnxruntime-fused.")
@click.option("--weights", type=click.Choice(list(SCHEMES)),
              help="Weight-only quantization for the onnxruntime targets: MatMul weights as onnxruntime's "
                   "MatMulNBits, the (tied) embedding and output head quantized once. Float graph verified first.")
@click.option("--block-size", type=DIM, metavar="N",
              help="Quantization block size along K (power of two >= 16; default 32). Needs --weights.")
@click.option("--accuracy-level", type=ACCURACY_LEVEL, metavar="L",
              help="MatMulNBits accuracy_level (0 unset, 1 fp32, 4 int8 compute: default 4, fastest on CPU). "
                   "Needs --weights.")
@click.option("--zero-points/--no-zero-points", "zero_points", default=None,
              help="With --weights: asymmetric blocks, each with its own zero point (MatMulNBits zero_points), or "
                   "symmetric ones (no zero points: the default, measured better on SmolLM2's int4: docs/export.md).")
@click.option("--gguf-grid", is_flag=True,
              help="With --weights int4 from a .gguf file: MatMul weights whose GGUF type fits MatMulNBits exactly "
                   "(Q4_0; Q4_1 with its offsets beside) take the GGUF's own blocks (bit-identical dequantized "
                   "weights); the others are requantized and listed with the reason.")
@click.option("--sliding-cache", type=click.Choice(opt.SLIDING_CACHES),
              help="Sliding-window layers when ctx_len exceeds the window: ring (window slots written at "
                   "position % window, axis 'sliding_window'; default on portable and onnxruntime) or full "
                   "(ctx_len slots, the window in the attention mask: more memory, rewinds of any depth; "
                   "always on onnxruntime-fused).")
@click.option("--mla-cache", type=click.Choice(opt.MLA_CACHES),
              help="Multi-head latent attention models (DeepSeek-V3): latent retains the compressed pair "
                   "compressed_kv.{i} [batch, 1, ctx_len, kv_lora_rank] and k_pe.{i} [batch, 1, ctx_len, "
                   "qk_rope_head_dim] and attends over it with absorbed projections; full (default): the model's "
                   "own attention over past_key/past_value. latent: portable and onnxruntime targets.")
@click.option("--single-graph", is_flag=True,
              help="Vision-language models: one graph with the vision encoder inside (pixel_values retained) "
                   "instead of a vision graph beside the language graph.")
@click.option("--image-size", type=DIM, metavar="N",
              help="Vision-language models that take any image size (Qwen2.5-VL): the side of the square image the "
                   "vision graph is traced for (default 448; a multiple of patch x merge size).")
@click.option("--speculative-tokens", type=DIM, metavar="K",
              help="Speculative decoding (QEfficient's target language model): the graph takes num_logits_to_keep "
                   "and a decode step verifies up to K drafted tokens (K+1 tokens in, logits for each out); the "
                   "decode specialization has seq_len K+1. Use with 'qeff-kv generate --speculative'. Also the "
                   "faster export for prompt logprobs (echo + logprobs, lm-eval's multiple-choice tasks): one run "
                   "per prefill chunk instead of one per prompt token; any export can score prompts.")
@click.option("--hidden-states", is_flag=True,
              help="One more output, hidden_states: the final hidden state at the logits' rows (what 'qeff-kv "
                   "serve' pools for /v1/embeddings). Text decoders only.")
@click.option("--lora", multiple=True, metavar="NAME=PEFT_DIR",
              help="A LoRA adapter (a PEFT folder) the graph takes per row; repeat for several. The graph adapts "
                   "their modules at their largest rank and is proved with each (docs/lora.md).")
@click.option("--max-lora-rank", type=int,
              help="The largest adapter rank the graph takes (default with --lora: the largest given). Alone: "
                   "the graph takes any adapter up to this rank at run time.")
@click.option("--lora-targets",
              help="With --max-lora-rank alone: the module names adapted, comma-separated (default: q_proj, k_proj, "
                   "v_proj, o_proj, gate_proj, up_proj, down_proj, and Phi-3's fused qkv_proj, gate_up_proj).")
@click.option("--verify/--no-verify", "verify", default=None,
              help="Run the written graph in onnxruntime on a probe prompt and compare logits and greedy tokens "
                   "with the PyTorch model before calling the export done. Default: on when a second copy of the "
                   "weights fits in memory (else skipped with a note).")
@click.option("--force", is_flag=True, help="Rebuild even if the export cache has this export.")
@click.option("-q", "--quiet", is_flag=True, help="No progress messages.")
def export(model, out_dir, specializations_format, verify, force, quiet, **fields):
    """Export MODEL (a local Hugging Face folder or a .gguf file; default: the bundled tiny Llama) to a
    retained-state ONNX graph, with manifest.json, custom_io.yaml and specializations.json beside it."""
    result = export_model(model, out_dir, options=ExportOptions(**fields), force=force, verify=verify,
                          specializations_format=specializations_format, progress=None if quiet else _progress)
    state = "reused" if result.reused else "exported"
    ver = result.manifest.get("verification") or {}
    note = {"passed": " (verified against PyTorch)", "skipped": " (not verified)"}.get(ver.get("status"), "")
    click.echo(f"{state}: {result.onnx_path}{note}")
    click.echo(format_buffer_table(graphio.layout_of(graphio.load(result.onnx_path)),
                                   ctx_len=result.manifest["ctx_len"]))


COMMANDS = [export]
