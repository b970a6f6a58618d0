"""The vision stage of a vision-language model at run time (what feeds the language session; the model that holds
both is :class:`qeff_kv.runtime.vision_language.VisionLanguageModel`):

* :class:`VisionStage` runs the dual layout's vision graph (``pixel_values -> vision_embeds``) once per image,
  each image's output written by onnxruntime straight into its row of one ``[images, vision_size, hidden]``
  buffer (IOBinding onto a row view: no copy);
* :class:`~qeff_kv.runtime.vision_language.VisionLanguageModel` opens an export folder (or a language ``.onnx``), checks a prompt's image inputs
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
import threading
from pathlib import Path
from typing import Sequence as Seq

import numpy as np
import onnxruntime as ort

from qeff_kv.support import capture
from qeff_kv.graph import graphio
from qeff_kv.contract import naming
from qeff_kv.errors import ContractError, GraphReadError, RuntimeInputError
from qeff_kv.runtime.execution import ep_proofs
from qeff_kv.runtime.arguments import check_providers, require_available
from qeff_kv.runtime.execution.executor import quiet_onnxruntime

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
        so.log_severity_level = capture.onnxruntime_log_severity()
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
        #: one IOBinding holds the images of one call: concurrent calls (a server's request threads) take turns
        self._lock = threading.Lock()
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
        (that one image is copied into place; later calls with images of that shape write in place). Thread-safe:
        concurrent calls take turns (they share the binding)."""
        with self._lock:
            return self._encode(images, rows, hidden)

    def _encode(self, images: list[np.ndarray], rows: int | None, hidden: int | None) -> np.ndarray:
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
