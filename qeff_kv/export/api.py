"""``export_model``: Hugging Face decoder (local folder or the bundled tiny default) -> retained-state ONNX.

:func:`export_model` is a pipeline of named stages, each a function in the module that owns it (see
``docs/architecture.md``): resolve the source and the options (:mod:`.sources`, :mod:`.options`) -> facts and
refusals (:mod:`.family`) -> the cache hit -> load, checkpoint identity and the reference for verification
(:mod:`.checkpoint`, :mod:`.vlm`, :mod:`.verify`) -> trace (:mod:`.trace`) -> graph passes (:mod:`.graph_passes`)
-> quantize (:mod:`.quantize`) -> verify (:mod:`.verify`) -> publish (:mod:`.publish`).

Only the stages after the cache hit import torch/transformers, so a bad prefix, a bad option or a cache hit never
needs them.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path

from qeff_kv.support import capture
from qeff_kv.tools import compile_config
from qeff_kv.graph import graphio
from qeff_kv.errors import ExportError, VerificationError, VerificationMemoryError
from qeff_kv.export import checkpoint as checkpoint_mod
from qeff_kv.export.facts import family
from qeff_kv.export import graph_passes, publish, sources
from qeff_kv.export.adapters.plan import LoraPlan
from qeff_kv.export.weights import prequant
from qeff_kv.export import options as opt
from qeff_kv.export.publish import MANIFEST_FILE, PARAMS_FILE, Progress, vision_onnx_name  # noqa: F401 (re-exported)
from qeff_kv.export.sources import BUNDLED_NAME, BUNDLED_SEED, TOKENIZER_FILES, bundled_model_dir  # noqa: F401 (re-exported)

DEFAULT_PREFILL_SEQ_LEN = opt.DEFAULT_PREFILL_SEQ_LEN
DEFAULT_MAX_CTX_LEN = opt.DEFAULT_MAX_CTX_LEN


@dataclass
class ExportResult:
    out_dir: Path
    onnx_path: Path
    manifest_path: Path
    manifest: dict
    reused: bool = False
    files: list[Path] = field(default_factory=list)


def export_model(model: str | Path | None = None, out_dir: str | Path | None = None, *,
                 options: opt.ExportOptions | None = None, force: bool = False,
                 specializations_format: compile_config.SpecFormat = "flat", verify: bool | None = None,
                 progress: Progress | None = None, **option_fields) -> ExportResult:
    """Export a decoder to a retained-state graph; see ``docs/export.md``.

    ``options``: an :class:`~qeff_kv.export.options.ExportOptions` (what the CLI fills); its fields may also be
    given as keywords (``ctx_len=..., target=...``), over ``options`` when both are given. Each field is described
    on the class: ``kv_cache_prefix``, ``ctx_len`` (default: the model's ``max_position_embeddings``, at most
    4096), ``prefill_seq_len``, ``dtype``, ``continuous_batching``/``full_batch_size``, ``target``, ``ccl``
    (``"auto"``, ``"512,1024"`` or a list of ints; contract section 9), ``weights``/``block_size``/
    ``accuracy_level``, ``sliding_cache`` (``"ring"``/``"full"``), ``single_graph``, ``image_size``,
    ``mla_cache`` (``"latent"``: contract section 11), ``speculative_tokens`` (``K``: the graph takes
    ``num_logits_to_keep`` and a decode step verifies ``K`` drafted tokens), ``hidden_states`` (one more output
    for ``/v1/embeddings``) and ``gguf_grid`` (a ``.gguf`` model's Q4_0 blocks kept as MatMulNBits).

    Without ``out_dir`` the export goes to the cache ``$QEFF_KV_HOME/<arch>/<name>-<hash>/`` and an
    identical earlier export is reused unless ``force``.

    ``verify``: run the written graph in onnxruntime on a probe and compare it with the PyTorch model before
    calling the export done (see :mod:`qeff_kv.export.verify`). ``None`` (default): on when a second copy of
    the weights fits comfortably in memory, else skipped with a note; ``True`` forces it, ``False`` skips it.
    """
    opt.check_run(model=model, out_dir=out_dir, progress=progress, verify=verify, force=force)
    options = opt.options_of(options, option_fields)
    say = progress or (lambda _msg: None)
    source, config, options = resolve(model, options)
    family.ModelFacts.from_config(config).require_exportable(options)
    LoraPlan.of(options)   # the adapters read and their ranks checked (one line each) before anything is loaded
    params = opt.hashed_params(config, options, source.fingerprint())
    if options.lora:   # the adapters the export is proved with: another file under the same name is another export
        params["lora_files"] = {name: opt.files_fingerprint(sorted(Path(folder).glob("adapter_*")))
                                for name, folder in options.lora}
    params["specializations_format"] = specializations_format
    digest = opt.params_hash(params)
    dest = opt.cache_dir(str(config["architectures"][0]), source.name, digest) if out_dir is None else Path(out_dir)
    cached = None if out_dir is not None or force else _cached(dest, digest)
    if cached is not None:
        say(f"reusing cached export {dest}")
        return cached
    if dest.exists() and not dest.is_dir():
        raise ExportError(f"{dest}: exists and is not a folder")
    return _export_into(dest, atomic=out_dir is None, source=source, config=config, options=options,
                        params=params, digest=digest, fmt=specializations_format, verify=verify, say=say)


def _export_into(dest: Path, *, atomic: bool, source, config: dict, options: opt.ExportOptions, params: dict,
                 digest: str, fmt, verify: bool | None, say: Progress) -> ExportResult:
    """The stages after the cache: build in a staging folder beside ``dest``, write the files, move into place."""
    onnx_name = f"{opt.safe_name(source.name)}.onnx"
    with publish.staging(dest) as (tmp, stage):
        built = _build(source, options, verify, say, tmp, stage / onnx_name)
        records = built.pop("records")
        manifest = publish.write_files(stage, stage / onnx_name, built["vision_path"], source=source, config=config,
                                       options=options, geometry=built["geometry"], params=params, digest=digest,
                                       fmt=fmt, records=records)
        publish.move_into_place(stage, dest, atomic=atomic)
    say(f"wrote {dest / onnx_name}")
    return ExportResult(dest, dest / onnx_name, dest / MANIFEST_FILE, manifest,
                        files=publish.written_files(dest, onnx_name))


def resolve(model, options: opt.ExportOptions):
    """The resolve stage: ``(source, config.json, validated ExportOptions)`` (:meth:`ExportOptions.resolved`: the
    model's ``ctx_len`` where none is given; a pre-quantized checkpoint's own scheme)."""
    source = sources.resolve_source(model)
    config = source.config()
    pq = prequant.detect(config) if source.kind == "folder" else None
    if pq is not None:   # the checkpoint says int4 and its own blocks: no flag needed, contradicting ones refused
        weights, block_size, accuracy_level = pq.resolve_flags(
            weights=options.weights, block_size=options.block_size, accuracy_level=options.accuracy_level,
            target=options.target, dtype=options.dtype, name=source.name)
        options = replace(options, weights=weights, block_size=block_size, accuracy_level=accuracy_level,
                          prequant=pq.format)
    options = options.resolved(config.get("max_position_embeddings"))
    if pq is not None and options.block_size != pq.block_size:   # the checkpoint's blocks, not the default
        options = replace(options, block_size=pq.block_size)
    if options.gguf_grid and source.kind != "gguf":
        raise ExportError(f"--gguf-grid takes the blocks of a GGUF file; {source.name} is a {source.kind} model")
    return source, config, options


def _cached(dest: Path, digest: str) -> ExportResult | None:
    """An identical earlier export in the cache folder ``dest`` (same options hash, graph present), else ``None``."""
    if not (dest / MANIFEST_FILE).is_file():
        return None
    manifest = json.loads((dest / MANIFEST_FILE).read_text())
    if manifest.get("options_hash") == digest and (dest / manifest["onnx"]).is_file():
        return ExportResult(dest, dest / manifest["onnx"], dest / MANIFEST_FILE, manifest, reused=True)
    return None


def _build(source, options: opt.ExportOptions, verify: bool | None, say: Progress, tmp: Path, onnx_path: Path) -> dict:
    """The torch stages: load (whole, or as a skeleton whose weights stream from the checkpoint: :mod:`.stream`),
    checkpoint identity, the reference for verification, trace (language and vision graphs), graph passes; then
    quantize and verify the staged graph. Returns ``geometry``, ``vision_path`` and the manifest ``records``."""
    from qeff_kv.export.weights import budget, stream

    source.check_files()   # the checkpoint's index and headers: refused before any weight is read, by any reader
    say = budget.StreamReasons(say)   # keeps why streaming was refused, for the memory refusal below
    streamed = stream.open_streamed(source, options, say)
    if streamed is not None:
        try:
            return _build_from(source, options, verify, say, tmp, onnx_path, streamed)
        except VerificationMemoryError:
            raise   # the whole model would need more memory still
        except VerificationError as exc:   # a verdict on the streamed graph: never retried with the whole model (at
            # the sizes streaming is for, it cannot load), never written
            raise VerificationError(f"{exc} (a streamed export: {stream.STREAM_ENV}=0 loads the whole model "
                                    "instead)") from None
        except Exception as exc:   # noqa: BLE001 - another failure of the streamed attempt: the whole path decides
            say(f"streaming is not possible ({exc if isinstance(exc, stream.StreamRefused) else capture_line(exc)}): "
                "loading the whole model")
            shutil.rmtree(tmp / "raw", ignore_errors=True)   # the staged files are written again below
            for old in (onnx_path, onnx_path.with_name(onnx_path.name + ".data")):
                old.unlink(missing_ok=True)
    # the whole model: refused in one line, before any weight is read, where it cannot fit (weights/budget.py)
    budget.require_whole_fits(source, options, say.reason or budget.reason_without_say(source))
    return _build_from(source, options, verify, say.say, tmp, onnx_path, None)


def capture_line(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def _build_from(source, options: opt.ExportOptions, verify: bool | None, say: Progress, tmp: Path, onnx_path: Path,
                streamed) -> dict:
    """:func:`_build` with the model loaded whole (``streamed`` None) or as a streamed skeleton."""
    import contextlib

    from qeff_kv.export.weights import quantize as quant_mod
    from qeff_kv.export import verify as verify_mod

    if streamed is None:
        torch_model = source.load_torch_model(options, say)   # torch missing: refused here, in one line
        ckpt = _checkpoint_record(source, torch_model, options.dtype)  # before tracing touches the model
    else:
        torch_model, ckpt = streamed.model, streamed.record
    from qeff_kv.export.adapters import proof as lora_proof_mod
    # --weights int4|int8 from a streamed checkpoint: quantized as the weights stream, no float graph; verified
    # against the reference on the quantized-then-dequantized weights (see docs/export.md)
    scheme = quant_mod.WeightScheme.of(options) \
        if streamed is not None and options.weights is not None and not options.prequant \
        and not options.gguf_grid else None
    say(f"checkpoint identity {ckpt['weights_sha256'][:16]} ({ckpt['bytes'] / 1e6:.0f} MB hashed)")
    # The loaded config carries the class defaults that config.json may omit (Cohere's logit_scale...): the
    # wrapper reads its facts from it; refusals before loading came from config.json.
    loaded = torch_model.config.to_dict()
    if not loaded.get("architectures"):   # a GGUF's converted config names the family, not the class it loaded as
        loaded["architectures"] = [type(torch_model).__name__]
    facts = family.ModelFacts.from_config(loaded)
    facts.require_exportable(options)
    plan = LoraPlan.of(options)
    lora_proof_mod.check_fit(torch_model, plan, options.dtype, source.describe())   # adapters of another model
    with contextlib.nullcontext() if streamed is None else streamed.weights():   # the encoder's real weights: its
        vision = _vision_geometry(torch_model, options, facts)   # half-precision stand-ins multiply ~90x slower
    transform = None if scheme is None else streamed.dequantizing(scheme, quant_mod.min_k(scheme.block_size),
                                                                  tmp / "packed")   # packed once, for both
    with contextlib.nullcontext() if streamed is None else streamed.weights(transform):
        probe, reference, skipped, kv_scales = _reference_stage(torch_model, source, options, verify, say, vision,
                                                                tmp, streamed is not None, scheme is not None)
        lora_proof = lora_proof_mod.references(torch_model, plan, probe, options.dtype)   # on the same weights
    natural = None
    if scheme is not None and probe is not None:   # the float model's view of a paragraph, for the quality check
        tokenizer = _tokenizer_of(source, tmp)
        if tokenizer is not None:
            with streamed.weights():
                natural = quant_mod.natural_reference(torch_model, tokenizer, options.ctx_len, say)
    geometry, vision_path = _trace_graphs(torch_model, options, facts, vision, tmp, onnx_path, ckpt, say, streamed,
                                          scheme, kv_scales)
    del torch_model
    verification = verify_mod.verify_export(onnx_path, vision_path, options, probe, reference, skipped, say)
    lora_record = lora_proof_mod.verify(onnx_path, options, probe, lora_proof, skipped, say) \
        if plan is not None and plan.adapters else None   # on the graph the base was proved on (before --weights)
    weights_record = _weights_record(source, options, scheme, probe, natural, verification, geometry, tmp, onnx_path,
                                     say)
    records = {"checkpoint": ckpt, "verification": verification.to_json(),
               **({} if lora_record is None else {"lora_verification": lora_record}),   # each adapter's proof
               **({} if kv_scales is None else {"kv_cache": _kv_record(kv_scales, options)})}
    if weights_record is not None:
        records["weights"] = weights_record
    if "vision" in geometry:
        records.update(layout="single" if options.single_graph else "dual", image_token_id=facts.image_token_id,
                       vision=geometry["vision"], vision_onnx=None if vision_path is None else vision_path.name)
    return {"geometry": geometry, "vision_path": vision_path, "records": records}


def _checkpoint_record(source, model, dtype: str) -> dict:
    """The whole-model path's checkpoint identity: over a folder's tensors as stored (the streamed path's), else (the
    bundled model, GGUF; a folder with a tensor dtype the checkpoint store does not read) over the loaded model."""
    if source.kind == "folder":
        from qeff_kv.export.weights.checkpoint_store import CheckpointStore

        try:
            return checkpoint_mod.stored_record(CheckpointStore(source.path), dtype)
        except ExportError:
            pass
    return checkpoint_mod.checkpoint_record(model, dtype)


def _weights_record(source, options: opt.ExportOptions, scheme, probe, natural, verification, geometry: dict,
                    tmp: Path, onnx_path: Path, say: Progress) -> dict | None:
    """The manifest's ``weights`` record: of a graph quantized as it streamed (``scheme``), or of the float graph
    quantized after its verification (``--weights``), else None."""
    from qeff_kv.export import verify as verify_mod
    from qeff_kv.export.weights import quantize as quant_mod

    kv_batch = options.full_batch_size if options.continuous_batching else 1
    if scheme is not None:
        if verification.status == "passed":   # what the graph was held to, in the manifest
            verification.extra.update(reference=f"PyTorch on the checkpoint's weights quantized to {scheme.scheme} "
                                      f"and dequantized (block {scheme.block_size}): the weights the graph holds",
                                      rtol=verify_mod.RTOL.get(options.dtype, verify_mod.RTOL["float16"]),
                                      kernels=quant_mod.KERNELS_NOTE)
        return quant_mod.streamed_record(onnx_path, options, probe, natural, say, kv_batch=kv_batch,
                                         float_bytes=geometry.pop("float_weight_bytes", None))
    if options.weights is None:
        return None
    return quant_mod.quantize_export(   # after the float graph was verified; see quantize.py
        onnx_path, tmp / "quant", options, probe, geometry["vocab_size"], say,
        save=lambda m, p: publish.save_graph(m, p, say), kv_batch=kv_batch,
        gguf=source.path if options.gguf_grid else None, tokenizer=_tokenizer_of(source, tmp),
        prequant=source.path if options.prequant else None)


def _reference_stage(model, source, options: opt.ExportOptions, verify, say, vision, tmp: Path, streamed: bool,
                     one_pass: bool):
    """``(probe, reference, why_skipped, kv_scales)``: :func:`~.verify.reference_for_export`, with an int8 cache's
    scales calibrated first and its quantization emulated in the reference (``kv_scales`` ``None`` otherwise)."""
    from qeff_kv.export import verify as verify_mod
    from qeff_kv.export.modeling import kv_quant

    kv_scales = _kv_scales(model, source, options, tmp, say)
    with kv_quant.emulated_cache(kv_scales, options.kv_cache_bits or 8):   # the reference's cache as the graph's
        probe, reference, skipped = verify_mod.reference_for_export(model, options, verify, say, vision,
                                                                    streamed=streamed, one_pass=one_pass)
    return probe, reference, skipped, kv_scales


def _kv_record(kv_scales: list, options: opt.ExportOptions) -> dict:
    from qeff_kv.export.modeling import kv_quant

    return kv_quant.scales_record(kv_scales, options.kv_cache_bits)


def _kv_scales(model, source, options: opt.ExportOptions, tmp: Path, say) -> list | None:
    """``--kv-cache-dtype int8`` (``int4``): the quantized cache's static scales, calibrated on the model
    (:mod:`.modeling.kv_quant`); otherwise ``None``."""
    if not options.quantized_kv:
        return None
    from qeff_kv.export.modeling import kv_quant

    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    ids = kv_quant.calibration_ids(_tokenizer_of(source, tmp), int(cfg.vocab_size),
                                   int(getattr(cfg, "max_position_embeddings", 0) or kv_quant.CALIBRATION_MAX))
    say(f"calibrating the {options.kv_cache_dtype} KV cache's static scales ({len(ids)} tokens, margin "
        f"{kv_quant.MARGIN})")
    return kv_quant.calibrate(model, ids, int(cfg.num_hidden_layers), options.kv_cache_bits)


def _tokenizer_of(source, tmp: Path):
    """The source's tokenizer (for the quantized graph's natural-text check), or None when it has none."""
    folder = tmp / "tokenizer"
    folder.mkdir(exist_ok=True)
    try:
        source.copy_tokenizer(folder)
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(folder / "tokenizer.json")) if (folder / "tokenizer.json").is_file() else None
    except Exception:   # noqa: BLE001 - no usable tokenizer: the probe check alone
        return None


def _vision_geometry(model, options: opt.ExportOptions, facts) -> dict | None:
    if not facts.vision_language:
        return None
    from qeff_kv.export.modeling import vlm

    name = type(model).__name__
    if not callable(getattr(model, "get_image_features", None)):
        raise ExportError(f"{name} has no get_image_features (its images reach the language model another way); "
                          f"qeff-kv does not export its vision side")
    try:
        return vlm.vision_geometry(model, options.image_size)
    except ExportError:
        raise
    except Exception as exc:  # an image encoder that does not run as qeff-kv runs one: one line, not a traceback
        raise ExportError(f"{name}'s image encoder does not run on one image of its configured size through "
                          f"get_image_features: {capture_line(exc)}") from None


def _trace_graphs(model, options: opt.ExportOptions, facts, vision, tmp: Path, onnx_path: Path, ckpt: dict,
                  say: Progress, streamed=None, scheme=None, kv_scales=None):
    """The trace and graph-passes stages: the language graph (and the dual layout's vision graph) traced, passed
    and saved into the staging folder. Returns ``(geometry, vision_path)``. ``streamed``: the skeleton's
    :class:`~qeff_kv.export.weights.stream.Streamed` (the graph is captured without weights, which are attached lazily).
    ``scheme``: the streamed graph's weights are quantized as they are written (no float graph)."""
    import contextlib

    from qeff_kv.export import trace

    say(f"tracing {facts.architecture} ({facts.num_layers} layers, ctx_len {options.ctx_len}, "
        f"prefill_seq_len {options.prefill_seq_len})")
    raw = tmp / "raw" / "model.onnx"
    raw.parent.mkdir()
    with capture.library_output(), \
            contextlib.nullcontext({}) if streamed is None else streamed.recorded() as recorded:
        # (torch prints the whole traced graph when an operator has no ONNX form)
        geometry = trace.trace_language(model, options, raw, facts, vision, export_params=streamed is None,
                                        kv_scales=kv_scales)
    say("post-processing graph")
    ir_model = graphio.load(raw)
    if streamed is not None:
        streamed.attach(ir_model, recorded)
    graph_passes.finalize(ir_model, options, geometry)
    ir_model.metadata_props[checkpoint_mod.METADATA_KEY] = ckpt["identity"]
    external = None
    if scheme is not None:
        from qeff_kv.export.weights import quantize as quant_mod

        float_bytes = quant_mod.quantize_in_memory(ir_model, scheme, say, streamed.spill)   # refuses (StreamRefused)
        geometry["float_weight_bytes"] = float_bytes   # for the weights record (popped before the manifest)
        external = float_bytes > opt.EXTERNAL_DATA_THRESHOLD
    publish.save_graph(ir_model, onnx_path, say, external=external)
    del ir_model
    if "vision" not in geometry or options.single_graph:
        return geometry, None
    from qeff_kv.export.modeling import vlm

    say("tracing the vision encoder")
    vision_path = onnx_path.with_name(vision_onnx_name(onnx_path.name))
    with capture.library_output(), \
            contextlib.nullcontext({}) if streamed is None else streamed.recorded() as recorded:
        vlm.trace_vision(model, options, tmp / "raw" / "vision.onnx", geometry["vision"],
                         export_params=streamed is None)
    vis_model = graphio.load(tmp / "raw" / "vision.onnx")
    if streamed is not None:   # the vision tower's weights, lazily from the checkpoint as the language graph's
        streamed.attach(vis_model, recorded)
    vlm.finalize_vision(vis_model, options, geometry["vision"])
    vis_model.metadata_props[checkpoint_mod.METADATA_KEY] = ckpt["identity"]
    publish.save_graph(vis_model, vision_path, say)
    return geometry, vision_path
