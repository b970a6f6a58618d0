"""Images over HTTP (issue 41): ``image_url`` parts of a chat request on a vision-language export give the tokens
``qeff-kv generate EXPORT --image FILE --prompt TEXT --chat`` gives (the export's processor and vision stage), with
``data:`` URLs and with ``file://`` URLs under ``--allowed-local-media-path`` only; the count and size limits and
every refusal are a 400 naming what is wrong. One server on the session's tiny Llava export (conftest.py
``llava_cb_export``); the official ``openai`` client sends the requests.
"""

from __future__ import annotations

import base64
import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("PIL")
pytest.importorskip("transformers")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from serve_helpers import LiveServer  # noqa: E402

PROMPT = "What is in the picture?"
NEW = 6


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    from hf_models import write_png

    root = tmp_path_factory.mktemp("media")
    (root / "allowed").mkdir()
    return {"photo": write_png(root / "allowed" / "photo.png", seed=0),
            "other": write_png(root / "allowed" / "other.png", seed=1),
            "outside": write_png(root / "outside.png", seed=2), "allowed": root / "allowed"}


@pytest.fixture(scope="module")
def served(llava_cb_export, media):
    from qeff_kv.serve.config import ServeConfig
    from qeff_kv.serve.server import build_engine, text_facts

    config = ServeConfig(export_dir=str(llava_cb_export), model_name="llava")
    srv = LiveServer(build_engine(config), text_facts(config), media_path=str(media["allowed"]))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0, timeout=120)


def _cli(export, image, system=None) -> dict:
    from click.testing import CliRunner

    from qeff_kv_cli.main import main

    args = ["generate", str(export), "--image", str(image), "--prompt", PROMPT, "--chat", "--max-new-tokens",
            str(NEW), "--ignore-eos", "--json"] + (["--system", system] if system else [])
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout.splitlines()[-1])["sequences"][0]


def _data_url(path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def _ask(url: str, text: str = PROMPT, system: str | None = None) -> list[dict]:
    user = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                        {"type": "text", "text": text}]}
    return ([{"role": "system", "content": system}] if system else []) + [user]


def _tokens(served, client, messages) -> tuple[list[int], int]:
    out = client.chat.completions.create(model="llava", messages=messages, max_tokens=NEW, temperature=0,
                                         logprobs=True, extra_body={"ignore_eos": True})
    tok = served.app.state.text.tokenizer
    ids = [tok.token_to_id(t.token) for t in out.choices[0].logprobs.content]
    return ids, out.usage.prompt_tokens


def test_data_url_gives_the_cli_tokens(served, client, media, llava_cb_export):
    want = _cli(llava_cb_export, media["photo"])
    assert _tokens(served, client, _ask(_data_url(media["photo"]))) == (want["tokens"], want["prompt_tokens"])
    other = _cli(llava_cb_export, media["other"])
    assert other["tokens"] != want["tokens"]            # the image decides the tokens
    assert _tokens(served, client, _ask(_data_url(media["other"])))[0] == other["tokens"]
    # the first image again: not answered from a kept sequence of the other image's prompt (same token ids)
    assert _tokens(served, client, _ask(_data_url(media["photo"])))[0] == want["tokens"]


def test_system_message_and_file_url_under_the_allowed_folder(served, client, media, llava_cb_export):
    want = _cli(llava_cb_export, media["photo"], system="Be brief.")
    got = _tokens(served, client, _ask(media["photo"].as_uri(), system="Be brief."))
    assert got == (want["tokens"], want["prompt_tokens"])


def _refused(served, messages, needle: str, param_prefix: str = "messages"):
    r = httpx.post(served.url + "/v1/chat/completions", timeout=60,
                   json={"messages": messages, "max_tokens": 2})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"] and "\n" not in err["message"], err
    assert err["param"].startswith(param_prefix)
    return err


def test_refusals(served, media, monkeypatch):
    from qeff_kv.serve.http import images

    _refused(served, _ask(media["outside"].as_uri()), "not a file under the server's --allowed-local-media-path")
    _refused(served, _ask((media["allowed"] / ".." / "outside.png").as_uri()), "--allowed-local-media-path")
    _refused(served, _ask("https://example.com/cat.png"), "not fetched")
    _refused(served, _ask("data:image/png;base64,@@@"), "not valid base64")
    many = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_url(media["photo"])}}] * 5
             + [{"type": "text", "text": "hi"}]}]
    _refused(served, many, f"the limit is {images.MAX_IMAGES} per request")
    monkeypatch.setattr(images, "MAX_IMAGE_BYTES", 1000)
    _refused(served, _ask(_data_url(media["photo"])), "larger than 1000 bytes (the limit per image)")
    monkeypatch.undo()
    _refused(served, _ask(_data_url(media["photo"])) + [{"role": "assistant", "content": "x"},
                                                         {"role": "user", "content": "y"}], "one user turn")
    _refused(served, _ask("data:image/png;base64," + base64.b64encode(b"not a png").decode()),
             "cannot read it as an image")
    bad_part = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x", "size": 3}}]}]
    assert _refused(served, bad_part, "unknown parameter")["param"] == "messages[0].content[0].image_url.size"
