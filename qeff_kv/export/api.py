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

from .. import __version__, capture, compile_config, fsutil, graphio, limits, naming
from ..errors import ExportError
from ..passes import (FuseSkipRMSNormPass, GateVisionEncoderPass, PackGQAQKVPass, RemovePassThroughPass,
                      SetKVPrefixPass)
from . import checkpoint as checkpoint_mod
from . import family, sources
from . import quantize as quant_mod
from . import verify as verify_mod
from . import options as opt
from .sources import BUNDLED_NAME, BUNDLED_SEED, TOKENIZER_FILES, bundled_model_dir  # noqa: F401 (re-exported)

MANIFEST_FILE = "manifest.json"
PARAMS_FILE = "export_params.json"
DEFAULT_PREFILL_SEQ_LEN = 32
DEFAULT_MAX_CTX_LEN = 4096
#: Staging folders (``.<name>.export-*``) older than this are left by killed exports and removed by the next one.
STALE_STAGING_S = 86400.0

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
    verify: bool | None = None,
    progress: Progress | None = None,
    ccl: str | list[int] | tuple[int, ...] | None = None,
    weights: str | None = None,
    block_size: int | None = None,
    accuracy_level: int | None = None,
    sliding_cache: str | None = None,
    single_graph: bool = False,
    image_size: int | None = None,
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
    """
    opt.check_call(model=model, out_dir=out_dir, progress=progress, verify=verify, force=force,
                   continuous_batching=continuous_batching, single_graph=single_graph, block_size=block_size,
                   accuracy_level=accuracy_level, full_batch_size=full_batch_size, image_size=image_size)
    say = progress or (lambda _msg: None)
    if kv_cache_prefix is not None:
        naming.validate_prefix(kv_cache_prefix)
    source = sources.resolve_source(model)
    config = source.config()
    arch = str(config["architectures"][0])
    if ctx_len is None:
        ctx_len = min(int(config.get("max_position_embeddings") or DEFAULT_MAX_CTX_LEN), DEFAULT_MAX_CTX_LEN)
    options = opt.ExportOptions(ctx_len=ctx_len, prefill_seq_len=prefill_seq_len, kv_cache_prefix=kv_cache_prefix,
                                dtype=dtype, continuous_batching=continuous_batching,
                                full_batch_size=full_batch_size, target=target,
                                ccl=opt.parse_ccl(ccl, ctx_len, prefill_seq_len) if isinstance(ctx_len, int) else ccl,
                                sliding_cache=sliding_cache, single_graph=bool(single_graph), image_size=image_size,
                                **quant_mod.resolve_options(weights, block_size, accuracy_level)).validate()
    ctx_len, prefill_seq_len, full_batch_size = options.ctx_len, options.prefill_seq_len, options.full_batch_size
    facts = family.ModelFacts.from_config(config)
    facts.require_exportable(options)
    params = opt.hashed_params(config, options, source.fingerprint())
    params["specializations_format"] = specializations_format
    digest = opt.params_hash(params)
    use_cache = out_dir is None
    target = opt.cache_dir(arch, source.name, digest) if use_cache else Path(out_dir)
    if use_cache and not force and (target / MANIFEST_FILE).is_file():
        manifest = json.loads((target / MANIFEST_FILE).read_text())
        if manifest.get("options_hash") == digest and (target / manifest["onnx"]).is_file():
            say(f"reusing cached export {target}")
            return ExportResult(target, target / manifest["onnx"], target / MANIFEST_FILE, manifest, reused=True)
    if target.exists() and not target.is_dir():
        raise ExportError(f"{target}: exists and is not a folder")

    onnx_name = f"{opt.safe_name(source.name)}.onnx"
    parent = target.parent
    fsutil.make_dirs(parent)
    # Staging folders of exports whose process is gone (their name carries its pid), or older than a day.
    fsutil.remove_stale(parent, ".*.export-*", max_age_s=STALE_STAGING_S)
    with tempfile.TemporaryDirectory(prefix=fsutil.staging_prefix(target.name, "export"), dir=parent) as tmp_s:
        tmp = Path(tmp_s)
        stage = tmp / "stage"
        stage.mkdir()
        torch_model = source.load_torch_model(options, say)
        ckpt = checkpoint_mod.checkpoint_record(torch_model, options.dtype)  # before tracing touches the model
        say(f"checkpoint identity {ckpt['weights_sha256'][:16]} ({ckpt['bytes'] / 1e6:.0f} MB hashed)")
        probe, reference, skipped = _reference_for_verification(torch_model, options, verify, say)
        say(f"tracing {arch} ({facts.num_layers} layers, ctx_len {ctx_len}, "
            f"prefill_seq_len {prefill_seq_len})")
        raw = tmp / "raw" / "model.onnx"
        raw.parent.mkdir()
        # The loaded config carries the class defaults that config.json may omit (Cohere's logit_scale...):
        # the wrapper reads its facts from it; refusals above came from config.json before loading.
        loaded = family.ModelFacts.from_config(torch_model.config.to_dict())
        loaded.require_exportable(options)
        with capture.library_output():   # torch prints the whole traced graph when an operator has no ONNX form
            geometry = _trace(torch_model, options, raw, loaded)
        say("post-processing graph")
        ir_model = graphio.load(raw)
        _finalize(ir_model, options, geometry)
        ir_model.metadata_props[checkpoint_mod.METADATA_KEY] = ckpt["identity"]
        onnx_path = stage / onnx_name
        _save_graph(ir_model, onnx_path, say)
        del ir_model
        vision_path = None
        if "vision" in geometry and not options.single_graph:
            say("tracing the vision encoder")
            vision_path = stage / vision_onnx_name(onnx_name)
            with capture.library_output():
                _trace_vision(torch_model, options, tmp / "raw" / "vision.onnx", geometry["vision"])
            vis_model = graphio.load(tmp / "raw" / "vision.onnx")
            _finalize_vision(vis_model, options, geometry["vision"])
            vis_model.metadata_props[checkpoint_mod.METADATA_KEY] = ckpt["identity"]
            _save_graph(vis_model, vision_path, say)
            del vis_model
        del torch_model
        if probe is not None:
            say(f"verifying against PyTorch ({len(probe.prompt)}-token prompt in chunks of {probe.chunk}, "
                f"{probe.decode_steps} decode steps)")
            verification = verify_mod.verify_graph(onnx_path, probe, reference, ctx_len=ctx_len, dtype=dtype,
                                                   kv_batch=full_batch_size if continuous_batching else 1,
                                                   ccl=options.ccl, vision_path=vision_path)
            say(f"verified: max |logit difference| {verification.max_abs_diff:.3g} "
                f"(tolerance {verification.tolerance:.3g})")
        else:
            verification = verify_mod.VerificationResult(status="skipped", reason=skipped)
        weights_record = None
        if options.weights is not None:  # after the float graph was verified; see quantize.py
            weights_record = quant_mod.quantize_export(
                onnx_path, tmp / "quant", options, probe, geometry["vocab_size"], say,
                save=lambda m, p: _save_graph(m, p, say),
                kv_batch=full_batch_size if continuous_batching else 1)
        layout = graphio.layout_of(graphio.load(onnx_path)).require_valid()
        written = compile_config.write_compile_config(
            layout, stage, prefill_seq_len=prefill_seq_len, ctx_len=ctx_len,
            full_batch_size=full_batch_size if continuous_batching else None, fmt=specializations_format,
            ccl=options.ccl, sliding_window=geometry["sliding_window"] if layout.has_sliding else None,
            vision=geometry.get("vision"), single_graph=options.single_graph if "vision" in geometry else None,
            vision_graph=vision_path)
        source.copy_tokenizer(stage)
        fsutil.write_json(stage / PARAMS_FILE, params)
        manifest = _manifest(onnx_name, layout, config, options, geometry, digest,
                             source=source.describe(),
                             fmt=specializations_format)
        manifest["checkpoint"] = ckpt
        manifest["verification"] = verification.to_json()
        if weights_record is not None:
            manifest["weights"] = weights_record
        if "vision" in geometry:
            manifest.update(layout="single" if options.single_graph else "dual",
                            image_token_id=loaded.image_token_id, vision=geometry["vision"],
                            vision_onnx=None if vision_path is None else vision_path.name)
        fsutil.write_json(stage / MANIFEST_FILE, manifest)
        if use_cache:
            with fsutil.atomic_dir(target) as final:
                for f in stage.iterdir():
                    shutil.move(str(f), final / f.name)
        else:
            fsutil.make_dirs(target)
            (target / MANIFEST_FILE).unlink(missing_ok=True)  # a folder without a manifest is incomplete
            names = sorted(p.name for p in stage.iterdir() if p.name != MANIFEST_FILE) + [MANIFEST_FILE]
            for fname in names:  # one rename per file; the manifest, written last, marks completion
                (stage / fname).replace(target / fname)
        del written
    names = [onnx_name, onnx_name + ".data", vision_onnx_name(onnx_name), vision_onnx_name(onnx_name) + ".data",
             MANIFEST_FILE, PARAMS_FILE, compile_config.CUSTOM_IO_FILE, compile_config.SPECIALIZATIONS_FILE,
             compile_config.CUSTOM_IO_VISION_FILE, compile_config.SPECIALIZATIONS_VISION_FILE]
    files = sorted(target / n for n in names if (target / n).exists())
    say(f"wrote {target / onnx_name}")
    return ExportResult(target, target / onnx_name, target / MANIFEST_FILE, manifest, files=files)


def _reference_for_verification(model, options: opt.ExportOptions, verify: bool | None, say: Progress):
    """The probe and the PyTorch reference on it, computed before tracing touches the model; or why not."""
    if verify is False:
        return None, None, "turned off (--no-verify)"
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if verify is None:
        ok, note = verify_mod.memory_allows(param_bytes)
        if not ok:
            say(note)
            return None, None, note
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    slot = min(1, options.full_batch_size - 1) if options.continuous_batching else 0
    facts = family.ModelFacts.from_config(model.config.to_dict())
    probe = verify_mod.make_probe(int(cfg.vocab_size), options.ctx_len, options.prefill_seq_len, slot=slot,
                                  window=facts.sliding_window if facts.sliding_layers else None)
    if facts.vision_language:
        vision = vision_geometry(model, options.image_size)
        try:
            probe = verify_mod.add_image(probe, facts.image_token_id, vision, options.ctx_len, options.dtype,
                                         image_blocks=facts.bidirectional_images)
        except verify_mod.VerificationError as exc:
            raise ExportError(str(exc)) from None
    try:
        reference = verify_mod.reference_run(model, probe)
    except Exception as exc:
        raise ExportError(f"{type(model).__name__}: the PyTorch reference run for verification failed "
                          f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                          f"--no-verify skips it") from None
    return probe, reference, None


def _trace(model, options: opt.ExportOptions, path: Path, facts: family.ModelFacts | None = None) -> dict:
    """Trace the wrapped model with the TorchScript exporter (opset 17) into ``path``."""
    import torch

    from . import moe, torch_graph

    cfg = model.config
    text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    num_layers = int(text_cfg.num_hidden_layers)
    tdtype = next(model.parameters()).dtype
    try:
        kv_shapes = torch_graph.probe_kv_shapes(model, num_layers)
    except Exception as exc:  # a model that does not run through our cache cannot be exported
        raise ExportError(f"{type(model).__name__} does not run with a retained-state cache: "
                          f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None
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
    # The probe KV tensors are allocated at ctx_len: refuse, in one line with their size, what cannot fit.
    limits.require_memory(
        limits.kv_buffer_bytes([s for layer in kv_shapes[:num_layers] for s in layer], ctx_len=options.ctx_len,
                               batch=kv_batch, itemsize=tdtype.itemsize),
        f"the probe KV tensors for tracing ({num_layers} layers x ctx_len {options.ctx_len})", error=ExportError)
    if facts is None:
        facts = family.ModelFacts.from_config(cfg.to_dict())
    ring_layers = facts.ring_layers(options)   # sliding layers kept as rings of `sliding_window` slots
    past = []
    for i in range(num_layers):
        ring = i in ring_layers
        for stem, (heads, dim) in zip(naming.EXPORT_STEMS, kv_shapes[i]):
            slots = int(facts.sliding_window) if ring else options.ctx_len
            past.append(torch.zeros((kv_batch, heads, slots, dim), dtype=tdtype))
            in_name = naming.kv_input_name(stem, i)
            out_name = naming.retained_name(in_name)
            in_names.append(in_name)
            out_names.append(out_name)
            dyn[in_name] = dyn[out_name] = {0: kv_axis, 2: naming.SLIDING_DIM if ring else naming.CTX_DIM}
    vision = None
    if facts.vision_language:   # contract section 6: the peer's input and output order
        from . import vlm as vlm_mod

        vision = vision_geometry(model, options.image_size)
        vision["image_token_id"] = int(facts.image_token_id)
        if facts.bidirectional_images:   # the runtime keeps each image in one prefill chunk
            vision["bidirectional_images"] = True
        if facts.bidirectional_images and options.prefill_seq_len < vision["vision_size"]:
            raise ExportError(f"{facts.architecture}'s {vision['vision_size']} image tokens attend to each other both "
                              f"ways, so one prefill chunk must hold a whole image; use --prefill-seq-len "
                              f"{vision['vision_size']} or more")
        image_idx = torch.zeros((1, 1), dtype=torch.int64)
        if facts.mrope:   # [4, batch, seq_len]: text positions, then the (t, h, w) RoPE rows
            position_ids = position_ids.unsqueeze(0).expand(4, 1, seq).contiguous()
            dyn["position_ids"] = {1: "batch_size", 2: "seq_len"}
        if options.single_graph:
            pixels = vision_pixels(vision, tdtype)
            lead, names = [input_ids, position_ids, pixels, image_idx], ["position_ids", naming.PIXEL_VALUES]
            dyn[naming.PIXEL_VALUES] = ({0: "grid_height"} if "grid" in vision
                                        else {0: "vision_batch_size", 2: "img_size", 3: "img_size"})
        else:
            rows = torch.zeros((1, vision["vision_size"], vision["hidden_size"]), dtype=tdtype)
            lead, names = [input_ids, rows, position_ids, image_idx], [naming.VISION_EMBEDS, "position_ids"]
            dyn[naming.VISION_EMBEDS] = {0: "vision_batch_size", 1: "vision_size"}
        retained_name = naming.retained_name(names[1] if options.single_graph else names[0])
        dyn[retained_name] = dyn[names[1] if options.single_graph else names[0]]
        in_names[1:2] = names + [naming.IMAGE_IDX]
        out_names[1:1] = [retained_name, naming.IMAGE_IDX_OUTPUT]
        args = [*lead, *past]
    else:
        args = [input_ids, position_ids, *past]
    if options.ccl is not None:  # contract section 9: after the KV inputs, before batch_index
        args.append(torch.ones(options.ctx_len, dtype=torch.int64))
        in_names.append(naming.CCL_INPUT)
        dyn[naming.CCL_INPUT] = {0: naming.CCL_INPUT}
    if options.continuous_batching:
        args.append(torch.zeros((1, 1), dtype=torch.int64))
        in_names.append("batch_index")
        dyn["batch_index"] = {0: "batch_size"}
    compact = options.target in ("onnxruntime", "onnxruntime-fused")
    fused = options.target == "onnxruntime-fused"
    # GroupQueryAttention's RoPE caches must cover every position the graph may be run at.
    max_positions = max(options.ctx_len, int(getattr(text_cfg, "max_position_embeddings", 0) or 0))
    common = dict(valid_length_attention=compact, fused=fused, max_positions=max_positions, facts=facts,
                  ccl=options.ccl is not None, ring_layers=ring_layers, windowed_layers=facts.windowed_layers(options))
    if vision is not None:
        wrapper = vlm_mod.VisionLanguageLM(model, num_layers, options.continuous_batching,
                                           image_token_id=facts.image_token_id, single_graph=options.single_graph,
                                           image_blocks=facts.bidirectional_images, mrope=facts.mrope,
                                           grid=vision.get("grid"), **common).eval()
    else:
        wrapper = torch_graph.RetainedStateLM(model, num_layers, options.continuous_batching, **common).eval()
    if fused and wrapper.rotary is not None:
        rotary = torch_graph.skip_model_rotary(model)
    elif compact:
        rotary = torch_graph.compact_rotary(model)
    else:
        rotary = contextlib.nullcontext()
    with warnings.catch_warnings(), torch.no_grad(), rotary, torch_graph.export_patches(model), \
            moe.static_routing(model, path):
        warnings.simplefilter("ignore")
        try:
            torch.onnx.export(wrapper, tuple(args), str(path), dynamo=False, opset_version=opt.OPSET,
                              input_names=in_names, output_names=out_names, dynamic_axes=dyn,
                              do_constant_folding=True,
                              custom_opsets={"com.microsoft": 1} if options.target == "onnxruntime-fused" else None)
        except Exception as exc:  # tracing failures are model-specific; report them in one line
            raise ExportError(f"tracing failed for {type(model).__name__}: {type(exc).__name__}: "
                              f"{str(exc).splitlines()[0] if str(exc) else ''}") from None
    (n_kv, head_dim), (v_heads, v_dim) = kv_shapes[0]
    geometry = {"num_layers": num_layers, "n_kv_heads": n_kv, "head_dim": head_dim,
                "vocab_size": int(text_cfg.vocab_size), "kv_dtype": options.dtype}
    if (v_heads, v_dim) != (n_kv, head_dim):
        geometry.update(value_heads=v_heads, value_head_dim=v_dim)
    if vision is not None:
        geometry["vision"] = vision
    geometry.update(sliding_window=facts.sliding_window if facts.sliding_layers else None,
                    sliding_layers=list(facts.sliding_layers), sliding_cache=facts.sliding_cache(options))
    return geometry


def vision_onnx_name(onnx_name: str) -> str:
    """The dual layout's vision graph beside the language graph ``onnx_name``: ``<name>_vision.onnx``."""
    return onnx_name[:-len(".onnx")] + "_vision.onnx"


#: the image side a vision graph is traced for when the vision config fixes none (Qwen2.5-VL), unless
#: ``--image-size`` says otherwise
DEFAULT_IMAGE_SIZE = 448


def vision_geometry(model, image_size: int | None = None) -> dict:
    """What a vision-language model's image input and vision rows look like, from its config and one run of its
    own image encoder on a blank image: ``image_size``, ``channels``, ``vision_size`` (rows per image) and
    ``hidden_size`` (of a row: the language model's). Models that take patch rows (``temporal_patch_size`` in
    the vision config: Qwen2.5-VL) add ``grid`` ``[t, h, w]`` (patches), ``patch_dim`` (values per patch row)
    and ``spatial_merge_size``; their vision graph is traced for that one grid."""
    import torch

    from . import vlm as vlm_mod

    vcfg = model.config.vision_config
    own = getattr(vcfg, "image_size", None)
    own = own[0] if isinstance(own, (list, tuple)) else own
    size = int(image_size or own or DEFAULT_IMAGE_SIZE)
    channels = int(getattr(vcfg, "num_channels", None) or getattr(vcfg, "in_channels", None) or 3)
    geometry = {"image_size": size, "channels": channels}
    temporal = getattr(vcfg, "temporal_patch_size", None)
    if temporal:
        patch, merge = int(vcfg.patch_size), int(getattr(vcfg, "spatial_merge_size", 1) or 1)
        if size % (patch * merge):
            raise ExportError(f"--image-size {size} is not a multiple of patch_size x spatial_merge_size "
                              f"({patch} x {merge}) of {type(model).__name__}'s vision encoder")
        geometry.update(grid=[1, size // patch, size // patch], patch_dim=channels * int(temporal) * patch * patch,
                        spatial_merge_size=merge)
    elif image_size is not None and own is not None and int(image_size) != int(own):
        raise ExportError(f"--image-size {image_size}: {type(model).__name__}'s vision encoder takes {own}x{own} "
                          f"images")
    dtype = next(model.parameters()).dtype
    grid = torch.tensor([geometry["grid"]], dtype=torch.int64) if "grid" in geometry else None
    with torch.no_grad():
        rows = vlm_mod.image_features(model, vision_pixels(geometry, dtype), grid)
    geometry.update(vision_size=int(rows.shape[1]), hidden_size=int(rows.shape[2]))
    return geometry


def vision_pixels(vision: dict, dtype):
    """A blank input for the vision encoder: one image ``[1, C, H, W]``, or its patch rows ``[t*h*w, patch_dim]``."""
    import torch

    if "grid" in vision:
        t, h, w = vision["grid"]
        return torch.zeros((t * h * w, vision["patch_dim"]), dtype=dtype)
    return torch.zeros((1, vision["channels"], vision["image_size"], vision["image_size"]), dtype=dtype)


def _trace_vision(model, options: opt.ExportOptions, path: Path, vision: dict) -> None:
    """The dual layout's vision graph: ``pixel_values [batch_size, channels, img_size, img_size] ->
    vision_embeds [batch_size, vision_size, hidden]``."""
    import torch

    from . import vlm as vlm_mod

    dtype = next(model.parameters()).dtype
    args, names = (vision_pixels(vision, dtype),), [naming.PIXEL_VALUES]
    dyn = {naming.PIXEL_VALUES: {0: "batch_size", 2: "img_size", 3: "img_size"},
           naming.VISION_EMBEDS: {0: "batch_size"}}
    if "grid" in vision:   # patch rows of one grid, fixed in the graph
        dyn = {naming.PIXEL_VALUES: {0: "grid_height"}}
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        try:
            torch.onnx.export(vlm_mod.VisionEncoder(model, vision.get("grid")).eval(), args, str(path), dynamo=False,
                              opset_version=opt.OPSET, input_names=names, output_names=[naming.VISION_EMBEDS],
                              dynamic_axes=dyn, do_constant_folding=True)
        except Exception as exc:
            raise ExportError(f"tracing the vision encoder of {type(model).__name__} failed: {type(exc).__name__}: "
                              f"{str(exc).splitlines()[0] if str(exc) else ''}") from None


def _finalize_vision(model: ir.Model, options: opt.ExportOptions, vision: dict) -> None:
    """Deterministic metadata, and the output's exact shape: ``[batch_size, vision_size, hidden]`` (one image
    per row; patch-row models: one row per image of the fixed grid)."""
    out = model.graph.outputs[0]
    out.shape = ir.Shape([1 if "grid" in vision else "batch_size", vision["vision_size"], vision["hidden_size"]])
    model.ir_version = opt.IR_VERSION
    model.producer_name = "qeff-kv"
    model.producer_version = __version__
    model.doc_string = None
    model.graph.name = "qeff_kv_vision"
    model.metadata_props["qeff_kv.exporter_version"] = str(opt.EXPORTER_VERSION)
    model.metadata_props["qeff_kv.target"] = options.target


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
    if geometry.get("sliding_window"):
        model.metadata_props[naming.SLIDING_WINDOW_META] = str(geometry["sliding_window"])
        model.metadata_props[naming.SLIDING_CACHE_META] = str(geometry["sliding_cache"])
    if geometry.get("vision"):   # what a runtime needs to feed images, with the bare .onnx too
        model.metadata_props[naming.VISION_META] = json.dumps(geometry["vision"], sort_keys=True)
    RemovePassThroughPass()(model)  # no-op nodes between a KV update and its retained output (in-place rule)
    if options.target == "onnxruntime-fused":
        PackGQAQKVPass()(model)
        if options.dtype == "float32":
            FuseSkipRMSNormPass()(model)
    if options.single_graph and options.target in ("onnxruntime", "onnxruntime-fused"):
        # decode steps (image_idx -1 from qeff-kv's runtime) skip the vision encoder; the portable target keeps the
        # peer's plain graph (accelerator compilers may not take an If)
        if GateVisionEncoderPass()(model).modified:
            model.metadata_props["qeff_kv.vision_encoder"] = "gated"   # runs only where image_idx >= 0
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
        "sliding_window": geometry.get("sliding_window"),
        "sliding_layers": geometry.get("sliding_layers", []),
        "sliding_cache": geometry.get("sliding_cache"),
        "buffers": layout.to_json(options.ctx_len)["pairs"],
        "regexes": naming.canonical_regexes(options.kv_cache_prefix),
        "specializations_format": fmt,
        "ccl": list(options.ccl) if options.ccl is not None else None,
        "exporter": {"name": "qeff-kv", "version": __version__, "opset": opt.OPSET, "ir_version": opt.IR_VERSION},
    }
