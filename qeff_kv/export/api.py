"""``export_model``: Hugging Face decoder (local folder or the bundled tiny default) -> retained-state ONNX.

Only :func:`_trace` and :func:`_load_torch_model` import torch/transformers, so a bad prefix, a bad option
or a cache hit never needs them.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import onnx_ir as ir

from .. import __version__, compile_config, fsutil, graphio, naming
from ..errors import ExportError
from ..passes import FuseSkipRMSNormPass, PackGQAQKVPass, SetKVPrefixPass
from . import family, sources
from . import options as opt
from .sources import BUNDLED_NAME, BUNDLED_SEED, bundled_model_dir  # noqa: F401 (re-exported)

MANIFEST_FILE = "manifest.json"
PARAMS_FILE = "export_params.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
DEFAULT_PREFILL_SEQ_LEN = 32
DEFAULT_MAX_CTX_LEN = 4096

Progress = Callable[[str], None]


@dataclass
class ExportResult:
    out_dir: Path
    onnx_path: Path
    manifest_path: Path
    manifest: dict
    reused: bool = False
    files: list[Path] = field(default_factory=list)


def export_model(
    model: str | Path | None = None,
    out_dir: str | Path | None = None,
    *,
    kv_cache_prefix: str | None = None,
    ctx_len: int | None = None,
    prefill_seq_len: int = DEFAULT_PREFILL_SEQ_LEN,
    dtype: str = "float32",
    continuous_batching: bool = False,
    full_batch_size: int | None = None,
    force: bool = False,
    specializations_format: compile_config.SpecFormat = "flat",
    target: str = "portable",
    progress: Progress | None = None,
) -> ExportResult:
    """Export a decoder to a retained-state graph; see ``docs/export.md``.

    Without ``out_dir`` the export goes to the cache ``$QEFF_KV_HOME/<arch>/<name>-<hash>/`` and an
    identical earlier export is reused unless ``force``.
    """
    say = progress or (lambda _msg: None)
    if kv_cache_prefix is not None:
        naming.validate_prefix(kv_cache_prefix)
    src_dir, bundled, name = sources.resolve_source(model)
    config = sources.read_config(src_dir)
    arch = str(config["architectures"][0])
    if ctx_len is None:
        ctx_len = min(int(config.get("max_position_embeddings") or DEFAULT_MAX_CTX_LEN), DEFAULT_MAX_CTX_LEN)
    options = opt.ExportOptions(ctx_len=ctx_len, prefill_seq_len=prefill_seq_len, kv_cache_prefix=kv_cache_prefix,
                                dtype=dtype, continuous_batching=continuous_batching,
                                full_batch_size=full_batch_size, target=target).validate()
    facts = family.ModelFacts.from_config(config)
    facts.require_exportable(options)
    params = opt.hashed_params(config, options, None if bundled else opt.weights_fingerprint(src_dir))
    params["specializations_format"] = specializations_format
    digest = opt.params_hash(params)
    use_cache = out_dir is None
    target = opt.cache_dir(arch, name, digest) if use_cache else Path(out_dir)
    if use_cache and not force and (target / MANIFEST_FILE).is_file():
        manifest = json.loads((target / MANIFEST_FILE).read_text())
        if manifest.get("options_hash") == digest and (target / manifest["onnx"]).is_file():
            say(f"reusing cached export {target}")
            return ExportResult(target, target / manifest["onnx"], target / MANIFEST_FILE, manifest, reused=True)
    if target.exists() and not target.is_dir():
        raise ExportError(f"{target}: exists and is not a folder")

    onnx_name = f"{opt.safe_name(name)}.onnx"
    parent = target.parent
    parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{target.name}.export-", dir=parent) as tmp_s:
        tmp = Path(tmp_s)
        stage = tmp / "stage"
        stage.mkdir()
        torch_model = sources.load_torch_model(src_dir, bundled, options, say)
        say(f"tracing {arch} ({config.get('num_hidden_layers')} layers, ctx_len {ctx_len}, "
            f"prefill_seq_len {prefill_seq_len})")
        raw = tmp / "raw" / "model.onnx"
        raw.parent.mkdir()
        geometry = _trace(torch_model, options, raw)
        del torch_model
        say("post-processing graph")
        ir_model = graphio.load(raw)
        _finalize(ir_model, options, geometry)
        onnx_path = stage / onnx_name
        _save_graph(ir_model, onnx_path, say)
        layout = graphio.layout_of(graphio.load(onnx_path)).require_valid()
        written = compile_config.write_compile_config(
            layout, stage, prefill_seq_len=prefill_seq_len, ctx_len=ctx_len,
            full_batch_size=full_batch_size if continuous_batching else None, fmt=specializations_format)
        for fname in TOKENIZER_FILES:
            if (src_dir / fname).is_file():
                shutil.copyfile(src_dir / fname, stage / fname)
        fsutil.write_json(stage / PARAMS_FILE, params)
        manifest = _manifest(onnx_name, layout, config, options, geometry, digest,
                             source=f"bundled:{BUNDLED_NAME}" if bundled else str(src_dir.resolve()),
                             fmt=specializations_format)
        fsutil.write_json(stage / MANIFEST_FILE, manifest)
        if use_cache:
            with fsutil.atomic_dir(target) as final:
                for f in stage.iterdir():
                    shutil.move(str(f), final / f.name)
        else:
            target.mkdir(parents=True, exist_ok=True)
            (target / MANIFEST_FILE).unlink(missing_ok=True)  # a folder without a manifest is incomplete
            names = sorted(p.name for p in stage.iterdir() if p.name != MANIFEST_FILE) + [MANIFEST_FILE]
            for fname in names:  # one rename per file; the manifest, written last, marks completion
                (stage / fname).replace(target / fname)
        del written
    names = [onnx_name, onnx_name + ".data", MANIFEST_FILE, PARAMS_FILE, compile_config.CUSTOM_IO_FILE,
             compile_config.SPECIALIZATIONS_FILE]
    files = sorted(target / n for n in names if (target / n).exists())
    say(f"wrote {target / onnx_name}")
    return ExportResult(target, target / onnx_name, target / MANIFEST_FILE, manifest, files=files)


def _trace(model, options: opt.ExportOptions, path: Path) -> dict:
    """Trace the wrapped model with the TorchScript exporter (opset 17) into ``path``."""
    import torch

    from . import torch_graph

    cfg = model.config
    text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    num_layers = int(text_cfg.num_hidden_layers)
    n_kv = int(getattr(text_cfg, "num_key_value_heads", None) or text_cfg.num_attention_heads)
    head_dim = int(getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // text_cfg.num_attention_heads)
    tdtype = next(model.parameters()).dtype
    seq = max(options.prefill_seq_len, 2)
    kv_batch = options.full_batch_size if options.continuous_batching else 1
    kv_axis = "full_batch_size" if options.continuous_batching else "batch_size"
    input_ids = torch.zeros((1, seq), dtype=torch.int64)
    position_ids = torch.arange(seq, dtype=torch.int64).unsqueeze(0)
    in_names = ["input_ids", "position_ids"]
    out_names = ["logits"]
    dyn: dict[str, dict[int, str]] = {"input_ids": {0: "batch_size", 1: "seq_len"},
                                      "position_ids": {0: "batch_size", 1: "seq_len"},
                                      "logits": {0: "batch_size"}}
    past = []
    for i in range(num_layers):
        for stem in naming.EXPORT_STEMS:
            past.append(torch.zeros((kv_batch, n_kv, options.ctx_len, head_dim), dtype=tdtype))
            in_name = naming.kv_input_name(stem, i)
            out_name = naming.retained_name(in_name)
            in_names.append(in_name)
            out_names.append(out_name)
            dyn[in_name] = dyn[out_name] = {0: kv_axis, 2: "ctx_len"}
    args = [input_ids, position_ids, *past]
    if options.continuous_batching:
        args.append(torch.zeros((1, 1), dtype=torch.int64))
        in_names.append("batch_index")
        dyn["batch_index"] = {0: "batch_size"}
    compact = options.target in ("onnxruntime", "onnxruntime-fused")
    fused = options.target == "onnxruntime-fused"
    # GroupQueryAttention's RoPE caches must cover every position the graph may be run at.
    max_positions = max(options.ctx_len, int(getattr(text_cfg, "max_position_embeddings", 0) or 0))
    wrapper = torch_graph.RetainedStateLM(model, num_layers, options.continuous_batching,
                                          valid_length_attention=compact, fused=fused,
                                          max_positions=max_positions).eval()
    if fused and wrapper.rotary is not None:
        rotary = torch_graph.skip_model_rotary(model)
    elif compact:
        rotary = torch_graph.compact_rotary(model)
    else:
        rotary = contextlib.nullcontext()
    with warnings.catch_warnings(), torch.no_grad(), rotary:
        warnings.simplefilter("ignore")
        try:
            torch.onnx.export(wrapper, tuple(args), str(path), dynamo=False, opset_version=opt.OPSET,
                              input_names=in_names, output_names=out_names, dynamic_axes=dyn,
                              do_constant_folding=True,
                              custom_opsets={"com.microsoft": 1} if options.target == "onnxruntime-fused" else None)
        except Exception as exc:  # tracing failures are model-specific; report them in one line
            raise ExportError(f"tracing failed for {type(model).__name__}: {type(exc).__name__}: "
                              f"{str(exc).splitlines()[0] if str(exc) else ''}") from None
    return {"num_layers": num_layers, "n_kv_heads": n_kv, "head_dim": head_dim,
            "vocab_size": int(text_cfg.vocab_size), "kv_dtype": options.dtype}


def _finalize(model: ir.Model, options: opt.ExportOptions, geometry: dict) -> None:
    """Deterministic metadata, the IR version onnxruntime loads, exact output shapes, then the prefix."""
    model.ir_version = opt.IR_VERSION
    model.producer_name = "qeff-kv"
    model.producer_version = __version__
    model.doc_string = None
    model.graph.name = "qeff_kv_decoder"
    logits = model.graph.outputs[0]
    logits.shape = ir.Shape(["batch_size", 1, geometry["vocab_size"]])
    model.metadata_props["qeff_kv.exporter_version"] = str(opt.EXPORTER_VERSION)
    model.metadata_props["qeff_kv.continuous_batching"] = str(bool(options.continuous_batching)).lower()
    model.metadata_props["qeff_kv.target"] = options.target
    if options.target == "onnxruntime-fused":
        PackGQAQKVPass()(model)
        if options.dtype == "float32":
            FuseSkipRMSNormPass()(model)
    if options.kv_cache_prefix is not None:
        SetKVPrefixPass(options.kv_cache_prefix)(model)


def _save_graph(model: ir.Model, path: Path, say: Progress) -> None:
    total = sum(v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None)
    if total > opt.EXTERNAL_DATA_THRESHOLD:
        say(f"writing {total / 1e9:.2f} GB of weights as external data")
        ir.save(model, path, external_data=path.name + ".data", size_threshold_bytes=1024)
    else:
        # Materialise tensors and write deterministically (no timestamps, stable field order).
        graphio.save(model, path, source_dir=path.parent)


def _manifest(onnx_name: str, layout, config: dict, options: opt.ExportOptions, geometry: dict, digest: str,
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
        "buffers": layout.to_json(options.ctx_len)["pairs"],
        "regexes": naming.canonical_regexes(options.kv_cache_prefix),
        "specializations_format": fmt,
        "exporter": {"name": "qeff-kv", "version": __version__, "opset": opt.OPSET, "ir_version": opt.IR_VERSION},
    }
