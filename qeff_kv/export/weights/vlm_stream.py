"""Streaming a vision-language model (issue 51): the skeleton is the image-text-to-text class the whole path loads
(:meth:`~qeff_kv.export.sources.FolderSource.load_torch_model`), and each parameter reads the checkpoint tensor that
transformers itself would load into it.

Hub checkpoints of Llava-style models keep the names of the classes before transformers 5
(``language_model.model.layers.0...``, ``vision_tower...``, ``language_model.lm_head...``) while the class names its
parameters ``model.language_model.layers.0...``, ``model.vision_tower...``, ``lm_head...``; transformers 5 renames
at load (and back at save, so a tiny model saved by it has the old names too). The renaming is not re-typed here:
:func:`~qeff_kv.export.weights.expert_keys.converted_store` runs transformers' own rules (its conversion mapping,
what ``from_pretrained`` runs) over the checkpoint's keys, as for every model; a conversion it does not stream is
refused in one line and the model loads whole.

Both graphs of a dual layout are captured from the same skeleton (the vision graph's parameters attached lazily,
as the language graph's), and the verification reference runs the skeleton with its weights streamed module by
module, the vision tower's too (:func:`~qeff_kv.export.weights.stream.streamed_weights`).
"""

from __future__ import annotations


def is_vision_language(config) -> bool:
    """Whether a config (``config.json`` as a dict, or a transformers config) describes a vision-language model:
    it has a vision config (the test the whole-model load makes)."""
    if isinstance(config, dict):
        return isinstance(config.get("vision_config"), dict)
    vision = getattr(config, "vision_config", None)
    return vision is not None and not isinstance(vision, (str, int, float, bool))


def auto_class(transformers, cfg):
    """The auto class the whole path loads ``cfg`` with: image-text-to-text for a vision-language model."""
    return transformers.AutoModelForImageTextToText if is_vision_language(cfg) else transformers.AutoModelForCausalLM

def sliced_view(t, shape: tuple) -> tuple | None:
    """``((start, stop) per axis)`` where the folded tensor ``t`` is a cut of the stand-in of ``shape``
    (``parameter[a0:b0, a1:b1, ...]``: the axes in order, step 1; InternVL's vision position table is folded as
    ``[:, :1]`` and ``[:, 1:]``); None where it is not one (or is the whole parameter). The last axis must be whole:
    a stand-in holds one element per row, so a cut along it cannot be told from another."""
    import numpy as np

    shape = tuple(int(d) for d in shape)
    if not shape or t.dim() != len(shape) or int(t.shape[-1]) != shape[-1] \
            or (t.storage_offset() == 0 and tuple(t.shape) == shape):
        return None
    base = shape[:-1] + (1,)
    strides = tuple(int(np.prod(base[i + 1:], dtype=np.int64)) for i in range(len(shape) - 1)) + (0,)
    if any(n > 1 and s != strides[i] for i, (n, s) in enumerate(zip(t.shape, t.stride()))) \
            or t.storage_offset() >= int(np.prod(base, dtype=np.int64)):
        return None
    starts = np.unravel_index(t.storage_offset(), base)
    cut = tuple((int(a), int(a) + int(n)) for a, n in zip(starts, t.shape))
    return cut if all(b <= d for (_a, b), d in zip(cut, shape)) else None
