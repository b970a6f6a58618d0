"""Issue 52: the names a server answers to. vLLM's ``--served-model-name NAME [NAME ...]`` (the first reported in
answers and listed first, the others aliases listed as entries of their own with the same metadata), llama-server's
behaviour behind ``--accept-any-model-name`` (any name answered, the answer repeating it), the existing 400 for an
unknown name without it, on every route that takes a model (completions, chat, responses, tokenize, embeddings'
check); the options checked before anything is loaded and read from the command line as vLLM spells them."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from qeff_kv.errors import RuntimeInputError  # noqa: E402
from qeff_kv.serve.config import ServeConfig  # noqa: E402
from qeff_kv.serve.engine.session_from_config import EngineSection  # noqa: E402
from qeff_kv.serve.wire.openai_io import APIError, ModelNames  # noqa: E402

ROUTES = (("/v1/completions", {"prompt": [5, 17, 33], "max_tokens": 2, "temperature": 0}),
          ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                    "temperature": 0}),
          ("/v1/responses", {"input": "hi", "max_output_tokens": 2, "temperature": 0}),
          ("/tokenize", {"prompt": "hi"}))


@pytest.fixture(scope="module")
def names_engine(own_cb_graph, tmp_path_factory):
    """The tiny continuous-batching export with a chat template, its engine and text facts (closed at the end)."""
    from serve_helpers import chat_export

    from qeff_kv.serve.server import build_engine, text_facts

    folder = chat_export(own_cb_graph, tmp_path_factory.mktemp("names") / "tiny-names")
    config = ServeConfig(str(folder), served_model_name=["tiny", "gpt-4.1", "gpt-3.5-turbo"])
    model = config.served_model()
    engine = build_engine(config, model)
    yield engine, text_facts(config, model), model
    engine.close()


def _app(names_engine, **kw):
    from starlette.testclient import TestClient

    from qeff_kv.serve.http.app import create_app

    engine, text, _ = names_engine
    return TestClient(create_app(engine, text=text, **kw))


def test_served_model_names_and_aliases(names_engine):
    engine, _, model = names_engine
    assert (model.name, model.aliases, model.any_name, engine.model_name) == (
        "tiny", ("gpt-4.1", "gpt-3.5-turbo"), False, "tiny")
    from starlette.testclient import TestClient

    from qeff_kv.serve.engine.defaults import SamplingDefaults
    from qeff_kv.serve.server import create_app_of

    config = ServeConfig("unused", served_model_name=["tiny", "gpt-4.1", "gpt-3.5-turbo"])
    app = create_app_of(config.http, engine, names_engine[1], SamplingDefaults(), None, 1, model)   # as serve() does
    with TestClient(app) as tc:
        cards = tc.get("/v1/models").json()["data"]
        assert [c["id"] for c in cards] == ["tiny", "gpt-4.1", "gpt-3.5-turbo"]
        assert all({k: v for k, v in c.items() if k != "id"} == {k: v for k, v in cards[0].items() if k != "id"}
                   for c in cards)
        assert tc.get("/v1/models/gpt-4.1").json()["id"] == "gpt-4.1"
        for route, body in ROUTES:
            for name in ("gpt-4.1", "tiny", None):
                r = tc.post(route, json={**body, **({"model": name} if name else {})})
                assert r.status_code == 200, (route, r.text)
                if route != "/tokenize":
                    assert r.json()["model"] == "tiny"   # the first name, whichever was asked (vLLM)
            r = tc.post(route, json={**body, "model": "llama-3"})
            err = r.json()["error"]
            assert r.status_code == 400 and (err["param"], err["code"]) == ("model", "model_not_found"), r.text
            assert err["message"] == ("the model 'llama-3' does not exist; this server serves 'tiny' or 'gpt-4.1' or "
                                      "'gpt-3.5-turbo'")


def test_accept_any_model_name(names_engine):
    """Any name answered, the answer repeating it (llama-server); /v1/models still lists the served names only."""
    with _app(names_engine, accept_any_model_name=True) as tc:
        for route, body in ROUTES:
            r = tc.post(route, json={**body, "model": "gpt-4o-mini"})
            assert r.status_code == 200, (route, r.text)
            if route != "/tokenize":
                assert r.json()["model"] == "gpt-4o-mini"
        r = tc.post("/v1/completions", json={**ROUTES[0][1], "model": 5})
        assert r.status_code == 400 and r.json()["error"]["param"] == "model"
        assert [c["id"] for c in tc.get("/v1/models").json()["data"]] == ["tiny"]


def test_model_names_check_and_report():
    names = ModelNames("m", ("a",), any_name=False)
    names.check("a", ())
    names.check("lora1", ("lora1",))
    with pytest.raises(APIError, match="^the model 'x' does not exist; this server serves 'm' or 'a' and the LoRA "
                                       "adapters 'lora1'$"):
        names.check("x", ("lora1",))
    assert [names.reported(m, ("lora1",)) for m in ("a", None, "lora1")] == ["m", "m", "lora1"]
    anyone = ModelNames("m", any_name=True)
    assert [anyone.reported(m, ("lora1",)) for m in ("x", "m", "lora1")] == ["x", "m", "lora1"]


@pytest.mark.parametrize("kw, message", [
    ({"served_model_name": ["a", "a"]}, r"^--served-model-name: a name given twice in \['a', 'a'\]$"),
    ({"served_model_name": ["a", " "]}, "^--served-model-name must be 1-256 printable characters, got ' '$"),
    ({"served_model_name": ["a\nb"]}, "^--served-model-name must be 1-256 printable characters"),
    ({"served_model_name": "a", "model_name": "b"}, "^give --served-model-name or --model-name, not both$"),
])
def test_name_options_refused_before_loading(kw, message):
    with pytest.raises(RuntimeInputError, match=message):
        ServeConfig("missing-export", **kw).check()


def test_the_command_line_reads_several_names():
    from click.testing import CliRunner

    from qeff_kv_cli.serve_cmd import serve_cmd, spread

    assert spread(["EXP", "--served-model-name", "a", "b", "--port", "1"]) == [
        "EXP", "--served-model-name", "a", "--served-model-name", "b", "--port", "1"]
    assert spread(["--served-model-name", "a", "--", "-b"]) == ["--served-model-name", "a", "--", "-b"]
    ctx = serve_cmd.make_context("serve", ["EXP", "--served-model-name", "a", "b", "--accept-any-model-name"])
    assert ctx.params["served_model_name"] == ("a", "b") and ctx.params["accept_any_model_name"] is True
    config = ServeConfig(**ctx.params)
    assert config.engine.names() == ("a", "b") and config.engine.accept_any_model_name
    assert EngineSection(served_model_name=()).served_model_name is None
    out = CliRunner().invoke(serve_cmd, ["--help"]).output
    assert "--served-model-name NAME [NAME ...]" in out and "--accept-any-model-name" in out
