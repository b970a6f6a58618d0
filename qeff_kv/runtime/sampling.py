"""Token selection: greedy, or sampling with temperature, top-k and top-p.

Randomness is a pure function of ``(seed, position)``, where ``position`` is the cache position the sampled
token will occupy. The same seed therefore gives the same tokens whether a sequence runs uninterrupted, is
rewound and re-decoded, or is saved in one process and continued in another.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import numpy as np

from ..errors import RuntimeInputError


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token.

    ``temperature == 0`` (the default) is greedy: the first index of the largest logit, exactly like
    ``argmax``. Otherwise logits are divided by ``temperature``, restricted to the ``top_k`` largest
    (``0``: no limit) and to the smallest set whose probability reaches ``top_p`` (``1.0``: no limit), and a
    token is drawn. With ``seed=None`` each :meth:`Session.generate` call draws a fresh random seed
    (:meth:`resolved`).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise RuntimeInputError(f"temperature must be >= 0, got {self.temperature}")
        if not isinstance(self.top_k, (int, np.integer)) or self.top_k < 0:
            raise RuntimeInputError(f"top_k must be a non-negative int, got {self.top_k!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise RuntimeInputError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and (not isinstance(self.seed, (int, np.integer)) or self.seed < 0):
            raise RuntimeInputError(f"seed must be a non-negative int, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def resolved(self) -> "SamplingParams":
        """The same parameters with a concrete seed (a fresh random one if ``seed`` is ``None``)."""
        if self.greedy or self.seed is not None:
            return self
        return SamplingParams(self.temperature, self.top_k, self.top_p, secrets.randbits(63))


GREEDY = SamplingParams()


def probabilities(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution sampling draws from (float64, sums to 1), after temperature, top-k and top-p."""
    x = np.asarray(logits, dtype=np.float64).reshape(-1)
    if not np.all(np.isfinite(x)):
        bad = int(np.count_nonzero(~np.isfinite(x)))
        raise RuntimeInputError(f"logits contain {bad} non-finite values; the graph produced NaN or inf")
    with np.errstate(over="ignore"):
        scaled = x / params.temperature
    if not np.all(np.isfinite(scaled)):   # a temperature so small that logits / temperature overflow: the limit
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
        order = np.argsort(-p, kind="stable")
        cum = np.cumsum(p[order])
        # keep the smallest prefix whose mass reaches top_p (always at least the most likely token)
        keep = int(np.searchsorted(cum, params.top_p, side="left")) + 1
        mask = np.zeros_like(p, dtype=bool)
        mask[order[:keep]] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    return p


def sample(logits: np.ndarray, params: SamplingParams, position: int) -> int:
    """Pick one token id from a row of logits (``[vocab]``) for cache position ``position``."""
    row = np.asarray(logits).reshape(-1)
    if params.greedy:
        if np.isnan(row).any():
            raise RuntimeInputError("logits contain NaN; the graph produced an invalid result")
        return int(np.argmax(row))
    if params.seed is None:
        raise RuntimeInputError("sampling needs a seed; call SamplingParams.resolved() first")
    p = probabilities(row, params)
    rng = np.random.default_rng([int(params.seed), int(position)])
    u = rng.random()
    cum = np.cumsum(p)
    idx = int(np.searchsorted(cum, u * cum[-1], side="right"))
    idx = min(idx, p.size - 1)
    while p[idx] == 0.0 and idx > 0:  # never land on a token that was filtered out
        idx -= 1
    return idx
