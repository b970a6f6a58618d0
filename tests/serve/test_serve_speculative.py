"""``qeff-kv serve --speculative`` (issue 21): the scheduler's decode turn verifies every running sequence's drafts
in one step of a ``--speculative-tokens K`` graph. Through the official ``openai`` client: text equal to plain
greedy / seeded decoding of the same prompt alone (the ordinary export, plain ``Session.generate``), completions
and chat, streamed and not, several concurrent clients; ``max_tokens`` and a stop string falling inside an
accepted run; the acceptance counters in ``/metrics``; the start-up refusals' exact messages; the draft-export
drafter; ``check`` on the speculative graph.

One server for the module: the bundled tiny Llama exported like conftest's ``own_cb_graph`` (3 slots, ctx_len 64,
prefill 8, prefix VLLM) plus ``speculative_tokens=4``; the references run on ``own_cb_graph`` itself.
"""

from __future__ import annotations

import json
import re
import shutil
import threading

import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from click.testing import CliRunner  # noqa: E402

from qeff_kv.tools.check import check  # noqa: E402
from qeff_kv.errors import RuntimeInputError  # noqa: E402
from qeff_kv.runtime.decoding.sampling import SamplingParams  # noqa: E402
from serve_helpers import LiveServer, chat_export  # noqa: E402

K = 4
MODEL = "tiny-spec"
#: prompts whose greedy continuations repeat (prompt lookup hits) and one that does not
PROMPTS = ["abcabcabcabcabc", "Once upon a time", "xyzxyz xyzxyz xyzxyz", "the cat the cat the cat"]
SEEDED = dict(temperature=0.9, top_p=0.95, seed=7)


def _export(src, out, **extra):
    from qeff_kv.export import export_model

    return export_model(src, out, ctx_len=64, prefill_seq_len=8, verify=False, kv_cache_prefix="VLLM",
                        continuous_batching=True, full_batch_size=3, **extra)


@pytest.fixture(scope="module")
def spec_export(tmp_path_factory):
    return _export(None, tmp_path_factory.mktemp("spec-serve") / "spec", speculative_tokens=K)


@pytest.fixture(scope="module")
def served(spec_export, own_cb_graph, tmp_path_factory):
    from qeff_kv.serve.config import ServeConfig
    from qeff_kv.serve.server import build_engine, check_config, text_facts

    root = tmp_path_factory.mktemp("spec-served")
    folder = chat_export(spec_export.out_dir, root / MODEL)
    config = ServeConfig(export_dir=str(folder), speculative="lookup")
    check_config(config)
    engine = build_engine(config)
    runs: list = []
    step = engine.speculation.step

    def recording(rows):   # what each verification gave each request (to place cuts inside accepted runs)
        out = step(rows)
        runs.extend((r.key.req.request_id, list(t)) for r, t in zip(rows, out))
        return out

    engine.speculation.step = recording
    srv = LiveServer(engine, text_facts(config))
    srv.folder, srv.text, srv.runs = folder, text_facts(config), runs
    srv.plain = chat_export(own_cb_graph, root / "plain")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reference(served):
    """``ref(ids, n, sampling=None, stop=False) -> (text, tokens, finish)``: plain decoding of the prompt alone on
    the ordinary export (no speculative tokens)."""
    from qeff_kv.runtime import Session

    session = Session(served.plain, max_sequences=1)
    tok = served.text.tokenizer
    cache: dict = {}

    def ref(ids, n, sampling=None, stop=False):
        key = (tuple(ids), n, repr(sampling), stop)
        if key not in cache:
            [g] = session.generate([list(ids)], max_new_tokens=n, sampling=sampling,
                                   stop_tokens=None if stop else [])
            session.remove_sequence(g.sequence)
            toks = g.tokens[:-1] if g.finish_reason == "stop" else g.tokens
            cache[key] = (tok.decode(toks, skip_special_tokens=True), g.tokens, g.finish_reason)
        return cache[key]

    return ref


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0, timeout=60)


def _ids(served, text):
    return list(served.text.tokenizer.encode(text).ids)


def _chat_ids(served, messages):
    rendered = served.text.chat_template.render(messages, add_generation_prompt=True)
    return list(served.text.tokenizer.encode(rendered, add_special_tokens=False).ids)


def _metric(name):
    text = httpx.get(_metric.url + "/metrics", timeout=10).text
    m = re.search(rf"^{name} ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else None


def _complete(cl, stream, **kw):
    if not stream:
        r = cl.completions.create(**kw)
        return r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens
    chunks = list(cl.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    return text, [c.choices[0].finish_reason for c in chunks if c.choices][-1], chunks[-1].usage.completion_tokens


# ------------------------------------------------------------------------------------------ equal to plain decoding
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_completions_equal_plain_decoding(client, served, reference, stream, seeded):
    sampling = SamplingParams(**SEEDED) if seeded else None
    for prompt in PROMPTS[:2]:
        want, toks, _ = reference(_ids(served, prompt), 24, sampling)
        kw = SEEDED if seeded else dict(temperature=0)
        got = _complete(client, stream, model=MODEL, prompt=prompt, max_tokens=24, extra_body={"ignore_eos": True},
                        **kw)
        assert got == (want, "length", 24) and len(toks) == 24


def test_chat_equals_plain_decoding(client, served, reference):
    messages = [{"role": "user", "content": "abab abab abab abab"}]
    want, toks, finish = reference(_chat_ids(served, messages), 20, stop=True)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    assert r.choices[0].message.content == want and r.usage.completion_tokens == len(toks)
    assert r.choices[0].finish_reason == ("stop" if finish == "stop" else "length")
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=20, temperature=0,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want


def test_concurrent_clients_equal_plain_decoding(served, reference):
    _metric.url = served.url
    jobs = [(c, PROMPTS[c % len(PROMPTS)] + " " * (c // len(PROMPTS)), c % 2 == 1, c % 3 == 2, 16 + c)
            for c in range(6)]
    for _, prompt, _, seeded, n in jobs:
        reference(_ids(served, prompt), n, SamplingParams(**SEEDED) if seeded else None)
    drafted0, accepted0 = (_metric("qeff_kv_speculative_draft_tokens_total"),
                           _metric("qeff_kv_speculative_accepted_tokens_total"))
    itl0, gen0 = _metric("qeff_kv_inter_token_latency_seconds_count"), _metric("qeff_kv_generation_tokens_total")
    results, errors = {}, []

    def worker(c, prompt, stream, seeded, n):
        cl = openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0, timeout=60)
        try:
            results[c] = _complete(cl, stream, model=MODEL, prompt=prompt, max_tokens=n,
                                   extra_body={"ignore_eos": True}, **(SEEDED if seeded else dict(temperature=0)))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(repr(exc))

    threads = [threading.Thread(target=worker, args=job) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    for c, prompt, _, seeded, n in jobs:
        want = reference(_ids(served, prompt), n, SamplingParams(**SEEDED) if seeded else None)[0]
        assert results[c] == (want, "length", n), c
    drafted, accepted = (_metric("qeff_kv_speculative_draft_tokens_total"),
                         _metric("qeff_kv_speculative_accepted_tokens_total"))
    assert drafted > drafted0 and 0 < accepted - accepted0 <= drafted - drafted0
    assert _metric("qeff_kv_speculative_verifications_total") > 0
    # every accepted token is its own event: one inter-token latency per token after each request's first
    total = sum(n for *_, n in jobs)
    assert _metric("qeff_kv_generation_tokens_total") - gen0 == total
    assert _metric("qeff_kv_inter_token_latency_seconds_count") - itl0 == total - len(jobs)


# ------------------------------------------------------------------------------------------ cuts inside a run
def _runs(served, client, prompt, n):
    """A greedy request's accepted runs: (index of the run's first token in the output, its tokens)."""
    served.runs.clear()
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0,
                                  extra_body={"ignore_eos": True})
    at, spans = 1, []    # the first token comes from the prefill
    for rid, toks in served.runs:
        if rid == r.id:
            spans.append((at, toks))
            at += len(toks)
    assert at == n
    return spans


def test_max_tokens_inside_an_accepted_run(client, served, reference):
    prompt = PROMPTS[0]
    start, run = next((s_, t) for s_, t in _runs(served, client, prompt, 40) if len(t) >= 3)
    cut = start + len(run) - 1            # the limit falls one token before the run's end
    want, toks, _ = reference(_ids(served, prompt), cut)
    assert toks == reference(_ids(served, prompt), 40)[1][:cut]
    for stream in (False, True):
        assert _complete(client, stream, model=MODEL, prompt=prompt, max_tokens=cut, temperature=0,
                         extra_body={"ignore_eos": True}) == (want, "length", cut)


def test_stop_string_inside_an_accepted_run(client, served, reference):
    prompt = PROMPTS[2]
    _, toks, _ = reference(_ids(served, prompt), 40)
    tok = served.text.tokenizer
    full = tok.decode(toks)
    # the stop string: the shortest piece of the text that first occurs where it ends inside an accepted run
    # (after the run's first token, before its last): the frontend must cut within the run's burst of tokens
    found = None
    for start, run in _runs(served, client, prompt, 40):
        for end in range(start + 1, start + len(run) - 1):          # the stop string's last token
            for j in range(end, max(0, end - 8), -1):
                stop, before = tok.decode(toks[j:end + 1]), tok.decode(toks[:j])
                if stop.strip() and "\ufffd" not in stop and full.find(stop) == len(before):
                    found = (stop, before)
                    break
            if found:
                break
        if found:
            break
    assert found, "no stop string ending inside an accepted run"
    stop, want = found
    for stream in (False, True):
        text, finish, _ = _complete(client, stream, model=MODEL, prompt=prompt, max_tokens=40, temperature=0,
                                    stop=[stop], extra_body={"ignore_eos": True})
        assert (text, finish) == (want, "stop")


# ------------------------------------------------------------------------------------------ a draft export
def test_draft_export_drafter_equals_plain_decoding(served, reference, own_graphs, tmp_path_factory):
    """The draft: the bundled model's first layer (same tokenizer), 3 sequences; several requests at once."""
    import transformers

    from qeff_kv.export.sources import TOKENIZER_FILES, bundled_model_dir
    from qeff_kv.runtime import Session
    from qeff_kv.serve.engine.engine import GenerationRequest, TokenOut
    from qeff_kv.serve.engine.scheduler import Scheduler
    from qeff_kv.serve.engine.speculative_step import Speculation, open_drafting

    root = tmp_path_factory.mktemp("draft")
    model = transformers.AutoModelForCausalLM.from_pretrained(own_graphs.llama_hf)
    model.model.layers = model.model.layers[:1]
    model.config.num_hidden_layers = 1
    model.save_pretrained(root / "hf", safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (bundled_model_dir() / name).is_file():
            shutil.copyfile(bundled_model_dir() / name, root / "hf" / name)
    draft = _export(root / "hf", root / "draft")
    target = Session(served.folder)
    engine = Scheduler(target, speculation=Speculation(target, open_drafting(str(draft.out_dir), target)))
    try:
        jobs = [(_ids(served, p), SamplingParams(**SEEDED) if i == 1 else None) for i, p in enumerate(PROMPTS[:3])]
        handles = [engine.submit(GenerationRequest(str(i), tuple(ids), 20, sp or SamplingParams(), frozenset()))
                   for i, (ids, sp) in enumerate(jobs)]
        for h, (ids, sp) in zip(handles, jobs):
            assert [e.token for e in h.iter_sync(timeout=60) if isinstance(e, TokenOut)] == reference(ids, 20, sp)[1]
        stats = engine.stats()
        assert 0 < stats["speculative_accepted"] <= stats["speculative_drafted"]
    finally:
        engine.close()
    # the draft's sequences are freed with their requests
    assert engine.speculation.drafting.session.sequences == []


# ------------------------------------------------------------------------------------------ refusals, check
def test_refusals(served, own_cb_graph, tmp_path):
    from qeff_kv.serve.config import ServeConfig
    from qeff_kv.serve.server import build_engine, check_config

    [graph] = [f.name for f in own_cb_graph.glob("*.onnx")]
    with pytest.raises(RuntimeInputError, match=rf"^--speculative: {re.escape(graph)} is not a speculative-decoding "
                                                r"graph "
                                                r"\(no num_logits_to_keep input\); export it with "
                                                r"--speculative-tokens K$"):
        build_engine(ServeConfig(export_dir=str(own_cb_graph), speculative="lookup"))
    other = shutil.copytree(served.folder, tmp_path / "other-tokenizer")
    tj = json.loads((other / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    a, b = list(vocab)[10:12]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tj))
    with pytest.raises(RuntimeInputError, match=rf"^--speculative {re.escape(str(other))}: the draft's tokenizer "
                                                r"differs from the target's; use a draft model of the same tokenizer$"):
        build_engine(ServeConfig(export_dir=str(served.folder), speculative=str(other)))
    with pytest.raises(RuntimeInputError, match=r"^--speculative 'nothing-here': neither 'lookup' nor an existing "):
        build_engine(ServeConfig(export_dir=str(served.folder), speculative="nothing-here"))
    with pytest.raises(RuntimeInputError, match=r"^--speculative does not go with --disaggregate"):
        check_config(ServeConfig(export_dir=str(served.folder), speculative="lookup", disaggregate=True))
    with pytest.raises(RuntimeInputError, match=r"^k must be an int in \[1, 4\]"):
        build_engine(ServeConfig(export_dir=str(served.folder), speculative="lookup", speculative_k=5))
    from qeff_kv_cli.main import main

    r = CliRunner().invoke(main, ["serve", str(own_cb_graph), "--speculative", "lookup", "--port", "0"])
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert r.exit_code == 2 and lines == [f"error: --speculative: {graph} is not a speculative-decoding graph (no "
                                          "num_logits_to_keep input); export it with --speculative-tokens K"]


def test_the_speculative_graph_passes_check(spec_export):
    report = check(spec_export.onnx_path)
    assert report.ok and report.to_json()["num_logits_to_keep"] == {"speculative_tokens": K}


@pytest.mark.parametrize("field, value", [("logprobs", 1), ("logit_bias", {"5": -100}),
                                          ("frequency_penalty", 0.5), ("repetition_penalty", 1.2)])
def test_adjusting_fields_are_refused_with_speculation(served, field, value):
    """The verifier selects tokens on the plain path: logprobs, bias and penalties are a 400, not ignored."""
    r = httpx.post(served.url + "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 4, field: value},
                   timeout=60)
    assert r.status_code == 400, r.text
    assert "--speculative" in r.json()["error"]["message"]


def test_constrained_requests_are_refused_with_a_400(client):
    """The verification accepts several drafted tokens per step without a grammar's mask: structured output and
    forced tool calls are refused in one line rather than produced unconstrained."""
    pytest.importorskip("llguidance")
    with pytest.raises(openai.BadRequestError, match="structured output and forced tool calls are not supported "
                                                     "with --speculative"):
        client.completions.create(model=MODEL, prompt="ab", max_tokens=4, extra_body={"guided_regex": "[ab]+"})
