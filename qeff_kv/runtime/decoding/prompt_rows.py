"""A prefill that returns the logits of every prompt position (prompt logprobs: OpenAI's ``echo`` + ``logprobs``,
lm-evaluation-harness's loglikelihood requests), on any export.

An ordinary graph returns one row of logits per call (its last valid position): :func:`prefill_rows` feeds the
prompt position by position there, one :meth:`Session.prefill` call of one token each (the in-place cache is
written as it goes, so the sequence ends prefilled as a plain prefill leaves it). A speculative-decoding graph
(exported with ``--speculative-tokens K``: a ``num_logits_to_keep`` input) returns the ``n`` rows ending at the
last valid one for any ``n`` it is given, so a prefill chunk of ``c`` tokens asking for ``c`` rows gets the logits
after each of them (:func:`chunked`): one call per chunk of the graph's prefill length instead of one per token,
the same chunks (and on a lock-step session the same row views) that :meth:`Session.prefill` uses. Both give the
same values (to float rounding). A fixed-``seq_len``, recurrent, vision-language or ring graph is fed position by
position even with the rows (its prefill plan is not this module's).
"""

from __future__ import annotations

import time
from typing import Sequence as Seq

import numpy as np

from qeff_kv.runtime.arguments import check_prefill
from qeff_kv.runtime.multimodal import positions as pos_mod
from qeff_kv.runtime.memory.hybrid import Sequence


def chunked(session) -> bool:
    """Whether ``session`` scores a prompt a chunk per graph run (its graph returns every row of a chunk); else
    :func:`prefill_rows` feeds it one position per run."""
    return bool(session.speculative and session.fixed_seq_len is None and not session.recurrent
                and session.media is None and not session.graph.memory.ring_within)


def prefill_rows(session, seq: Sequence, tokens: Seq[int], *, checkpoint: bool | Seq[int] = True) -> np.ndarray:
    """:meth:`Session.prefill` of ``tokens``, returning the logits after each of them, ``[n, vocab]`` (row ``i``
    scores the token at position ``length + i + 1``; the last row is what ``prefill`` returns). ``checkpoint``:
    as :meth:`Session.prefill`'s (recurrent state; ``True``: the end of these tokens and one before)."""
    if not chunked(session):
        return _one_by_one(session, seq, tokens, checkpoint)
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


def _one_by_one(session, seq: Sequence, tokens: Seq[int], checkpoint: bool | Seq[int]) -> np.ndarray:
    """The prompt fed one position per :meth:`Session.prefill` call (a graph returning its last row only); the
    whole prompt checked first, so nothing is written when it is refused."""
    seq = session.cache.get(seq)
    toks = check_prefill(seq, tokens, vocab_size=session.vocab_size, ctx_len=session.ctx_len)
    if session.media is not None:   # image tokens without images: refused before the first position is fed
        session.media.check(toks, None, session.prefill_seq_len)
    end = seq.length + len(toks)
    marks = (end - 1, end) if checkpoint is True else checkpoint   # the prompt's boundary, not every position's
    return np.stack([np.array(session.prefill(seq, [t], checkpoint=marks), copy=True) for t in toks])


def log_softmax(rows: np.ndarray) -> np.ndarray:
    """``log_softmax`` over the last axis, in float64."""
    x = rows.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))
