"""What a request's choices carry besides text: the sampling each choice runs with (request fields over the
server's defaults; OpenAI's ``n``: choice ``i`` of a seeded request uses ``seed + i``, so it gives the tokens a
request with that seed alone gives) and the ``logprobs`` objects of both routes.

Logprobs are read from the logits the token was selected from, after ``logit_bias`` and the penalties and before
temperature and the top-k / top-p / min-p truncation (:mod:`qeff_kv.runtime.decoding.sampling`); a token's ``token`` text
is its own decoded text (a token holding part of a UTF-8 character shows U+FFFD; ``bytes`` are that text's
UTF-8). Under a grammar they are the allowed tokens' (the row renormalised over them, the distribution the token
is drawn from), and ``top_logprobs`` lists allowed tokens only (fewer than asked when fewer are allowed). Every
number is finite JSON: a logprob below :data:`LOGPROB_FLOOR` (or ``-inf``) is shown as that floor (OpenAI's
-9999.0). Entries cover every token generated up to the one that completed a stop string (the stop string's text
is cut from the content, not its tokens from the logprobs); a stop token (eos) has none, as it has no text.
"""

from __future__ import annotations

import dataclasses

from qeff_kv.runtime.decoding.sampling import DEFAULTED, SamplingParams
from qeff_kv.serve.engine.defaults import SamplingDefaults
from qeff_kv.serve.wire.openai_io import Params

#: the smallest logprob shown (OpenAI's value for a token of no probability): JSON has no -Infinity
LOGPROB_FLOOR = -9999.0
#: seeds are 63-bit: choice i of seed s uses (s + i) mod 2**63
_SEED_SPACE = 2 ** 63


def sampling_of(p: Params, defaults: SamplingDefaults) -> SamplingParams:
    """The first choice's sampling: each field from the request, else the server's default."""
    def pick(name):
        v = getattr(p, name)
        return getattr(defaults, name) if v is None else v

    return SamplingParams(**{k: pick(k) for k in DEFAULTED}, seed=p.seed, presence_penalty=p.presence_penalty,
                          frequency_penalty=p.frequency_penalty, logit_bias=p.logit_bias)


def choice_samplings(first: SamplingParams, n: int) -> list[SamplingParams]:
    """``n`` choices: a seeded request's choice ``i`` uses ``seed + i``; an unseeded one's draw their own seeds."""
    if first.seed is None:
        return [first] * n
    return [dataclasses.replace(first, seed=(first.seed + i) % _SEED_SPACE) for i in range(n)]


def max_tokens_of(p: Params, defaults: SamplingDefaults) -> int | None:
    """What the request asks for: its ``max_tokens`` (0: echo, the prompt only), else the server's default; None:
    no limit asked. The engine decides the budget from it once (:func:`~qeff_kv.runtime.decoding.stopping.token_budget`)."""
    return p.max_tokens if p.max_tokens is not None else defaults.max_tokens


def _shown(logprob: float) -> float:
    """A logprob as JSON can carry it: at least :data:`LOGPROB_FLOOR` (NaN too)."""
    v = float(logprob)
    return v if v >= LOGPROB_FLOOR else LOGPROB_FLOOR


class TokenText:
    """Token ids as the text the logprobs show (cached per id)."""

    def __init__(self, tokenizer):
        self._tok = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        s = self._cache.get(token)
        if s is None:
            s = self._tok.decode([token], skip_special_tokens=False)
            if len(self._cache) < 200_000:
                self._cache[token] = s
        return s


class Logprobs:
    """One choice's logprob entries (from :class:`~.engine.TokenOut` events), shaped for chat or completions.
    :meth:`take` returns the entries gathered since the last call (a stream chunk's)."""

    def __init__(self, text: TokenText, chat: bool, offset: int = 0):
        self.text, self.chat = text, chat
        self._entries: list[tuple[int, float, tuple]] = []
        self._taken = 0
        self._offset = offset   # completions' text_offset: where the completion starts (after an echoed prompt)

    def add_prompt(self, entries) -> None:
        """Prompt tokens' entries (:class:`~.engine.PromptLogprobs`; the first token's logprob None)."""
        for t, lp, top in entries:
            self._entries.append((t, None if lp is None else _shown(lp), tuple((a, _shown(v)) for a, v in top)))

    def add(self, ev) -> None:
        if ev.logprob is not None:
            self._entries.append((ev.token, _shown(ev.logprob), tuple((t, _shown(v)) for t, v in ev.top)))

    def take(self) -> dict | None:
        part, self._taken = self._entries[self._taken:], len(self._entries)
        return self._shape(part)

    def all(self) -> dict:
        return self._shape(self._entries)

    def _shape(self, entries) -> dict:
        if self.chat:
            return {"content": [dict(self._chat_item(t, lp), top_logprobs=[self._chat_item(a, b) for a, b in top])
                                for t, lp, top in entries], "refusal": None}
        tokens = [self.text(t) for t, _, _ in entries]
        offsets = []
        for s in tokens:
            offsets.append(self._offset)
            self._offset += len(s)
        return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in entries],
                "top_logprobs": [None if lp is None else {self.text(a): b for a, b in top}
                                 for _, lp, top in entries],
                "text_offset": offsets}

    def _chat_item(self, token: int, logprob: float) -> dict:
        s = self.text(token)
        return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}
