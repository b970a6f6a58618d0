"""The image inputs of a vision-language *language* graph (contract section 6), as :class:`~.session.Session`
feeds them. The vision stage that makes them is :mod:`qeff_kv.runtime.multimodal.vision`.

A language graph of either layout takes, besides the text decoder's inputs,

* its retained image buffer: ``vision_embeds [images, vision_size, hidden]`` (dual layout) or ``pixel_values``
  (single layout), output unchanged as ``<name>_RetainedState``. One ``OrtValue`` is bound as both the input and
  the output (in place: onnxruntime's ``Identity``/``Cast`` of a buffer onto itself copies nothing), so the image
  rows are never copied per step. A prompt's images are bound once, before its first chunk, and stay bound for
  the decode steps after it; before any image a zero placeholder of one image is bound;
* ``image_idx`` / ``image_idx_output`` (int64 ``[1, 1]``): the first image row of the chunk and one past the last
  row it used. The session sets ``image_idx = 0`` before a prompt with images and copies ``image_idx_output``
  back after each chunk, so an image split across chunks continues where it stopped; decode steps and prompts
  without an image get ``-1``, which merges nothing (an image token generated after the prompt keeps its text
  embedding, as in transformers).

What the graph does not say (the image token, rows per image, whether an image must stay in one chunk) comes
from the graph's ``qeff_kv.vision`` metadata or the export manifest; for another exporter's graph (the peer's:
no metadata) from the graph's static dims, the caller (the image token id, ``image_size``, ``vision_size``) or
the prompt (:class:`~qeff_kv.runtime.vision_language.VisionLanguageModel` resolves them). The peer's graphs take a chunk of one token for
a decode step and merge no image there, so no chunk of one token holds an image token (:func:`plan_prompt`).
Several sequences of a continuous-batching graph each bind their own images for
their own prefill (one prefill runs at a time): ``image_idx`` restarts at 0 for every prompt.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import onnxruntime as ort

from qeff_kv.contract import multimodal, naming
from qeff_kv.contract.chunking import plan_chunks, token_runs
from qeff_kv.errors import ContractError, RuntimeInputError
from qeff_kv.contract.layout import KVLayout
from qeff_kv.runtime.multimodal.positions import RopeMark


#: The image processor's arrays a vision-language export takes, by name (the rest of its output is text: ids, masks)
IMAGE_INPUTS = (naming.PIXEL_VALUES, "image_grid_thw", "image_sizes")


@dataclass
class Images:
    """One prompt's images, ready for the language graph (made by
    :meth:`qeff_kv.runtime.vision_language.VisionLanguageModel.images`).

    Attributes:
        array: ``vision_embeds [images, vision_size, hidden]`` (dual) or ``pixel_values`` (single); ``value`` is an
            ``OrtValue`` over the same memory.
        count: images; ``rows``: the image tokens they fill (``count * vision_size``).
        rope: multimodal RoPE rows ``[3, len(tokens)]`` of the prompt, counted from 0, and ``marks``: each image's
            ``(start, end, delta)`` in the prompt (:mod:`qeff_kv.runtime.multimodal.positions`); ``None`` / empty otherwise.
    """

    array: np.ndarray
    count: int
    rows: int
    rope: np.ndarray | None = None
    marks: list[tuple[int, int, int]] = field(default_factory=list)
    value: ort.OrtValue | None = None

    def __post_init__(self):
        if self.value is None:
            self.value = ort.OrtValue.ortvalue_from_numpy(self.array)

    def after_text(self, k: int) -> "Images":
        """The same images for the prompt with ``k`` text tokens put before it (a pending token fed first)."""
        rope = None if self.rope is None else np.concatenate(
            [np.tile(np.arange(k, dtype=np.int64), (3, 1)), self.rope + k], axis=1)
        return Images(self.array, self.count, self.rows, rope, [(s + k, e + k, d) for s, e, d in self.marks],
                      self.value)


@dataclass
class Prompt:
    """A request for :meth:`Session.stream` / :meth:`Session.generate`: prompt token ids with their images."""

    tokens: Sequence[int]
    images: Images | None = None


def graph_geometry(t) -> dict:
    """What the static dims of a language graph's image input say: ``vision_embeds [images, vision_size, hidden]``
    gives ``vision_size`` and ``hidden_size``; ``pixel_values [images, C, S, S]`` gives ``channels`` and
    ``image_size``. Symbolic dims say nothing (the peer's graphs)."""
    shape = tuple(t.shape or ())
    static = [d if isinstance(d, int) and not isinstance(d, bool) else None for d in shape]
    out = {}
    if t.name == naming.VISION_EMBEDS and len(static) == 3:
        out.update(vision_size=static[1], hidden_size=static[2])
    elif t.name == naming.PIXEL_VALUES and len(static) == 4:
        out.update(channels=static[1], image_size=static[2] if static[2] == static[3] else None)
    return {k: v for k, v in out.items() if v is not None}


def plan_prompt(tokens: Sequence[int], chunk: int, image_token: int, *, keep_runs_whole: bool = False
                ) -> list[tuple[int, int]]:
    """The chunks of a prompt: :func:`qeff_kv.contract.chunking.plan_chunks`, then no chunk of one token that holds an image
    token (the peer's merge takes ``seq_len == 1`` for a decode step and keeps the text embedding): such a chunk
    takes the token before it from the previous chunk. (Images kept whole start their chunk: not moved.)"""
    plan = plan_chunks(tokens, chunk, run_token=image_token, keep_runs_whole=keep_runs_whole)
    for i, (off, cnt) in enumerate([] if keep_runs_whole else plan):
        if cnt == 1 and tokens[off] == image_token:
            if i == 0 or plan[i - 1][1] < 2:
                raise RuntimeInputError(f"image token at prompt position {off} would be fed in a chunk of one token, "
                                        "which a vision-language graph takes for a decode step (no image merged); "
                                        "use a prefill length of 2 or more (--prefill-seq-len)")
            poff, pcnt = plan[i - 1]
            plan[i - 1], plan[i] = (poff, pcnt - 1), (off - 1, 2)
    return plan


def vision_facts(layout: KVLayout, manifest: dict | None) -> dict:
    """The vision geometry: graph metadata ``qeff_kv.vision``, else the manifest's ``vision`` (plus its
    ``image_token_id``), else ``{}`` (another exporter's graph)."""
    raw = layout.metadata.get(naming.VISION_META)
    if raw:
        try:
            facts = json.loads(raw)
            if isinstance(facts, dict):
                return facts
        except ValueError:
            pass
    man = manifest or {}
    facts = dict(man.get("vision") or {})
    if man.get("image_token_id") is not None:
        facts.setdefault("image_token_id", man["image_token_id"])
    return facts


class LanguageMedia:
    """Feeds the image inputs of one vision-language language graph through the session's IOBinding."""

    def __init__(self, layout: KVLayout, kind: str, facts: dict, image_token_id: int | None):
        self.kind = kind
        self.name = naming.VISION_EMBEDS if kind == multimodal.DUAL else naming.PIXEL_VALUES
        self.input = layout.input(self.name)
        self.output_name = naming.retained_name(self.name)
        self.facts = {**graph_geometry(self.input), **facts}   # metadata / manifest first, then static dims
        token = image_token_id if image_token_id is not None else facts.get("image_token_id")
        if token is None:
            raise RuntimeInputError(f"{self.name} graph without qeff-kv's vision metadata or manifest: give its image "
                                    "token id (image_token_id=..., --image-token-id)")
        self.image_token_id = int(token)
        #: every image must stay in one prefill chunk (its tokens attend to each other both ways: Gemma3)
        self.whole_images = bool(facts.get("bidirectional_images"))
        self.vision_size = facts.get("vision_size")
        self._idx_in = np.full((1, 1), -1, dtype=np.int64)
        self._idx_out = np.zeros((1, 1), dtype=np.int64)
        self._idx_values = (ort.OrtValue.ortvalue_from_numpy(self._idx_in),
                            ort.OrtValue.ortvalue_from_numpy(self._idx_out))
        self.placeholder = Images(np.zeros(self._placeholder_shape(), np.dtype(self.input.dtype)), 1, 0)
        self.bound: Images = self.placeholder
        self._rebind = False

    def set_facts(self, facts: dict) -> None:
        """The vision geometry resolved after the session opened (a peer graph's, from its vision graph, options or
        a prompt): rows per image, and a placeholder image of the right size (rebound before the next prompt)."""
        self.facts = facts
        self.vision_size = facts.get("vision_size")
        placeholder = Images(np.zeros(self._placeholder_shape(), np.dtype(self.input.dtype)), 1, 0)
        if placeholder.array.shape != self.placeholder.array.shape:
            if self.bound is self.placeholder:
                self.bound = placeholder
                self._rebind = True
            self.placeholder = placeholder

    @property
    def placeholder_known(self) -> bool:
        """Whether a text-only prompt can run: a single-layout graph encodes its bound image in every call, so its
        placeholder must be an image the encoder takes (its size known); the dual layout's rows are never read."""
        f = self.facts
        return self.kind != multimodal.SINGLE or "grid" in f or f.get("image_size") is not None

    # ------------------------------------------------------------------------------------------ set-up
    @classmethod
    def resolve(cls, layout: KVLayout, manifest: dict | None,
                image_token_id: int | None = None) -> "LanguageMedia | None":
        """The media of a vision-language graph, ``None`` for a text decoder; a graph with other non-KV retained
        buffers, or malformed image buffers, is refused in one line."""
        kind = multimodal.graph_kind(layout)
        names = [i or o for i, o in layout.non_kv_retained]
        if kind not in (multimodal.DUAL, multimodal.SINGLE):
            if names:
                raise ContractError(f"graph has non-KV retained buffers {names}; the runtime runs text decoders and "
                                    f"vision-language graphs ({naming.VISION_EMBEDS} or {naming.PIXEL_VALUES} with "
                                    f"{naming.IMAGE_IDX})")
            return None
        issues = multimodal.non_kv_issues(layout)
        if issues:
            raise ContractError(issues[0].message)
        own = naming.VISION_EMBEDS if kind == multimodal.DUAL else naming.PIXEL_VALUES
        other = [n for n in names if n not in (own, naming.IMAGE_IDX)]
        if other:
            raise ContractError(f"graph has non-KV retained buffers {other} besides {own} and {naming.IMAGE_IDX}; "
                                "the runtime does not know how to feed them")
        if layout.input(naming.IMAGE_IDX) is None or layout.output(naming.IMAGE_IDX_OUTPUT) is None:
            raise ContractError(f"vision-language graph without both {naming.IMAGE_IDX} and "
                                f"{naming.IMAGE_IDX_OUTPUT}: the runtime chains the image rows across prefill chunks")
        return cls(layout, kind, vision_facts(layout, manifest), image_token_id)

    @property
    def input_names(self) -> tuple[str, str]:
        return self.name, naming.IMAGE_IDX

    def _placeholder_shape(self) -> tuple[int, ...]:
        """One image's worth of zeros at the graph's own dims (symbolic ones from the vision facts, else 1)."""
        shape = self.input.shape or ()
        f = self.facts
        if self.name == naming.VISION_EMBEDS:
            want = [1, f.get("vision_size", 1), f.get("hidden_size", 1)]
        elif "grid" in f:
            t, h, w = f["grid"]
            want = [t * h * w, f.get("patch_dim", 1)]
        else:
            want = [1, f.get("channels", 3), f.get("image_size", 1), f.get("image_size", 1)]
        if len(want) != len(shape):
            want = [1] * len(shape)
        return tuple(d if isinstance(d, int) else int(w) for d, w in zip(shape, want))

    def bind(self, io: ort.IOBinding, bind_out: Callable[[str, ort.OrtValue], None]) -> None:
        """Bind the current images in place and the ``image_idx`` pair (once; after every image change)."""
        io.bind_ortvalue_input(self.name, self.bound.value)
        bind_out(self.output_name, self.bound.value)
        io.bind_ortvalue_input(naming.IMAGE_IDX, self._idx_values[0])
        bind_out(naming.IMAGE_IDX_OUTPUT, self._idx_values[1])

    # ------------------------------------------------------------------------------------------ a prefill
    def check(self, tokens: Sequence[int], images: Images | None, chunk: int) -> list[tuple[int, int]]:
        """Refuse a prompt whose image tokens do not match its images (one line, before anything runs); return
        its chunk plan ``[(offset, count)]``."""
        n = sum(1 for t in tokens if t == self.image_token_id)
        if images is None and n:
            raise RuntimeInputError(f"the prompt holds {n} image token(s) (id {self.image_token_id}) but no image "
                                    "was given")
        if images is not None:
            if not isinstance(images, Images):
                raise RuntimeInputError(f"images must come from VisionLanguageModel.images(), got "
                                        f"{type(images).__name__}")
            if n != images.rows:
                raise RuntimeInputError(f"the prompt holds {n} image token(s) (id {self.image_token_id}) but its "
                                        f"{images.count} image(s) fill {images.rows} (one token per image row)")
            if images.rope is not None and images.rope.shape[1] != len(tokens):
                raise RuntimeInputError("the images' RoPE rows were made for another prompt")
        elif self.bound is self.placeholder and not self.placeholder_known:
            raise RuntimeInputError(f"{self.name} graph: a text-only prompt runs its vision encoder on a placeholder "
                                    "image, and the image size of this graph is recorded nowhere: give it "
                                    "(VisionLanguageModel(image_size=...), --image-size), or an image first")
        return plan_prompt(tokens, chunk, self.image_token_id, keep_runs_whole=self.whole_images)

    def begin(self, io: ort.IOBinding, bind_out, images: Images | None) -> None:
        """Before a prompt's first chunk: its images bound (if any), ``image_idx`` 0, else -1 (no merge)."""
        if images is not None and images is not self.bound:
            self.bound = images
            self._rebind = True
        if self._rebind:
            self.bind(io, bind_out)
            self._rebind = False
        self._idx_in[0, 0] = 0 if images is not None else -1

    def chain(self) -> None:
        """After a chunk: the next one continues at the row this one stopped."""
        if self._idx_in[0, 0] >= 0:
            self._idx_in[...] = self._idx_out

    def end(self) -> None:
        """After a prompt: decode steps merge nothing."""
        self._idx_in[0, 0] = -1

    @staticmethod
    def marks(images: Images | None, start: int, delta: int) -> list[RopeMark]:
        """The RoPE marks of a prompt's images once it sits at position ``start`` after text offset ``delta``."""
        if images is None:
            return []
        return [RopeMark(start + s, start + e, delta + d) for s, e, d in images.marks]

    def image_runs(self, tokens: Sequence[int]) -> list[tuple[int, int]]:
        return token_runs(tokens, self.image_token_id)
