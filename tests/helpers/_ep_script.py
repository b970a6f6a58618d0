"""The conformance script of issue 40, shared by the proofs that an execution provider (or onnx's reference
evaluator) runs the runtime's feeds exactly: ``tests/runtime/test_ep_conformance.py`` (the CPU EP against the strict
reference evaluator), ``tests/runtime/test_ep_cuda.py`` (the CUDA EP against the CPU's, GPU only) and
``benchmarks/gpu_check.py`` (the same on a GPU machine without pytest). Needs numpy and the runtime only.

:func:`script` drives one :class:`~qeff_kv.runtime.Session` through prefill in chunks (the last one short), greedy
decode, ``truncate`` and the tokens fed again, and, where the session holds two or more sequences, ``copy`` into a
second sequence that diverges, both decoding in one step (continuous-batching rows or lock step), ``relocate`` of
the second into another slot and one more step together. It returns every greedy token and the logits it came from.
"""

from __future__ import annotations

import numpy as np

PROMPT = [5, 17, 42, 99, 13, 7, 101, 64, 3, 77, 21]   # chunks of 4: 4, 4, 3 (the last unpadded)
STEPS = 3


def script(sess) -> tuple[list[int], list[np.ndarray]]:
    """Greedy tokens (and the logits they came from) through every verb the session's graph allows."""
    toks, logits = [], []

    def greedy(row: np.ndarray) -> int:
        logits.append(np.array(row, np.float64))
        toks.append(int(np.argmax(row)))
        return toks[-1]

    a = sess.add_sequence()
    t = greedy(sess.prefill(a, PROMPT))
    for _ in range(STEPS):
        t = greedy(sess.decode({a: t})[a])
    # truncate: back one position (a ring holds no more; a recurrent state: to its checkpoint at or below), the
    # tokens fed again
    n = sess.reusable(a, a.length - 1)
    fed = list(a.tokens)
    sess.truncate(a, n)
    t = greedy(sess.prefill(a, fed[n:]))
    if sess.max_sequences < 2:
        return toks, logits
    # copy a into b, b diverges; both decode in one step (continuous batching rows, or lock step)
    b = sess.add_sequence()
    sess.copy(a, b, a.length)
    u = greedy(sess.prefill(b, [7]))
    for _ in range(2):
        out = sess.decode({a: t, b: u})
        t, u = greedy(out[a]), greedy(out[b])
    # relocate b into another slot (a free one, else exchanging with a), then one more step together
    free = [s for s in range(sess.max_sequences) if s not in {x.slot for x in sess.sequences}]
    sess.relocate(b, free[-1] if free else a.slot)
    out = sess.decode({a: t, b: u})
    greedy(out[a]), greedy(out[b])
    return toks, logits
