"""A vision-language model at run time: the vision stage (:class:`~qeff_kv.runtime.multimodal.vision.VisionStage`)
feeding the language :class:`~qeff_kv.runtime.session.Session`; see :mod:`qeff_kv.runtime.multimodal.vision` for
what the stage does and docs/vlm.md. It sits above the session (it opens one), the stage below it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Mapping, Sequence as Seq

import numpy as np

from qeff_kv.contract import mrope, naming
from qeff_kv.support.validate import integer_array
from qeff_kv.errors import ContractError, RuntimeInputError
from qeff_kv.support.limits import positive_int
from qeff_kv.runtime.multimodal.media import IMAGE_INPUTS, Images, Prompt
from qeff_kv.runtime.multimodal.vision import TEXT_KEYS, VisionStage
from qeff_kv.runtime.results import Generation
from qeff_kv.runtime.session import Session


class VisionLanguageModel:
    """A vision-language export, run with images.

    Args:
        model: an export folder (``manifest.json`` naming the language graph and the vision graph), or the language
            ``.onnx`` (its vision graph ``<name>_vision.onnx`` beside it, or ``vision``).
        vision: the vision graph (dual layout), where the manifest does not name it: a peer dual pair is
            ``VisionLanguageModel("lang.onnx", "vision.onnx", image_token_id=...)``.
        image_size, vision_size: the image side and the image rows per image, where neither the graphs' metadata,
            the manifest nor their static dims say them (the peer's graphs); else taken from the image given (its
            side), the vision graph's output (its rows) or, in the single layout, the prompt (one run of image
            tokens per image). Given where the graph fixes them, they must agree.
        **session_kwargs: for the language :class:`Session` (``ctx_len``, ``max_sequences``, ``threads``,
            ``image_token_id``...).
    """

    def __init__(self, model: str | os.PathLike, vision: str | os.PathLike | None = None, *,
                 image_size: int | None = None, vision_size: int | None = None, **session_kwargs):
        for label, v in (("image_size", image_size), ("vision_size", vision_size)):
            if v is not None:
                positive_int(label, v)
        self.session = Session(model, **session_kwargs)
        self._attach(vision, image_size, vision_size, session_kwargs)

    @classmethod
    def around(cls, session: Session, **stage_kwargs) -> "VisionLanguageModel":
        """The vision-language model of an open language ``session`` (a server's: its vision stage opened beside
        it, with ``threads``, ``providers``, ``device`` from ``stage_kwargs``); the facts as the constructor finds
        them with no ``vision``, ``image_size`` or ``vision_size`` given."""
        model = cls.__new__(cls)
        model.session = session
        model._attach(None, None, None, stage_kwargs)
        return model

    def _attach(self, vision, image_size, vision_size, session_kwargs: dict) -> None:
        media = self.session.media
        if media is None:
            raise ContractError(f"{self.session.files.onnx_path}: a text decoder graph (no {naming.VISION_EMBEDS} or "
                                f"{naming.PIXEL_VALUES} input); open it with Session")
        self.media = media
        facts = dict(media.facts)   # metadata / manifest, then the language graph's static dims
        self.vision: VisionStage | None = None
        if media.kind == "dual":
            path = self._vision_path(vision)
            if path is not None:
                self.vision = VisionStage(path, threads=session_kwargs.get("threads"),
                                          providers=session_kwargs.get("providers"),
                                          device=session_kwargs.get("device"))
                if self.vision.out_dtype != np.dtype(media.input.dtype):
                    raise ContractError(f"{path}: vision_embeds is {self.vision.out_dtype}; the language graph takes "
                                        f"{media.input.dtype}")
                facts = {**self.vision.geometry(), **facts}
        elif vision is not None:
            raise RuntimeInputError("a vision graph was given for a single-layout graph (it encodes images itself)")
        for key, option, given in (("image_size", "--image-size", image_size),
                                   ("vision_size", "--vision-size", vision_size)):
            if given is None:
                continue
            if facts.get(key) is not None and int(facts[key]) != int(given):
                raise RuntimeInputError(f"{key}={given} ({option}) was given, but this graph's {key} is {facts[key]}")
            facts[key] = int(given)
        self.facts = facts
        media.set_facts(facts)

    def _vision_path(self, given) -> Path | None:
        if given is not None:
            return Path(given)
        files = self.session.files
        name = (files.manifest or {}).get("vision_onnx")
        if name:
            return files.folder / str(name)
        beside = files.onnx_path.with_name(files.onnx_path.stem + "_vision.onnx")
        return beside if beside.is_file() else None

    # ------------------------------------------------------------------------------------------ images
    def images(self, tokens: Seq[int], image_inputs: Mapping[str, np.ndarray]) -> Images:
        """Check ``image_inputs`` (the image processor's arrays) against the export and ``tokens``, run the vision
        stage, and return what the language session binds for this prompt."""
        if not isinstance(image_inputs, Mapping):
            raise RuntimeInputError(f"image inputs must be a mapping of array names to arrays, got "
                                    f"{type(image_inputs).__name__}")
        f = self.facts
        known = {*IMAGE_INPUTS, *TEXT_KEYS}
        unknown = sorted(k for k in image_inputs if k not in known)
        if unknown:
            raise RuntimeInputError(f"image input {unknown[0]!r} is not used by this model (it takes "
                                    f"{naming.PIXEL_VALUES}{', image_grid_thw' if 'grid' in f else ''})")
        if naming.PIXEL_VALUES not in image_inputs:
            raise RuntimeInputError(f"image inputs have no {naming.PIXEL_VALUES!r} array (they have "
                                    f"{sorted(image_inputs)})")
        pixels = np.asarray(image_inputs[naming.PIXEL_VALUES])
        if not np.issubdtype(pixels.dtype, np.floating):
            raise RuntimeInputError(f"{naming.PIXEL_VALUES} is {pixels.dtype}; expected floats")
        per_image, grids = (self._patch_images(pixels, image_inputs) if "grid" in f
                            else self._square_images(pixels, image_inputs))
        token = self.media.image_token_id
        rope, marks = None, []
        if self.session.mrope:
            merge = int(f.get("spatial_merge_size", 1))
            rope, _ = mrope.prompt_positions(list(tokens), token, grids, merge)
            marks = mrope.image_marks(list(tokens), token, grids, merge)
        rows_per_image = f.get("vision_size")
        t0 = time.perf_counter()
        dtype = np.dtype(self.media.input.dtype)
        if self.media.kind == "single":
            if "grid" in f and len(per_image) != 1:
                raise RuntimeInputError(f"a single-layout graph of a patch-row model encodes one image of grid "
                                        f"{f['grid']} per prompt; {len(per_image)} were given")
            if rows_per_image is None:
                rows_per_image = self._rows_from_prompt(tokens, len(per_image))
            array = np.ascontiguousarray(np.concatenate(per_image), dtype=dtype)
        else:
            if self.vision is None:
                raise RuntimeInputError(f"no vision graph for {self.session.files.onnx_path.name}: give it "
                                        "(vision=..., --vision-graph; the dual layout's <name>_vision.onnx)")
            # rows the vision graph's static output fixes are written in place; else its output says them
            static = self.vision.geometry()
            array = self.vision.encode(per_image, static.get("vision_size"), static.get("hidden_size"))
            if rows_per_image is not None and array.shape[1] != int(rows_per_image):
                raise RuntimeInputError(f"the vision graph made {array.shape[1]} rows per image; this graph's "
                                        f"vision_size is {rows_per_image} (metadata, manifest, --vision-size)")
            rows_per_image = array.shape[1]
        rows_per_image = int(rows_per_image)
        timings = self.session.timings
        timings.vision_s += time.perf_counter() - t0
        timings.images += len(per_image)
        return Images(array, len(per_image), len(per_image) * rows_per_image, rope, marks)

    def _rows_from_prompt(self, tokens: Seq[int], images: int) -> int:
        """A single-layout graph whose rows per image are recorded nowhere: one run of image tokens per image, all
        of one length."""
        runs = [n for _, n in self.media.image_runs(tokens)]
        if len(runs) == images and len(set(runs)) == 1:
            return runs[0]
        raise RuntimeInputError(f"the image rows per image (vision_size) of this graph are recorded nowhere, and the "
                                f"prompt's image tokens (runs of {runs}) are not one run of one length per image for "
                                f"its {images} image(s): give vision_size=... (--vision-size)")

    def _square_images(self, pixels: np.ndarray, inputs) -> tuple[list[np.ndarray], list]:
        f = self.facts
        want = (f.get("channels", 3), f.get("image_size"), f.get("image_size"))
        if pixels.ndim != 4 or pixels.shape[0] < 1 or any(w is not None and d != w for d, w in zip(pixels.shape[1:],
                                                                                                 want)):
            raise RuntimeInputError(f"{naming.PIXEL_VALUES} has shape {list(pixels.shape)}; this export takes "
                                    f"[images, {want[0]}, {want[1]}, {want[2]}]")
        sizes = inputs.get("image_sizes")
        if sizes is not None:
            sizes = integer_array("image_sizes", sizes).reshape(-1, 2)
            if sizes.shape[0] != pixels.shape[0] or not np.all(sizes == np.array(pixels.shape[2:])):
                raise RuntimeInputError(f"image_sizes {sizes.tolist()}: this export takes {want[1]}x{want[2]} images "
                                        f"(resize them to that size)")
        return [pixels[i:i + 1] for i in range(pixels.shape[0])], []

    def _patch_images(self, pixels: np.ndarray, inputs) -> tuple[list[np.ndarray], list]:
        f = self.facts
        grid = [int(x) for x in f["grid"]]
        per = grid[0] * grid[1] * grid[2]
        dim = int(f.get("patch_dim", pixels.shape[-1]))
        if pixels.ndim != 2 or pixels.shape[1] != dim or pixels.shape[0] == 0 or pixels.shape[0] % per:
            raise RuntimeInputError(f"{naming.PIXEL_VALUES} has shape {list(pixels.shape)}; this export takes patch "
                                    f"rows [images x {per}, {dim}] (image grid {grid})")
        n = pixels.shape[0] // per
        thw = inputs.get("image_grid_thw")
        if thw is not None:
            thw = integer_array("image_grid_thw", thw).reshape(-1, 3)
            if thw.shape[0] != n:
                raise RuntimeInputError(f"image_grid_thw lists {thw.shape[0]} images; {naming.PIXEL_VALUES} holds {n}")
            bad = [row for row in thw.tolist() if row != grid]
            if bad:
                raise RuntimeInputError(f"image_grid_thw {bad[0]}: this export was traced for image grid {grid} "
                                        f"({f.get('image_size')}x{f.get('image_size')} images; export again with "
                                        "--image-size for another size)")
        return [pixels[i * per:(i + 1) * per] for i in range(n)], [grid] * n

    def prompt(self, tokens: Seq[int], image_inputs: Mapping[str, np.ndarray] | None = None) -> Prompt:
        """A request for :meth:`generate` or ``session.stream``: ``tokens`` with their images (if any)."""
        tokens = list(tokens)
        return Prompt(tokens, None if image_inputs is None else self.images(tokens, image_inputs))

    def generate(self, requests, **kwargs) -> list[Generation]:
        """Like :meth:`Session.generate`; a request may also be ``(token ids, image inputs)`` or a :class:`Prompt`."""
        if isinstance(requests, (list, tuple)) and requests and all(
                isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in requests):
            requests = [list(requests)]
        if isinstance(requests, tuple) and len(requests) == 2 and isinstance(requests[1], Mapping):
            requests = [requests]
        prepared = []
        for r in requests:
            if isinstance(r, tuple) and len(r) == 2 and (r[1] is None or isinstance(r[1], Mapping)) \
                    and not isinstance(r[0], (Prompt,)) and not hasattr(r[0], "slot"):
                r = self.prompt(r[0], r[1])
            prepared.append(r)
        return self.session.generate(prepared, **kwargs)
