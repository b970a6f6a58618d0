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

from .. import capture, compile_config, graphio, naming  # noqa: F401 (compile_config: SpecFormat)
from ..errors import ExportError, VerificationError, VerificationMemoryError
from . import checkpoint as checkpoint_mod
from . import family, graph_passes, prequant, publish, schemes, sources
from . import options as opt
from .publish import MANIFEST_FILE, PARAMS_FILE, Progress, vision_onnx_name  # noqa: F401 (re-exported)
from .sources import BUNDLED_NAME, BUNDLED_SEED, TOKENIZER_FILES, bundled_model_dir  # noqa: F401 (re-exported)

DEFAULT_PREFILL_SEQ_LEN = 32
DEFAULT_MAX_CTX_LEN = 4096


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
    verify: bool | None = None,
    progress: Progress | None = None,
    ccl: str | list[int] | tuple[int, ...] | None = None,
    weights: str | None = None,
    block_size: int | None = None,
    accuracy_level: int | None = None,
    sliding_cache: str | None = None,
    single_graph: bool = False,
    image_size: int | None = None,
    mla_cache: str | None = None,
    speculative_tokens: int | None = None,
    gguf_grid: bool = False,
    hidden_states: bool = False,
) -> ExportResult:
    """Export a decoder to a retained-state graph; see ``docs/export.md``.

    Without ``out_dir`` the export goes to the cache ``$QEFF_KV_HOME/<arch>/<name>-<hash>/`` and an
    identical earlier export is reused unless ``force``.

    ``sliding_cache``: ``"ring"`` or ``"full"`` for sliding-window layers when ``ctx_len`` exceeds the window
    (default: ring buffers where the target can; see :class:`~qeff_kv.export.options.ExportOptions`).

    ``single_graph``: a vision-language model as one graph (vision encoder inside, ``pixel_values`` retained)
    instead of a vision graph beside the language graph (the default; contract section 6).

    ``verify``: run the written graph in onnxruntime on a probe and compare it with the PyTorch model before
    calling the export done (see :mod:`qeff_kv.export.verify`). ``None`` (default): on when a second copy of
    the weights fits comfortably in memory, else skipped with a note; ``True`` forces it, ``False`` skips it.

    ``ccl``: compute-context lengths (``"auto"``, ``"512,1024"`` or a list of ints; contract section 9): the graph
    takes ``comp_ctx_lengths`` and attends over its length only; one prefill and one decode specialization per
    value. Not with ``target="onnxruntime-fused"``.

    ``mla_cache``: for multi-head latent attention models (DeepSeek-V3), ``"latent"`` retains the compressed pair
    ``compressed_kv.{i}``/``k_pe.{i}`` and attends over it with absorbed projections (contract section 11);
    ``"full"`` or ``None`` (default): the model's own attention over ``past_key``/``past_value``.

    ``speculative_tokens``: ``K`` for speculative decoding (QEfficient's "target language model"): the graph
    takes ``num_logits_to_keep`` ``[n, 1]`` last and returns the logits of its last ``n`` rows, ``[batch, n,
    vocab]`` (``n = 1`` for prefill, ``K+1`` to verify ``K`` drafted tokens in one decode step); names, prefix and
    pairing are unchanged; the decode specialization has ``seq_len = K+1``.

    ``hidden_states``: one more output, last, ``hidden_states`` ``[batch, 1 or n, hidden]``: the final (normed)
    hidden state at the rows the logits are taken at (``/v1/embeddings`` pools it; text decoders only).

    ``gguf_grid``: with ``weights="int4"`` and a ``.gguf`` model, MatMul weights whose GGUF type maps onto
    MatMulNBits exactly (Q4_0) take the GGUF's own blocks; the rest are requantized and reported
    (:mod:`qeff_kv.export.gguf_grid`; the manifest's ``weights.gguf_grid``).
    """
    opt.check_call(model=model, out_dir=out_dir, progress=progress, verify=verify, force=force,
                   continuous_batching=continuous_batching, single_graph=single_graph, block_size=block_size,
                   accuracy_level=accuracy_level, full_batch_size=full_batch_size, image_size=image_size)
    say = progress or (lambda _msg: None)
    source, config, options = resolve(model, kv_cache_prefix=kv_cache_prefix, ctx_len=ctx_len,
                                      prefill_seq_len=prefill_seq_len, dtype=dtype,
                                      continuous_batching=continuous_batching, full_batch_size=full_batch_size,
                                      target=target, ccl=ccl, sliding_cache=sliding_cache, single_graph=single_graph,
                                      image_size=image_size, weights=weights, block_size=block_size,
                                      accuracy_level=accuracy_level, mla_cache=mla_cache,
                                      speculative_tokens=speculative_tokens, gguf_grid=bool(gguf_grid),
                                      hidden_states=bool(hidden_states))
    family.ModelFacts.from_config(config).require_exportable(options)
    params = opt.hashed_params(config, options, source.fingerprint())
    params["specializations_format"] = specializations_format
    digest = opt.params_hash(params)
    dest = opt.cache_dir(str(config["architectures"][0]), source.name, digest) if out_dir is None else Path(out_dir)
    cached = None if out_dir is not None or force else _cached(dest, digest)
    if cached is not None:
        say(f"reusing cached export {dest}")
        return cached
    if dest.exists() and not dest.is_dir():
        raise ExportError(f"{dest}: exists and is not a folder")
    onnx_name = f"{opt.safe_name(source.name)}.onnx"
    with publish.staging(dest) as (tmp, stage):
        built = _build(source, options, verify, say, tmp, stage / onnx_name)
        records = built.pop("records")
        manifest = publish.write_files(stage, stage / onnx_name, built["vision_path"], source=source, config=config,
                                       options=options, geometry=built["geometry"], params=params, digest=digest,
                                       fmt=specializations_format, records=records)
        publish.move_into_place(stage, dest, atomic=out_dir is None)
    say(f"wrote {dest / onnx_name}")
    return ExportResult(dest, dest / onnx_name, dest / MANIFEST_FILE, manifest,
                        files=publish.written_files(dest, onnx_name))


def resolve(model, *, kv_cache_prefix, ctx_len, weights, block_size, accuracy_level, single_graph, ccl, **kw):
    """The resolve stage: ``(source, config.json, validated ExportOptions)``; ``ctx_len`` defaults to the model's
    ``max_position_embeddings``, at most :data:`DEFAULT_MAX_CTX_LEN`."""
    if kv_cache_prefix is not None:
        naming.validate_prefix(kv_cache_prefix)
    source = sources.resolve_source(model)
    config = source.config()
    pq = prequant.detect(config) if source.kind == "folder" else None
    if pq is not None:   # the checkpoint says int4 and its own blocks: no flag needed, contradicting ones refused
        weights, block_size, accuracy_level = pq.resolve_flags(
            weights=weights, block_size=block_size, accuracy_level=accuracy_level, target=kw.get("target"),
            dtype=kw.get("dtype"), name=source.name)
        kw["prequant"] = pq.format
    if ctx_len is None:
        ctx_len = min(int(config.get("max_position_embeddings") or DEFAULT_MAX_CTX_LEN), DEFAULT_MAX_CTX_LEN)
    options = opt.ExportOptions(ctx_len=ctx_len, kv_cache_prefix=kv_cache_prefix, single_graph=bool(single_graph),
                                ccl=opt.parse_ccl(ccl, ctx_len, kw.get("prefill_seq_len")) if isinstance(ctx_len, int) else ccl, **kw,
                                **schemes.resolve_options(weights, block_size, accuracy_level)).validate()
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
    from . import stream

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
    return _build_from(source, options, verify, say, tmp, onnx_path, None)


def capture_line(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def _build_from(source, options: opt.ExportOptions, verify: bool | None, say: Progress, tmp: Path, onnx_path: Path,
                streamed) -> dict:
    """:func:`_build` with the model loaded whole (``streamed`` None) or as a streamed skeleton."""
    import contextlib

    from . import quantize as quant_mod
    from . import verify as verify_mod

    if streamed is None:
        torch_model = source.load_torch_model(options, say)
        ckpt = checkpoint_mod.checkpoint_record(torch_model, options.dtype)  # before tracing touches the model
    else:
        torch_model, ckpt = streamed.model, streamed.record
    # --weights int4|int8 from a streamed checkpoint: quantized as the weights stream, no float graph; verified
    # against the reference on the quantized-then-dequantized weights (see docs/export.md)
    scheme = quant_mod.WeightScheme(options.weights, options.block_size, options.accuracy_level) \
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
    vision = _vision_geometry(torch_model, options, facts)
    transform = None if scheme is None else streamed.dequantizing(scheme, quant_mod.min_k(scheme.block_size))
    with contextlib.nullcontext() if streamed is None else streamed.weights(transform):
        probe, reference, skipped = verify_mod.reference_for_export(torch_model, options, verify, say, vision,
                                                                    streamed=streamed is not None,
                                                                    one_pass=scheme is not None)
    natural = None
    if scheme is not None and probe is not None:   # the float model's view of a paragraph, for the quality check
        tokenizer = _tokenizer_of(source, tmp)
        if tokenizer is not None:
            with streamed.weights():
                natural = quant_mod.natural_reference(torch_model, tokenizer, options.ctx_len, say)
    geometry, vision_path = _trace_graphs(torch_model, options, facts, vision, tmp, onnx_path, ckpt, say, streamed,
                                          scheme)
    del torch_model
    verification = verify_mod.verify_export(onnx_path, vision_path, options, probe, reference, skipped, say)
    weights_record = None
    if scheme is not None and verification.status == "passed":   # what the graph was held to, in the manifest
        verification.extra.update(reference=f"PyTorch on the checkpoint's weights quantized to {scheme.scheme} and "
                                  f"dequantized (block {scheme.block_size}): the weights the graph holds",
                                  rtol=verify_mod.RTOL.get(options.dtype, verify_mod.RTOL["float16"]))
    if scheme is not None:
        weights_record = quant_mod.streamed_record(onnx_path, options, probe, natural, say,
                                                   kv_batch=options.full_batch_size if options.continuous_batching
                                                   else 1, float_bytes=geometry.pop("float_weight_bytes", None))
    elif options.weights is not None:  # after the float graph was verified; see quantize.py
        weights_record = quant_mod.quantize_export(
            onnx_path, tmp / "quant", options, probe, geometry["vocab_size"], say,
            save=lambda m, p: publish.save_graph(m, p, say),
            kv_batch=options.full_batch_size if options.continuous_batching else 1,
            gguf=source.path if options.gguf_grid else None, tokenizer=_tokenizer_of(source, tmp),
            prequant=source.path if options.prequant else None)
    records = {"checkpoint": ckpt, "verification": verification.to_json()}
    if weights_record is not None:
        records["weights"] = weights_record
    if "vision" in geometry:
        records.update(layout="single" if options.single_graph else "dual", image_token_id=facts.image_token_id,
                       vision=geometry["vision"], vision_onnx=None if vision_path is None else vision_path.name)
    return {"geometry": geometry, "vision_path": vision_path, "records": records}


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
    from . import vlm

    return vlm.vision_geometry(model, options.image_size)


def _trace_graphs(model, options: opt.ExportOptions, facts, vision, tmp: Path, onnx_path: Path, ckpt: dict,
                  say: Progress, streamed=None, scheme=None):
    """The trace and graph-passes stages: the language graph (and the dual layout's vision graph) traced, passed
    and saved into the staging folder. Returns ``(geometry, vision_path)``. ``streamed``: the skeleton's
    :class:`~qeff_kv.export.stream.Streamed` (the graph is captured without weights, which are attached lazily).
    ``scheme``: the streamed graph's weights are quantized as they are written (no float graph)."""
    import contextlib

    from . import trace

    say(f"tracing {facts.architecture} ({facts.num_layers} layers, ctx_len {options.ctx_len}, "
        f"prefill_seq_len {options.prefill_seq_len})")
    raw = tmp / "raw" / "model.onnx"
    raw.parent.mkdir()
    with capture.library_output(), \
            contextlib.nullcontext({}) if streamed is None else streamed.recorded() as recorded:
        # (torch prints the whole traced graph when an operator has no ONNX form)
        geometry = trace.trace_language(model, options, raw, facts, vision, export_params=streamed is None)
    say("post-processing graph")
    ir_model = graphio.load(raw)
    if streamed is not None:
        streamed.attach(ir_model, recorded)
    graph_passes.finalize(ir_model, options, geometry)
    ir_model.metadata_props[checkpoint_mod.METADATA_KEY] = ckpt["identity"]
    external = None
    if scheme is not None:
        from . import quantize as quant_mod

        float_bytes = quant_mod.quantize_in_memory(ir_model, scheme, say)   # refuses (StreamRefused) what it cannot
        geometry["float_weight_bytes"] = float_bytes   # for the weights record (popped before the manifest)
        external = float_bytes > opt.EXTERNAL_DATA_THRESHOLD
    publish.save_graph(ir_model, onnx_path, say, external=external)
    del ir_model
    if "vision" not in geometry or options.single_graph:
        return geometry, None
    from . import vlm

    say("tracing the vision encoder")
    vision_path = onnx_path.with_name(vision_onnx_name(onnx_path.name))
    with capture.library_output():
        vlm.trace_vision(model, options, tmp / "raw" / "vision.onnx", geometry["vision"])
    vis_model = graphio.load(tmp / "raw" / "vision.onnx")
    vlm.finalize_vision(vis_model, options, geometry["vision"])
    vis_model.metadata_props[checkpoint_mod.METADATA_KEY] = ckpt["identity"]
    publish.save_graph(vis_model, vision_path, say)
    return geometry, vision_path
