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
``position_ids [4, batch, seq_len]`` (text positions, then the multimodal RoPE rows of :mod:`qeff_kv.mrope`).

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

import torch

from .family import needs_image_sizes
from .wrapper import RetainedStateLM


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


def _grid_tensor(grid) -> torch.Tensor | None:
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
        return image_features(self.model, pixel_values, _grid_tensor(self.grid))


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


class VisionLanguageLM(RetainedStateLM):
    """The language graph of a vision-language model (dual layout), or the whole model (``single_graph``).

    Inputs in the peer's order: dual ``(input_ids, vision_embeds, position_ids, image_idx, *KV, [batch_index])``,
    single ``(input_ids, position_ids, pixel_values, image_idx, *KV, [batch_index])``. Outputs: ``(logits,
    vision_embeds | pixel_values, image_idx_output, *KV_RetainedState)``."""

    def __init__(self, model: torch.nn.Module, num_layers: int, continuous_batching: bool, *, image_token_id: int,
                 single_graph: bool = False, image_blocks: bool = False, mrope: bool = False, grid=None, **kwargs):
        super().__init__(model, num_layers, continuous_batching, **kwargs)
        self.image_token_id = int(image_token_id)
        self.single_graph = single_graph
        #: image tokens attend to each other both ways within an image (Gemma3)
        self.image_blocks = image_blocks
        #: ``position_ids [4, B, S]``: text positions, then the multimodal RoPE rows (Qwen2.5-VL)
        self.mrope = mrope
        #: the single graph's fixed patch grid (see :class:`VisionEncoder`)
        self.grid = grid

    def forward(self, input_ids, first, second, *rest):
        if self.single_graph:
            position_ids, pixel_values = first, second
            image_idx, *rest = rest
            vision_embeds = image_features(self.lm, pixel_values, _grid_tensor(self.grid))
            retained_input = pixel_values
        else:
            vision_embeds, position_ids = first, second
            image_idx, *rest = rest
            retained_input = vision_embeds
        rope_rows = None
        if self.mrope:
            position_ids, rope_rows = position_ids[0], position_ids[1:]
        text = self.lm.get_input_embeddings()(input_ids)
        merged, image_idx_out = merge_image_rows(text, input_ids, position_ids, vision_embeds, image_idx,
                                                 self.image_token_id)
        blocks = image_blocks(input_ids, position_ids, self.image_token_id) if self.image_blocks else None
        logits, *kv = self.run(input_ids, position_ids, rest, inputs_embeds=merged, blocks=blocks,
                               rope_rows=rope_rows)
        return (logits, retained_input, image_idx_out, *kv)
