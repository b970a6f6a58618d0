"""Graph commands: ``rewrite``, ``check``, ``buffers``, ``compile-config``.

Thin: parse options, call one library function, print. Library errors (``QeffKvError``) become
``error: <message>`` and exit 2 in ``main``; ``check`` exits 1 when a rule fails.
"""

from __future__ import annotations

import json
import sys

import click

from qeff_kv.tools import buffers as _buffers
from qeff_kv.tools import check as _check
from qeff_kv.tools import compile_from_graph as _compile_from_graph
from qeff_kv.tools import rewrite as _rewrite

from .params import DIM, PRECISION, SLIDING_WINDOW

_MODEL = click.argument("model", type=click.Path(dir_okay=False, path_type=str))


@click.command("rewrite")
@_MODEL
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=str), default=None,
              help="Output .onnx file (never the input unless --in-place).")
@click.option("--kv-cache-prefix", "prefix", default=None, metavar="P",
              help="Add or change the KV-cache prefix to P ([A-Za-z0-9]{1,64}).")
@click.option("--strip-prefix", is_flag=True, help="Remove the KV-cache prefix.")
@click.option("--in-place", is_flag=True, help="Rewrite MODEL itself (atomically).")
@click.option("--allow-mixed-prefixes", is_flag=True,
              help="Accept a graph whose layers carry different prefixes and make them uniform.")
@click.option("--to", "to", default=None, type=click.Choice(["retained-state", "static-cache", "shared-past-present"]),
              help="Convert the KV cache to this dialect (docs/naming.md \"Dialects\"); the prefix is kept.")
@click.option("--capacity", "capacity", default=None, type=DIM, metavar="N",
              help="With --to: the positions of the fixed-capacity cache a growing past/present graph is rebuilt "
                   "over (required for one); with --to static-cache, the buffers' fixed size (else kept symbolic).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def rewrite_cmd(model: str, output: str | None, prefix: str | None, strip_prefix: bool, in_place: bool,
                allow_mixed_prefixes: bool, to: str | None, capacity: int | None, as_json: bool) -> None:
    """Add, change or strip the KV-cache prefix of a graph, or convert its KV cache to another dialect (--to).

    Renames exactly the KV buffers (input and its output together); weights are never loaded.
    Refusals print one line and exit 2 without writing anything.
    """
    if prefix is not None and strip_prefix:
        raise click.UsageError("give either --kv-cache-prefix or --strip-prefix, not both")
    if prefix is None and not strip_prefix and to is None:
        raise click.UsageError("give --kv-cache-prefix P or --strip-prefix (or --to DIALECT)")
    if output is None and not in_place:
        raise click.UsageError("give -o OUTPUT, or --in-place to rewrite MODEL itself")
    result = _rewrite.rewrite(model, output, prefix=prefix, strip=strip_prefix, in_place=in_place,
                              allow_mixed=allow_mixed_prefixes, to=to, capacity=capacity)
    if as_json:
        click.echo(json.dumps(result.to_json(), indent=2))
    else:
        click.echo(result.summary())


@click.command("check")
@click.argument("models", nargs=-1, required=True, type=click.Path(dir_okay=False, path_type=str))
@click.option("--kv-cache-prefix", "prefix", default=None, metavar="P",
              help="Require the KV buffers to carry exactly this prefix.")
@click.option("--no-kv-cache-prefix", "unprefixed", is_flag=True, help="Require unprefixed KV buffers.")
@click.option("--json", "as_json", is_flag=True,
              help="Print the stable JSON report (schema qeff-kv.check/1); a list of reports for several models.")
@click.option("--skip-onnx-checker", is_flag=True, help="Do not run onnx.checker (rule onnx-checker skipped).")
def check_cmd(models: tuple[str, ...], prefix: str | None, unprefixed: bool, as_json: bool,
              skip_onnx_checker: bool) -> None:
    """Check MODELS against the retained-state rules.

    Exit 0: every rule passes; 1: a rule failed; 2: a file is unreadable, or bad usage.
    """
    if prefix is not None and unprefixed:
        raise click.UsageError("give either --kv-cache-prefix or --no-kv-cache-prefix, not both")
    expected = None if unprefixed else (prefix if prefix is not None else _check.ANY)
    reports = [_check.check(m, expected_prefix=expected, skip_checker=skip_onnx_checker) for m in models]
    if as_json:
        obj = reports[0].to_json() if len(reports) == 1 else [r.to_json() for r in reports]
        click.echo(json.dumps(obj, indent=2))
    else:
        click.echo("\n".join(r.format_text() for r in reports), nl=False)
    sys.exit(max(r.exit_code for r in reports))


@click.command("buffers")
@click.argument("model", type=click.Path(path_type=str))
@click.option("--regex", default=None, metavar="R",
              help="Show exactly which inputs/outputs R selects (full match) and whether that is the KV set.")
@click.option("--ctx-len", type=DIM, default=None, help="Context length for bytes per sequence.")
@click.option("--sliding-window", type=SLIDING_WINDOW, default=None, metavar="N",
              help="Window (capacity) of the sliding-window ring buffers (axis 'sliding_window') for their bytes "
                   "per sequence; default: the graph metadata qeff_kv.sliding_window.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (schema qeff-kv.buffers/1).")
def buffers_cmd(model: str, regex: str | None, ctx_len: int | None, sliding_window: int | None,
                as_json: bool) -> None:
    """List the KV buffer pairs, non-KV retained buffers and canonical selection regexes of MODEL.

    MODEL is an .onnx file, or an export folder (the graph its manifest.json names as "onnx": the language graph
    of a vision-language export).
    """
    report = _buffers.buffers_report(model, regex=regex, ctx_len=ctx_len, sliding_window=sliding_window)
    click.echo(report.to_json_text() if as_json else report.format_text(), nl=False)


@click.command("compile-config")
@_MODEL
@click.option("-o", "--output-dir", "out_dir", required=True, type=click.Path(file_okay=False, path_type=str),
              help="Folder for custom_io.yaml and specializations.json.")
@click.option("--prefill-seq-len", type=DIM, required=True)
@click.option("--ctx-len", type=DIM, required=True)
@click.option("--batch-size", type=DIM, default=1, show_default=True)
@click.option("--full-batch-size", type=DIM, default=None,
              help="Continuous batching: rows of the decode specialization (needed for CB graphs).")
@click.option("--specializations-format", "fmt", type=click.Choice(["flat", "named"]), default="flat",
              show_default=True, help="flat: read by every compiler release; named: newer format.")
@click.option("--precision", type=PRECISION, default=None,
              help="Precision of the KV buffers in custom_io (default: float16; an int8 KV cache: int8, and no other).")
@click.option("--ccl", metavar="L1,L2,...|auto",
              help="Compute-context lengths of a graph with a comp_ctx_lengths input: one prefill and one decode "
                   "specialization per value.")
@click.option("--sliding-window", type=SLIDING_WINDOW, default=None, metavar="N",
              help="Window of a graph with sliding-window ring buffers (axis 'sliding_window'), written as the "
                   "symbol sliding_window of every specialization; default: the graph metadata "
                   "qeff_kv.sliding_window (peer graphs carry none).")
@click.option("--img-size", type=DIM, default=None, metavar="N",
              help="Vision-language graph: image side (symbol img_size); default: the export's manifest.json "
                   "beside MODEL, else a static pixel_values axis.")
@click.option("--vision-size", type=DIM, default=None, metavar="N",
              help="Dual-layout language graph: image rows per image (symbol vision_size); default: the manifest, "
                   "else a static vision_embeds axis, else the vision graph's shapes at --img-size.")
@click.option("--vision-batch-size", type=DIM, default=1, show_default=True, metavar="N",
              help="Vision-language graph: images per vision run / rows of vision_embeds (symbol "
                   "vision_batch_size; the vision program's batch_size).")
@click.option("--max-num-images", type=DIM, default=None, metavar="N",
              help="Vision-language graph: symbol max_num_images (written when given, or when a graph axis has "
                   "that name: then 1 by default).")
@click.option("--vision-precision", type=click.Choice(["float16", "bfloat16", "float32"]), default=None,
              help="Precision of the vision buffers (vision_embeds, pixel_values) in custom_io; default: the "
                   "model dtype (their dtype in the graph).")
@click.option("--vision-model", type=click.Path(dir_okay=False, path_type=str), default=None, metavar="FILE",
              help="Dual layout: the vision graph (pixel_values -> vision_embeds); adds custom_io_vision.yaml and "
                   "specializations_vision.json. Default: the manifest's vision_onnx.")
@click.option("--speculative-tokens", type=DIM, default=None, metavar="K",
              help="Speculative-decoding graph (a num_logits_to_keep input): decode runs K+1 tokens; default: the "
                   "graph metadata qeff_kv.speculative_tokens.")
@click.option("--lora-slots", type=DIM, default=None, metavar="N",
              help="Graph with LoRA adapter inputs: adapter slots compiled (symbol lora_slots; slot 0 is the base); "
                   "default: 1 + the adapters the export was proved with (1 + 1 when none).")
@click.option("--lora-rank", type=DIM, default=None, metavar="R",
              help="Graph with LoRA adapter inputs: the stacked adapters' rank (symbol lora_rank); default: the "
                   "graph metadata's max_rank.")
def compile_config_cmd(model: str, out_dir: str, prefill_seq_len: int, ctx_len: int, batch_size: int,
                       full_batch_size: int | None, fmt: str, precision: str, ccl: str | None,
                       sliding_window: int | None, img_size: int | None, vision_size: int | None,
                       vision_batch_size: int, max_num_images: int | None, vision_precision: str | None,
                       vision_model: str | None, speculative_tokens: int | None, lora_slots: int | None,
                       lora_rank: int | None) -> None:
    """Write the prefix-aware custom_io.yaml and specializations.json for an existing graph.

    For a vision-language graph the files carry the vision buffers and symbols too; for the dual layout's
    language graph the vision program's custom_io_vision.yaml and specializations_vision.json are written beside
    them when its vision graph is known (--vision-model, or the export's manifest).
    """
    paths = _compile_from_graph.write_compile_config_for_graph(
        model, out_dir, prefill_seq_len=prefill_seq_len, ctx_len=ctx_len, batch_size=batch_size,
        full_batch_size=full_batch_size, fmt=fmt, precision=precision, ccl=ccl,  # type: ignore[arg-type]
        sliding_window=sliding_window, img_size=img_size, vision_size=vision_size,
        vision_batch_size=vision_batch_size, max_num_images=max_num_images, vision_precision=vision_precision,
        vision_model=vision_model, speculative_tokens=speculative_tokens, lora_slots=lora_slots, lora_rank=lora_rank)
    for p in paths:
        click.echo(f"wrote {p}")


COMMANDS = [rewrite_cmd, check_cmd, buffers_cmd, compile_config_cmd]
