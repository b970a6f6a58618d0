"""Token selection: one per-row logits-processing pipeline, then greedy or seeded sampling.

The pipeline for one row (one sequence's logits of one step), each stage vectorised over the vocabulary:

1. **adjust** (:meth:`TokenPicker.adjusted`): ``logit_bias`` added; ``repetition_penalty`` (every token of the
   prompt and of the output so far: a positive logit divided by it, a negative one multiplied, the Hugging Face /
   vLLM rule); ``presence_penalty`` and ``frequency_penalty`` subtracted (output tokens only: ``presence *
   [count > 0] + frequency * count``, OpenAI's rule); then an optional allowed-token mask (disallowed tokens set
   to ``-inf``; where a grammar plugs in).
2. **logprobs** (:meth:`TokenPicker.pick` with ``top_logprobs``): the log-softmax of the adjusted logits (before
   temperature and the top-k/top-p/min-p truncation, so they do not depend on the temperature and the greedy
   token is always the most likely one).
3. **select**: greedy (the first index of the largest adjusted logit), or :func:`probabilities` (temperature,
   top-k, top-p, min-p) and one seeded draw.

A row with nothing to adjust and no logprobs takes the fast path :func:`sample` on the raw row (no copy).

Randomness is a pure function of ``(seed, position)``, where ``position`` is the cache position the sampled
token will occupy. The same seed therefore gives the same tokens whether a sequence runs uninterrupted, is
rewound and re-decoded, or is saved in one process and continued in another.
"""

from __future__ import annotations

import dataclasses
import secrets
from dataclasses import dataclass

import numpy as np

from qeff_kv.errors import RuntimeInputError

#: a temperature below this samples greedily (vLLM's rule: dividing by a denormal overflows to inf)
GREEDY_BELOW = 1e-5
#: at most this many alternatives per token in logprobs (OpenAI's bound)
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token.

    ``temperature == 0`` (the default; also anything below :data:`GREEDY_BELOW`) is greedy: the first index of
    the largest (adjusted) logit, exactly like ``argmax``. Otherwise logits are divided by ``temperature``,
    restricted to the ``top_k`` largest (``0``: no limit), to the smallest set whose probability reaches ``top_p``
    (``1.0``: no limit) and to the tokens at least ``min_p`` times as likely as the most likely one (``0``: no
    limit), and a token is drawn. With ``seed=None`` each :meth:`Session.generate` call draws a fresh random seed
    (:meth:`resolved`). ``logit_bias`` (``((token id, bias), ...)``), ``repetition_penalty`` (1: none),
    ``presence_penalty`` and ``frequency_penalty`` (0: none) adjust the logits first (module docstring); they need
    the token history, so they go through a :class:`TokenPicker`, not :func:`sample`.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise RuntimeInputError(f"temperature must be >= 0, got {self.temperature}")
        if not isinstance(self.top_k, (int, np.integer)) or self.top_k < 0:
            raise RuntimeInputError(f"top_k must be a non-negative int, got {self.top_k!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise RuntimeInputError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and (not isinstance(self.seed, (int, np.integer)) or self.seed < 0):
            raise RuntimeInputError(f"seed must be a non-negative int, got {self.seed!r}")
        if not (0.0 <= self.min_p <= 1.0):
            raise RuntimeInputError(f"min_p must be in [0, 1], got {self.min_p}")
        if not (np.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise RuntimeInputError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not np.isfinite(getattr(self, name)):
                raise RuntimeInputError(f"{name} must be a finite number, got {getattr(self, name)}")
        for tok, bias in self.logit_bias:
            if isinstance(tok, bool) or not isinstance(tok, (int, np.integer)) or tok < 0 or not np.isfinite(bias):
                raise RuntimeInputError(f"logit_bias entries must be (token id >= 0, finite bias), got "
                                        f"{(tok, bias)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def adjusts(self) -> bool:
        """Whether the logits are adjusted before selection (bias or a penalty): then a :class:`TokenPicker`."""
        return bool(self.logit_bias) or self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 \
            or self.frequency_penalty != 0.0

    def resolved(self) -> "SamplingParams":
        """The same parameters with a concrete seed (a fresh random one if ``seed`` is ``None``)."""
        if self.greedy or self.seed is not None:
            return self
        return dataclasses.replace(self, seed=secrets.randbits(63))


GREEDY = SamplingParams()
#: the sampling fields, in order: the one list the sampling options are named after (``qeff-kv generate``'s
#: ``--temperature ... --logit-bias``, a generate request, the serve defaults)
FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))
#: the fields a server default fills where a request leaves them out (``qeff-kv serve --temperature`` ...,
#: ``generation_config.json``; :mod:`qeff_kv.serve.engine.defaults`)
DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def probabilities(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution sampling draws from (float64, sums to 1), after temperature, top-k, top-p and min-p."""
    x = np.asarray(logits, dtype=np.float64).reshape(-1)
    if np.isnan(x).any() or np.isposinf(x).any():
        bad = int(np.count_nonzero(np.isnan(x) | np.isposinf(x)))
        raise RuntimeInputError(f"logits contain {bad} non-finite values; the graph produced NaN or inf")
    if np.isneginf(x).all():
        raise RuntimeInputError("every token is excluded (all logits are -inf)")
    with np.errstate(over="ignore"):
        scaled = x / params.temperature
    if np.isposinf(scaled).any():   # a temperature so small that logits / temperature overflow: the limit
        scaled = np.full_like(x, -np.inf)   # as it goes to 0, greedy's token (never NaN probabilities)
        scaled[int(np.argmax(x))] = 0.0
    x = scaled
    if params.top_k and params.top_k < x.size:
        kth = np.partition(x, -params.top_k)[-params.top_k]
        x = np.where(x >= kth, x, -np.inf)
    x = x - x.max()
    p = np.exp(x)
    p /= p.sum()
    if params.top_p < 1.0:
        mask = np.zeros_like(p, dtype=bool)
        mask[_nucleus(p, params.top_p)] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    if params.min_p > 0.0:
        p = np.where(p >= params.min_p * p.max(), p, 0.0)
        p /= p.sum()
    return p


def _nucleus(p: np.ndarray, top_p: float) -> np.ndarray:
    """The smallest prefix of the tokens in descending probability (a stable order: ties by lower id) whose mass
    reaches ``top_p``, always at least the most likely token. Sorting only the likeliest candidates (all tokens at
    or above the k-th largest probability, k growing until their mass reaches ``top_p``) gives exactly the prefix a
    sort of the whole vocabulary gives (the same order, the same sequential cumulative sums), without sorting it."""
    k = 64
    while True:
        if k >= p.size:
            order = np.argsort(-p, kind="stable")
        else:
            kth = np.partition(p, p.size - k)[p.size - k]
            cand = np.flatnonzero(p >= kth)
            order = cand[np.argsort(-p[cand], kind="stable")]
        cum = np.cumsum(p[order])
        if cum[-1] >= top_p or order.size == p.size:
            return order[:int(np.searchsorted(cum, top_p, side="left")) + 1]
        k *= 8


def _draw(p: np.ndarray, seed: int, position: int) -> int:
    rng = np.random.default_rng([int(seed), int(position)])
    u = rng.random()
    cum = np.cumsum(p)
    idx = int(np.searchsorted(cum, u * cum[-1], side="right"))
    idx = min(idx, p.size - 1)
    while p[idx] == 0.0 and idx > 0:  # never land on a token that was filtered out
        idx -= 1
    return idx


def select(row: np.ndarray, params: SamplingParams, position: int) -> int:
    """Stage 3 on an (adjusted) row: greedy argmax, or a seeded draw from :func:`probabilities`."""
    if params.greedy:
        if np.isnan(row).any():
            raise RuntimeInputError("logits contain NaN; the graph produced an invalid result")
        return int(np.argmax(row))
    if params.seed is None:
        raise RuntimeInputError("sampling needs a seed; call SamplingParams.resolved() first")
    return _draw(probabilities(row, params), params.seed, position)


def sample(logits: np.ndarray, params: SamplingParams, position: int, allowed: np.ndarray | None = None) -> int:
    """Pick one token id from a row of raw logits (``[vocab]``) for cache position ``position``: the fast path
    with nothing to adjust (parameters that adjust need a :class:`TokenPicker`); ``allowed`` (bool ``[vocab]``, a
    grammar's mask): only among those tokens."""
    if params.adjusts:
        raise RuntimeInputError("logit_bias and penalties need the token history: pick through a TokenPicker")
    if allowed is not None:
        return TokenPicker(params).pick(logits, position, allowed=allowed).token
    return select(np.asarray(logits).reshape(-1), params, position)


def log_softmax(row: np.ndarray) -> np.ndarray:
    x = np.asarray(row, dtype=np.float64).reshape(-1)
    m = x.max()
    return x - (m + np.log(np.exp(x - m).sum()))


@dataclass(frozen=True)
class Pick:
    """One selected token; with logprobs asked for, its logprob and the ``top`` alternatives
    (``((token id, logprob), ...)``, most likely first; ties by lower id)."""

    token: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()


def best_logprobs(lp: np.ndarray, k: int) -> tuple[tuple[int, float], ...]:
    """The ``k`` largest entries of ``lp`` (a logprob row), most likely first, ties by lower token id; never an
    excluded token (``-inf``: masked by a grammar): fewer than ``k`` when fewer may be chosen."""
    k = min(k, int(np.isfinite(lp).sum()))
    if k <= 0:
        return ()
    idx = np.argpartition(-lp, k - 1)[:k]
    idx = idx[np.lexsort((idx, -lp[idx]))]
    return tuple((int(i), float(lp[i])) for i in idx)


class TokenPicker:
    """One sequence's token selection: its :class:`SamplingParams` and the token history the penalties need.

    ``prompt``: the sequence's prompt ids (``repetition_penalty`` counts them). Call :meth:`pick` with each step's
    row of logits and :meth:`accept` with the token the sequence takes (a picked one, or any other: a handed-over
    or forced token). ``allowed`` in :meth:`pick`: a boolean mask over the vocabulary (a grammar's), or None.
    """

    def __init__(self, params: SamplingParams, prompt=(), vocab_size: int | None = None):
        self.params = params
        self._prompt = [int(t) for t in prompt]
        self._vocab = vocab_size
        self._counts: np.ndarray | None = None     # output token counts by id (presence/frequency)
        self._seen: np.ndarray | None = None       # prompt + output tokens by id (repetition)
        # the ids those hold, so that a penalty touches them only (not the whole vocabulary)
        self._seen_ids: list[int] = []
        self._out_ids: list[int] = []
        self._pending: list[int] = []              # accepted before the vocabulary size was known

    @property
    def plain(self) -> bool:
        """Nothing to adjust: :func:`sample` on the raw row gives the same token."""
        return not self.params.adjusts

    def accept(self, token: int) -> None:
        if self.plain:
            return
        if self._counts is None:
            self._pending.append(int(token))
            return
        if 0 <= token < self._counts.size:
            if not self._counts[token]:
                self._out_ids.append(int(token))
            if not self._seen[token]:
                self._seen_ids.append(int(token))
            self._counts[token] += 1
            self._seen[token] = True

    def _history(self, vocab: int) -> None:
        if self._counts is not None and self._counts.size == vocab:
            return
        self._counts = np.zeros(vocab, dtype=np.int64)
        self._seen = np.zeros(vocab, dtype=bool)
        prompt = np.unique(np.asarray([t for t in self._prompt if t < vocab], dtype=np.int64))
        self._seen[prompt] = True
        self._seen_ids, self._out_ids = prompt.tolist(), []
        for t in self._pending:
            self.accept(t)
        self._pending = []

    def adjusted(self, logits: np.ndarray, allowed: np.ndarray | None = None) -> np.ndarray:
        """Stage 1: a float64 copy of the row with bias, penalties and the ``allowed`` mask applied."""
        p = self.params
        x = np.array(logits, dtype=np.float64).reshape(-1)
        if p.logit_bias:
            ids = np.fromiter((t for t, _ in p.logit_bias), dtype=np.int64, count=len(p.logit_bias))
            vals = np.fromiter((b for _, b in p.logit_bias), dtype=np.float64, count=len(p.logit_bias))
            inside = ids < x.size
            x[ids[inside]] += vals[inside]
        if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty:
            self._history(x.size)
            if p.repetition_penalty != 1.0 and self._seen_ids:
                ids, r = np.asarray(self._seen_ids, dtype=np.int64), p.repetition_penalty
                v = x[ids]
                x[ids] = np.where(v > 0, v / r, v * r)
            if (p.presence_penalty or p.frequency_penalty) and self._out_ids:
                ids = np.asarray(self._out_ids, dtype=np.int64)
                c = self._counts[ids]
                x[ids] -= p.frequency_penalty * c + p.presence_penalty * (c > 0)
        if allowed is not None:
            mask = np.zeros(x.size, dtype=bool)
            mask[:min(x.size, allowed.size)] = allowed[:x.size]
            x[~mask] = -np.inf
        return x

    def pick(self, logits: np.ndarray, position: int, *, top_logprobs: int | None = None,
             allowed: np.ndarray | None = None) -> Pick:
        """Select the token for cache position ``position`` (stages 1-3); ``top_logprobs``: with logprobs (the
        chosen token's and that many alternatives; 0: the chosen token's only)."""
        if self.plain and allowed is None and top_logprobs is None:
            return Pick(sample(logits, self.params, position))
        x = self.adjusted(logits, allowed)
        if np.isnan(x).any():
            raise RuntimeInputError("logits contain NaN; the graph produced an invalid result")
        if np.isneginf(x).all():
            raise RuntimeInputError("every token is excluded (all logits are -inf)")
        tok = select(x, self.params, position)
        if top_logprobs is None:
            return Pick(tok)
        lp = log_softmax(x)
        return Pick(tok, float(lp[tok]), best_logprobs(lp, top_logprobs))
