"""LoRA adapters served (issue 50; docs/lora.md#serving): vLLM's interface (``--lora-modules``, ``model`` naming an
adapter, ``/v1/models`` entries, the load and unload routes behind ``--allow-runtime-lora-updating``) and
llama-server's (the ``lora`` request field, ``/lora-adapters``), against transformers + PEFT greedy tokens.

One server for the module: a tiny seeded Llama (the bundled tokenizer, one token per byte) exported once with two
PEFT adapters of non-zero B (``--max-lora-rank 8``, continuous batching of 4), served with both from the start,
``--max-loras 3``, runtime updating on and KV events on; a third adapter is loaded while a request runs. One test
starts the disaggregated engine (Ray, one prefill and one decode replica) on the same export.
"""

from __future__ import annotations

import json
import shutil
import threading
import time

import pytest

from suite import requires_torch

pytestmark = [requires_torch]
pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from serve_helpers import LiveServer, SlowDecode, chat_export, free_port  # noqa: E402

PROMPT = [5, 17, 33, 9, 40, 7, 60, 70, 80, 91]
NEW = 8
BS = 4   # tokens per published KV block


@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    """The base model, its adapters (a1, a2 exported with; a3 loaded at run time; a rank-16 one, a DoRA folder, an
    empty folder) and the export (chat template added)."""
    from hf_models import make_model_dir
    from lora_adapters import make_adapter

    from qeff_kv.export import export_model
    from qeff_kv.export.sources import bundled_model_dir

    root = tmp_path_factory.mktemp("lora-serve")
    base = make_model_dir("llama", root, vocab_size=256)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(bundled_model_dir() / name, base / name)
    ad = {"a1": make_adapter(base, root / "a1", r=4, alpha=8, targets=["q_proj", "v_proj", "down_proj"], seed=1),
          "a2": make_adapter(base, root / "a2", r=8, alpha=16, targets=["q_proj", "k_proj", "o_proj", "up_proj"],
                             seed=2, rslora=True),
          "a3": make_adapter(base, root / "a3", r=4, alpha=4, targets=["q_proj", "v_proj"], seed=3),
          "big": make_adapter(base, root / "big", r=16, alpha=16, targets=["q_proj"], seed=4)}
    dora = shutil.copytree(ad["a1"], root / "dora")
    cfg = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    (root / "empty").mkdir()
    out = export_model(base, root / "exp" / "tiny-lora", lora=[f"a1={ad['a1']}", f"a2={ad['a2']}"],
                       max_lora_rank=8, continuous_batching=True, full_batch_size=4, ctx_len=64)
    folder = chat_export(out.out_dir, root / "tiny-lora")
    return {"base": base, "folder": folder, "root": root, "dora": dora, "empty": root / "empty", **ad}


@pytest.fixture(scope="module")
def reference(lora):
    """``ref(adapter or None, prompt, n)``: transformers (+ PEFT) greedy tokens, no eos."""
    import torch

    from hf_models import hf_greedy
    from lora_adapters import peft_model

    cache: dict = {}

    def ref(adapter, prompt=PROMPT, n=NEW):
        key = (adapter, tuple(prompt), n)
        if key not in cache:
            if adapter is None:
                cache[key] = hf_greedy(lora["base"], list(prompt), n)
            else:
                model = peft_model(lora["base"], lora[adapter])
                ids = torch.tensor([list(prompt)])
                with torch.no_grad():
                    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                         min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
                cache[key] = out[0, len(prompt):].tolist()
        return cache[key]

    return ref


@pytest.fixture(scope="module")
def served(lora):
    from qeff_kv.serve.config import ServeConfig
    from qeff_kv.serve.server import build_engine, check_config, text_facts

    modules = (f"a1={lora['a1']}", json.dumps({"name": "a2", "path": str(lora["a2"])}))   # both of vLLM's forms
    config = ServeConfig(export_dir=str(lora["folder"]), lora_modules=modules, max_loras=3,
                         allow_runtime_lora_updating=True, kv_events=f"tcp://127.0.0.1:{free_port()}",
                         kv_events_block_size=BS)
    check_config(config)
    engine = build_engine(config)
    srv = LiveServer(engine, text_facts(config), max_n=4)
    srv.slow, srv.text, srv.events = SlowDecode(engine.session), text_facts(config), config.events.kv_events
    yield srv
    srv.stop()


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _text(served, tokens) -> str:
    return served.text.tokenizer.decode(list(tokens), skip_special_tokens=True)


def _complete(client, model, prompt=PROMPT, n=NEW, **extra):
    return client.completions.create(model=model, prompt=list(prompt), max_tokens=n, temperature=0,
                                     extra_body={"ignore_eos": True, **extra})


def _post(served, path, body):
    return httpx.post(served.url + path, json=body, timeout=120)


def _error(r, status=400):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert "\n" not in err["message"]
    return err


def _stats(served) -> dict:
    return httpx.get(served.url + "/health", timeout=10).json()


# ============================================================================================ vLLM's interface
def test_models_list_each_adapter_with_its_parent(client, served, lora):
    got = {m.id: m for m in client.models.list().data}
    assert list(got) == ["tiny-lora", "a1", "a2"]
    assert got["tiny-lora"].parent is None
    for i, name in enumerate(("a1", "a2")):
        assert (got[name].parent, got[name].root, got[name].lora_int_id) == ("tiny-lora", str(lora[name]), i + 1)
    assert httpx.get(served.url + "/v1/models/a2", timeout=10).json()["root"] == str(lora["a2"])


def test_adapters_by_model_name_equal_peft_in_one_mixed_batch(client, served, reference):
    """Base, a1, a2 and a1 again, concurrently from the openai client: each equals transformers (+ PEFT), and some
    decode step ran rows of different adapters together."""
    models = ["tiny-lora", "a1", "a2", "a1"]
    want = {m: _text(served, reference(None if m == "tiny-lora" else m)) for m in set(models)}
    before = _stats(served)["lora_mixed_steps"]
    got: dict = {}
    served.slow.delay = 0.03
    try:
        threads = [threading.Thread(target=lambda i, m: got.__setitem__(i, _complete(client, m)), args=(i, m))
                   for i, m in enumerate(models)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        served.slow.delay = 0.0
    for i, m in enumerate(models):
        assert got[i].model == m and got[i].choices[0].text == want[m], m
        assert got[i].usage.completion_tokens == NEW
    assert len(set(want.values())) == 3   # the adapters change the output
    assert _stats(served)["lora_mixed_steps"] > before


def test_chat_and_responses_select_the_adapter_by_model(client, served):
    messages = [{"role": "user", "content": "hi there"}]
    ids = _post(served, "/tokenize", {"model": "a2", "messages": messages})
    assert ids.status_code == 200, ids.text
    want = _complete(client, "a2", ids.json()["tokens"]).choices[0].text
    chat = client.chat.completions.create(model="a2", messages=messages, max_tokens=NEW, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert chat.model == "a2" and chat.choices[0].message.content == want
    base = client.chat.completions.create(model="tiny-lora", messages=messages, max_tokens=NEW, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert base.choices[0].message.content != want
    resp = client.responses.create(model="a2", input=messages, max_output_tokens=NEW, temperature=0)
    assert resp.model == "a2" and want.startswith(resp.output_text)


def test_any_model_name_answers_the_base_and_an_adapter_name_still_selects_it(served, reference):
    """Issue 52: ``--accept-any-model-name`` (llama-server's behaviour): another name runs the base model and the
    answer repeats it; an adapter's name still runs the adapter; /v1/models lists the served names only."""
    from starlette.testclient import TestClient

    from qeff_kv.serve.http.app import create_app

    app = create_app(served.engine, text=served.text, accept_any_model_name=True)
    with TestClient(app) as tc:
        for model, adapter in (("gpt-3.5-turbo", None), ("a1", "a1"), ("tiny-lora", None)):
            r = tc.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": NEW,
                                                 "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert r.json()["model"] == model and r.json()["choices"][0]["text"] == _text(served, reference(adapter))
        assert [m["id"] for m in tc.get("/v1/models").json()["data"]] == ["tiny-lora", "a1", "a2"]
        assert tc.get("/v1/models/gpt-3.5-turbo").status_code == 404


def test_prompt_reuse_never_crosses_adapters(client, served, reference):
    """The same prompt under a1, then a2, then the base: each exact (a kept sequence of another adapter is never
    reused); the same adapter again reuses its own."""
    prompt = [11, 12, 13, 14, 15, 16, 17, 18, 19]
    for model in ("a1", "a2", "tiny-lora"):
        r = _complete(client, model, prompt)
        assert r.choices[0].text == _text(served, reference(None if model == "tiny-lora" else model, prompt)), model
        assert r.usage.prompt_tokens_details.cached_tokens == 0, model
    again = _complete(client, "a1", prompt)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert again.choices[0].text == _text(served, reference("a1", prompt))


def test_n_choices_of_an_adapter_are_forked_with_it(client, served, reference):
    prompt = [31, 32, 33, 34, 35, 36, 37]
    r = client.completions.create(model="a2", prompt=prompt, n=2, max_tokens=NEW, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert [c.text for c in r.choices] == [_text(served, reference("a2", prompt))] * 2


# ============================================================================================ llama-server's
def test_llama_server_lora_field_and_global_scales(client, served, reference):
    base, a1, a2 = (_text(served, reference(m)) for m in (None, "a1", "a2"))
    for lora_field, want in (([{"id": 0, "scale": 0}], base), ([{"id": 0, "scale": 1}], a1),
                             ([{"id": 0, "scale": 0}, {"id": 1, "scale": 1.0}], a2), ([], base)):
        assert _complete(client, "tiny-lora", lora=lora_field).choices[0].text == want, lora_field
    listed = httpx.get(served.url + "/lora-adapters", timeout=10).json()
    assert [(a["id"], a["name"], a["scale"]) for a in listed][:2] == [(0, "a1", 0.0), (1, "a2", 0.0)]
    assert _post(served, "/lora-adapters", [{"id": 1, "scale": 1}]).json() == {"success": True}
    try:
        assert _complete(client, "tiny-lora").choices[0].text == a2          # the global scale applies
        assert _complete(client, "tiny-lora", lora=[]).choices[0].text == base   # the request's field wins
        assert _complete(client, "a1").choices[0].text == a1
    finally:
        assert _post(served, "/lora-adapters", []).status_code == 200
    assert _complete(client, "tiny-lora").choices[0].text == base


@pytest.mark.parametrize("body, param, message", [
    ({"model": "nope"}, "model", "the model 'nope' does not exist"),
    ({"lora": [{"id": 0, "scale": 1}, {"id": 1, "scale": 0.5}]}, "lora",
     "lora gives 2 adapters a non-zero scale; a request runs with one adapter"),
    ({"model": "a1", "lora": [{"id": 1, "scale": 1}]}, "lora", "give the adapter either as model or in lora"),
    ({"lora": [{"id": 7, "scale": 1}]}, "lora", "no LoRA adapter has id 7"),
    ({"lora": [{"id": 0}]}, "lora", "lora[0].scale must be a finite number"),
    ({"lora": [{"id": 0, "scale": 1, "x": 2}]}, "lora[0].x", "unknown parameter lora[0].x"),
])
def test_refusals_are_one_line_400s(served, body, param, message):
    err = _error(_post(served, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, **body}))
    assert err["param"] == param and err["message"].startswith(message), err
    assert _error(_post(served, "/lora-adapters", [{"id": 0, "scale": 1}, {"id": 1, "scale": 1}]))["message"] \
        .startswith("lora gives 2 adapters a non-zero scale")


# ============================================================================================ load and unload
def test_load_while_running_then_use_then_unload(client, served, lora, reference):
    table = served.engine.adapters
    table.updating = False   # as without --allow-runtime-lora-updating / VLLM_ALLOW_RUNTIME_LORA_UPDATING
    try:
        err = _error(_post(served, "/v1/load_lora_adapter", {"lora_name": "a3", "lora_path": str(lora["a3"])}), 404)
        assert "--allow-runtime-lora-updating" in err["message"]
    finally:
        table.updating = True
    for path, why in ((lora["empty"], "adapter_config.json"), (lora["dora"], "DoRA"),
                      (lora["big"], "rank 16, more than the graph's max_rank 8")):
        err = _error(_post(served, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(path)}))
        assert why in err["message"] and err["param"] == "lora_path", err
    long: dict = {}
    served.slow.delay = 0.05
    runner = threading.Thread(target=lambda: long.setdefault("r", _complete(client, "a1", n=30)))
    runner.start()
    try:
        while _stats(served)["sequences_active"] == 0:
            time.sleep(0.01)
        r = _post(served, "/v1/load_lora_adapter", {"lora_name": "a3", "lora_path": str(lora["a3"])})
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'a3' added successfully."
        err = _error(_post(served, "/v1/unload_lora_adapter", {"lora_name": "a1"}))   # a1 is running
        assert err["code"] == "lora_in_use" and "in use by 1 running or waiting request" in err["message"]
        assert runner.is_alive()   # the load and the refused unload happened while it ran
    finally:
        served.slow.delay = 0.0
        runner.join(120)
    assert long["r"].choices[0].text == _text(served, reference("a1", n=30))
    assert _complete(client, "a3").choices[0].text == _text(served, reference("a3"))
    assert [m.id for m in client.models.list().data] == ["tiny-lora", "a1", "a2", "a3"]
    err = _error(_post(served, "/v1/load_lora_adapter", {"lora_name": "a4", "lora_path": str(lora["a3"])}))
    assert "--max-loras 3" in err["message"]
    assert _error(_post(served, "/v1/load_lora_adapter", {"lora_name": "a1", "lora_path": str(lora["a1"])}))[
        "message"] == "the LoRA adapter 'a1' has already been loaded"
    r = _post(served, "/v1/unload_lora_adapter", {"lora_name": "a3"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'a3' removed successfully."
    assert _error(_post(served, "/v1/unload_lora_adapter", {"lora_name": "a3"}), 404)["code"] == "lora_not_found"
    assert _error(_post(served, "/v1/completions", {"model": "a3", "prompt": PROMPT}))["code"] == "model_not_found"
    assert "a3" not in served.engine.session.lora.names


# ============================================================================================ engine, events, P/D
def test_kv_events_carry_the_adapters_lora_id(client, served):
    zmq = pytest.importorskip("zmq")
    msgpack = pytest.importorskip("msgpack")
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(served.events)
    sub.setsockopt_string(zmq.SUBSCRIBE, "kv-events")
    time.sleep(0.3)   # ZeroMQ's slow joiner
    prompt = [21, 22, 23, 24, 25, 26, 27, 28, 29]
    try:
        _complete(client, "a2", prompt, n=2)
        _complete(client, "tiny-lora", prompt, n=2)
        stored = []
        while sub.poll(500):
            _, _, payload = sub.recv_multipart()
            stored += [e for e in msgpack.unpackb(payload)[1] if e[0] == "BlockStored"]
    finally:
        sub.close(linger=0)
        ctx.term()
    firsts = {e[5]: e for e in stored if e[2] is None and e[3][:BS] == prompt[:BS]}
    assert set(firsts) == {2, None}                 # a2's lora_int_id, and the base model's None
    assert firsts[2][1][0] != firsts[None][1][0]     # the same tokens, other blocks


def test_handoff_runs_with_the_requests_adapter(served, reference):
    """P/D: a sequence prefilled with a1 (as a producer's) is handed off with its adapter; the decode side runs it
    with the request's adapter (tokens equal PEFT's), and a request of another adapter is refused (400)."""
    from serve_helpers import collect

    from qeff_kv.runtime.decoding.sampling import SamplingParams
    from qeff_kv.serve.cluster import pd
    from qeff_kv.serve.cluster.transfer import extract
    from qeff_kv.serve.engine.engine import GenerationRequest
    from qeff_kv.serve.wire.openai_io import APIError, Params

    def produce(sched):
        seq = sched.prefix_cache.fresh(("a1", 1.0))
        seq.pending = int(sched.session.prefill(seq, PROMPT).argmax())
        out = extract(sched.session, seq, "r1")
        sched.prefix_cache.remove(seq)
        return out

    transfer = served.engine.run_on_engine(("call", produce)).result(timeout=60)
    assert transfer.lora == ("a1", 1.0)
    req = GenerationRequest("r1", tuple(PROMPT), NEW, SamplingParams(temperature=0), frozenset(),
                            state=transfer.state, lora=("a1", 1.0))
    toks, fin = collect(served.engine.submit(req))
    assert toks == reference("a1") and fin.finish_reason == "length"

    class Held:   # a connector holding that state
        def matched_tokens(self, params): return len(PROMPT)
        def peek(self, params): return None
        def load(self, params, tokens=None): return transfer
        def note_take_refused(self): pass

    class Engine:
        session, connector = served.engine.session, Held()

    kvp = {"do_remote_prefill": True, "remote_engine_id": "p", "transfer_id": "t"}
    with pytest.raises(APIError, match="was prefilled with LoRA adapter 'a1' at scale 1; this request runs LoRA "
                                       "adapter 'a2'"):
        pd.prepare(Engine, Params(kv_transfer_params=kvp), PROMPT, lora=("a2", 1.0))
    assert pd.prepare(Engine, Params(kv_transfer_params=kvp), PROMPT, lora=("a1", 1.0)).state is transfer.state


# ============================================================================================ start-up
def test_options_and_start_refusals(lora, monkeypatch, tmp_path):
    from qeff_kv.errors import AdapterError, RuntimeInputError
    from qeff_kv.export import export_model
    from qeff_kv.serve.config import ServeConfig
    from qeff_kv.serve.server import build_engine

    folder = str(lora["folder"])
    for opts, message in (({"lora_modules": ("a1",)}, "give NAME=PEFT_DIR"),
                          ({"lora_modules": ("a=x", "a=y")}, "names adapter 'a' twice"),
                          ({"lora_modules": ("a=x", "b=y"), "max_loras": 1}, "--max-loras is 1"),
                          ({"lora_modules": ('{"name": "a"}',)}, "the JSON form is")):
        with pytest.raises(RuntimeInputError, match=message):
            ServeConfig(folder, **opts).check()
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    assert ServeConfig(folder).lora.runtime_updating()
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
    assert not ServeConfig(folder).lora.runtime_updating()
    plain = export_model(lora["base"], tmp_path / "plain", ctx_len=64, continuous_batching=True, full_batch_size=2,
                         verify=False).out_dir
    with pytest.raises(AdapterError, match=r"^--lora-modules needs a graph with LoRA inputs; .* has none"):
        build_engine(ServeConfig(str(plain), lora_modules=(f"a1={lora['a1']}",)))
    with pytest.raises(AdapterError, match="DoRA"):
        build_engine(ServeConfig(folder, lora_modules=(f"d={lora['dora']}",)))


def test_disaggregated_replicas_run_the_requests_adapter(lora, reference):
    """``--disaggregate``: every replica loads the --lora-modules; a request's adapter runs on its prefill replica
    and, handed off, on its decode replica (tokens equal PEFT's)."""
    ray = pytest.importorskip("ray", reason="disaggregated serving needs the [ray] extra (ray)")
    from serve_helpers import collect

    from qeff_kv.runtime.decoding.sampling import SamplingParams
    from qeff_kv.serve.config import ServeConfig
    from qeff_kv.serve.engine.engine import GenerationRequest
    from qeff_kv.serve.server import build_engine

    owns = not ray.is_initialized()
    if owns:
        ray.init(num_cpus=2, include_dashboard=False, logging_level="warning", log_to_driver=False)
    engine = None
    try:
        engine = build_engine(ServeConfig(str(lora["folder"]), disaggregate=True, max_sequences=2,
                                          lora_modules=(f"a1={lora['a1']}", f"a2={lora['a2']}")))
        assert engine.adapters.names() == ["a1", "a2"]
        for key in (("a2", 1.0), None, ("a1", 1.0)):
            req = GenerationRequest(f"r{key}", tuple(PROMPT), NEW, SamplingParams(temperature=0), frozenset(),
                                    lora=key)
            toks, fin = collect(engine.submit(req))
            assert toks == reference(key[0] if key else None) and fin.finish_reason == "length", key
    finally:
        if engine is not None:
            engine.close()
        if owns:
            ray.shutdown()


def test_a_slot_of_an_adapter_saves_and_restores_only_with_it(lora, reference, tmp_path):
    """llama-server's slot save/restore (serve/engine/slots.py) on an adapter's sequence: the file records the
    adapter, a restore continues it exactly with the adapter, and a session without that adapter refuses it."""
    from qeff_kv.errors import StateFileError
    from qeff_kv.runtime.memory.prefix_cache import PrefixCache
    from qeff_kv.runtime.session import Session
    from qeff_kv.serve.engine import slots

    s = Session(lora["folder"])
    s.lora.load("a1", lora["a1"])
    cache = PrefixCache(s)
    seq = s.add_sequence(adapter="a1")
    s.prefill(seq, PROMPT[:-1])
    cache.keep(seq)
    saved = slots.run(s, cache, set(), seq.slot, "save", tmp_path / "a1.bin")
    assert saved["n_saved"] == len(PROMPT) - 1
    slots.run(s, cache, set(), seq.slot, "erase", None)
    restored = slots.run(s, cache, set(), 0, "restore", tmp_path / "a1.bin")
    assert restored["n_restored"] == len(PROMPT) - 1
    again = cache.in_slot(0)
    assert (again.adapter, again.lora_scale) == ("a1", 1.0)
    assert s.generate([(again, PROMPT[-1:])], max_tokens=NEW)[0].tokens == reference("a1")
    bare = Session(lora["folder"])
    with pytest.raises(StateFileError, match="a1"):
        slots.run(bare, PrefixCache(bare), set(), 0, "restore", tmp_path / "a1.bin")
    assert bare.sequences == [] or all(q.length == 0 for q in bare.sequences)
