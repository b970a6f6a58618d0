"""Speculative decoding over a :class:`~qeff_kv.runtime.session.Session` of a speculative-decoding graph
(exported with ``--speculative-tokens K``: a ``num_logits_to_keep`` input, QEfficient's "target language model").

Each step a *drafter* proposes up to ``K`` tokens that may follow the text so far; :func:`score` feeds the pending
token and the drafts in one graph step and gets the logits after each of them; the draft tokens are accepted while
each equals the token the runtime's own selection (:func:`~qeff_kv.runtime.decoding.sampling.sample`, greedy or seeded)
picks from those logits, the first differing pick is kept as the correction, and the rejected drafts are rewound
in O(1) (:meth:`Session.truncate`: only the valid length moves). Selection is a pure function of (logits, seed,
position), so the output is the output of plain decoding: the same tokens, in fewer graph steps when drafts hit.
(Exactly so up to floating point: a step over several rows sums in another order than one over one row, which
could flip a near-tie; the tests and the benchmark compare token for token.)

Drafters (:class:`Drafter`):

* :class:`PromptLookup`: n-gram match of the text's last tokens against the prompt and the text so far (no
  second model); backs off (drafts nothing for a growing number of steps) after drafts that miss, so free text
  runs at about plain decoding speed;
* :class:`DraftModel`: a smaller model of the same tokenizer (an export of its own, its own Session) decoding
  greedily ahead; its cache follows the accepted text (rewound to the longest common prefix each step).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable, Protocol, Sequence as Seq

import numpy as np

from qeff_kv.contract import naming
from qeff_kv.errors import RuntimeInputError
from qeff_kv.runtime.arguments import check_tokens
from qeff_kv.runtime.multimodal import positions as pos_mod
from qeff_kv.runtime.memory.hybrid import Sequence
from qeff_kv.runtime.results import Generation
from qeff_kv.runtime.decoding.sampling import GREEDY, SamplingParams, sample
from qeff_kv.runtime.decoding.stopping import (DEFAULT_MAX_TOKENS, asked_tokens, check_asked, check_stop,
                                                context_room, draft_limit)


def score(session, seq: Sequence, tokens: Seq[int]) -> np.ndarray:
    """Feed ``tokens`` to ``seq`` in one step (positions ``[length, length + n)``) and return the logits after
    each of them, ``[n, vocab]``: the verification step of speculative decoding. Needs a speculative-decoding
    graph (``num_logits_to_keep``) for ``n > 1``."""
    return score_rows(session, [(seq, tokens)])[0]


def score_rows(session, feeds: Seq[tuple[Sequence, Seq[int]]]) -> list[np.ndarray]:
    """:func:`score` for several sequences in one step (a graph with ``batch_index``: one row each).

    Row ``i`` feeds its ``n_i`` tokens at positions ``[length_i, length_i + n_i)``; rows shorter than the widest
    ``W`` are padded (their last token again, at the following positions, up to ``length_i + W``: writes past the
    valid length that nothing reads, since the mask is causal, and the next real token overwrites). Returns each
    row's logits ``[n_i, vocab]``; each sequence's length grows by its ``n_i``."""
    if not feeds:
        return []
    seqs = [session.cache.get(s) for s, _ in feeds]
    toks = [check_tokens(t, session.vocab_size) for _, t in feeds]
    if len({s.id for s in seqs}) != len(seqs):
        raise RuntimeInputError("a sequence appears twice in one verification step")
    width = max(len(t) for t in toks)
    if min(len(t) for t in toks) == 0:
        raise RuntimeInputError("score needs at least one token")
    for seq in seqs:
        if seq.length == 0:
            raise RuntimeInputError(f"sequence {seq.id} is empty: prefill it first")
    if width > 1 and not session.speculative:
        raise RuntimeInputError("the graph returns one row of logits per step (no num_logits_to_keep input); "
                                "export it with --speculative-tokens K to verify drafted tokens")
    if session.lockstep or session.fixed_seq_len is not None:
        raise RuntimeInputError("speculative decoding needs a graph with a symbolic seq_len run one sequence "
                                "per step (not lock step)")
    if len(seqs) > 1 and not session.continuous_batching:
        raise RuntimeInputError("a graph without batch_index verifies one sequence per step")
    session.cache.check_room(seqs, width)    # padding included: every row writes W positions
    t0 = time.perf_counter()
    rows = len(seqs)
    arrays = session.binding.bind_small(rows, width, width)
    ids = arrays["input_ids"]
    for r, (seq, t) in enumerate(zip(seqs, toks)):
        ids[r, :len(t)] = t
        ids[r, len(t):] = t[-1]
        pos_mod.write(arrays["position_ids"], r, seq.length, width, delta=pos_mod.delta(seq.rope_marks))
        if session.continuous_batching:
            arrays["batch_index"][r, 0] = seq.slot
    session.binding.adapt_rows(arrays, enumerate(seqs))   # row r: seqs[r] (never lock step, refused above)
    needed = max(s.length for s in seqs) + width
    if width > 1:
        out = session.binding.run(rows, width, np.full(rows, width - 1), needed=needed, keep=width)
    else:
        out = session.binding.run(rows, 1, np.zeros(rows, np.int64), needed=needed)[:, None, :]
    result = []
    for r, (seq, t) in enumerate(zip(seqs, toks)):
        n = len(t)
        seq.length += n
        session.cache.positional.wrote(seq, seq.length)
        seq.tokens.extend(t)
        seq.pending = None
        seq.pending_emitted = False
        result.append(out[r, :n])
    session.timings.decode_s += time.perf_counter() - t0
    session.timings.decode_steps += 1
    return result


def accept(rows: np.ndarray, draft: Seq[int], params: SamplingParams, base: int,
           stops: Iterable[int] = ()) -> list[int]:
    """The tokens a verification step gives: ``rows[i]`` are the logits after the pending token and ``draft[:i]``
    (position ``base + i``); drafts are taken while each equals the pick of :func:`sample` there, and the first
    differing pick (or the pick after the last draft) ends the run; so does a stop token. Every returned token
    is what plain decoding would have picked; ``len(result) - 1`` drafts were accepted."""
    stops = set(stops)
    emitted: list[int] = []
    for i in range(len(draft) + 1):
        y = sample(rows[i], params, base + i)
        emitted.append(y)
        if i == len(draft) or y != draft[i] or y in stops:
            break
    return emitted


# ============================================================================================ drafters
class Drafter(Protocol):
    """Proposes tokens that may follow ``context`` (every token of the text so far, the pending one last)."""

    name: str

    def draft(self, context: list[int], k: int) -> list[int]: ...

    def feedback(self, proposed: int, accepted: int) -> None: ...


class PromptLookup:
    """Draft by n-gram lookup: the text's last ``n`` tokens (``max_ngram`` down to ``min_ngram``) are looked up
    in the prompt and the text so far; the tokens that followed their latest earlier occurrence are the draft.

    Back-off: after ``patience`` drafts in a row with nothing accepted it drafts nothing for 2, 4, ... up to
    ``max_pause`` steps (plain decode steps); any accepted draft resets it."""

    name = "lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, patience: int = 2, max_pause: int = 16):
        if not 1 <= min_ngram <= max_ngram:
            raise RuntimeInputError(f"n-gram sizes must satisfy 1 <= min_ngram <= max_ngram, got {min_ngram}, "
                                    f"{max_ngram}")
        self.max_ngram, self.min_ngram, self.patience, self.max_pause = max_ngram, min_ngram, patience, max_pause
        self._index: dict[tuple[int, ...], int] = {}   # n-gram -> where its latest continuation starts
        self._text: list[int] = []
        self._misses = 0
        self._pause = 0

    def _update(self, context: list[int]) -> None:
        done = len(self._text)
        if context[:done] != self._text:   # another text: start over
            self._index.clear()
            done = 0
        self._text = list(context)
        # index every n-gram ending at j < len - 1 (its continuation starts at j + 1); later ones overwrite
        for j in range(max(0, done - 1), len(context) - 1):
            for n in range(self.min_ngram, self.max_ngram + 1):
                if j - n + 1 >= 0:
                    self._index[tuple(context[j - n + 1:j + 1])] = j + 1

    def draft(self, context: list[int], k: int) -> list[int]:
        self._update(context)
        if self._pause > 0:
            self._pause -= 1
            return []
        for n in range(min(self.max_ngram, len(context)), self.min_ngram - 1, -1):
            start = self._index.get(tuple(context[-n:]))
            if start is not None:
                return list(context[start:start + k])
        return []

    def feedback(self, proposed: int, accepted: int) -> None:
        if proposed == 0:
            return
        if accepted > 0:
            self._misses = 0
            return
        self._misses += 1
        if self._misses >= self.patience:
            self._pause = min(2 ** (self._misses - self.patience + 1), self.max_pause)


class DraftModel:
    """Draft with a smaller model of the same tokenizer: its own :class:`Session` (any retained-state graph,
    e.g. an export of a model with fewer layers), decoding greedily ahead of the text."""

    name = "draft-model"

    def __init__(self, session):
        self.session = session
        self.seq: Sequence | None = None

    def draft(self, context: list[int], k: int) -> list[int]:
        s = self.session
        if self.seq is None:
            self.seq = s.add_sequence()
        have = self.seq.tokens
        common = 0
        limit = min(len(have), len(context) - 1)   # the last token is fed again: its logits are the next draft's
        while common < limit and have[common] == context[common]:
            common += 1
        if common < self.seq.length:
            s.truncate(self.seq, common)
        k = min(k, context_room(s.ctx_len, len(context)))
        if k <= 0:
            return []
        logits = s.prefill(self.seq, context[common:])
        out: list[int] = []
        for i in range(k):
            out.append(int(np.argmax(logits)))
            if i + 1 < k:
                logits = s.decode({self.seq: out[-1]})[self.seq]
        return out

    def feedback(self, proposed: int, accepted: int) -> None:
        pass


# ============================================================================================ the loop
@dataclass
class SpeculativeStats:
    """What a speculative run did: verification steps, drafted and accepted tokens, decode wall time."""

    drafter: str
    steps: int = 0               # graph steps after the prompt (verifications and plain decode steps)
    verifications: int = 0       # steps that carried drafts
    drafted: int = 0
    accepted: int = 0
    decode_tokens: int = 0       # tokens produced after the first (as Timings.decode_tokens)
    decode_s: float = 0.0        # wall time after the prompt, drafting included
    draft_s: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def to_json(self) -> dict:
        return {"drafter": self.drafter, "steps": self.steps, "verifications": self.verifications,
                "drafted": self.drafted, "accepted": self.accepted,
                "acceptance_rate": round(self.acceptance_rate, 4), "decode_tokens": self.decode_tokens,
                "decode_s": round(self.decode_s, 6), "draft_s": round(self.draft_s, 6),
                "decode_tokens_per_s": round(self.decode_tokens / self.decode_s, 3) if self.decode_s > 0 else 0.0}


def drafts_per_step(session, k) -> int:
    """``K``, the drafts per verification step on ``session``'s speculative-decoding graph, validated against what
    the graph accepts: ``k`` when given (a positive int), else the graph's recorded ``K`` (metadata or manifest); a
    graph that records none (the peer's target graphs) needs ``k``. A recorded ``K`` bounds it; a graph that
    records none takes any ``K`` whose ``K + 1`` tokens fit a prefill chunk (its ``num_logits_to_keep`` and
    ``seq_len`` axes are symbolic: the peer compiles ``K + 1`` up to the prefill length) and the capacity. A
    static ``num_logits_to_keep`` axis is refused: a step keeps as many rows as it feeds, fewer near the end."""
    graph_k = session.speculative_tokens
    if k is None:
        if graph_k is None:
            raise RuntimeInputError(f"{session.files.onnx_path.name} records no K (speculative_tokens); give "
                                    "--speculative-k K (drafts per step)")
        k = graph_k
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise RuntimeInputError(f"k must be a positive int, got {k!r}")
    keep = session.layout.input(naming.LOGITS_TO_KEEP_INPUT)
    rows = (keep.shape or (None,))[0] if keep is not None else None
    if isinstance(rows, int):
        raise RuntimeInputError(f"the graph fixes {naming.LOGITS_TO_KEEP_INPUT} at {rows} rows; speculative "
                                "decoding keeps as many rows as a step feeds (1 to K+1): it needs the axis symbolic")
    if graph_k is not None and k > graph_k:
        raise RuntimeInputError(f"k={k} drafts exceed the graph's speculative_tokens={graph_k}")
    if graph_k is None and k + 1 > session.prefill_seq_len:
        raise RuntimeInputError(f"k={k}: a verification step of {k + 1} tokens exceeds the prefill length "
                                f"{session.prefill_seq_len}, the most the graph is run with; give a smaller K or a "
                                "larger --prefill-seq-len")
    if k + 1 >= session.ctx_len:
        raise RuntimeInputError(f"k={k}: a verification step of {k + 1} tokens does not fit ctx_len={session.ctx_len}")
    return int(k)


@dataclass
class SpeculativeDecoder:
    """Generate with ``session`` (a speculative-decoding graph) and ``drafter``; ``k``: drafts per step (default
    and maximum: the graph's ``K``). ``adaptive``: the draft length follows the hits (up by 2 after a step whose
    drafts were all accepted, down by 1 after one with a rejection, between 1 and ``k``), so the verification steps
    of text where drafts miss stay short."""

    session: object
    drafter: Drafter
    k: int | None = None
    adaptive: bool = True
    stats: SpeculativeStats = field(init=False)

    def __post_init__(self) -> None:
        s = self.session
        if not s.speculative:
            raise RuntimeInputError(f"{s.files.onnx_path.name} is not a speculative-decoding graph (no "
                                    "num_logits_to_keep input); export it with --speculative-tokens K")
        if s.rings:
            raise RuntimeInputError("speculative decoding rewinds rejected drafts, which sliding-window ring "
                                    "buffers cannot serve; export with --sliding-cache full")
        if s.recurrent:
            raise RuntimeInputError("speculative decoding rewinds rejected drafts, which a recurrent state can do "
                                    "only to a checkpoint; not supported on recurrent or hybrid graphs")
        self.k = drafts_per_step(s, self.k)
        if isinstance(self.drafter, DraftModel):
            dv, tv = self.drafter.session.vocab_size, s.vocab_size
            if dv is not None and tv is not None and dv != tv:
                raise RuntimeInputError(f"the draft model's vocabulary ({dv}) differs from the target's ({tv}); "
                                        "use a draft model of the same tokenizer")
        self.stats = SpeculativeStats(self.drafter.name)

    def generate(self, prompt: Seq[int], *, max_tokens: int = DEFAULT_MAX_TOKENS,
                 sampling: SamplingParams | None = None, stop_tokens: Iterable[int] | None = None,
                 max_new_tokens: int | None = None, adapter: str | None = None,
                 lora_scale: float = 1.0) -> Generation:
        """The tokens plain :meth:`Session.generate` would give for ``prompt`` (a new sequence, running with LoRA
        ``adapter`` at ``lora_scale`` when given), decoded speculatively; :attr:`stats` says how.
        ``max_new_tokens``: the deprecated name of ``max_tokens``."""
        s = self.session
        max_tokens = check_asked(asked_tokens(max_tokens, max_new_tokens), least=1)
        if sampling is not None and not isinstance(sampling, SamplingParams):
            raise RuntimeInputError(f"sampling must be a SamplingParams or None, got {sampling!r}")
        params = (sampling or GREEDY).resolved()
        toks = check_tokens(prompt, s.vocab_size)
        if not toks:
            raise RuntimeInputError("a prompt is empty; give at least one token")
        stops = set(check_tokens(stop_tokens if stop_tokens is not None else s.eos_token_ids, s.vocab_size))
        if max_tokens > context_room(s.ctx_len, len(toks)):   # the prompt is fed, its first new token not
            raise RuntimeInputError(f"{len(toks)} prompt + {max_tokens} new tokens need {len(toks) + max_tokens - 1} "
                                    f"positions; the capacity is ctx_len={s.ctx_len}")
        seq = s.add_sequence(adapter, lora_scale)
        self.stats = stats = SpeculativeStats(self.drafter.name)
        gen = Generation(seq, [], len(toks))
        tok = sample(s.prefill(seq, toks), params, seq.length)
        gen.tokens.append(tok)
        t0 = time.perf_counter()
        width = self.k                             # the draft length now (adaptive)
        while check_stop(tok, len(gen.tokens), max_tokens, stops) is None:
            k = min(width, draft_limit(max_tokens - len(gen.tokens)))
            t_draft = time.perf_counter()
            draft = self.drafter.draft(seq.tokens + [tok], k)[:k] if k > 0 else []
            stats.draft_s += time.perf_counter() - t_draft
            stats.steps += 1
            if not draft:
                tok = sample(s.decode({seq: tok})[seq], params, seq.length)
                gen.tokens.append(tok)
                continue
            base = seq.length + 1                  # where the first token after ``tok`` goes
            emitted = accept(score(s, seq, [tok] + draft), draft, params, base, stops)
            accepted = len(emitted) - 1            # drafts kept (they equal emitted[:-1])
            s.truncate(seq, base + accepted)       # O(1): drop the rejected drafts' positions
            self.drafter.feedback(len(draft), accepted)
            if self.adaptive:
                width = min(self.k, width + 2) if accepted == len(draft) else max(1, width - 1)
            stats.verifications += 1
            stats.drafted += len(draft)
            stats.accepted += accepted
            gen.tokens.extend(emitted)
            tok = emitted[-1]
        stats.decode_s = time.perf_counter() - t0
        stats.decode_tokens = len(gen.tokens) - 1
        s.timings.decode_tokens += stats.decode_tokens
        seq.pending, seq.pending_emitted = tok, True
        gen.finish_reason = check_stop(tok, len(gen.tokens), max_tokens, stops)
        return gen

