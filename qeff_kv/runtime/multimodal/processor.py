"""Image files and a prompt -> the inputs of a vision-language export, with the export folder's own processor.

:func:`image_prompt` loads the Hugging Face processor that the exporter copied into the export folder (the
tokenizer files, ``preprocessor_config.json`` / ``processor_config.json`` and any chat template: see
:data:`qeff_kv.export.sources.PROCESSOR_FILES`), writes the prompt text with one image placeholder per image
(plain, or through the chat template), and lets the processor expand each placeholder into the model's image
tokens and turn the images into arrays. The result feeds :meth:`qeff_kv.runtime.vision_language.VisionLanguageModel.images`
and the session's prompt.

It needs transformers and Pillow (the ``image`` extra), imported on first use: the image processor runs on
transformers' PIL backend (numpy), so neither torch nor torchvision is needed. Without them, the arrays can be
made elsewhere and given as a ``.npz`` file (``--image-inputs``).
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from qeff_kv.errors import MissingDependencyError, RuntimeInputError
from qeff_kv.runtime.multimodal.media import IMAGE_INPUTS

#: The processor outputs a vision-language export takes as image inputs (the text ones are the token ids).
IMAGE_KEYS = IMAGE_INPUTS
#: Files that hold an image processor's settings (transformers 5 nests them in ``processor_config.json``).
PREPROCESSOR_FILE, PROCESSOR_FILE = "preprocessor_config.json", "processor_config.json"
MISSING_DEPENDENCY = ("--image needs transformers and Pillow (pip install 'qeff-kv[image]'); "
                      "or give --image-inputs FILE.npz")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def _import_dependencies():
    # transformers advises at import that torch is missing: expected here (the PIL backend needs no torch)
    quiet = "TRANSFORMERS_NO_ADVISORY_WARNINGS" not in os.environ
    if quiet:
        os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = "1"
    try:
        import transformers
        from PIL import Image
    except ImportError:
        raise MissingDependencyError(MISSING_DEPENDENCY) from None
    finally:
        if quiet:
            os.environ.pop("TRANSFORMERS_NO_ADVISORY_WARNINGS", None)
    return transformers, Image


def has_image_processor(folder: Path) -> bool:
    """Whether ``folder`` holds an image processor's settings: ``preprocessor_config.json``, or an
    ``image_processor`` entry in ``processor_config.json`` (how transformers 5 saves a processor)."""
    if (folder / PREPROCESSOR_FILE).is_file():
        return True
    try:
        data = json.loads((folder / PROCESSOR_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and isinstance(data.get("image_processor"), dict)


def _load_processor(transformers, folder: Path):
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()   # no backend/deprecation notices on the command line
    try:
        # backend="pil": the numpy/PIL image processor, never the torchvision one (a serving host has no torch)
        return transformers.AutoProcessor.from_pretrained(folder, backend="pil")
    except Exception as exc:  # noqa: BLE001 - whatever transformers raises on a folder it cannot read
        raise RuntimeInputError(f"{folder}: cannot load the image processor ({_first_line(exc)})") from None
    finally:
        hf_logging.set_verbosity(verbosity)


@dataclass(frozen=True)
class ImageLimits:
    """Bounds on the images :func:`image_prompt` decodes, checked from each file's header (Pillow reads the size
    without decoding) before any pixel is decoded: a decompression bomb (a small file declaring a huge image) is
    refused in one line instead of filling memory.

    Attributes:
        max_pixels: the most pixels (width x height) of one image.
        max_total_pixels: the most pixels of all the images of one call together.
        formats: the Pillow formats opened (None: any Pillow knows).
        option: how the caller names the limit, appended to the refusal (``--max-image-pixels``).
    """

    max_pixels: int
    max_total_pixels: int
    formats: tuple[str, ...] | None = None
    option: str = ""


#: the image formats a server decodes: what cameras, browsers and screenshots make (no format whose Pillow plugin
#: runs another program, such as EPS through Ghostscript)
WEB_FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP", "TIFF")   # JPEG: a camera's MPO too


def _open_images(Image, images: Sequence[str | os.PathLike], limits: ImageLimits | None = None) -> list:
    """The images decoded to RGB: the first frame of a multi-frame file (GIF, APNG, TIFF) only. With ``limits``,
    every header is read and checked before the first image is decoded."""
    lazy = []
    try:
        for path in images:
            lazy.append(_open_lazy(Image, path, limits))
        if limits is not None:
            _check_sizes(images, [im.size for im in lazy], limits)
        return [_decoded(im, path) for im, path in zip(lazy, images)]
    finally:
        for im in lazy:
            im.close()


def _open_lazy(Image, path, limits: ImageLimits | None):
    """``Image.open``: the header read, nothing decoded (the size known)."""
    formats = None if limits is None else limits.formats
    if formats is not None:
        Image.init()   # every plugin registered (Pillow's first pass knows a few: asking it for another fails)
        formats = tuple(f for f in formats if f in Image.OPEN)   # those this Pillow has
    try:
        return Image.open(path, formats=formats)
    except FileNotFoundError:
        raise RuntimeInputError(f"image {os.fspath(path)}: no such file") from None
    except Exception as exc:  # noqa: BLE001 - PIL raises UnidentifiedImageError, OSError, ValueError...
        raise RuntimeInputError(f"image {os.fspath(path)}: cannot read it as an image "
                                f"({_first_line(exc)})") from None


def _check_sizes(images, sizes: list[tuple[int, int]], limits: ImageLimits) -> None:
    option = f" ({limits.option})" if limits.option else ""
    for path, (w, h) in zip(images, sizes):
        if w * h > limits.max_pixels:
            raise RuntimeInputError(f"image {os.fspath(path)}: {w}x{h} pixels ({w * h}); the limit is "
                                    f"{limits.max_pixels} pixels per image{option}")
    total = sum(w * h for w, h in sizes)
    if total > limits.max_total_pixels:
        raise RuntimeInputError(f"the {len(sizes)} images hold {total} pixels together; the limit is "
                                f"{limits.max_total_pixels} pixels per request{option}")


def _decoded(im, path):
    """The current (first) frame of ``im`` decoded to RGB."""
    try:
        out = im.convert("RGB")   # loads the current frame alone: frame 0, never the animation
    except Exception as exc:  # noqa: BLE001 - truncated data, decoder errors...
        raise RuntimeInputError(f"image {os.fspath(path)}: cannot read it as an image "
                                f"({_first_line(exc)})") from None
    if out.size != im.size:   # a decoder that grew the image past what its header declared: not decoded further
        raise RuntimeInputError(f"image {os.fspath(path)}: the decoded size differs from the header's")
    return out


def _manifest_image_token_id(folder: Path) -> int | None:
    for name in ("manifest.json", "config.json"):
        try:
            data = json.loads((folder / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        for key in ("image_token_id", "image_token_index"):
            if isinstance(data, dict) and isinstance(data.get(key), int):
                return data[key]
    return None


def _image_placeholder(processor, folder: Path) -> str:
    """The text the processor expands into one image's tokens (``<image>`` for Llava)."""
    tokenizer = getattr(processor, "tokenizer", None)
    token = getattr(processor, "image_token", None)
    if not isinstance(token, str) or not token:
        token_id = getattr(processor, "image_token_id", None)
        if not isinstance(token_id, int):
            token_id = _manifest_image_token_id(folder)
        if isinstance(token_id, int) and tokenizer is not None:
            token = tokenizer.convert_ids_to_tokens(token_id)
    if not isinstance(token, str) or not token:
        raise RuntimeInputError(f"{folder}: the processor names no image token to place the image with "
                                f"(use --chat, or give --image-inputs)")
    # Qwen2-VL / Qwen2.5-VL: the chat template wraps the image pad in vision start/end tokens; so does a plain prompt
    vocab = tokenizer.get_vocab() if tokenizer is not None and hasattr(tokenizer, "get_vocab") else {}
    if token == "<|image_pad|>" and "<|vision_start|>" in vocab and "<|vision_end|>" in vocab:
        return f"<|vision_start|>{token}<|vision_end|>"
    return token


def exact_size_kwargs(image_processor, image_size: int | None) -> dict:
    """The image processor's call kwargs that make it keep an ``image_size x image_size`` image at that size, for
    the processors that pick the size themselves: a Qwen2-VL image processor (Qwen2-VL, Qwen2.5-VL) rounds the
    image to a multiple of ``patch_size * merge_size`` within its pixel bounds (``size["shortest_edge"]`` /
    ``["longest_edge"]``: the least and most pixels, ``min_pixels`` / ``max_pixels`` of old), so both bounds become
    ``image_size ** 2``. ``{}`` for the others (a Llava's CLIP processor resizes to its own fixed size) and without
    ``image_size``."""
    if image_size is None or image_processor is None:
        return {}
    valid = getattr(getattr(image_processor, "valid_kwargs", None), "__annotations__", {})
    size = getattr(image_processor, "size", None)   # a SizeDict (or a dict) of the processor's settings
    bounds = [size.get(k) if isinstance(size, dict) else getattr(size, k, None)
              for k in ("shortest_edge", "longest_edge")]
    if not ({"min_pixels", "max_pixels"} <= set(valid) and None not in bounds):
        return {}
    pixels = int(image_size) ** 2
    return {"size": {"shortest_edge": pixels, "longest_edge": pixels}}


def _chat_text(processor, folder: Path, text: str, n_images: int, system: str | None) -> str:
    messages = []
    if system is not None:
        messages.append({"role": "system", "content": [{"type": "text", "text": system}]})
    content = [{"type": "image"} for _ in range(n_images)] + [{"type": "text", "text": text}]
    messages.append({"role": "user", "content": content})
    template = None
    if getattr(processor, "chat_template", None) is None:
        template = getattr(getattr(processor, "tokenizer", None), "chat_template", None)
        if template is None:
            raise RuntimeInputError(f"{folder}: the processor has no chat template (drop --chat)")
    try:
        return processor.apply_chat_template(messages, chat_template=template, add_generation_prompt=True,
                                             tokenize=False)
    except Exception as exc:  # noqa: BLE001 - jinja2 errors and whatever the template raises
        raise RuntimeInputError(f"{folder}: the chat template failed ({_first_line(exc)})") from None


def image_prompt(folder: Path, text: str, images: Sequence[str | os.PathLike], *, chat: bool = False,
                 system: str | None = None, image_size: int | None = None, vision: dict | None = None,
                 limits: ImageLimits | None = None) -> tuple[list[int], dict[str, np.ndarray]]:
    """The prompt token ids and image arrays for ``text`` about ``images``, made by the processor of the
    export (or model) folder ``folder``.

    Each image gets one placeholder before the text (``chat=False``: ``"<image>" * n + text`` for Llava), or
    the chat template renders an optional ``system`` turn and one user turn of the images then the text, with
    the generation prompt (``chat=True``). The processor expands every placeholder into the model's image
    tokens (16 ``<image>`` tokens per image for a Llava of 16 image rows).

    Returns ``(token ids, arrays)``: the arrays are the image processor's outputs the export takes, by name
    (``pixel_values``, and ``image_grid_thw`` / ``image_sizes`` when the processor gives them).

    ``image_size``: resize every image to ``image_size x image_size`` first (PIL, bicubic: an export traced for one
    patch grid, Qwen2.5-VL), and have the image processor keep that size (:func:`exact_size_kwargs`).

    ``vision``: the export's vision facts (``image_token_id``, ``vision_size``), used when the folder's processor
    cannot be loaded as a whole (Qwen2.5-VL's needs torchvision for its video half): the image processor and the
    tokenizer then do the work, and each image placeholder is expanded here into the image's tokens
    (``prod(image_grid_thw) / merge_size^2``, or ``vision_size``), as the processor would.

    ``limits``: :class:`ImageLimits` checked from the image headers before any image is decoded (None: any size
    Pillow's own decompression-bomb guard lets through). Only the first frame of an animated image is decoded.

    Raises :class:`~qeff_kv.errors.MissingDependencyError` without transformers or Pillow, and
    :class:`~qeff_kv.errors.RuntimeInputError` (one line) for a folder without an image processor, an image
    file that is missing or unreadable, or a processor that fails on the input.
    """
    return ImagePrompter(folder, vision).prompt(text, images, chat=chat, system=system, image_size=image_size,
                                                limits=limits)


class ImagePrompter:
    """:func:`image_prompt` for one folder, its processor loaded once (:meth:`load`: a server calls it at start-up)
    and shared by threads: loading and running the processor hold a lock (transformers' lazy imports and a fast
    tokenizer are not safe to enter from two threads at once); decoding the images does not."""

    def __init__(self, folder: str | os.PathLike, vision: dict | None = None):
        self.folder = Path(folder)
        self.vision = vision
        self._lock = threading.Lock()
        self._loaded: tuple | None = None   # ("processor", p) | ("parts", image_processor, tokenizer) | ("error", e)

    def load(self) -> "ImagePrompter":
        """Load the folder's processor now (once; a failure is kept and raised by every :meth:`prompt`)."""
        with self._lock:
            self._load_locked()
        return self

    def _load_locked(self) -> tuple:
        if self._loaded is None:
            try:
                self._loaded = self._load_parts()
            except RuntimeInputError as exc:
                self._loaded = ("error", exc)
        return self._loaded

    def _load_parts(self) -> tuple:
        transformers, _ = _import_dependencies()
        folder = self.folder
        if not has_image_processor(folder):
            raise RuntimeInputError(f"{folder}: no image processor ({PREPROCESSOR_FILE} is missing); "
                                    f"give the image arrays with --image-inputs FILE.npz")
        try:
            return ("processor", _load_processor(transformers, folder))
        except RuntimeInputError:
            if self.vision is None:
                raise
        return ("parts", *_load_image_processor(transformers, folder))

    def prompt(self, text: str, images: Sequence[str | os.PathLike], *, chat: bool = False,
               system: str | None = None, image_size: int | None = None, limits: ImageLimits | None = None,
               vision: dict | None = None) -> tuple[list[int], dict[str, np.ndarray]]:
        """:func:`image_prompt` with this folder's processor (``vision``: the vision facts now, default: those it
        was made with)."""
        images = list(images)
        if not isinstance(text, str):
            raise RuntimeInputError(f"the prompt must be text, got {type(text).__name__}")
        if not images:
            raise RuntimeInputError("no image given")
        _, Image = _import_dependencies()
        if self._loaded is None and not has_image_processor(self.folder):
            self.load()   # the refusal, before any image is read
        if self._loaded is not None and self._loaded[0] == "error":
            raise self._loaded[1]
        pil_images = _open_images(Image, images, limits)
        if image_size is not None:
            pil_images = [im.resize((int(image_size), int(image_size)), Image.BICUBIC) for im in pil_images]
        with self._lock:
            loaded = self._load_locked()
            if loaded[0] == "error":
                raise loaded[1]
            if loaded[0] == "parts":
                return _with_image_processor(loaded[1], loaded[2], self.folder, text, pil_images, chat, system,
                                             self.vision if vision is None else vision, image_size)
            return _with_processor(loaded[1], self.folder, text, pil_images, chat, system, image_size)


def _with_processor(processor, folder: Path, text: str, pil_images: list, chat: bool, system: str | None,
                    image_size: int | None) -> tuple[list[int], dict[str, np.ndarray]]:
    if chat:
        prompt = _chat_text(processor, folder, text, len(pil_images), system)
    else:
        if system is not None:
            raise RuntimeInputError("a system prompt needs the chat template (--chat)")
        prompt = _image_placeholder(processor, folder) * len(pil_images) + text
    return _process(processor, folder, prompt, pil_images, chat=chat, image_size=image_size)


def _process(processor, folder: Path, prompt: str, pil_images: list, *, chat: bool, image_size: int | None
             ) -> tuple[list[int], dict[str, np.ndarray]]:
    """Run the folder's processor on the rendered ``prompt`` and the images: ``(token ids, image arrays)``."""
    kwargs = {}
    bos = getattr(getattr(processor, "tokenizer", None), "bos_token", None)
    if chat and isinstance(bos, str) and bos and prompt.startswith(bos):
        kwargs["add_special_tokens"] = False   # the template wrote it (as transformers' apply_chat_template does)
    image_kwargs = exact_size_kwargs(getattr(processor, "image_processor", None), image_size)
    if image_kwargs:
        kwargs["images_kwargs"] = image_kwargs
    try:
        out = processor(text=[prompt], images=pil_images, return_tensors="np", **kwargs)
    except Exception as exc:  # noqa: BLE001 - the processor's own refusals (image count, sizes...)
        raise RuntimeInputError(f"{folder}: the processor failed on the prompt and images "
                                f"({_first_line(exc)})") from None
    ids = np.asarray(out["input_ids"])
    if ids.ndim != 2 or ids.shape[0] != 1:
        raise RuntimeInputError(f"{folder}: the processor returned input_ids of shape {list(ids.shape)}; "
                                f"expected one sequence")
    arrays = {k: np.asarray(out[k]) for k in IMAGE_KEYS if k in out and out[k] is not None}
    if "pixel_values" not in arrays:
        raise RuntimeInputError(f"{folder}: the processor returned no pixel_values (it gave {sorted(out.keys())})")
    return [int(t) for t in ids[0]], arrays


def image_sizes_of(images: Sequence[str | os.PathLike]) -> list[tuple[int, int]]:
    """``(width, height)`` of each image file (one-line errors as :func:`image_prompt`'s)."""
    _, Image = _import_dependencies()
    return [im.size for im in _open_images(Image, images)]


def _load_image_processor(transformers, folder: Path) -> tuple:
    """The folder's image processor and ``tokenizer.json`` alone (when the whole processor cannot be loaded)."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        image_processor = transformers.AutoImageProcessor.from_pretrained(folder, backend="pil")
    except Exception as exc:  # noqa: BLE001 - whatever transformers raises
        raise RuntimeInputError(f"{folder}: cannot load the image processor ({_first_line(exc)})") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    tok_path = folder / "tokenizer.json"
    try:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(tok_path))
    except Exception as exc:  # noqa: BLE001 - a missing or unreadable tokenizer.json
        raise RuntimeInputError(f"{tok_path}: cannot read the tokenizer ({_first_line(exc)})") from None
    return image_processor, tokenizer


def _with_image_processor(image_processor, tokenizer, folder: Path, text: str, pil_images: list, chat: bool,
                          system: str | None, vision: dict, image_size: int | None = None
                          ) -> tuple[list[int], dict[str, np.ndarray]]:
    """:func:`image_prompt` with the image processor and the tokenizer alone (the processor's own expansion of
    each image placeholder into its tokens, done here)."""
    from qeff_kv.runtime.text.chat import load_chat_template

    try:
        out = image_processor(images=pil_images, return_tensors="np", **exact_size_kwargs(image_processor, image_size))
    except Exception as exc:  # noqa: BLE001 - whatever transformers raises
        raise RuntimeInputError(f"{folder}: the image processor failed on the images ({_first_line(exc)})") from None
    arrays = {k: np.asarray(out[k]) for k in IMAGE_KEYS if k in out and out[k] is not None}
    if "pixel_values" not in arrays:
        raise RuntimeInputError(f"{folder}: the image processor returned no pixel_values")
    if "image_grid_thw" in arrays:
        merge = int(getattr(image_processor, "merge_size", 1) or 1)
        counts = [int(np.prod(g)) // (merge * merge) for g in arrays["image_grid_thw"].reshape(-1, 3)]
    elif vision.get("vision_size"):
        counts = [int(vision["vision_size"])] * len(pil_images)
    else:
        raise RuntimeInputError(f"{folder}: cannot tell how many tokens an image takes (no vision_size)")
    token = tokenizer.id_to_token(int(vision.get("image_token_id", -1))) if vision.get("image_token_id") is not None \
        else None
    if not token:
        raise RuntimeInputError(f"{folder}: the image token is not in the tokenizer")
    add_special = True
    if chat:
        template = load_chat_template(folder)
        messages = [] if system is None else [{"role": "system", "content": [{"type": "text", "text": system}]}]
        messages.append({"role": "user", "content": [{"type": "image"} for _ in pil_images]
                         + [{"type": "text", "text": text}]})
        prompt = template.render(messages, add_generation_prompt=True)
        bos = template.special_tokens.get("bos_token")
        add_special = not (bos and prompt.startswith(bos))
    else:
        if system is not None:
            raise RuntimeInputError("a system prompt needs the chat template (--chat)")
        vocab = tokenizer.get_vocab()
        placeholder = (f"<|vision_start|>{token}<|vision_end|>" if token == "<|image_pad|>"
                       and "<|vision_start|>" in vocab and "<|vision_end|>" in vocab else token)
        prompt = placeholder * len(pil_images) + text
    parts = prompt.split(token)
    if len(parts) - 1 != len(counts):
        raise RuntimeInputError(f"the prompt places {len(parts) - 1} images (image token {token!r}) but "
                                f"{len(counts)} were given")
    prompt = parts[0] + "".join(token * n + rest for n, rest in zip(counts, parts[1:]))
    return list(tokenizer.encode(prompt, add_special_tokens=add_special).ids), arrays
