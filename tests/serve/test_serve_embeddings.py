"""``POST /v1/embeddings`` (issue 41) from a decoder exported with ``hidden_states=True`` (``--hidden-states``):
through the official ``openai`` client, each input's embedding equal to transformers' final hidden state of its
last token on the same weights, L2-normalised (a text and token ids; the ids longer than a prefill chunk); base64
equal to float; served on a lock-step session while the slots keep serving completions; the one-line refusals (an
export without the output, ``dimensions``, an unknown field, an id outside the vocabulary); the option leaves an
export without it unchanged (its options hash).
"""

from __future__ import annotations

import base64

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from serve_helpers import LiveServer, chat_export  # noqa: E402

IDS = [int(t) for t in np.random.RandomState(7).randint(3, 250, 21)]
TEXT = "embeddings, please"


def _serve(folder):
    from qeff_kv.serve.config import ServeConfig
    from qeff_kv.serve.server import build_engine, check_config, text_facts

    config = ServeConfig(export_dir=str(folder))
    check_config(config)
    srv = LiveServer(build_engine(config), text_facts(config))
    srv.text = text_facts(config)
    return srv


@pytest.fixture(scope="module")
def hidden_export(tmp_path_factory):
    from qeff_kv.export import export_model

    return export_model(None, tmp_path_factory.mktemp("emb") / "hid", ctx_len=64, prefill_seq_len=8, verify=False,
                        hidden_states=True, speculative_tokens=2)


@pytest.fixture(scope="module")
def served(hidden_export, tmp_path_factory):
    srv = _serve(chat_export(hidden_export.out_dir, tmp_path_factory.mktemp("emb-served") / "tiny-emb"))
    srv.client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    yield srv
    srv.stop()


def _reference(own_graphs, ids: list[int]) -> np.ndarray:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(own_graphs.llama_hf, attn_implementation="eager")
    with torch.no_grad():
        h = model.eval().model(torch.tensor([ids])).last_hidden_state[0, -1].double().numpy()
    return h / np.linalg.norm(h)


def test_embeddings_equal_transformers(served, own_graphs):
    text_ids = list(served.text.tokenizer.encode(TEXT).ids)
    out = served.client.embeddings.create(model="tiny-emb", input=[TEXT, IDS])
    assert [d.index for d in out.data] == [0, 1] and out.usage.prompt_tokens == len(text_ids) + len(IDS)
    np.testing.assert_allclose(out.data[0].embedding, _reference(own_graphs, text_ids), atol=1e-4)
    np.testing.assert_allclose(out.data[1].embedding, _reference(own_graphs, IDS), atol=1e-4)
    raw = httpx.post(served.url + "/v1/embeddings", json={"input": IDS, "encoding_format": "base64"}, timeout=60)
    vec = np.frombuffer(base64.b64decode(raw.json()["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_array_equal(vec, np.asarray(out.data[1].embedding, dtype=np.float32))


def test_completions_still_served_beside_embeddings(served):
    """After an embedding, steps of other shapes (prompt logprobs' rows, two rows of lock step) run as before."""
    import concurrent.futures

    def ask(prompt):
        return served.client.completions.create(model="tiny-emb", prompt=prompt, max_tokens=6, temperature=0,
                                                echo=True, logprobs=1).choices[0]

    before = [ask(p) for p in ("abc", "xyz xyz")]
    served.client.embeddings.create(model="tiny-emb", input=TEXT)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        after = list(pool.map(ask, ("abc", "xyz xyz")))
    assert [a.text for a in after] == [b.text for b in before]
    for a, b in zip(after, before):
        np.testing.assert_allclose(a.logprobs.token_logprobs[1:], b.logprobs.token_logprobs[1:], atol=1e-5)


@pytest.mark.parametrize("body, param, message", [
    ({"input": "x", "dimensions": 8}, "dimensions",
     "dimensions is not supported (the embedding is the model's hidden size)"),
    ({"input": "x", "frob": 1}, "frob", "unknown field 'frob': not supported by /v1/embeddings on this server"),
    ({"input": [[1, 2, 100000]]}, "input", "input[0] must hold 1 to 63 tokens, each below 256"),
    ({"input": []}, "input", "input must be a string, token ids, or a list of 1 to 64 of them"),
])
def test_refusals(served, body, param, message):
    r = httpx.post(served.url + "/v1/embeddings", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param and r.json()["error"]["message"] == message


def test_refused_without_the_output(own_cb_graph, tmp_path):
    srv = _serve(chat_export(own_cb_graph, tmp_path / "plain"))
    try:
        r = httpx.post(srv.url + "/v1/embeddings", json={"input": "x"}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["message"] == (
            "the graph has no hidden_states output; export it with --hidden-states for /v1/embeddings")
    finally:
        srv.stop()


def test_the_option_leaves_other_exports_unchanged():
    from qeff_kv.export.options import ExportOptions

    plain = ExportOptions(ctx_len=64, prefill_seq_len=8).to_json()
    assert "hidden_states" not in plain and ExportOptions(ctx_len=64, prefill_seq_len=8, hidden_states=True).to_json()["hidden_states"]
