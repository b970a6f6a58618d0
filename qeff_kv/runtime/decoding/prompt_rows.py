"""A prefill that returns the logits of every prompt position (prompt logprobs: OpenAI's ``echo`` + ``logprobs``,
lm-evaluation-harness's loglikelihood requests).

An ordinary graph returns one row of logits per sequence (its last valid position). A speculative-decoding graph
(exported with ``--speculative-tokens K``: a ``num_logits_to_keep`` input) returns the ``n`` rows ending at the
last valid one for any ``n`` it is given, so a prefill chunk of ``c`` tokens asking for ``c`` rows gets the logits
after each of them: no other export option is needed. :func:`prefill_rows` feeds a prompt in chunks of the
graph's prefill length that way (the same chunks, and on a lock-step session the same row views, that
:meth:`Session.prefill` uses for a text decoder of this exporter), so the cache it leaves is the one a plain
prefill leaves. :func:`unsupported` says why a session cannot.
"""

from __future__ import annotations

import time
from typing import Sequence as Seq

import numpy as np

from qeff_kv.errors import RuntimeInputError
from qeff_kv.runtime.arguments import check_prefill
from qeff_kv.runtime.multimodal import positions as pos_mod
from qeff_kv.runtime.memory.hybrid import Sequence

#: the export option that adds the rows (named in every refusal)
EXPORT_OPTION = "--speculative-tokens K"


def unsupported(session) -> str | None:
    """Why ``session`` cannot return every prompt position's logits, in one line; None when it can."""
    if not session.speculative:
        return (f"the graph returns the logits of the last prompt position only; export it with {EXPORT_OPTION} "
                "(a num_logits_to_keep input) for prompt logprobs")
    why = ("a fixed seq_len graph" if session.fixed_seq_len is not None
           else "a recurrent graph" if session.recurrent else "a vision-language graph" if session.media is not None
           else "another exporter's rings" if session.graph.memory.ring_within else None)
    return None if why is None else f"prompt logprobs are not computed on {why}"


def prefill_rows(session, seq: Sequence, tokens: Seq[int]) -> np.ndarray:
    """:meth:`Session.prefill` of ``tokens``, returning the logits after each of them, ``[n, vocab]`` (row ``i``
    scores the token at position ``length + i + 1``; the last row is what ``prefill`` returns)."""
    why = unsupported(session)
    if why is not None:
        raise RuntimeInputError(why)
    seq = session.cache.get(seq)
    toks = check_prefill(seq, tokens, vocab_size=session.vocab_size, ctx_len=session.ctx_len)
    t0, S, rows = time.perf_counter(), session.prefill_seq_len, []
    session.binding.use_kv(session.graph.batching.prefill_views(session.binding.rows, seq))
    for off in range(0, len(toks), S):
        part = toks[off:off + S]
        width = len(part)
        arrays = session.binding.bind_small(1, width, width)
        arrays["input_ids"][0, :] = part
        pos_mod.write(arrays["position_ids"], 0, seq.length, width)
        session.graph.batching.fill_prefill(arrays, seq)
        session.binding.adapt_rows(arrays, ((0, seq),))
        out = session.binding.run(1, width, np.array([width - 1]), needed=seq.length + width, keep=width)
        rows.append(out[0] if width > 1 else out)   # [width, vocab] (one row: run gives [1, vocab])
        session.timings.prefill_runs += 1
        seq.length += width
        session.cache.positional.wrote(seq, seq.length)
        seq.tokens.extend(part)
    seq.pending = None
    seq.pending_emitted = False
    session.timings.prefill_s += time.perf_counter() - t0
    session.timings.prefill_tokens += len(toks)
    return np.concatenate(rows, axis=0)


def log_softmax(rows: np.ndarray) -> np.ndarray:
    """``log_softmax`` over the last axis, in float64."""
    x = rows.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))
