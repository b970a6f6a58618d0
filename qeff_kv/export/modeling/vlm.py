"""Vision-language models (contract section 6): the vision encoder graph and the language graph's image merge.

Two layouts, the peer's:

* **dual graph** (default): a vision graph ``pixel_values -> vision_embeds [images, vision_size, hidden]`` (the
  model's own ``get_image_features``: vision tower, feature-layer selection, projector), and a language graph
  ``(input_ids, vision_embeds, position_ids, image_idx, KV...) -> (logits, vision_embeds_RetainedState,
  image_idx_output, KV_RetainedState...)``;
* **single graph**: ``(input_ids, position_ids, pixel_values, image_idx, KV...) -> (logits,
  pixel_values_RetainedState, image_idx_output, KV_RetainedState...)``, the vision encoder inside.

Models that take images as patch rows with a grid (Qwen2.5-VL) get graphs for one grid, fixed at export (the
manifest's ``vision.grid``), and no ``image_grid_thw`` input; their language graph takes
``position_ids [4, batch, seq_len]`` (text positions, then the multimodal RoPE rows of :mod:`qeff_kv.contract.mrope`).

The merge rule (:func:`merge_image_rows`): the image-token positions of a chunk take consecutive rows of the
flattened ``vision_embeds``, starting at row ``image_idx``; ``image_idx_output`` is one past the last row used
(or ``image_idx`` when the chunk has no image token), so the runner feeds it back as the next chunk's
``image_idx`` and an image split across prefill chunks continues where it stopped. A negative ``image_idx``
(qeff-kv's runtime feeds -1 to decode steps and to prompts without an image; the peer's runners never do) merges
nothing: every token keeps its text embedding, as transformers does for an image token generated after the
prompt. ``vision_embeds`` / ``pixel_values`` are retained unchanged (the output
is the input), so a runtime binds one buffer for both and the device keeps it.

This module imports torch; nothing outside :mod:`qeff_kv.export` imports it.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import onnx_ir as ir
import torch

from qeff_kv import __version__
from qeff_kv.contract import naming
from qeff_kv.errors import ExportError
from qeff_kv.export.facts.family import needs_image_sizes
from qeff_kv.export.versions import EXPORTER_VERSION, IR_VERSION, OPSET


def image_features(model: torch.nn.Module, pixel_values: torch.Tensor,
                   image_grid_thw: torch.Tensor | None = None) -> torch.Tensor:
    """``[images, vision_size, hidden]``: the model's own ``get_image_features`` (projected into the language
    model's hidden size), with the config's feature layer and selection strategy. ``image_grid_thw``: the patch
    grid of each image, for models that take images as patch rows (Qwen2.5-VL; the graph is traced for one
    grid, which the runtime must feed unchanged)."""
    extra = {} if image_grid_thw is None else {"image_grid_thw": image_grid_thw}
    if image_grid_thw is None and needs_image_sizes(model):
        # Pixtral-style encoders (Mistral3) take each image's size: the graph's images are all of its one size
        h, w = int(pixel_values.shape[-2]), int(pixel_values.shape[-1])
        extra["image_sizes"] = torch.tensor([[h, w]] * int(pixel_values.shape[0]), dtype=torch.int64)
    out = model.get_image_features(pixel_values=pixel_values, return_dict=True, **extra)
    feats = getattr(out, "pooler_output", out)
    if isinstance(feats, (list, tuple)):
        feats = torch.stack(list(feats), 0)
    if feats.dim() == 2:
        images = pixel_values.shape[0] if image_grid_thw is None else image_grid_thw.shape[0]
        feats = feats.reshape(images, -1, feats.shape[-1])
    return feats


def grid_tensor(grid) -> torch.Tensor | None:
    return None if grid is None else torch.tensor([list(grid)], dtype=torch.int64)


class VisionEncoder(torch.nn.Module):
    """The vision graph: ``pixel_values -> vision_embeds``. ``grid``: the one patch grid ``[t, h, w]`` of a
    patch-row model (Qwen2.5-VL), fixed in the graph (the vision encoder's window layout is computed from it in
    Python, so a traced graph holds one grid; the manifest records it)."""

    def __init__(self, model: torch.nn.Module, grid=None):
        super().__init__()
        self.model = model
        self.grid = grid

    def forward(self, pixel_values):
        return image_features(self.model, pixel_values, grid_tensor(self.grid))


def merge_image_rows(text_embeds: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor,
                     vision_embeds: torch.Tensor, image_idx: torch.Tensor, image_token_id: int):
    """``(embeds [B, S, H], image_idx_output [1, 1])``: image-token rows replaced by consecutive rows of the
    flattened ``vision_embeds`` from row ``image_idx`` on (padding, ``position_ids < 0``, never counts); none when
    ``image_idx < 0``."""
    hidden = int(text_embeds.shape[-1])   # a constant: the rows are flattened by Reshape(rows, [-1, hidden])
    selected = (input_ids == image_token_id) & (position_ids >= 0) & (image_idx >= 0)    # [B, S]
    idx = selected.to(torch.int64).cumsum(1) - 1
    idx = torch.where(idx != -1, idx + image_idx, idx)                                   # -1: not an image row
    rows = vision_embeds.reshape(-1, hidden).to(text_embeds.dtype)
    gathered = rows[idx.clamp(min=0)]                                                    # [B, S, H]
    merged = torch.where(selected.unsqueeze(-1), gathered, text_embeds)
    image_idx_out = torch.maximum(image_idx, (idx.max() + 1).reshape(1, 1))
    return merged, image_idx_out


def image_blocks(input_ids: torch.Tensor, position_ids: torch.Tensor, image_token_id: int) -> torch.Tensor:
    """``[B, S]``: for each image token of the chunk the index of its image (each maximal run of image tokens
    is one image), ``-1`` for text and padding; transformers' ``token_type_ids`` blocks (Gemma3), within which
    attention goes both ways."""
    is_image = (input_ids == image_token_id) & (position_ids >= 0)
    previous = torch.cat([torch.zeros_like(is_image[:, :1]), is_image[:, :-1]], dim=1)
    starts = is_image & ~previous
    ids = starts.to(torch.int64).cumsum(1) - 1
    return torch.where(is_image, ids, torch.full_like(ids, -1))


# ------------------------------------------------------------------------------- geometry and tracing
#: the image side a vision graph is traced for when the vision config fixes none (Qwen2.5-VL), unless
#: ``--image-size`` says otherwise
DEFAULT_IMAGE_SIZE = 448


def vision_geometry(model, image_size: int | None = None) -> dict:
    """What a vision-language model's image input and vision rows look like, from its config and one run of its
    own image encoder on a blank image: ``image_size``, ``channels``, ``vision_size`` (rows per image) and
    ``hidden_size`` (of a row: the language model's). Models that take patch rows (``temporal_patch_size`` in
    the vision config: Qwen2.5-VL) add ``grid`` ``[t, h, w]`` (patches), ``patch_dim`` (values per patch row)
    and ``spatial_merge_size``; their vision graph is traced for that one grid."""
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
        rows = image_features(model, vision_pixels(geometry, dtype), grid)
    geometry.update(vision_size=int(rows.shape[1]), hidden_size=int(rows.shape[2]))
    return geometry


def vision_pixels(vision: dict, dtype):
    """A blank input for the vision encoder: one image ``[1, C, H, W]``, or its patch rows ``[t*h*w, patch_dim]``."""
    if "grid" in vision:
        t, h, w = vision["grid"]
        return torch.zeros((t * h * w, vision["patch_dim"]), dtype=dtype)
    return torch.zeros((1, vision["channels"], vision["image_size"], vision["image_size"]), dtype=dtype)


def language_inputs(io, vision: dict, facts, options, dtype) -> dict:
    """The language graph's vision inputs in the peer's order (contract section 6), put into the trace's
    :class:`~qeff_kv.export.trace.GraphIO` before its KV buffers; returns the geometry the graph records
    (``vision`` plus ``image_token_id`` and ``bidirectional_images``). Dual: ``(input_ids, vision_embeds,
    position_ids, image_idx, ...)``; single: ``(input_ids, position_ids, pixel_values, image_idx, ...)``; outputs
    ``(logits, vision_embeds | pixel_values retained, image_idx_output, ...)``."""
    vision = dict(vision)
    vision["image_token_id"] = int(facts.image_token_id)
    if facts.bidirectional_images:   # the runtime keeps each image in one prefill chunk
        vision["bidirectional_images"] = True
    if facts.bidirectional_images and options.prefill_seq_len < vision["vision_size"]:
        raise ExportError(f"{facts.architecture}'s {vision['vision_size']} image tokens attend to each other both "
                          f"ways, so one prefill chunk must hold a whole image; use --prefill-seq-len "
                          f"{vision['vision_size']} or more")
    input_ids, position_ids = io.args
    dyn = io.dyn
    seq = int(input_ids.shape[1])
    image_idx = torch.zeros((1, 1), dtype=torch.int64)
    if facts.mrope:   # [4, batch, seq_len]: text positions, then the (t, h, w) RoPE rows
        position_ids = position_ids.unsqueeze(0).expand(4, 1, seq).contiguous()
        dyn["position_ids"] = {1: "batch_size", 2: "seq_len"}
    if options.single_graph:
        pixels = vision_pixels(vision, dtype)
        lead, names = [input_ids, position_ids, pixels, image_idx], ["position_ids", naming.PIXEL_VALUES]
        dyn[naming.PIXEL_VALUES] = ({0: "grid_height"} if "grid" in vision
                                    else {0: "vision_batch_size", 2: "img_size", 3: "img_size"})
    else:
        rows = torch.zeros((1, vision["vision_size"], vision["hidden_size"]), dtype=dtype)
        lead, names = [input_ids, rows, position_ids, image_idx], [naming.VISION_EMBEDS, "position_ids"]
        dyn[naming.VISION_EMBEDS] = {0: "vision_batch_size", 1: "vision_size"}
    retained_name = naming.retained_name(names[1] if options.single_graph else names[0])
    dyn[retained_name] = dyn[names[1] if options.single_graph else names[0]]
    io.in_names[1:2] = names + [naming.IMAGE_IDX]
    io.out_names[1:1] = [retained_name, naming.IMAGE_IDX_OUTPUT]
    io.args = lead
    return vision


def trace_vision(model, options, path: Path, vision: dict, *, export_params: bool = True) -> None:
    """The dual layout's vision graph: ``pixel_values [batch_size, channels, img_size, img_size] ->
    vision_embeds [batch_size, vision_size, hidden]``. ``export_params=False``: the parameters stay graph inputs
    without data (the streaming export attaches them)."""
    dtype = next(model.parameters()).dtype
    args, names = (vision_pixels(vision, dtype),), [naming.PIXEL_VALUES]
    dyn = {naming.PIXEL_VALUES: {0: "batch_size", 2: "img_size", 3: "img_size"},
           naming.VISION_EMBEDS: {0: "batch_size"}}
    if "grid" in vision:   # patch rows of one grid, fixed in the graph
        dyn = {naming.PIXEL_VALUES: {0: "grid_height"}}
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        try:
            torch.onnx.export(VisionEncoder(model, vision.get("grid")).eval(), args, str(path), dynamo=False,
                              opset_version=OPSET, input_names=names, output_names=[naming.VISION_EMBEDS],
                              dynamic_axes=dyn, do_constant_folding=True, export_params=export_params)
        except Exception as exc:
            raise ExportError(f"tracing the vision encoder of {type(model).__name__} failed: {type(exc).__name__}: "
                              f"{str(exc).splitlines()[0] if str(exc) else ''}") from None


def finalize_vision(model: ir.Model, options, vision: dict) -> None:
    """Deterministic metadata, and the output's exact shape: ``[batch_size, vision_size, hidden]`` (one image
    per row; patch-row models: one row per image of the fixed grid)."""
    out = model.graph.outputs[0]
    out.shape = ir.Shape([1 if "grid" in vision else "batch_size", vision["vision_size"], vision["hidden_size"]])
    model.ir_version = IR_VERSION
    model.producer_name = "qeff-kv"
    model.producer_version = __version__
    model.doc_string = None
    model.graph.name = "qeff_kv_vision"
    model.metadata_props[naming.EXPORTER_VERSION_META] = str(EXPORTER_VERSION)
    model.metadata_props[naming.TARGET_META] = options.target
