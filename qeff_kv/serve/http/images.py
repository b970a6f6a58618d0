"""Images over HTTP for vision-language exports: a chat request's ``image_url`` parts turned into the prompt and the
image inputs that ``qeff-kv generate EXPORT --image FILE --prompt TEXT --chat [--system S]`` makes from the same
files and text (the export's own processor, :func:`~qeff_kv.runtime.multimodal.processor.image_prompt`, then the vision stage,
:meth:`~qeff_kv.runtime.vision_language.VisionLanguageModel.images`), so the served tokens are that command's.

* **URLs**: ``data:image/...;base64,...`` always; ``file://`` URLs only under the folder the server was started
  with (``--allowed-local-media-path DIR``, vLLM's option; resolved, links included, and refused outside it);
  ``http(s)://`` is not fetched (the server reaches nothing on a client's behalf).
* **Limits** (a 400 naming them): at most :data:`MAX_IMAGES` images per request and :data:`MAX_IMAGE_BYTES` bytes
  per image (encoded), checked before anything is decoded or read; at most ``--max-image-pixels`` pixels per image
  (:data:`DEFAULT_MAX_IMAGE_PIXELS`) and twice that for the images of a request together, read from each image's
  header before any pixel is decoded (a decompression bomb: a small file declaring a huge image). Only the first
  frame of an animated image is decoded; only :data:`~qeff_kv.runtime.multimodal.processor.WEB_FORMATS` are opened.
* **Decoding** runs in the request's worker thread (never on the event loop), at most :data:`DECODES_AT_ONCE`
  requests at a time (the memory of decoded images is bounded by that times the request limit); the export's
  processor is loaded once, at start-up (:func:`start`), and shared.
* **file:// paths** are checked before any file is opened (no null byte; resolved under the allowed folder), then
  opened without following a FIFO's wait and read only if a regular file within the size limit.
* **Shape**: the images and the text of one user turn, after an optional system message (the turn ``generate
  --image --chat`` renders: the processor's chat template, images first); other chats with images, tools with
  images, or images for a text-only export (or an engine that runs no images: ``--disaggregate``, ``--kv-role``)
  are refused in one line.

A prompt with images is prefilled in one call, reuses no cached prefix and is not kept for reuse
(:class:`~.engine.GenerationRequest` ``images``).
"""

from __future__ import annotations

import base64
import binascii
import os
import re
import stat
import tempfile
import threading
from pathlib import Path
from urllib.parse import unquote, urlparse

from qeff_kv.errors import QeffKvError
from qeff_kv.serve.wire.openai_io import bad

#: the most images one request may carry
MAX_IMAGES = 4
#: the largest image (decoded bytes)
MAX_IMAGE_BYTES = 10 << 20
#: the default of ``--max-image-pixels``: the most pixels of one image (a 48-megapixel camera's photo fits; decoded
#: to RGB it takes 150 MB); the images of one request together get twice that
DEFAULT_MAX_IMAGE_PIXELS = 50_000_000
#: requests decoding images at the same time (the others wait their turn)
DECODES_AT_ONCE = 2
_DECODES = threading.BoundedSemaphore(DECODES_AT_ONCE)
_PROMPTER_LOCK = threading.Lock()
_DATA_URL = re.compile(r"data:image/[A-Za-z0-9.+-]+(?:;[A-Za-z0-9=._-]+)*;base64,", re.I)


def has_images(messages) -> bool:
    return any(m.get("images") for m in messages or ())


def first_image_param(messages) -> str:
    for m in messages or ():
        if m.get("images"):
            return m["images"][0][1]
    return "messages"


def check_engine(engine) -> object:
    """The engine's vision-language model, or a 400 saying why this server runs no images."""
    vision = getattr(engine, "vision", None)
    if vision is not None:
        return vision
    session = getattr(engine, "session", None)
    if session is not None and getattr(session, "media", None) is None:
        return "image_url parts need a vision-language export; this one is text-only"
    return "images are not served by this engine (--disaggregate and --kv-role serve text only)"


def image_limits(max_image_pixels: int | None):
    """The :class:`~qeff_kv.runtime.multimodal.processor.ImageLimits` of ``--max-image-pixels`` (None: the default)."""
    from qeff_kv.runtime.multimodal.processor import WEB_FORMATS, ImageLimits

    n = DEFAULT_MAX_IMAGE_PIXELS if max_image_pixels is None else int(max_image_pixels)
    return ImageLimits(n, 2 * n, WEB_FORMATS, "--max-image-pixels")


def start(engine) -> None:
    """Load the export's processor now (a vision-language engine; nothing otherwise): no request waits for it or
    races another loading it. A processor that cannot be loaded is not an error here (text requests are served);
    image requests get its one-line refusal."""
    if getattr(engine, "vision", None) is not None:
        _prompter(engine, engine.vision).load()


def _prompter(engine, vision):
    """The engine's :class:`~qeff_kv.runtime.multimodal.processor.ImagePrompter` (made once)."""
    from qeff_kv.runtime.multimodal.processor import ImagePrompter

    with _PROMPTER_LOCK:
        prompter = getattr(engine, "image_prompter", None)
        if prompter is None:
            prompter = engine.image_prompter = ImagePrompter(vision.session.files.folder, vision.facts)
        return prompter


def image_request(engine, messages: list[dict], *, media_path: str | None, tools, generation_prompt: bool,
                  kv_transfer: bool, max_image_pixels: int | None = None) -> tuple[list[int], object]:
    """``(prompt ids, runtime Images)`` for a chat whose messages carry images (see the module docstring)."""
    param = first_image_param(messages)
    vision = check_engine(engine)
    if isinstance(vision, str):
        raise bad(vision, param)
    if tools is not None or kv_transfer or not generation_prompt:
        raise bad("images do not go with tools, kv_transfer_params or assistant prefill here", param)
    system, user = _turn(messages, param)
    urls = user["images"]
    if len(urls) > MAX_IMAGES:
        raise bad(f"the request carries {len(urls)} images; the limit is {MAX_IMAGES} per request", param)
    prompter = _prompter(engine, vision)
    facts = vision.facts
    size = int(facts["image_size"]) if "grid" in facts and facts.get("image_size") else None
    with tempfile.TemporaryDirectory(prefix="qeff-kv-img-") as tmp, _DECODES:
        paths = [_image_file(url, where, Path(tmp) / f"{i}.img", media_path) for i, (url, where) in enumerate(urls)]
        try:
            ids, arrays = prompter.prompt(user["content"], paths, chat=True, system=system, image_size=size,
                                          vision=facts, limits=image_limits(max_image_pixels))
            return ids, vision.images(ids, arrays)
        except QeffKvError as exc:   # the temporary files named by the part they came from; no server path
            text = str(exc)
            for p, (_, where) in zip(paths, urls):
                text = text.replace(f"image {p}", where).replace(str(p), where)
            text = text.replace(str(prompter.folder), "the export").replace(tmp, "(request)")
            raise bad(text, param) from None


def _turn(messages: list[dict], param: str) -> tuple[str | None, dict]:
    """The optional system text and the one user turn of a chat with images."""
    system = None
    rest = list(messages)
    if rest and rest[0]["role"] == "system" and not rest[0].get("images"):
        system, rest = rest[0]["content"], rest[1:]
    if len(rest) != 1 or rest[0]["role"] != "user":
        raise bad("images are served in a chat of one user turn (images and text), after an optional system "
                  "message, as qeff-kv generate --image --chat runs them", param)
    return system, rest[0]


def _image_file(url: str, where: str, dest: Path, media_path: str | None) -> Path:
    """The file holding the image of ``url``: a data: URL decoded into ``dest``; a file URL under ``media_path``."""
    head = url[:64].lower()
    if head.startswith("data:"):
        m = _DATA_URL.match(url[:256])
        if m is None:
            raise bad(f"{where}: a data: URL must be data:image/<type>;base64,<data>", where)
        data = url[m.end():]
        if len(data) * 3 // 4 > MAX_IMAGE_BYTES + 3:
            raise bad(f"{where}: the image is larger than {MAX_IMAGE_BYTES} bytes (the limit per image)", where)
        try:
            raw = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise bad(f"{where}: the data: URL is not valid base64", where) from None
        if len(raw) > MAX_IMAGE_BYTES:
            raise bad(f"{where}: the image is larger than {MAX_IMAGE_BYTES} bytes (the limit per image)", where)
        dest.write_bytes(raw)
        return dest
    if head.startswith("file:"):
        dest.write_bytes(_local_file(url, where, media_path))
        return dest
    if head.startswith(("http:", "https:")):
        raise bad(f"{where}: image URLs are not fetched by this server; send the image as a data: URL", where)
    raise bad(f"{where}: the image URL must be a data: URL (or a file: URL under --allowed-local-media-path)", where)


def _local_file(url: str, where: str, media_path: str | None) -> bytes:
    """The bytes of a file URL's file: its path checked before any filesystem call (no null byte; under
    ``media_path`` once resolved), then opened without blocking (a FIFO) and read only if it is a regular file of
    at most :data:`MAX_IMAGE_BYTES`, through the one descriptor checked. The refusals name no server path."""
    if media_path is None:
        raise bad(f"{where}: file URLs need the server started with --allowed-local-media-path DIR", where)
    try:
        parsed = urlparse(url)
    except ValueError:
        raise bad(f"{where}: not a valid file URL", where) from None
    if parsed.netloc not in ("", "localhost"):
        raise bad(f"{where}: a file URL must name a local path (file:///...)", where)
    name = unquote(parsed.path)
    if "\x00" in name:
        raise bad(f"{where}: a file URL's path must not hold a null byte (%00)", where)
    outside = bad(f"{where}: not a file under the server's --allowed-local-media-path", where)
    if not name.startswith("/"):
        raise outside
    root = Path(os.path.realpath(media_path))
    path = Path(os.path.realpath(name))
    if not path.is_relative_to(root):
        raise outside
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0))
    except (OSError, ValueError):
        raise outside from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise outside
        if info.st_size > MAX_IMAGE_BYTES:
            raise bad(f"{where}: the image is larger than {MAX_IMAGE_BYTES} bytes (the limit per image)", where)
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(MAX_IMAGE_BYTES + 1)
    except OSError:
        raise outside from None
    finally:
        os.close(fd)
    if len(data) > MAX_IMAGE_BYTES:   # grew since fstat
        raise bad(f"{where}: the image is larger than {MAX_IMAGE_BYTES} bytes (the limit per image)", where)
    return data
