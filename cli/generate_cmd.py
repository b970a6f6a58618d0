"""``qeff-kv generate``: run a retained-state graph (an .onnx file or an export folder) in onnxruntime.

Thin: the options, named as the fields of :class:`~qeff_kv.runtime.generate_job.GenerateRequest` (and of its
sampling, :data:`qeff_kv.runtime.decoding.sampling.FIELDS`), fill one request; call
:func:`qeff_kv.runtime.generate_job.run_generate`, print. Errors are one line, exit 2.
"""

from __future__ import annotations

import json
import warnings

import click
from click.core import ParameterSource

from qeff_kv.runtime.decoding.sampling import GREEDY
from qeff_kv.runtime.generate_job import GenerateRequest, run_generate

from .params import COUNT, DIM, FLOAT, ID, SLIDING_WINDOW, THREADS, sampling_options


def _deprecated_max_new_tokens(ctx: click.Context, param, value):
    """``--max-new-tokens``, the deprecated alias of ``--max-tokens`` for one release (hidden): its count fills
    ``max_tokens``; both given is refused."""
    if value is None:
        return
    warnings.warn("--max-new-tokens is deprecated: use --max-tokens (the same count)", DeprecationWarning)
    if ctx.get_parameter_source("max_tokens") == ParameterSource.COMMANDLINE:
        raise click.BadParameter("give --max-tokens or its deprecated alias --max-new-tokens, not both")
    ctx.meta["max_new_tokens"] = value
    if "max_tokens" in ctx.params:   # --max-tokens took its default already
        ctx.params["max_tokens"] = value


def _max_tokens(ctx: click.Context, param, value):
    """``--max-tokens``, or the count its deprecated alias gave."""
    if "max_new_tokens" not in ctx.meta:
        return value
    if ctx.get_parameter_source("max_tokens") == ParameterSource.COMMANDLINE:
        raise click.BadParameter("give --max-tokens or its deprecated alias --max-new-tokens, not both")
    return ctx.meta["max_new_tokens"]


@click.command("generate")
@click.argument("model", type=click.Path(path_type=str))
@click.option("--prompt", "prompts", multiple=True, metavar="TEXT",
              help="Prompt text (needs tokenizer.json beside the graph). Repeat for several sequences.")
@click.option("--chat", is_flag=True,
              help="Format each --prompt as a user turn with the chat template from the model folder "
                   "(tokenizer_config.json or chat_template.jinja), the assistant's turn opened.")
@click.option("--system", default=None, metavar="TEXT", help="With --chat: a system turn before each prompt.")
@click.option("--prompt-ids", "prompt_ids", multiple=True, metavar="IDS",
              help="Prompt token ids, e.g. 5,17,42. Repeat for several sequences (after any --prompt).")
@click.option("--image-inputs", "image_inputs", multiple=True, type=click.Path(dir_okay=False, path_type=str),
              metavar="FILE.npz",
              help="Vision-language exports: the image processor's arrays by name (pixel_values, and image_grid_thw "
                   "where the model takes it), one file per prompt in order; the prompt ids already hold the image "
                   "tokens (a file's own input_ids serve as the prompt when none is given).")
@click.option("--image", "images", multiple=True, type=click.Path(dir_okay=False, path_type=str), metavar="FILE",
              help="An image for the one --prompt (repeatable), read with the image processor saved in the export "
                   "folder (needs transformers and Pillow: pip install 'qeff-kv[image]'); resized to the export's "
                   "image size where the export fixes one patch grid (Qwen2.5-VL).")
@click.option("--image-token-id", type=ID, default=None,
              help="Image token of another exporter's vision-language graph (qeff-kv's exports record it).")
@click.option("--vision-graph", type=click.Path(dir_okay=False, path_type=str), default=None, metavar="VISION.onnx",
              help="The vision graph of a dual-layout language graph MODEL (pixel_values -> vision_embeds), where no "
                   "manifest names it and it is not <name>_vision.onnx beside MODEL (the peer's dual pair).")
@click.option("--image-size", type=DIM, default=None,
              help="Image side of a vision-language graph that records none and does not fix it (the peer's single "
                   "graph needs it for a text-only prompt before any image).")
@click.option("--vision-size", type=DIM, default=None,
              help="Image rows per image of a vision-language graph that records none (default: the vision graph's "
                   "output, or one run of image tokens per image in the prompt).")
@click.option("--max-tokens", type=COUNT, default=64, show_default=True, callback=_max_tokens,
              help="Tokens to generate per sequence; 0 = prefill only (with --save-state).")
@click.option("--max-new-tokens", type=COUNT, default=None, hidden=True, expose_value=False,
              callback=_deprecated_max_new_tokens)
@click.option("--ctx-len", type=DIM, default=None, help="Cache capacity, where the graph leaves it symbolic.")
@click.option("--prefill-seq-len", type=DIM, default=None, help="Prefill chunk length, where the graph leaves it symbolic.")
@click.option("--sliding-window", type=SLIDING_WINDOW, default=None,
              help="Window of a graph with sliding-window ring buffers (axis sliding_window) that records none.")
@click.option("--checkpoint-every", type=COUNT, default=None, metavar="N",
              help="Recurrent/hybrid graphs: checkpoint the recurrent state every N positions (0: only at prompt "
                   "boundaries; default 256), the points a sequence can be rewound or copied to.")
@click.option("--max-checkpoints", type=COUNT, default=None, metavar="N",
              help="Recurrent/hybrid graphs: checkpoints kept per sequence, oldest dropped (0: none; default 8).")
@click.option("--max-sequences", type=DIM, default=None,
              help="Slots of a continuous-batching graph, or sequences run in lock step on a graph without "
                   "batch_index (default: the manifest's, or the number of prompts).")
@sampling_options({
    "temperature": "0 = greedy.",
    "top_k": "Sample among the K most likely (0 = all).",
    "top_p": "Nucleus sampling mass.",
    "seed": "Sampling seed (same seed, same tokens).",
    "min_p": "Sample among tokens at least this share as likely as the most likely one (0 = all).",
    "repetition_penalty": "Divide positive (multiply negative) logits of tokens already in the prompt or output "
                          "(1 = none).",
    "presence_penalty": "Subtract from the logit of every token already generated (OpenAI's rule).",
    "frequency_penalty": "Subtract this times its count from the logit of every token already generated.",
}, defaults=GREEDY)
@click.option("--logit-bias", "logit_bias", multiple=True, metavar="ID=BIAS",
              help="Add BIAS to token ID's logit before selection (repeatable; -100 bans a token).")
@click.option("--stop-token", "stop_tokens", type=ID, multiple=True, metavar="ID",
              help="Stop a sequence after this token (repeatable; the manifest's eos ids are included).")
@click.option("--ignore-eos", is_flag=True, help="Do not stop at the manifest's eos ids.")
@click.option("--on-capacity", type=click.Choice(["error", "stop"]), default="error", show_default=True,
              help="When prompt + new tokens exceed ctx_len: refuse before running, or stop early.")
@click.option("--save-state", type=click.Path(dir_okay=False, path_type=str), default=None,
              help="Save the sequence's KV state (safetensors) when done.")
@click.option("--load-state", type=click.Path(dir_okay=False, path_type=str), default=None,
              help="Continue a sequence saved with --save-state.")
@click.option("--select", default=None, metavar="REGEX",
              help="Serving regex choosing the buffers to save (default: .*PREFIX.* or the exact KV regex).")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="Where the graph runs: the CPU, or CUDA (our own targets' graphs; any other kind is refused "
                   "in one line; see docs/runtime.md).")
@click.option("--threads", type=THREADS, default=None, help="onnxruntime intra-op threads.")
@click.option("--no-inplace", "inplace", flag_value=False, default=None,
              help="Bind separate output buffers even if the graph is in-place safe.")
@click.option("--speculative", metavar="lookup|DRAFT_DIR", default=None,
              help="Speculative decoding on a graph exported with --speculative-tokens K (one prompt): drafts by "
                   "prompt lookup ('lookup': n-gram match against the prompt and the text so far) or by a draft "
                   "export (a smaller model of the same tokenizer), verified K at a time; the same tokens as plain "
                   "decoding. --json reports the acceptance rate under timings.speculative.")
@click.option("--speculative-k", type=DIM, default=None, metavar="K",
              help="With --speculative: drafts per step (default and maximum: the graph's K). Needed on a graph that "
                   "records no K (the peer's target graphs): K+1 must fit the prefill length and ctx_len.")
@click.option("--lora", default=None, metavar="[NAME=]PEFT_DIR",
              help="Run every prompt with this LoRA adapter (a PEFT folder; NAME: the folder's name unless given), "
                   "loaded once, on a graph exported with adapter inputs (export --lora or --max-lora-rank; "
                   "docs/lora.md). A graph without them is refused.")
@click.option("--lora-scale", type=FLOAT, default=None, metavar="S",
              help="With --lora: multiply the adapter's delta by S (default 1; 0 runs the base model).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (sequences, timings).")
def generate_cmd(as_json, **options) -> None:
    """Generate tokens from MODEL (an .onnx file or an export folder) with a persistent in-place KV cache."""
    req = GenerateRequest.from_options(**options)
    result = run_generate(req)
    for r in result["resized_images"]:
        click.echo(f"resized {r['image']} {r['from'][0]}x{r['from'][1]} -> {r['to'][0]}x{r['to'][1]} (the export's "
                   "fixed image size)", err=True)
    t = result["timings"]
    click.echo(f"prefill {t['prefill_tokens']} tokens in {t['prefill_s']:.3f}s; decode {t['decode_tokens']} tokens "
               f"in {t['decode_s']:.3f}s ({t['decode_tokens_per_s']:.1f} tokens/s)"
               + ("" if result["inplace"] else "; separate output buffers (not in place)"), err=True)
    if "speculative" in t:
        sp = t["speculative"]
        click.echo(f"speculative ({sp['drafter']}): {sp['accepted']} of {sp['drafted']} drafted tokens accepted "
                   f"({100 * sp['acceptance_rate']:.0f}%) in {sp['verifications']} verification steps", err=True)
    if as_json:
        click.echo(json.dumps(result))
        return
    for i, s in enumerate(result["sequences"]):
        if not s["tokens"]:  # prefill only
            continue
        ids = " ".join(str(x) for x in s["tokens"])
        prefix = f"[{i}] " if len(result["sequences"]) > 1 else ""
        click.echo(f"{prefix}{s['text']}" if s["text"] is not None else f"{prefix}{ids}")
    if result["saved_state"]:
        click.echo(f"saved state to {result['saved_state']}", err=True)


COMMANDS = [generate_cmd]
