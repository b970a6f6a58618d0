"""Speculative decoding in the server's decode turn (``qeff-kv serve --speculative lookup|DRAFT_DIR``).

The :class:`~.scheduler.Scheduler` owns the turn; a :class:`Speculation` is what it calls for the decode step
when one is configured (composition: the session has no speculative mode, the scheduler no drafting code).
Each running sequence has its own drafter (:class:`~qeff_kv.runtime.decoding.speculative.PromptLookup`, or a
:class:`~qeff_kv.runtime.decoding.speculative.DraftModel` sequence in the shared draft session), made by a
:class:`Drafting` source and released when the request ends.

One step, for every running sequence together:

1. each sequence drafts up to its current width (adaptive as in
   :class:`~qeff_kv.runtime.decoding.speculative.SpeculativeDecoder`), never more than what is left of its budget
   minus one (:func:`~qeff_kv.runtime.decoding.stopping.draft_limit`: a run never crosses the budget, the cut
   happens in the draft; the budget was decided within the context's room, so this caps the capacity too), and
   no row drafts past what the fullest row's room allows (every row writes the widest row's positions), through
   the same :func:`~qeff_kv.runtime.decoding.stopping.context_room`;
2. if nobody drafted, one plain decode step; else one verification step of the speculative graph
   (:func:`~qeff_kv.runtime.decoding.speculative.score_rows`: one row per sequence, padded to the widest);
3. each row keeps its drafts while they equal the pick of plain decoding (greedy or the seeded draw at that
   position), plus the first differing pick, stopping at a stop token
   (:func:`~qeff_kv.runtime.decoding.speculative.accept`); its rejected positions are rewound (``truncate``, O(1)).

The tokens are therefore those of plain decoding, request by request; the scheduler emits each accepted token as
its own event. Invariant after a step: each sequence's cache holds exactly the tokens fed (the previous token and
its accepted drafts) and its pending token is the last one returned.
"""

from __future__ import annotations

import json
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

from qeff_kv.errors import RuntimeInputError
from qeff_kv.runtime.decoding.sampling import sample
from qeff_kv.runtime.decoding.speculative import DraftModel, Drafter, PromptLookup, accept, drafts_per_step, score_rows
from qeff_kv.runtime.decoding.stopping import context_room, draft_limit


class Drafting(ABC):
    """Where each request's drafter comes from."""

    name: str

    @abstractmethod
    def drafter(self) -> Drafter:
        """A drafter for one new request."""

    def release(self, drafter: Drafter) -> None:
        """The request ended: free what its drafter holds."""

    def close(self) -> None:
        """The engine stops."""


class LookupDrafting(Drafting):
    """Prompt lookup: an n-gram index of each request's own text (nothing shared, nothing to free)."""

    name = "lookup"

    def drafter(self) -> Drafter:
        return PromptLookup()


class DraftModelDrafting(Drafting):
    """A draft export (a smaller model of the same tokenizer) in one session of its own, one sequence per
    request; it must hold as many sequences as the server runs at once."""

    name = "draft-model"

    def __init__(self, session):
        self.session = session

    def drafter(self) -> Drafter:
        return DraftModel(self.session)

    def release(self, drafter: Drafter) -> None:
        seq = getattr(drafter, "seq", None)
        if seq is not None and seq.alive:
            self.session.remove_sequence(seq)
        drafter.seq = None


def _tokenizer_vocab(folder: Path) -> object | None:
    """What decides token ids in ``folder/tokenizer.json`` (its model's vocabulary and merges, added tokens)."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        return None
    data = json.loads(path.read_text(encoding="utf-8"))
    return {"model": data.get("model"), "added": [(t.get("id"), t.get("content")) for t in
                                                  data.get("added_tokens") or []]}


def open_drafting(spec: str, target, *, threads: int | None = None) -> Drafting:
    """``"lookup"``, or the folder/``.onnx`` of a draft export checked against ``target`` (the target session):
    the same vocabulary size and the same tokenizer (``tokenizer.json``), ``target.max_sequences`` sequences."""
    if spec == "lookup":
        return LookupDrafting()
    from qeff_kv.runtime import Session
    from qeff_kv.runtime.model_files import resolve_model

    if not Path(spec).exists():
        raise RuntimeInputError(f"--speculative {spec!r}: neither 'lookup' nor an existing draft export "
                                "(folder or .onnx)")
    files = resolve_model(spec)
    mine, theirs = _tokenizer_vocab(target.files.folder), _tokenizer_vocab(files.folder)
    if theirs is None:
        raise RuntimeInputError(f"--speculative {spec}: the draft export has no tokenizer.json to compare with "
                                "the target's")
    if mine != theirs:
        raise RuntimeInputError(f"--speculative {spec}: the draft's tokenizer differs from the target's; use a "
                                "draft model of the same tokenizer")
    try:
        draft = Session(spec, max_sequences=target.max_sequences, threads=threads)
    except RuntimeInputError as exc:
        raise RuntimeInputError(f"--speculative {spec}: the draft cannot hold {target.max_sequences} sequences "
                                f"({exc})") from None
    if draft.vocab_size != target.vocab_size:
        raise RuntimeInputError(f"--speculative {spec}: the draft's vocabulary ({draft.vocab_size}) differs from "
                                f"the target's ({target.vocab_size}); use a draft model of the same tokenizer")
    return DraftModelDrafting(draft)


def refusal(session) -> str | None:
    """Why ``session`` cannot verify drafts in the server, or ``None``."""
    name = session.files.onnx_path.name
    if not session.speculative:
        return (f"--speculative: {name} is not a speculative-decoding graph (no num_logits_to_keep input); export "
                "it with --speculative-tokens K")
    if session.rings:
        return "--speculative: the graph has sliding-window ring buffers, which cannot rewind rejected drafts"
    if session.lockstep:
        return ("--speculative: the graph has no batch_index input, so several sequences run in lock step, which "
                "cannot verify drafts; export with --continuous-batching or serve --max-sequences 1")
    if session.fixed_seq_len is not None:
        return f"--speculative: the graph fixes seq_len={session.fixed_seq_len}; a verification step needs it symbolic"
    return None


@dataclass(eq=False)
class _Track:
    drafter: Drafter
    width: int


@dataclass
class Row:
    """One running sequence in a step: its key (the scheduler's request), sequence, token to feed, resolved
    sampling, tokens left in its budget (>= 1) and stop tokens."""

    key: object
    seq: object
    last: int
    params: object
    left: int
    stops: frozenset


class Speculation:
    """The decode step with drafts (see the module docstring). ``k``: drafts per sequence and step (default and
    maximum: the graph's ``K``); ``adaptive``: the width follows the hits (+2 after all accepted, -1 after a
    rejection, between 1 and ``k``)."""

    def __init__(self, session, drafting: Drafting, *, k: int | None = None, adaptive: bool = True):
        why = refusal(session)
        if why is not None:
            raise RuntimeInputError(why)
        graph_k = session.speculative_tokens
        if graph_k is not None and k is not None and (isinstance(k, bool) or not isinstance(k, int)
                                                      or not 1 <= k <= graph_k):
            raise RuntimeInputError(f"k must be an int in [1, {graph_k}] (the graph's speculative_tokens), got {k!r}")
        k = drafts_per_step(session, k)   # a graph that records no K (the peer's) takes --speculative-k
        self.session, self.drafting, self.k, self.adaptive = session, drafting, k, adaptive
        self._tracks: dict[object, _Track] = {}
        self._lock = threading.Lock()
        self.counts = {"speculative_drafted": 0, "speculative_accepted": 0, "speculative_verifications": 0}

    def release(self, key) -> None:
        track = self._tracks.pop(key, None)
        if track is not None:
            self.drafting.release(track.drafter)

    def close(self) -> None:
        for key in list(self._tracks):
            self.release(key)
        self.drafting.close()

    def stats(self) -> dict:
        with self._lock:
            return dict(self.counts)

    def step(self, rows: list[Row]) -> list[list[int]]:
        """One step for ``rows``: the tokens each produces (at least one; at most its ``left``; a stop token only
        last)."""
        s = self.session
        drafts: list[list[int]] = []
        for r in rows:
            track = self._tracks.get(r.key)
            if track is None:
                track = self._tracks[r.key] = _Track(self.drafting.drafter(), self.k)
            # the budget left holds the context's room (it was decided within it): draft_limit caps both
            k = min(track.width, draft_limit(r.left))
            drafts.append(track.drafter.draft(r.seq.tokens + [r.last], k)[:k] if k > 0 else [])
        # every row writes the widest row's positions (padding): stay inside each row's capacity, the room of the
        # row with the least (its pending token fed first)
        most = min(draft_limit(context_room(s.ctx_len, r.seq.length + 1)) for r in rows)
        drafts = [d[:most] for d in drafts]
        if not any(drafts):
            out = s.decode([(r.seq, r.last) for r in rows])
            return [[sample(out[r.seq], r.params, r.seq.length)] for r in rows]
        bases = [r.seq.length + 1 for r in rows]
        logits = score_rows(s, [(r.seq, [r.last] + d) for r, d in zip(rows, drafts)])
        result = []
        drafted = accepted_total = 0
        for r, d, base, lg in zip(rows, drafts, bases, logits):
            emitted = accept(lg, d, r.params, base, r.stops)
            accepted = len(emitted) - 1
            if r.seq.length != base + accepted:
                s.truncate(r.seq, base + accepted)     # O(1): drop the rejected drafts' positions
            if d:
                track = self._tracks[r.key]
                track.drafter.feedback(len(d), accepted)
                if self.adaptive:
                    track.width = min(self.k, track.width + 2) if accepted == len(d) else max(1, track.width - 1)
                drafted += len(d)
                accepted_total += accepted
            result.append(emitted)
        with self._lock:
            self.counts["speculative_drafted"] += drafted
            self.counts["speculative_accepted"] += accepted_total
            self.counts["speculative_verifications"] += 1
        return result
