"""The publish stage: graphs saved deterministically, the compile files, tokenizer, parameters and manifest
written into the staging folder, then everything moved into place (the manifest last: a folder without one is
an incomplete export). Nothing here imports torch."""

from __future__ import annotations

import contextlib
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import onnx_ir as ir

from qeff_kv import __version__
from qeff_kv.tools import compile_config
from qeff_kv.support import fsutil
from qeff_kv.graph import graphio, sidecars
from qeff_kv.contract import naming
from qeff_kv.export import options as opt

MANIFEST_FILE = "manifest.json"
PARAMS_FILE = "export_params.json"
#: Staging folders (``.<name>.export-*``) older than this are left by killed exports and removed by the next one.
STALE_STAGING_S = 86400.0

Progress = Callable[[str], None]


def vision_onnx_name(onnx_name: str) -> str:
    """The dual layout's vision graph beside the language graph ``onnx_name``: ``<name>_vision.onnx``."""
    return onnx_name[:-len(".onnx")] + "_vision.onnx"


@contextlib.contextmanager
def staging(dest: Path):
    """``(tmp, stage)``: a private folder beside ``dest`` (removed on exit) and its ``stage`` subfolder, where the
    export's files are written before :func:`move_into_place`."""
    parent = dest.parent
    fsutil.make_dirs(parent)
    # Staging folders of exports whose process is gone (their name carries its pid), or older than a day.
    fsutil.remove_stale(parent, ".*.export-*", max_age_s=STALE_STAGING_S)
    with tempfile.TemporaryDirectory(prefix=fsutil.staging_prefix(dest.name, "export"), dir=parent) as tmp_s:
        tmp = Path(tmp_s)
        (tmp / "stage").mkdir()
        yield tmp, tmp / "stage"


def save_graph(model: ir.Model, path: Path, say: Progress, external: bool | None = None) -> None:
    """``model`` written to ``path``, with external data when its weights are large or were on disk already
    (``external``: decided by the caller; a graph quantized as it streams is written as its float graph would
    have been, then quantized)."""
    total = sum(v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None)
    on_disk = any(isinstance(v.const_value, ir.ExternalTensor) for v in model.graph.initializers.values())
    if external is None:   # (on_disk: a graph quantized from external data)
        external = total > opt.EXTERNAL_DATA_THRESHOLD or on_disk
    if external:
        lazy = sum(isinstance(v.const_value, ir.LazyTensor) for v in model.graph.initializers.values())
        say(f"writing {total / 1e9:.2f} GB of weights as external data"
            + (f" ({lazy} of them computed or read from the checkpoint as they are written)" if lazy else ""))
        _inline_constant_attributes(model)
        inline = 1024   # tensors of at most this many bytes stay in the graph (and out of the progress line)
        outside = sum(v.const_value.nbytes for v in model.graph.initializers.values()
                      if v.const_value is not None and v.const_value.nbytes > inline)
        ir.save(model, path, external_data=path.name + ".data", size_threshold_bytes=inline,
                callback=progress_bar("weights", outside) if sys.stderr.isatty() else None)
    else:
        # Materialise tensors and write deterministically (no timestamps, stable field order).
        graphio.save(model, path, source_dir=path.parent)


def ticker(label: str, total_bytes: int, count: int):
    """``step(nbytes)``: one line on the terminal (stderr), redrawn per tensor, with the tensors and bytes done and
    the time left; a no-op when stderr is not a terminal."""
    if not sys.stderr.isatty():
        return lambda _nbytes: None
    start = time.monotonic()
    done = [0, 0]

    def step(nbytes: int) -> None:
        done[0] += nbytes
        done[1] += 1
        frac = min(1.0, done[0] / max(1, total_bytes))
        elapsed = time.monotonic() - start
        eta = elapsed * (1 - frac) / frac if frac > 0 else 0.0
        sys.stderr.write(f"\r{label} [{'#' * int(frac * 30):<30}] {frac:4.0%} tensor {done[1]}/{count} "
                         f"{done[0] / 1e9:.2f}/{total_bytes / 1e9:.2f} GB, ETA {eta:4.0f}s")
        if done[1] >= count:
            sys.stderr.write("\n")
        sys.stderr.flush()

    return step


def progress_bar(label: str, total_bytes: int):
    """A callback for ``onnx_ir.save`` drawing :func:`ticker`."""
    step = None

    def callback(tensor, info) -> None:
        nonlocal step
        if step is None:
            step = ticker(label, total_bytes, info.total)
        step(tensor.nbytes)

    return callback


def _inline_constant_attributes(model: ir.Model) -> None:
    """Constant nodes whose tensor is external data (torch writes every large tensor of a graph over 2 GB to its
    own file, Constant attributes included) get their tensor inline: ``ir.save`` moves initializers into the one
    data file but leaves attribute tensors pointing at files of the folder the graph was traced into."""
    for graph in model.graphs():
        for node in graph:
            for name, attr in list(node.attributes.items()):
                if attr.type == ir.AttributeType.TENSOR and isinstance(attr.value, ir.ExternalTensor):
                    node.attributes[name] = ir.AttrTensor(name, ir.tensor(attr.value.numpy(), name=attr.value.name))


def write_files(stage: Path, onnx_path: Path, vision_path: Path | None, *, source, config: dict, options, geometry: dict,
                params: dict, digest: str, fmt: str, records: dict) -> dict:
    """The compile files, tokenizer, parameters and manifest beside the staged graph(s); returns the manifest.
    ``records``: manifest entries of the earlier stages (``checkpoint``, ``verification``, ``weights``, VLM facts)."""
    layout = graphio.layout_of(graphio.load(onnx_path)).require_valid()
    compile_config.write_compile_config(
        layout, stage, prefill_seq_len=options.prefill_seq_len, ctx_len=options.ctx_len,
        full_batch_size=options.full_batch_size if options.continuous_batching else None, fmt=fmt,
        ccl=options.ccl, sliding_window=geometry["sliding_window"] if layout.has_sliding else None,
        vision=geometry.get("vision"), single_graph=options.single_graph if "vision" in geometry else None,
        vision_graph=vision_path, speculative_tokens=options.speculative_tokens)
    source.copy_tokenizer(stage)
    fsutil.write_json(stage / PARAMS_FILE, params)
    man = manifest(onnx_path.name, layout, config, options, geometry, digest, source=source.describe(), fmt=fmt)
    man.update(records)
    written: list[Path] = []
    if vision_path is None:  # runtimes' sidecars describe a single text decoder graph
        written = sidecars.write_sidecars(layout, stage, sidecars.SidecarFacts.from_manifest(man, config))
    why_not = sidecars.reasons(layout) if vision_path is None else {
        f: "a vision-language export has two graphs; the sidecars written here describe one text decoder"
        for f in sidecars.SIDECAR_FILES}
    man["sidecars"] = {"written": [p.name for p in written], "not_written": why_not}
    fsutil.write_json(stage / MANIFEST_FILE, man)
    return man


def move_into_place(stage: Path, dest: Path, *, atomic: bool) -> None:
    """The staged files into ``dest``: one atomic folder rename (``atomic``: the export cache), else one rename
    per file with the manifest last."""
    if atomic:
        with fsutil.atomic_dir(dest) as final:
            for f in stage.iterdir():
                shutil.move(str(f), final / f.name)
        return
    fsutil.make_dirs(dest)
    (dest / MANIFEST_FILE).unlink(missing_ok=True)  # a folder without a manifest is incomplete
    names = sorted(p.name for p in stage.iterdir() if p.name != MANIFEST_FILE) + [MANIFEST_FILE]
    for fname in names:  # one rename per file; the manifest, written last, marks completion
        (stage / fname).replace(dest / fname)


def written_files(dest: Path, onnx_name: str) -> list[Path]:
    names = [onnx_name, onnx_name + ".data", vision_onnx_name(onnx_name), vision_onnx_name(onnx_name) + ".data",
             MANIFEST_FILE, PARAMS_FILE, compile_config.CUSTOM_IO_FILE, compile_config.SPECIALIZATIONS_FILE,
             compile_config.CUSTOM_IO_VISION_FILE, compile_config.SPECIALIZATIONS_VISION_FILE, *sidecars.SIDECAR_FILES]
    return sorted(dest / n for n in names if (dest / n).exists())


def manifest(onnx_name: str, layout, config: dict, options: opt.ExportOptions, geometry: dict, digest: str,
              *, source: str, fmt: str) -> dict:
    eos = config.get("eos_token_id")
    if isinstance(eos, int):
        eos = [eos]
    return {
        "format": "qeff-kv-export",
        "format_version": 1,
        "onnx": onnx_name,
        "architecture": str(config["architectures"][0]),
        "model_type": config.get("model_type"),
        "source": source,
        "options": options.to_json(),
        "options_hash": digest,
        "ctx_len": options.ctx_len,
        "prefill_seq_len": options.prefill_seq_len,
        "prefix": options.kv_cache_prefix,
        "dtype": options.dtype,
        "continuous_batching": options.continuous_batching,
        "full_batch_size": options.full_batch_size,
        "target": options.target,
        "num_layers": geometry["num_layers"],
        "n_kv_heads": geometry["n_kv_heads"],
        "head_dim": geometry["head_dim"],
        "vocab_size": geometry["vocab_size"],
        "eos_token_id": eos,
        "sliding_window": geometry.get("sliding_window"),
        "sliding_layers": geometry.get("sliding_layers", []),
        "sliding_cache": geometry.get("sliding_cache"),
        "buffers": layout.to_json(options.ctx_len)["pairs"],
        "regexes": naming.canonical_regexes(options.kv_cache_prefix, layout.stems or naming.EXPORT_STEMS),
        "specializations_format": fmt,
        "ccl": list(options.ccl) if options.ccl is not None else None,
        "speculative_tokens": options.speculative_tokens,
        "state_spec": geometry["state_spec"].to_json() if geometry.get("state_spec") is not None else None,
        # recurrent / hybrid models only: the mixer, its layers and its state geometry
        **({"recurrent": geometry["recurrent"]} if "recurrent" in geometry else {}),
        # LoRA adapters mixed per row (docs/lora.md): the graph's rank and modules, the adapters it was proved with
        **({"lora": {**geometry["lora"], "folders": {n: str(Path(p).resolve()) for n, p in options.lora or ()}}}
           if "lora" in geometry else {}),
        "exporter": {"name": "qeff-kv", "version": __version__, "opset": opt.OPSET, "ir_version": opt.IR_VERSION},
    }
