"""Vision-language models at run time: a vision stage feeding the language :class:`~.session.Session`.

* :class:`VisionStage` runs the dual layout's vision graph (``pixel_values -> vision_embeds``) once per image,
  each image's output written by onnxruntime straight into its row of one ``[images, vision_size, hidden]``
  buffer (IOBinding onto a row view: no copy);
* :class:`VisionLanguageModel` opens an export folder (or a language ``.onnx``), checks a prompt's image inputs
  (the image processor's arrays by name: ``pixel_values``, and ``image_grid_thw`` for patch-row models) against
  the export's vision geometry and the prompt's image tokens, runs the vision stage (single layout: none, the
  pixels themselves are the language graph's retained input) and hands the language session an
  :class:`~.media.Images`, which it binds in place as the retained ``vision_embeds`` / ``pixel_values`` buffer.
  Multimodal RoPE rows (Qwen2.5-VL) are computed here from the image grids (:mod:`qeff_kv.contract.mrope`).

Everything else (sequences, continuous batching, rewinds, state files and hand-off) is the language session's:
``model.session``. A state file carries the KV buffers and, for multimodal RoPE, the RoPE offsets; the images
are not part of it (decode never reads them).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Mapping, Sequence as Seq

import numpy as np
import onnxruntime as ort

from qeff_kv.support import capture
from qeff_kv.graph import graphio
from qeff_kv.contract import mrope, naming
from qeff_kv.support.validate import integer_array
from qeff_kv.errors import ContractError, GraphReadError, RuntimeInputError
from qeff_kv.support.limits import positive_int
from qeff_kv.runtime.multimodal.media import IMAGE_INPUTS, Images, Prompt
from qeff_kv.runtime.results import Generation
from qeff_kv.runtime.execution import ep_proofs
from qeff_kv.runtime.arguments import check_providers, require_available
from qeff_kv.runtime.execution.executor import quiet_onnxruntime
from qeff_kv.runtime.session import Session

#: processor outputs that are not images: the prompt's own ids and masks (the runtime derives what it needs)
TEXT_KEYS = ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids")


class VisionStage:
    """The dual layout's vision graph: ``pixel_values`` (one image) -> ``vision_embeds [1, vision_size, hidden]``."""

    def __init__(self, path: str | os.PathLike, *, threads: int | None = None, providers: Seq[str] | None = None,
                 device: str | None = None):
        providers = check_providers(providers, device)
        ep_proofs.require(providers, "vision")   # before anything is read
        require_available(providers)
        self.path = Path(path)
        if not self.path.is_file():
            raise GraphReadError(f"{self.path}: no such vision graph")
        layout = graphio.layout_of(graphio.load(self.path))
        ins, outs = {t.name: t for t in layout.inputs}, {t.name: t for t in layout.outputs}
        if naming.PIXEL_VALUES not in ins or naming.VISION_EMBEDS not in outs or len(ins) != 1:
            raise ContractError(f"{self.path}: not a vision graph ({naming.PIXEL_VALUES} -> {naming.VISION_EMBEDS}); "
                                f"it has inputs {sorted(ins)}")
        self.input, self.output = ins[naming.PIXEL_VALUES], outs[naming.VISION_EMBEDS]
        self.dtype = np.dtype(self.input.dtype)
        self.out_dtype = np.dtype(self.output.dtype)
        so = ort.SessionOptions()
        so.log_severity_level = 3
        if threads:
            so.intra_op_num_threads = int(threads)
        quiet_onnxruntime()
        try:
            with capture.library_output():   # onnxruntime's own log lines stay out of the terminal
                self._sess = ort.InferenceSession(str(self.path), so, providers=providers)
        except Exception as exc:
            raise GraphReadError(f"{self.path}: onnxruntime cannot load it ({' '.join(str(exc).split())[:300]})") \
                from None
        self._io = self._sess.io_binding()
        self.runs = 0
        #: rows and hidden size of the output for an input shape, where the graph's output dims are symbolic
        self._out_dims: dict[tuple, tuple[int, int]] = {}

    def geometry(self) -> dict:
        """What the graph's static dims say: ``vision_size`` and ``hidden_size`` of the output rows, ``channels`` and
        ``image_size`` of a square image input."""
        out, inp = self.output.shape or (), self.input.shape or ()
        g = {}
        if len(out) == 3 and isinstance(out[1], int) and isinstance(out[2], int):
            g.update(vision_size=out[1], hidden_size=out[2])
        if len(inp) == 4 and isinstance(inp[1], int):
            g["channels"] = inp[1]
        if len(inp) == 4 and isinstance(inp[2], int) and inp[2] == inp[3]:
            g["image_size"] = inp[2]
        return g

    def encode(self, images: list[np.ndarray], rows: int | None, hidden: int | None) -> np.ndarray:
        """Run each image once; returns ``[len(images), rows, hidden]``, each image's rows written in place. With
        ``rows`` or ``hidden`` unknown (a graph whose output dims are symbolic), the first image's output says them
        (that one image is copied into place; later calls with images of that shape write in place)."""
        first = None
        if rows is None or hidden is None:
            rows, hidden = self._out_dims.get(tuple(images[0].shape), (rows, hidden))
        if rows is None or hidden is None:
            self._io.bind_cpu_input(naming.PIXEL_VALUES, np.ascontiguousarray(images[0], dtype=self.dtype))
            self._io.bind_output(naming.VISION_EMBEDS, "cpu")
            self._run(0)
            first = self._io.get_outputs()[0].numpy()
            if first.ndim != 3 or first.shape[0] != 1:
                raise RuntimeInputError(f"the vision graph made {naming.VISION_EMBEDS} of shape {list(first.shape)} "
                                        "for one image; expected [1, rows, hidden]")
            rows, hidden = int(first.shape[1]), int(first.shape[2])
            self._out_dims[tuple(images[0].shape)] = (rows, hidden)
        out = np.empty((len(images), rows, hidden), dtype=self.out_dtype)
        for i, pixels in enumerate(images):
            if i == 0 and first is not None:
                out[0] = first[0]
                continue
            self._io.bind_cpu_input(naming.PIXEL_VALUES, np.ascontiguousarray(pixels, dtype=self.dtype))
            self._io.bind_ortvalue_output(naming.VISION_EMBEDS, ort.OrtValue.ortvalue_from_numpy(out[i:i + 1]))
            self._run(i)
        return out

    def _run(self, i: int) -> None:
        try:
            self._sess.run_with_iobinding(self._io)
        except Exception as exc:
            raise RuntimeInputError(f"the vision graph failed on image {i}: "
                                    f"{' '.join(str(exc).split())[:300]}") from None
        self.runs += 1


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
