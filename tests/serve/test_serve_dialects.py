"""The serving engine over graphs of the other KV dialects (issue 49): a static cache (TensorScatter at
``write_indices``) and a growing past/present graph, two requests at once in lock step, prompt reuse on; every
request's tokens equal the plain onnxruntime loop's on the graph as its writer wrote it."""

from __future__ import annotations

import pytest

import dialect_loops
from growing_graph import growing_decoder
from qeff_kv.contract import naming
from qeff_kv.runtime import SamplingParams, Session
from qeff_kv.serve.engine.engine import Finished, GenerationRequest, TokenOut
from qeff_kv.serve.engine.scheduler import Scheduler

CAPACITY = 32
PROMPTS = ([1, 5, 9, 13, 17, 21, 3], [2, 4, 6], [1, 5, 9, 13, 17, 21, 8, 8])   # the third reuses the first's prefix


def _graph(kind, folder):
    if kind == naming.STATIC_CACHE:
        return dialect_loops.static_cache_graph(folder / "static.onnx", capacity=CAPACITY)
    return growing_decoder(folder / "growing.onnx", capacity=CAPACITY)


@pytest.mark.parametrize("kind", [naming.STATIC_CACHE, "growing"])
def test_engine_serves_other_dialects_exactly(kind, tmp_path):
    path = _graph(kind, tmp_path)
    n = 8
    want = [dialect_loops.greedy_loop(path, p, n, capacity=CAPACITY) for p in PROMPTS]
    session = Session(path, ctx_len=CAPACITY, max_sequences=2)
    assert session.layout.dialect == (naming.STATIC_CACHE if kind == naming.STATIC_CACHE
                                                   else naming.PAST_PRESENT)
    sched = Scheduler(session)
    try:
        handles = [sched.submit(GenerationRequest(str(i), tuple(p), n, SamplingParams(), frozenset()))
                   for i, p in enumerate(PROMPTS[:2])]
        got = [_tokens(h) for h in handles]
        got.append(_tokens(sched.submit(GenerationRequest("2", tuple(PROMPTS[2]), n, SamplingParams(),
                                                          frozenset()))))
    finally:
        sched.close()
    assert got == want


def _tokens(handle) -> list[int]:
    evs = list(handle.iter_sync(timeout=60))
    assert isinstance(evs[-1], Finished) and all(isinstance(e, TokenOut) for e in evs[:-1])
    return [e.token for e in evs[:-1]]
