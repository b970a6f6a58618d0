"""LoRA adapters at run time (docs/lora.md, "Runtime"): each row of a step runs with its own sequence's adapter, on
every path that runs the graph, and every cache verb carries the adapter.

One tiny seeded Llama, PEFT adapters of different ranks with non-zero random B (one rslora, one on the MLP's gate),
four exports made once for the module (a continuous-batching graph proved with three adapters, a lock-step graph,
a ``--max-lora-rank`` graph that takes adapters at run time and also verifies drafts and returns hidden states, a
plain graph), and transformers + PEFT greedy tokens as the reference of every row.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from suite import requires_torch

pytestmark = requires_torch

N_REF = 12       # reference tokens per (adapter, prompt): 8 generated, then continuations after a verb
NEW = 8
P0 = [5, 17, 33, 9, 40, 7, 21, 60, 3, 11]          # two prefill chunks of 8
P1 = [90, 4, 77, 12, 8, 101, 56, 19, 64]
REP = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6]   # prompt lookup drafts on it
A1_TARGETS = ["q_proj", "v_proj", "down_proj"]


class Refs:
    """transformers (+ PEFT) greedy tokens, each model loaded once: ``refs(key, prompt)``; ``key`` None is the
    base model, else an adapter of ``dirs``."""

    def __init__(self, base, dirs):
        self.base, self.dirs, self.models, self.tokens = base, dirs, {}, {}

    def model(self, key):
        if key not in self.models:
            import torch
            import transformers

            from lora_adapters import peft_model

            self.models[key] = (peft_model(self.base, self.dirs[key]) if key is not None else
                                transformers.AutoModelForCausalLM.from_pretrained(
                                    self.base, dtype=torch.float32, attn_implementation="eager").eval())
        return self.models[key]

    def __call__(self, key, prompt, n: int = N_REF) -> list[int]:
        import torch

        if (key, tuple(prompt), n) not in self.tokens:
            ids = torch.tensor([prompt])
            with torch.no_grad():
                out = self.model(key).generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                               min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
            self.tokens[(key, tuple(prompt), n)] = out[0, len(prompt):].tolist()
        return self.tokens[(key, tuple(prompt), n)]


class World:
    pass


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    from hf_models import make_model_dir
    from lora_adapters import make_adapter
    from qeff_kv.export import export_model

    root = tmp_path_factory.mktemp("lora-runtime")
    w = World()
    w.base = base = make_model_dir("llama", root)
    w.dirs = {
        "a1": make_adapter(base, root / "a1", r=4, alpha=8, targets=A1_TARGETS, seed=1),
        "a2": make_adapter(base, root / "a2", r=8, alpha=16, targets=["q_proj", "k_proj", "o_proj", "up_proj"],
                           seed=2, rslora=True),
        "a3": make_adapter(base, root / "a3", r=2, alpha=4, targets=["gate_proj", "v_proj"], seed=3),
        # a1 with its PEFT scaling halved (alpha 4 for 8, the same seeded weights): a1 at lora_scale 0.5
        "a1_half": make_adapter(base, root / "a1_half", r=4, alpha=4, targets=A1_TARGETS, seed=1),
        "big": make_adapter(base, root / "big", r=16, alpha=16, targets=["q_proj"], seed=4),
    }
    w.refs = Refs(base, w.dirs)
    common = dict(ctx_len=64, prefill_seq_len=8, verify=False)
    lora = [f"{n}={w.dirs[n]}" for n in ("a1", "a2", "a3")]
    w.cb = export_model(base, root / "cb", lora=lora, continuous_batching=True, full_batch_size=6, **common).out_dir
    w.lockstep = export_model(base, root / "ls", lora=lora[:2], **common).out_dir   # no gate_proj
    w.rank = export_model(base, root / "rank", max_lora_rank=8, speculative_tokens=3, continuous_batching=True,
                          full_batch_size=4, hidden_states=True, **common).out_dir
    w.plain = export_model(base, root / "plain", **common).out_dir
    return w


def session(world, graph: str, adapters=("a1", "a2", "a3"), **kwargs):
    from qeff_kv.runtime.session import Session

    s = Session(getattr(world, graph), **kwargs)
    for name in adapters:
        s.lora.load(name, world.dirs[name])
    return s


def generate(s, requests, n: int = NEW) -> list[list[int]]:
    return [g.tokens for g in s.generate(requests, max_tokens=n, stop_tokens=[])]


def rows_equal_peft(world, s, rows):
    """``rows``: ``(adapter, scale, prompt, reference key)``; one session step set, each row its own adapter."""
    seqs = [s.add_sequence(adapter=a, lora_scale=sc) for a, sc, _, _ in rows]
    got = generate(s, [(q, p) for q, (_, _, p, _) in zip(seqs, rows)])
    want = [world.refs(key, p)[:NEW] for _, _, p, key in rows]
    assert got == want
    return seqs


def test_references_differ_by_adapter(world):
    """Every adapter changes the greedy tokens of one prompt: a row run on the wrong adapter cannot pass."""
    refs = [tuple(world.refs(k, P0)[:NEW]) for k in (None, "a1", "a2", "a3", "a1_half")]
    assert len(set(refs)) == len(refs)


def test_mixed_batch_on_continuous_batching_equals_peft_row_by_row(world):
    s = session(world, "cb")
    rows_equal_peft(world, s, [(None, 1.0, P0, None), ("a1", 1.0, P0, "a1"), ("a2", 1.0, P0, "a2"),
                               ("a3", 1.0, P0, "a3"), ("a2", 1.0, P1, "a2"), (None, 1.0, P1, None)])


def test_mixed_batch_in_lock_step_equals_peft_and_relocate_and_truncate_keep_the_adapter(world):
    s = session(world, "lockstep", ("a1", "a2"), max_sequences=3)
    assert s.lockstep
    base, one, two = rows_equal_peft(world, s, [(None, 1.0, P0, None), ("a1", 1.0, P1, "a1"),
                                                ("a2", 1.0, P0, "a2")])
    assert s.relocate(two, 0) is base and (two.slot, base.slot, two.adapter) == (0, 2, "a2")
    s.truncate(one, len(P1) + 3)   # holds P1 and its first three tokens, still with a1
    ref1, ref2 = world.refs("a1", P1), world.refs("a2", P0)
    got = generate(s, [(one, [ref1[3]]), two], n=4)
    assert got == [ref1[4:8], ref2[NEW:NEW + 4]] and one.adapter == "a1"


def test_adapters_loaded_at_run_time_on_a_max_rank_graph(world):
    s = session(world, "rank")
    assert s.graph.lora.proved_with == () and s.graph.lora.max_rank == 8
    rows_equal_peft(world, s, [("a3", 1.0, P1, "a3"), (None, 1.0, P0, None), ("a2", 1.0, P0, "a2"),
                               ("a1", 1.0, P1, "a1")])


def test_speculative_verification_runs_each_row_with_its_adapter(world):
    from qeff_kv.runtime.decoding.speculative import PromptLookup, SpeculativeDecoder, score_rows

    s = session(world, "rank")
    dec = SpeculativeDecoder(s, PromptLookup(), k=3, adaptive=False)
    gen = dec.generate(REP, max_tokens=NEW, stop_tokens=[], adapter="a2")
    assert dec.stats.verifications > 0 and gen.sequence.adapter == "a2"
    assert gen.tokens == world.refs("a2", REP)[:NEW]
    # two rows of one verification step, each with its adapter
    for q in list(s.sequences):
        s.remove_sequence(q)
    seqs = [s.add_sequence(adapter=a) for a in ("a1", "a3")]
    firsts = [int(np.argmax(s.prefill(q, P0))) for q in seqs]
    refs = [world.refs(a, P0) for a in ("a1", "a3")]
    rows = score_rows(s, [(q, [f] + r[1:3]) for q, f, r in zip(seqs, firsts, refs)])
    assert firsts == [r[0] for r in refs]
    assert [list(np.argmax(r, axis=-1)) for r in rows] == [r[1:4] for r in refs]


def test_prompt_rows_and_embeddings_run_with_the_sequence_adapter(world):
    import torch

    from lora_adapters import peft_logits
    from qeff_kv.runtime.decoding.prompt_rows import prefill_rows
    from qeff_kv.runtime.embeddings import embed

    s = session(world, "rank", ("a2", "a1"))
    rows = prefill_rows(s, s.add_sequence(adapter="a1", lora_scale=0.5), P0)
    np.testing.assert_allclose(rows, peft_logits(world.base, world.dirs["a1_half"], P0)[0], atol=1e-4)
    vec = embed(s, s.add_sequence(adapter="a2"), P0)
    with torch.no_grad():
        hidden = world.refs.model("a2")(input_ids=torch.tensor([P0]), output_hidden_states=True).hidden_states[-1]
    want = hidden[0, -1].numpy()
    np.testing.assert_allclose(vec, want / np.linalg.norm(want), atol=1e-5)


def test_lora_scale_half_equals_peft_with_the_scaling_halved(world):
    s = session(world, "cb")
    assert world.refs("a1_half", P0)[:NEW] != world.refs("a1", P0)[:NEW]
    rows_equal_peft(world, s, [("a1", 0.5, P0, "a1_half"), ("a1", 1.0, P0, "a1"), ("a1", 0.0, P0, None),
                               ("a1", 0.5, P1, "a1_half")])


def test_stacks_are_built_once_per_change_of_the_adapter_set(world, monkeypatch):
    from qeff_kv.tools import adapters as adapters_mod

    built = []
    stack = adapters_mod.stack
    monkeypatch.setattr(adapters_mod, "stack", lambda *a, **k: built.append(1) or stack(*a, **k))
    s = session(world, "cb")
    feeds = s.binding.adapters
    seqs = [s.add_sequence(adapter=a) for a in ("a1", "a2")]
    generate(s, [(q, P0) for q in seqs], n=3)
    values = dict(feeds.values)
    generate(s, seqs, n=3)
    assert len(built) == feeds.builds == 1 and all(feeds.values[k] is v for k, v in values.items())
    s.lora.load("h", world.dirs["a1_half"])
    assert s.lora.names == ["a1", "a2", "a3", "h"]
    generate(s, seqs, n=1)
    assert len(built) == 2 and feeds.values is not None and feeds.values.keys() == values.keys()
    dims = sum(m.in_features + m.out_features for m in s.graph.lora.modules)
    assert s.lora.nbytes() == 5 * 8 * dims * 4 == sum(v.numpy().nbytes for v in feeds.values.values())
    summary = s.lora.summary()
    assert list(summary) == ["a1", "a2", "a3", "h"] and summary["a2"]["rank"] == 8 and summary["a2"]["rslora"]
    assert s.describe()["lora"]["loaded"] == ["a1", "a2", "a3", "h"]


def test_load_and_unload_while_sequences_exist(world):
    from qeff_kv.errors import AdapterError

    s = session(world, "cb")
    one, two, three = seqs = [s.add_sequence(adapter=a) for a in ("a1", "a2", "a3")]
    generate(s, [(q, P0) for q in seqs])
    with pytest.raises(AdapterError, match=r"^adapter 'a1' is in use by sequence \d+: remove it first$"):
        s.lora.unload("a1")
    s.remove_sequence(one)
    s.lora.unload("a1")   # a2 and a3 move down a slot under the running sequences
    assert s.lora.names == ["a2", "a3"] and s.binding.adapters.slot("a3") == 2
    s.lora.load("h", world.dirs["a1_half"])
    late = s.add_sequence(adapter="h", lora_scale=2.0)   # a1 again: half the scaling, twice the scale
    got = generate(s, [two, three, (late, P1)], n=4)
    assert got == [world.refs("a2", P0)[NEW:NEW + 4], world.refs("a3", P0)[NEW:NEW + 4], world.refs("a1", P1)[:4]]
    with pytest.raises(AdapterError, match=r"^adapter 'a1' is not loaded \(loaded: a2, a3, h\)$"):
        s.add_sequence(adapter="a1")


def test_adapters_that_do_not_fit_are_refused(world):
    from qeff_kv.errors import AdapterError

    s = session(world, "cb", ())
    with pytest.raises(AdapterError, match=r"^adapter big has rank 16, more than the graph's max_rank 8"):
        s.lora.load("big", world.dirs["big"])
    ls = session(world, "lockstep", (), max_sequences=3)
    with pytest.raises(AdapterError, match=r"^adapter a3 adapts mlp\.gate_proj, which the graph does not adapt"):
        ls.lora.load("a3", world.dirs["a3"])
    assert s.lora.names == ls.lora.names == []
    with pytest.raises(AdapterError, match="is not a folder"):
        s.lora.load("gone", world.base / "no-such-adapter")


def test_switching_adapter_after_prefill_is_refused(world):
    from qeff_kv.errors import AdapterError

    s = session(world, "cb")
    seq = s.add_sequence(adapter="a1")
    s.lora.use(seq, "a2")   # nothing computed yet: allowed
    s.prefill(seq, P0)
    for name, scale in (("a1", 1.0), ("a2", 0.5), (None, 1.0)):
        with pytest.raises(AdapterError, match=rf"^sequence {seq.id} holds {len(P0)} positions computed with "
                                               r"adapter 'a2'; it cannot switch to"):
            s.lora.use(seq, name, scale)
    assert (seq.adapter, seq.lora_scale) == ("a2", 1.0)
    with pytest.raises(AdapterError, match=r"^lora_scale 0.5 goes with an adapter"):
        s.add_sequence(lora_scale=0.5)
    with pytest.raises(AdapterError, match=r"^lora_scale 0.5 goes with an adapter"):
        s.lora.use(s.add_sequence(adapter="a1"), None, 0.5)


def test_copy_carries_the_adapter_and_continues_exactly(world):
    from qeff_kv.errors import AdapterError

    s = session(world, "cb")
    src = s.add_sequence(adapter="a1", lora_scale=0.5)
    other = s.add_sequence(adapter="a2")
    [toks, _] = generate(s, [(src, P0), (other, P1)])
    fork = s.add_sequence()
    s.copy(src, fork, src.length)
    assert (fork.adapter, fork.lora_scale, fork.length) == ("a1", 0.5, src.length)
    got = generate(s, [(fork, [toks[-1]]), src], n=3)
    assert got == [world.refs("a1_half", P0)[NEW:NEW + 3]] * 2   # the fork continues as its source does
    with pytest.raises(AdapterError, match=rf"^sequence {other.id} holds \d+ positions computed with adapter 'a2'; "
                                           rf"sequence {src.id} was computed with adapter 'a1' \(scale 0.5\)"):
        s.copy(src, other, 4)
    assert other.adapter == "a2" and other.length == len(P1) + NEW - 1
    empty = s.add_sequence()
    s.copy(fork, empty, len(P0))   # an empty sequence takes the adapter of what it receives
    assert (empty.adapter, empty.lora_scale) == ("a1", 0.5)
    s.remove_sequence(src)
    s.remove_sequence(fork)
    with pytest.raises(AdapterError, match=rf"in use by sequence {empty.id}"):
        s.lora.unload("a1")


def test_state_round_trip_with_the_adapter_and_refusals(world, tmp_path):
    from qeff_kv.errors import AdapterError, StateAdapterError, StateFileError
    from qeff_kv.runtime.memory.state_file import read_state

    s = session(world, "cb")
    seq = s.add_sequence(adapter="a2")
    generate(s, [(seq, P0)])
    path = s.save_state(seq, tmp_path / "a2.safetensors")
    meta = read_state(path).metadata
    assert (meta["format_version"], meta["lora_adapter"], meta["lora_scale"]) == ("2", "a2", "1.0")
    plain_seq = s.add_sequence()
    generate(s, [(plain_seq, P1)], n=2)
    base_meta = read_state(s.save_state(plain_seq, tmp_path / "base.safetensors")).metadata
    assert base_meta["format_version"] == "1" and not any(k.startswith("lora") for k in base_meta)

    t = session(world, "cb", ("a3", "a2"))   # other slots: the name is what counts
    restored = t.load_state(path)
    assert restored.adapter == "a2"
    assert generate(t, [restored], n=4) == [world.refs("a2", P0)[NEW:NEW + 4]]
    assert t.load_state(tmp_path / "base.safetensors").adapter is None

    held = t.add_sequence(adapter="a3")
    generate(t, [(held, P1)], n=1)
    with pytest.raises(AdapterError, match=rf"^sequence {held.id} holds {len(P1)} positions computed with adapter "
                                           r"'a3'; .*a2\.safetensors was computed with adapter 'a2'"):
        t.load_state(path, held)
    assert held.adapter == "a3" and held.length == len(P1)
    for loaded, why in (((), r"which this session has not loaded \(loaded: none\); load it first"),
                        (("a1",), r"which this session has not loaded \(loaded: a1\)")):
        with pytest.raises(StateAdapterError, match=r"a2\.safetensors: computed with adapter 'a2', " + why):
            session(world, "cb", loaded).load_state(path)
    u = session(world, "cb", ())
    u.lora.load("a2", world.dirs["a1"])   # another adapter under the name
    with pytest.raises(StateFileError, match=r"the adapter loaded as 'a2' \(.*a1\) has other weights$"):
        u.load_state(path)
    with pytest.raises(StateAdapterError, match=r"takes no LoRA adapters$"):
        session(world, "plain", ()).load_state(path)
    assert u.sequences == []


def test_a_graph_without_adapters_refuses_the_lora_verbs(world):
    from qeff_kv.errors import AdapterError

    s = session(world, "plain", ())
    with pytest.raises(AdapterError, match=r"^tiny-llama\.onnx takes no LoRA adapters: export it with --lora "
                                           r"name=PEFT_DIR or --max-lora-rank R$"):
        s.lora.load("a1", world.dirs["a1"])
    with pytest.raises(AdapterError, match="takes no LoRA adapters"):
        s.add_sequence(adapter="a1")
    assert (s.lora.names, s.lora.nbytes(), s.lora.summary(), s.describe()["lora"]) == ([], 0, {}, None)
    assert s.sequences == []


def _cli(*args):
    from qeff_kv_cli.main import main

    return CliRunner().invoke(main, ["generate", *map(str, args)])


def test_generate_cli_with_lora_equals_peft(world):
    ids = lambda p: ",".join(map(str, p))   # noqa: E731
    r = _cli(world.cb, "--lora", world.dirs["a2"], "--prompt-ids", ids(P0), "--prompt-ids", ids(P1),
             "--max-tokens", NEW, "--ignore-eos", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert [q["tokens"] for q in out["sequences"]] == [world.refs("a2", p)[:NEW] for p in (P0, P1)]
    assert (out["lora"]["name"], out["lora"]["rank"], out["lora"]["scale"]) == ("a2", 8, 1.0)
    r = _cli(world.rank, "--lora", f"x={world.dirs['a1']}", "--lora-scale", "0.5", "--prompt-ids", ids(P0),
             "--max-tokens", NEW, "--ignore-eos")
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() == " ".join(map(str, world.refs("a1_half", P0)[:NEW]))


def test_generate_cli_saves_and_continues_an_adapter_state(world, tmp_path):
    from cli_checks import one_error

    state, a3 = tmp_path / "a3.safetensors", f"a3={world.dirs['a3']}"
    r = _cli(world.cb, "--lora", a3, "--prompt-ids", ",".join(map(str, P1)), "--max-tokens", 4, "--ignore-eos",
             "--save-state", state)
    assert r.exit_code == 0, r.output
    r = _cli(world.cb, "--lora", a3, "--load-state", state, "--max-tokens", 4, "--ignore-eos")
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() == " ".join(map(str, world.refs("a3", P1)[4:8]))
    one_error(_cli(world.cb, "--load-state", state, "--max-tokens", 1), "computed with adapter 'a3', which this "
              "session has not loaded (loaded: none)")
    one_error(_cli(world.cb, "--lora", a3, "--lora-scale", 0.5, "--load-state", state, "--max-tokens", 1),
              "computed with adapter 'a3', not with adapter 'a3' (scale 0.5)")


def test_generate_cli_lora_refusals(world):
    from cli_checks import one_error

    one_error(_cli(world.plain, "--lora", world.dirs["a1"], "--prompt-ids", "5,6", "--max-tokens", 2),
              "tiny-llama.onnx takes no LoRA adapters")
    one_error(_cli(world.cb, "--lora-scale", "0.5", "--prompt-ids", "5,6"), "--lora-scale scales the adapter of --lora")
    one_error(_cli(world.cb, "--lora", world.base / "none", "--prompt-ids", "5,6"), "no such adapter folder")
    one_error(_cli(world.cb, "--lora", world.dirs["big"], "--prompt-ids", "5,6"), "more than the graph's max_rank 8")


def test_a_growing_graph_runs_each_held_length_with_its_rows_adapters():
    """A growing past/present graph runs a step whose rows hold different lengths as one run per length
    (runtime/execution/growing.py): each run is fed its own rows' adapter slots and scales, then the step's own
    values are bound again."""
    import onnxruntime as ort

    from qeff_kv.runtime.execution.growing import GrowingKV

    class Value:
        def __init__(self, array):
            self.array = array

        def numpy(self):
            return self.array

    class Io:
        def __init__(self):
            self.bound, self.runs = {}, []

        def bind_ortvalue_input(self, name, value):
            self.bound[name] = value.numpy().copy()

        def bind_output(self, name, where):
            pass

        def run(self):
            ids, scales, past = (self.bound[k] for k in ("lora_ids", "lora_scales", "past_key.0"))
            self.runs.append((ids.tolist(), scales.tolist()))
            rows, width = len(ids), self.bound["input_ids"].shape[1]
            self.out = {"present.0": Value(np.zeros((rows, 1, past.shape[2] + width, 2), np.float32)),
                        "logits": Value(np.repeat(ids.astype(np.float32)[:, None, None], 4, axis=2))}

    small = {"input_ids": np.array([[7], [8], [9]]), "position_ids": np.array([[2], [5], [2]]),
             "lora_ids": np.array([1, 2, 3]), "lora_scales": np.array([0.5, 1.0, 0.25], np.float32)}
    values = {k: ort.OrtValue.ortvalue_from_numpy(v) for k, v in small.items()}
    grow, io = GrowingKV({"past_key.0": np.zeros((3, 1, 8, 2), np.float32)}, {"past_key.0": "present.0"}), Io()
    grow.bind_outputs(lambda name, value: None)
    feeds = type("Feeds", (), {"feed": lambda self, io, pos: None})()
    logits = grow.run(io, small, values, feeds, lambda: io.out)
    assert io.runs == [([1, 3], [0.5, 0.25]), ([2], [1.0])]
    assert logits[:, 0, 0].tolist() == [1.0, 2.0, 3.0]
    assert io.bound["lora_ids"].tolist() == [1, 2, 3] and io.bound["lora_scales"].tolist() == [0.5, 1.0, 0.25]


def test_the_prefix_cache_reuses_only_sequences_of_the_same_adapter(world):
    from qeff_kv.runtime.memory.prefix_cache import PrefixCache

    s = session(world, "cb")
    cache = PrefixCache(s)
    done = s.add_sequence(adapter="a1")
    generate(s, [(done, P0)])
    cache.keep(done)
    longer = P0 + world.refs("a1", P0)[:3]
    assert cache.lookup(longer) == (None, 0) and cache.lookup(longer, lora=("a1", 0.5)) == (None, 0)
    assert cache.lookup(longer, lora=("a1", 1.0)) == (done, len(longer) - 1)
    base, n = cache.acquire(longer)   # the base model: a fresh sequence, nothing reused
    assert (base.adapter, n) == (None, 0) and base is not done
    seq, n = cache.acquire(longer, lora=("a1", 1.0))
    assert (seq.adapter, n) == ("a1", len(longer) - 1)
    got = generate(s, [(seq, longer[n:]), (base, longer)], n=4)
    assert got == [world.refs("a1", P0)[3:7], world.refs(None, longer, 4)]
