"""``qeff-kv serve``: an OpenAI-compatible HTTP server over an export (needs the ``[serve]`` extra).

Thin: the options, named as the fields of the sections of :class:`qeff_kv.serve.config.ServeConfig`, fill it
(checked there); call :func:`qeff_kv.serve.server.serve`. ``-h`` lists the options in one group per section
(:data:`qeff_kv.serve.config.SECTIONS`), each in its order here.
"""

from __future__ import annotations

import json

import click

from qeff_kv.errors import MissingDependencyError

from .params import COUNT, DIM, THREADS, AsciiFloat, AsciiIntRange, sampling_options


class ResourcesType(click.ParamType):
    """A JSON object of Ray custom resources: ``{"NAME": AMOUNT, ...}``."""

    name = "JSON"

    def convert(self, value, param, ctx):
        if value is None or isinstance(value, dict):
            return value
        try:
            parsed = json.loads(value)
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict) or not parsed:
            self.fail(f"{value!r} is not a JSON object of Ray resources, e.g. '{{\"qeffkv_prefill\": 1}}'", param,
                      ctx)
        return parsed


class ChunkType(click.ParamType):
    name = "N|auto"

    def convert(self, value, param, ctx):
        if value is None or value == "auto" or isinstance(value, int):
            return value
        try:
            n = int(value)
        except ValueError:
            n = 0
        if n < 1:
            self.fail(f"{value!r} is neither a positive integer nor 'auto'", param, ctx)
        return n


#: the options taking one or more values (argparse's nargs="+", as vLLM spells them): ``--served-model-name a b``
SPREAD_OPTIONS = ("--served-model-name",)


def spread(args: list[str]) -> list[str]:
    """``--served-model-name a b c`` as click reads a repeated option (``--served-model-name a
    --served-model-name b ...``): the values up to the next option (or ``--``)."""
    out, i = [], 0
    while i < len(args):
        out.append(args[i])
        if args[i] in SPREAD_OPTIONS:
            flag, i = args[i], i + 1
            first = True
            while i < len(args) and (first or not args[i].startswith("-")):
                out.extend([args[i]] if first else [flag, args[i]])
                first, i = False, i + 1
            continue
        if args[i] == "--":
            return out + args[i + 1:]
        i += 1
    return out


class SectionedCommand(click.Command):
    """A command whose help lists its options in groups, one per section of :class:`ServeConfig` (click's own
    ``formatter.section``); options no section holds (``-h``) under "Options". One column width for every group
    (the one click gives the whole list), so that each option's text wraps as in one list."""

    def parse_args(self, ctx, args):
        return super().parse_args(ctx, spread(list(args)))

    def format_options(self, ctx, formatter) -> None:
        rows = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None and not isinstance(param, click.Argument):
                rows[param.name] = record
        width = min(max(click.formatting.term_len(term) for term, _ in rows.values()), 30)
        for title, names in option_groups(list(rows)):
            part = [rows[n] for n in names]
            part[0] = (part[0][0].ljust(width), part[0][1])   # the column width of the whole list
            with formatter.section(title):
                formatter.write_dl(part)


def option_groups(names: list[str]) -> list[tuple[str, list[str]]]:
    """``names`` (in the command's order) grouped by the section of :class:`ServeConfig` holding each (an option
    in two sections: the first); the rest under "Options"."""
    from qeff_kv.serve.config import SECTIONS, section_fields

    groups, placed = [], set()
    for _, cls, title, _ in SECTIONS:
        fields = set(section_fields(cls)) - placed
        mine = [n for n in names if n in fields]
        placed |= fields
        if mine:
            groups.append((f"{title} options", mine))
    rest = [n for n in names if n not in placed]
    return groups + ([("Options", rest)] if rest else [])


@click.command("serve", cls=SectionedCommand)
@click.argument("export_dir", type=click.Path(path_type=str))
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="Port to listen on.")
@click.option("--max-sequences", type=DIM, default=None,
              help="Sequences generated at once (slots of a continuous-batching graph, or rows in lock step on a "
                   "graph without batch_index; default: the export's full_batch_size, else 4).")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="Where the graph runs: the CPU, or CUDA (our own targets' graphs; any other kind is refused "
                   "in one line; see docs/runtime.md).")
@click.option("--threads", type=THREADS, default=None, help="onnxruntime intra-op threads.")
@click.option("--api-key", default=None, envvar="QEFF_KV_API_KEY",
              help="Require 'Authorization: Bearer KEY' on /v1 and /slots (or set QEFF_KV_API_KEY).")
@click.option("--max-queue", type=COUNT, default=64, show_default=True,
              help="Requests that may wait for a sequence slot; more get HTTP 429.")
@click.option("--max-request-bytes", type=AsciiIntRange(min=1024, max=1 << 40), default=None, metavar="N",
              help="Request bodies larger than this get HTTP 413 before they are read (default 8 MiB).")
@click.option("--drain-seconds", type=AsciiFloat(), default=None, metavar="S",
              help="After SIGTERM: seconds running requests may take to finish before they are stopped with an "
                   "error (default 30); new requests get 503 meanwhile.")
@click.option("--state-dir", type=click.Path(file_okay=False, path_type=str), default=None,
              help="Folder of slot state files (POST /slots/{id}?action=save|restore).")
@click.option("--ctx-len", type=DIM, default=None, help="Cache capacity, where the graph leaves it symbolic.")
@click.option("--prefill-seq-len", type=DIM, default=None,
              help="Prefill chunk length, where the graph leaves it symbolic (also the most prefill work done "
                   "between two decode steps).")
@click.option("--prefill-chunk", type=ChunkType(), default=None, metavar="N|auto",
              help="Prompt tokens fed between two decode steps (default: the prefill length); smaller keeps running "
                   "streams smoother while long prompts arrive; auto: what costs about one decode step (measured).")
@click.option("--checkpoint-every", type=COUNT, default=None, metavar="N",
              help="Recurrent/hybrid graphs: checkpoint the recurrent state every N positions (0: only at prompt "
                   "boundaries; default 256); prompt reuse returns to checkpoints.")
@click.option("--max-checkpoints", type=COUNT, default=None, metavar="N",
              help="Recurrent/hybrid graphs: checkpoints kept per sequence, oldest dropped (default 8).")
@click.option("--no-prompt-reuse", "reuse_prompts", flag_value=False, default=True,
              help="Destroy finished sequences instead of keeping them for reuse.")
@click.option("--deterministic", is_flag=True,
              help="Batch-invariant serving: a request's greedy (and seeded) tokens equal the same request alone, at "
                   "any concurrency (one graph run per sequence and step, prompt reuse and chunks in whole prefill "
                   "lengths; slower with several sequences: docs/serving.md).")
@click.option("--model-name", default=None, help="Model id in /v1/models (default: the export folder's name).")
@click.option("--served-model-name", multiple=True, metavar="NAME [NAME ...]",
              help="vLLM's: the names requests may give as model; the first is the one answers report and "
                   "/v1/models lists first, the others are aliases, each listed too (instead of --model-name).")
@click.option("--accept-any-model-name", is_flag=True,
              help="Answer a request naming any model with this one (llama-server's behaviour; the answer repeats "
                   "the name asked for); a LoRA adapter's name still selects the adapter; /v1/models lists the "
                   "served names.")
@click.option("--speculative", metavar="lookup|DRAFT_DIR", default=None,
              help="Speculative decoding on a graph exported with --speculative-tokens K: each decode step verifies "
                   "every running sequence's drafts (prompt lookup, or a draft export of the same tokenizer); the "
                   "same tokens as plain decoding. Acceptance in /metrics.")
@click.option("--speculative-k", type=DIM, default=None,
              help="With --speculative: drafts per sequence and step (default and maximum: the graph's K).")
@sampling_options({
    "temperature": "Default temperature of requests that give none (default: the export's generation_config.json, "
                   "else 1).",
    "top_p": "Default top_p (default: generation_config.json, else 1).",
    "top_k": "Default top_k (default: generation_config.json, else 0 = all).",
    "min_p": "Default min_p (default: generation_config.json, else 0).",
    "repetition_penalty": "Default repetition_penalty (default: generation_config.json, else 1 = none).",
})
@click.option("--max-tokens", type=DIM, default=None,
              help="Default max_tokens (default: generation_config.json's max_new_tokens, else what the context "
                   "holds).")
@click.option("--max-n", type=DIM, default=None,
              help="Largest n (choices per request) accepted (default and maximum: the sequences run at once).")
@click.option("--allowed-origins", default=None, metavar="ORIGINS",
              help="Browser origins allowed to call the server (CORS), comma-separated, or '*'; default: none.")
@click.option("--allowed-local-media-path", type=click.Path(file_okay=False, path_type=str), default=None,
              metavar="DIR",
              help="Vision-language exports: image_url parts may name local files under DIR (file:// URLs); "
                   "default: data: URLs only.")
@click.option("--max-image-pixels", type=DIM, default=None, metavar="N",
              help="Vision-language exports: the most pixels (width x height) of one image, read from its header "
                   "before it is decoded; a request's images together get twice that (default 50000000).")
@click.option("--lora-modules", "lora_modules", multiple=True, metavar="NAME=PEFT_DIR",
              help="A LoRA adapter served from the start (repeatable; vLLM's flag, also its JSON form "
                   "'{\"name\": NAME, \"path\": PEFT_DIR}'): a model of /v1/models that a request's model selects; "
                   "ids 0, 1, ... in this order (llama-server's lora field). Needs a graph exported with --lora or "
                   "--max-lora-rank (docs/lora.md).")
@click.option("--max-loras", type=DIM, default=8, show_default=True, metavar="N",
              help="LoRA adapters loaded at once; loading one more is refused.")
@click.option("--allow-runtime-lora-updating", is_flag=True,
              help="Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's routes; also with "
                   "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True in the environment).")
@click.option("--disaggregate", is_flag=True,
              help="Prefill and decode in separate Ray actors handing KV states over (needs ray).")
@click.option("--prefill-replicas", type=DIM, default=1, show_default=True, help="With --disaggregate.")
@click.option("--decode-replicas", type=DIM, default=1, show_default=True, help="With --disaggregate.")
@click.option("--prefill-export", type=click.Path(path_type=str), default=None,
              help="With --disaggregate: the prefill replicas' export (default: EXPORT_DIR).")
@click.option("--ray-address", default=None,
              help="With --disaggregate or --kv-role: an existing Ray cluster (default: a local one, listening on "
                   "127.0.0.1 only).")
@click.option("--prefill-resources", type=ResourcesType(), default=None,
              help="With --disaggregate: Ray custom resources each prefill replica asks for, a JSON object (e.g. "
                   "'{\"qeffkv_prefill\": 1}': the replicas run on nodes started with such resources).")
@click.option("--decode-resources", type=ResourcesType(), default=None,
              help="With --disaggregate: the same for each decode replica.")
@click.option("--kv-events", default=None, metavar="tcp://HOST:PORT",
              help="Publish KV cache events in vLLM's format (ZeroMQ PUB bound here; msgpack KVEventBatch) for "
                   "KV-aware routers; with --disaggregate each prefill replica i binds PORT + i.")
@click.option("--kv-events-block-size", type=DIM, default=16, show_default=True,
              help="With --kv-events: tokens per published block.")
@click.option("--kv-events-topic", default="kv-events", show_default=True,
              help="With --kv-events: the topic frame of every message.")
@click.option("--kv-events-replay", default=None, metavar="tcp://HOST:PORT",
              help="With --kv-events: a replay socket (ZeroMQ ROUTER): send a sequence number, get the buffered "
                   "batches from it.")
@click.option("--route", type=click.Choice(["prefix", "load"]), default="prefix", show_default=True,
              help="With --disaggregate: send a request to the prefill replica holding the longest prefix of its "
                   "prompt, else the least loaded (prefix), or to the least loaded (load).")
@click.option("--kv-role", type=click.Choice(["producer", "consumer", "both"]), default=None,
              help="vLLM's P/D protocol between separate servers (kv_transfer_params): a producer prefills and holds "
                   "the KV in Ray's object store, a consumer takes it and decodes (needs ray; give both servers one "
                   "--ray-address).")
@click.option("--kv-hold-seconds", type=AsciiFloat(), default=60.0, show_default=True, metavar="S",
              help="With --kv-role producer|both: seconds a state no consumer took is held before it is freed.")
def serve_cmd(**options) -> None:
    """Serve EXPORT_DIR over HTTP: OpenAI's /v1/completions, /v1/chat/completions and /v1/models, /health,
    /metrics, /slots and a chat page at /."""
    try:
        from qeff_kv.serve.server import serve
    except ImportError as exc:
        raise MissingDependencyError(f"qeff-kv serve needs the [serve] extra (pip install 'qeff-kv[serve]'): "
                                     f"{exc}") from None
    from qeff_kv.serve.config import ServeConfig

    config = ServeConfig(**options)
    host, port = config.http.host, config.http.port

    def ready(engine) -> None:
        spec = getattr(engine, "speculation", None)
        extra = f", speculative {spec.drafting.name} k={spec.k}" if spec is not None else ""
        click.echo(f"serving {engine.model_name} on http://{host}:{port} (context {engine.ctx_len}, "
                   f"{engine.max_sequences} sequences at once{extra})", err=True)

    serve(config, on_ready=ready)


COMMANDS = [serve_cmd]
