"""Batch-invariant serving (issue 54, ``qeff-kv serve --deterministic``): a request's tokens, and the logits they
were read from (each token's logprob and top alternatives, compared bit for bit), equal the same request served
alone, whatever else runs: several concurrencies, arrival orders, prompts sharing prefixes (prompt reuse on, the
kept sequences of earlier examples included), prompts fed in chunks across turns, greedy and seeded sampling; on
a float continuous-batching graph and an int4 fused (lock-step) one. And its one-line refusals."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qeff_kv.errors import RuntimeInputError
from qeff_kv.runtime import SamplingParams, Session
from qeff_kv.serve.engine.engine import Finished, GenerationRequest
from qeff_kv.serve.engine.scheduler import Scheduler
from suite import requires_torch

#: a shared opening (a system prompt's part): prompts take 0..len of it, then a tail of their own
BASE = [random.Random(54).randrange(3, 120) for _ in range(24)]
SEEDED = SamplingParams(temperature=0.9, seed=7)


def _prompt(cut: int, tail_seed: int, tail_len: int) -> tuple[int, ...]:
    rng = random.Random(tail_seed)
    return tuple(BASE[:cut] + [rng.randrange(3, 120) for _ in range(tail_len)])


def _request(i: int, prompt, seeded: bool) -> GenerationRequest:
    return GenerationRequest(f"r{i}", tuple(prompt), 6, SEEDED if seeded else SamplingParams(), frozenset(),
                             logprobs=2)


def _outcome(handle, reused: list | None = None):
    """Every token with its logprob and alternatives (read from the logits bit for bit); the prompt tokens taken
    from a kept sequence go to ``reused``."""
    evs = list(handle.iter_sync(timeout=120))
    assert isinstance(evs[-1], Finished) and evs[-1].finish_reason == "length", evs[-1]
    if reused is not None:
        reused.append(evs[-1].cached_tokens)
    return [(e.token, e.logprob, e.top) for e in evs[:-1]]


class Served:
    """One batch-invariant server of ``path`` (``rows`` sequences, prompt reuse on, kept across examples) and the
    reference: the same requests served one at a time by a server without prompt reuse (each alone)."""

    def __init__(self, path, rows: int, deterministic: bool = True):
        self.path = path
        self.sched = Scheduler(Session(path, max_sequences=rows), prefill_chunk=1, deterministic=deterministic)
        self.alone_sched = Scheduler(Session(path, max_sequences=rows), reuse_prompts=False, deterministic=True)
        self.alone_cache: dict = {}
        self.reused: list[int] = []   # cached prompt tokens of each request served together

    def alone(self, prompt, seeded: bool):
        key = (prompt, seeded)
        if key not in self.alone_cache:
            self.alone_cache[key] = _outcome(self.alone_sched.submit(_request(0, prompt, seeded)))
        return self.alone_cache[key]

    def together(self, reqs) -> list:
        handles = [self.sched.submit(_request(i, p, s)) for i, (p, s) in enumerate(reqs)]
        return [_outcome(h, self.reused) for h in handles]

    def close(self) -> None:
        self.sched.close()
        self.alone_sched.close()


@pytest.fixture(scope="module")
def int4_fused(family_models, tmp_path_factory):
    from families import CHUNK
    from qeff_kv.export import export_model

    return export_model(family_models("llama"), tmp_path_factory.mktemp("det") / "llama-int4-fused", ctx_len=48,
                        prefill_seq_len=CHUNK, target="onnxruntime-fused", weights="int4").out_dir


WORKLOAD = st.lists(st.tuples(st.integers(0, 24), st.integers(0, 3), st.integers(1, 6), st.booleans()),
                    min_size=1, max_size=5)


def _check_invariant(served: Served, data) -> None:
    reqs = [(_prompt(cut, seed, n), seeded) for cut, seed, n, seeded in data.draw(WORKLOAD)]
    order = data.draw(st.permutations(range(len(reqs))))
    got = dict(zip(order, served.together([reqs[i] for i in order])))
    for i, (prompt, seeded) in enumerate(reqs):
        assert got[i] == served.alone(prompt, seeded), (i, prompt, seeded)


SETTINGS = settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


@requires_torch
@pytest.mark.parametrize("graph,rows", [("own_cb_graph", 3), ("int4_fused", 4)],
                         ids=["float-continuous-batching", "int4-fused-lock-step"])
def test_tokens_equal_each_request_alone(graph, rows, request):
    served = Served(request.getfixturevalue(graph), rows=rows)

    @SETTINGS
    @given(st.data())
    def check(data):
        _check_invariant(served, data)

    try:
        check()
    finally:
        served.close()
    assert any(served.reused), "no prompt was reused: the property was not tried with prompt reuse"


def test_deterministic_refusals():
    from qeff_kv.serve.config import ServeConfig

    with pytest.raises(RuntimeInputError) as err:
        ServeConfig("x", deterministic=True, prefill_chunk="auto").check()
    assert str(err.value) == ("--deterministic does not go with --prefill-chunk auto (its chunks follow the timing); "
                              "give a number of tokens")
    with pytest.raises(RuntimeInputError) as err:
        ServeConfig("x", deterministic=True, speculative="lookup").check()
    assert str(err.value) == ("--deterministic does not go with --speculative (its steps are not the runs a request "
                              "alone makes)")
    with pytest.raises(RuntimeInputError, match="^--deterministic does not go with --kv-role "):
        ServeConfig("x", deterministic=True, kv_role="both").check()
