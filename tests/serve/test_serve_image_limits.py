"""Hostile images (issue 52, items 3-5): an image is bounded by its pixels, read from its header before anything is
decoded (a decompression bomb: a small PNG declaring 13000x13000 pixels is a one-line 400 at once, not 110 s and
5 GB then a 200), and a request's images together; only the first frame of an animated image is decoded; decoding
runs off the event loop (/health and other requests answer meanwhile); the export's processor is loaded once at
start-up (concurrent first requests of a fresh server all answered alike, not some a 400 from a half-loaded
transformers); the vision stage is safe to enter from several request threads; ``file://`` paths are checked before
any filesystem call (a null byte, a FIFO, a device: a one-line 400, never a 500 or a hang) and no refusal shows a
server path. A hypothesis property test sends random image bodies: a 200 or a 4xx in OpenAI's error shape, never a
5xx, and /health keeps answering.

One server on the session's tiny Llava export (conftest.py ``llava_cb_export``) with ``--max-image-pixels 4096``
(the photos of ``hf_models.write_png`` are 48x40: 1920 pixels), plus one fresh ``qeff-kv serve`` process.
"""

from __future__ import annotations

import base64
import io
import os
import struct
import subprocess
import sys
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
PIL_Image = pytest.importorskip("PIL.Image")
pytest.importorskip("transformers")
httpx = pytest.importorskip("httpx")

from serve_helpers import LiveServer, free_port  # noqa: E402

LIMIT = 4096
PROMPT = "What is in the picture?"


# ------------------------------------------------------------------------------------------------- images
def png_declaring(width: int, height: int, rows: int | None = None) -> bytes:
    """A grayscale PNG declaring ``width x height`` pixels whose data is ``rows`` rows of zeros (default: all of
    them, a valid image; compressed as it is made, so a 13000x13000 one is a few hundred KB and never in memory)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    comp = zlib.compressobj(9)
    rows = height if rows is None else rows
    row = b"\0" * (width + 1) if rows else b""
    data = b"".join(comp.compress(row) for _ in range(rows)) + comp.flush()
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", data) + chunk(b"IEND", b""))


def encoded(image, fmt: str = "PNG", **kwargs) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **kwargs)
    return buf.getvalue()


def data_url(raw: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64," + base64.b64encode(raw).decode()


def ask(*urls: str, text: str = PROMPT) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": u}} for u in urls]
             + [{"type": "text", "text": text}]}]


# ------------------------------------------------------------------------------------------------- server
@pytest.fixture(scope="module")
def media(tmp_path_factory):
    from hf_models import write_png

    root = tmp_path_factory.mktemp("limits-media")
    allowed = root / "allowed"
    allowed.mkdir()
    fifo = allowed / "pipe.png"
    os.mkfifo(fifo)
    (allowed / "zero.png").symlink_to("/dev/zero")
    return {"photo": write_png(allowed / "photo.png", seed=0), "other": write_png(allowed / "other.png", seed=1),
            "allowed": allowed, "fifo": fifo, "root": root}


@pytest.fixture(scope="module")
def served(llava_cb_export, media):
    from qeff_kv.serve.config import ServeConfig
    from qeff_kv.serve.server import build_engine, text_facts

    config = ServeConfig(export_dir=str(llava_cb_export), model_name="llava")
    srv = LiveServer(build_engine(config), text_facts(config), media_path=str(media["allowed"]),
                     max_image_pixels=LIMIT)
    yield srv
    srv.stop()


def post(served, messages, timeout: float = 60, max_tokens: int = 3) -> httpx.Response:
    return httpx.post(served.url + "/v1/chat/completions", timeout=timeout,
                      json={"messages": messages, "max_tokens": max_tokens, "temperature": 0})


def refused(served, messages, timeout: float = 60) -> str:
    r = post(served, messages, timeout)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and "\n" not in err["message"], err
    return err["message"]


def answer(served, messages) -> str:
    r = post(served, messages)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


# ------------------------------------------------------------------------------------------ item 3: pixels
def test_a_decompression_bomb_is_refused_from_its_header(served):
    bomb = png_declaring(13000, 13000)
    assert len(bomb) < 400_000   # 169 megapixels in a few hundred KB
    start = time.monotonic()
    msg = refused(served, ask(data_url(bomb)), timeout=20)
    assert msg == (f"messages[0].content[0]: 13000x13000 pixels (169000000); the limit is {LIMIT} pixels "
                   f"per image (--max-image-pixels)")
    assert time.monotonic() - start < 10   # nothing decoded (it took 35 s an image before)
    # the second image of a request named as such; a small image over the limit is refused too
    big = encoded(PIL_Image.new("RGB", (100, 100), (9, 9, 9)))
    ok = encoded(PIL_Image.new("RGB", (48, 40), (200, 10, 10)))
    assert refused(served, ask(data_url(ok), data_url(big))) == (
        f"messages[0].content[1]: 100x100 pixels (10000); the limit is {LIMIT} pixels per image "
        "(--max-image-pixels)")


def test_the_images_of_a_request_are_bounded_together(served):
    each = data_url(encoded(PIL_Image.new("RGB", (60, 60), (1, 2, 3))))   # 3600 pixels: under the limit alone
    answer(served, ask(each))
    assert refused(served, ask(each, each, each)) == (
        f"the 3 images hold 10800 pixels together; the limit is {2 * LIMIT} pixels per request (--max-image-pixels)")


def test_only_the_first_frame_of_an_animated_image_is_decoded(served, media):
    first, second = (PIL_Image.open(media[k]).convert("RGB") for k in ("photo", "other"))
    animated = encoded(first, "GIF", save_all=True, append_images=[second] * 40, duration=50, loop=0)
    alone = [answer(served, ask(data_url(encoded(im, "GIF"), "gif"))) for im in (first, second)]
    assert alone[0] != alone[1]   # the frame decides the answer
    assert answer(served, ask(data_url(animated, "gif"))) == alone[0]
    apng = encoded(first, "PNG", save_all=True, append_images=[second], duration=50)
    assert answer(served, ask(data_url(apng))) == answer(served, ask(data_url(encoded(first))))


def test_max_image_pixels_option_is_checked():
    from qeff_kv.errors import RuntimeInputError
    from qeff_kv.serve.http.http_config import HttpSection

    with pytest.raises(RuntimeInputError, match=r"^--max-image-pixels must be at least 1, got 0$"):
        HttpSection(max_image_pixels=0).check()


def test_decoding_runs_off_the_event_loop(served, media, monkeypatch):
    """An image request held inside its decode: /health and a text request answer meanwhile (a decode on the event
    loop would stall them until it ends)."""
    entered, release = threading.Event(), threading.Event()
    convert = PIL_Image.Image.convert

    def held(self, *args, **kwargs):
        if not entered.is_set():
            entered.set()
            release.wait(60)
        return convert(self, *args, **kwargs)

    monkeypatch.setattr(PIL_Image.Image, "convert", held)
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(post, served, ask(data_url(media["photo"].read_bytes())))
        try:
            assert entered.wait(30), "the image request never reached its decode"
            assert httpx.get(served.url + "/health", timeout=10).status_code == 200
            text = httpx.post(served.url + "/v1/completions", timeout=30, json={"prompt": "w1 w2", "max_tokens": 2})
            assert text.status_code == 200, text.text
            assert not pending.done()   # still decoding
        finally:
            release.set()
        assert pending.result().status_code == 200


# ------------------------------------------------------------------------ item 4: loaded once, thread-safe
def test_the_vision_stage_is_safe_from_several_threads(served, media):
    from qeff_kv.runtime.multimodal.processor import image_prompt

    vision = served.engine.vision
    inputs = [image_prompt(vision.session.files.folder, PROMPT, [media[k]], chat=True) for k in ("photo", "other")]
    want = [vision.images(ids, arrays).array.copy() for ids, arrays in inputs]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda i: vision.images(*inputs[i % 2]).array.copy(), range(16)))
    for i, array in enumerate(got):
        assert (array == want[i % 2]).all(), i


def test_concurrent_first_image_requests_on_a_fresh_server(llava_cb_export, media):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "qeff_kv_cli.main", "serve", str(llava_cb_export), "--port",
                             str(port), "--model-name", "llava"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stderr.read()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.1)
        body = {"messages": ask(data_url(media["photo"].read_bytes())), "max_tokens": 3, "temperature": 0}
        with ThreadPoolExecutor(6) as pool:
            replies = list(pool.map(lambda _: httpx.post(url + "/v1/chat/completions", json=body, timeout=120),
                                    range(6)))
        assert [r.status_code for r in replies] == [200] * 6, [r.text for r in replies]
        assert len({r.json()["choices"][0]["message"]["content"] for r in replies}) == 1
    finally:
        proc.terminate()
        proc.wait(30)


# ------------------------------------------------------------------------------------- item 5: file:// URLs
def test_file_urls_are_checked_before_any_filesystem_call(served, media, monkeypatch):
    from qeff_kv.serve.http import images

    allowed = media["allowed"]
    cases = {
        allowed.as_uri() + "/photo.png%00.txt": "a file URL's path must not hold a null byte (%00)",
        media["fifo"].as_uri(): "not a file under the server's --allowed-local-media-path",
        (allowed / "zero.png").as_uri(): "not a file under the server's --allowed-local-media-path",
        allowed.as_uri(): "not a file under the server's --allowed-local-media-path",
        "file://[oops/photo.png": "not a valid file URL",
        "file://" + allowed.as_posix() + "/" + "x" * 5000 + ".png": "not a file under",
        "file:photo.png": "not a file under",
    }
    for url, needle in cases.items():
        msg = refused(served, ask(url), timeout=20)
        assert msg.startswith("messages[0].content[0]: ") and needle in msg, (url, msg)
        assert str(media["root"]) not in msg.replace(url, "")
    monkeypatch.setattr(images, "MAX_IMAGE_BYTES", 1000)
    assert "larger than 1000 bytes" in refused(served, ask(media["photo"].as_uri()))
    monkeypatch.undo()
    assert answer(served, ask(media["photo"].as_uri())) == answer(served, ask(data_url(media["photo"].read_bytes())))


def test_processor_refusals_name_no_server_path(served, media, llava_cb_export):
    msg = refused(served, ask(data_url(media["photo"].read_bytes()), text="<image> one more"))
    assert msg.startswith("the export: the processor failed on the prompt and images (")
    assert str(llava_cb_export) not in msg and "qeff-kv-img-" not in msg


# --------------------------------------------------------------------------------------- property test
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_MODES = ["1", "L", "P", "RGB", "RGBA", "CMYK", "I", "F", "LA", "I;16", "YCbCr", "RGBX"]
_FORMATS = ["PNG", "GIF", "BMP", "TIFF", "WEBP", "JPEG"]


@st.composite
def _odd_image(draw) -> str:
    """A real image of an odd mode and format (whatever Pillow can write of it), or a random TIFF/PNG."""
    mode, fmt = draw(st.sampled_from(_MODES)), draw(st.sampled_from(_FORMATS))
    size = (draw(st.integers(1, 90)), draw(st.integers(1, 90)))
    try:
        raw = encoded(PIL_Image.new(mode, size, draw(st.integers(0, 255))), fmt)
    except (OSError, ValueError, KeyError, TypeError):
        raw = encoded(PIL_Image.new("RGB", size), "PNG")
    return data_url(raw, draw(st.sampled_from(["png", fmt.lower()])))


def _truncated_png(data) -> str:
    raw = encoded(PIL_Image.new("RGB", (40, 30), (3, 4, 5)))
    return data_url(raw[:data])


_BAD_BASE64 = st.text(alphabet="ABCxyz019+/=_-@ \n%é\u0000", max_size=40)
_URL = st.one_of(
    st.binary(max_size=300).map(data_url),                                             # random bytes
    st.integers(0, 120).map(_truncated_png),                                           # truncated PNGs
    st.tuples(st.integers(1, 2**31 - 1), st.integers(1, 2**31 - 1)).map(
        lambda wh: data_url(png_declaring(*wh, rows=0))),                              # huge declared sizes
    st.tuples(st.integers(1, 120), st.integers(1, 120), st.integers(0, 5)).map(
        lambda t: data_url(png_declaring(*t))),                                        # short image data
    _odd_image(),                                                                      # odd modes and formats
    _BAD_BASE64.map(lambda s: "data:image/png;base64," + s),                           # bad base64
    st.text(max_size=60).map(lambda s: "file://" + s),                                 # file URLs, odd characters
    st.text(max_size=30).map(lambda s: "file:///" + s.replace("/", "%2F") + "%00"),
)


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(urls=st.lists(_URL, min_size=1, max_size=2))
def test_random_image_bodies_get_200_or_a_4xx_and_health_answers(served, urls):
    r = post(served, ask(*urls), timeout=60, max_tokens=1)
    assert r.status_code == 200 or 400 <= r.status_code < 500, r.text
    if r.status_code != 200:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["message"] and "\n" not in err["message"], err
        assert err["type"] == "invalid_request_error" and "qeff-kv-img-" not in err["message"], err
    assert httpx.get(served.url + "/health", timeout=10).status_code == 200
