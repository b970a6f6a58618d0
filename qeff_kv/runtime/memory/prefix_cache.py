"""The prefix cache: where prompt reuse is decided, over one :class:`~qeff_kv.runtime.Session`'s memory.

vLLM v1's shape (``kv_cache_manager.get_computed_blocks``): the scheduler only *asks*. A finished sequence is
not destroyed: it is **kept** in its slot, with its tokens, least recently used first out when a slot is needed.
A new prompt asks :meth:`PrefixCache.lookup` which sequence (kept, or one of the ``running`` sequences the caller
names) shares its longest prefix, then :meth:`PrefixCache.acquire` the sequence to prefill the rest into:

* **Lookup rules.** At most ``len(prompt) - 1`` tokens are reused (the last prompt token is always fed: its logits
  give the first token); the prefix ends where the source can return to (``Session.reusable``: any position of a
  positional cache, a checkpoint of a recurrent or hybrid sequence's state, llama.cpp's server rule); fewer than
  :data:`MIN_REUSE` tokens are not worth a slot (a shared BOS token alone).
* **Acquire.** When the source must stay (it is running, or kept and longer than the prefix) and a slot can be
  had (a free one, or another kept sequence's, evicted least recently used first), the prefix is **copied** into
  it (``Session.copy``); else a kept source is **truncated** to the prefix and continued in its slot; else the
  prompt starts from scratch in a fresh slot. Ring buffers that cannot serve the prefix refuse the copy or the
  rewind (a :class:`~qeff_kv.errors.QeffKvError`): the prompt is then prefilled whole, in the slot taken.
* **Placement on a lock-step session** (:attr:`PrefixCache.low_rows`): a step runs every row up to the highest
  one fed, and a kept row below a running one costs a row of every step (its attention over its whole length: a
  stream in slot 7 above seven kept 1000-token sequences steps at 27.5 ms, in slot 0 at 5.9 ms, SmolLM2-135M int4).
  So a new sequence takes the lowest slot no sequence in use holds: a kept sequence there moves to the highest free
  slot; and :meth:`PrefixCache.lower` moves a running sequence down into the lowest row no request holds, a kept
  sequence there taking its row in exchange (the scheduler asks for the top row's sequence before each step). Both
  are ``Session.relocate``: the same sequences, their rows moved, so nothing else (tokens, pending tokens, the LRU
  order, the listener) changes. Continuous batching runs only the rows fed: nothing moves there.
* **Capabilities**, decided once, here (:attr:`PrefixCache.copies`): a session always has the verbs
  (``reusable``, ``copy``, ``truncate``); what a memory kind cannot do for given positions is a refusal of the verb
  (a :class:`~qeff_kv.errors.QeffKvError`). A session whose ``copy`` is ``None`` (a memory without the verb)
  reuses by truncating in place only, and forks of OpenAI's ``n`` prefill instead of copying.

* **Exact reuse** (``align``, the serve engine's ``--deterministic``): a reused prefix must hold the bytes a fresh
  prefill of the new prompt would write, and the rest must be fed in the chunks a fresh prefill runs. Only
  positions a prompt's whole prefill chunks wrote qualify (:meth:`held` records ``length // align * align``, ``align``
  the prefill length; decode steps, a prompt's last partial chunk, a scored or handed-off prompt do not), and the
  reuse length is rounded down to a whole number of prefill lengths: the chunks after it are the fresh run's.
* **LoRA adapters** (docs/lora.md): a sequence's KV was computed with its adapter and scale (``Sequence.adapter``,
  ``Sequence.lora_scale``), so prompts are reused only between sequences of one adapter at one scale: every
  question and :meth:`fresh` take the ``lora`` key of the prompt (:func:`lora_of`: ``(adapter, scale)``, ``None`` for
  the base model) and only sources of that key are looked at; a new sequence runs with it.

Nothing is changed by :meth:`lookup` or :meth:`longest_prefix` (what a router asks a replica). Every sequence the
cache's user destroys goes through :meth:`remove` (or :meth:`release`), so that a :class:`CacheListener` (the KV
events publisher, :mod:`qeff_kv.serve.cluster.kv_events`) is told what every sequence holds: ``holds(key, tokens)`` when a
sequence's prompt is prefilled (:meth:`held`), kept, truncated or removed (``tokens`` empty), with ``lora=(adapter,
scale)`` for a sequence of an adapter; ``clear()`` when every kept sequence is dropped at once.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence as Seq
from typing import Optional, Protocol

from qeff_kv.errors import QeffKvError
from qeff_kv.runtime.memory.hybrid import Sequence

#: shortest common prefix worth reusing (a kept sequence sharing only a BOS token is not worth a slot)
MIN_REUSE = 2

#: the adapter a sequence's KV was computed with: ``(adapter name, scale)``, ``None`` for the base model
LoraKey = Optional[tuple[str, float]]


def lora_of(seq) -> LoraKey:
    """``seq``'s :data:`LoraKey`: its adapter and scale, ``None`` for the base model."""
    name = getattr(seq, "adapter", None)
    return None if name is None else (name, float(seq.lora_scale))


class CacheListener(Protocol):
    """Told what the session's sequences hold (the KV events publisher diffs blocks from it)."""

    def holds(self, key: int, tokens: Seq[int]) -> None:
        """Sequence ``key`` now holds exactly ``tokens`` at positions ``[0, len(tokens))`` (empty: nothing). A
        sequence of a LoRA adapter is told with ``lora=(adapter, scale)`` too (a listener of adapters takes it)."""

    def clear(self) -> None:
        """No sequence holds anything any more."""


def common_prefix(a: Seq[int], b: Seq[int], limit: int) -> int:
    """How many leading tokens ``a`` and ``b`` share, at most ``limit``."""
    n = min(len(a), len(b), limit)
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    """Kept sequences (LRU) and the prompt-reuse decision over ``session`` (see the module docstring).

    Args:
        session: the :class:`~qeff_kv.runtime.Session` whose sequences it keeps; the cache's user is its only user.
        reuse: keep finished sequences and start prompts from them (False: :meth:`release` destroys, nothing is
            reused, :meth:`lookup` finds nothing).
        listener: a :class:`CacheListener` told what sequences hold, or None.
        align: exact reuse in whole prefill lengths of ``align`` tokens (the module docstring), or None.
    """

    def __init__(self, session, *, reuse: bool = True, listener: CacheListener | None = None,
                 align: int | None = None):
        self.session = session
        self.reuse = reuse
        self.listener = listener
        self.align = align
        #: with ``align``: sequence id -> the positions whole prefill chunks wrote (what may be reused exactly)
        self._exact: dict[int, int] = {}
        self._kept: collections.OrderedDict[int, Sequence] = collections.OrderedDict()   # LRU first
        #: whether the session copies sequences (its ``copy`` verb is set): decided once, for every user
        self.copies = callable(session.copy)
        #: new sequences take the lowest rows (kept ones move up): a lock-step step runs every row up to the
        #: highest one fed, so a kept row below a running one costs a row of every step
        self.low_rows = bool(session.lockstep)
        #: prompt tokens :meth:`acquire` handed out as already held (not prefilled again)
        self.reused_tokens = 0

    # ------------------------------------------------------------------------------------ views
    @property
    def kept(self) -> tuple[Sequence, ...]:
        """The kept sequences, least recently used first."""
        return tuple(self._kept.values())

    def __len__(self) -> int:
        return len(self._kept)

    def __contains__(self, seq) -> bool:
        return isinstance(seq, Sequence) and self._kept.get(seq.id) is seq

    def in_slot(self, slot: int) -> Sequence | None:
        """The kept sequence in ``slot``, or None."""
        return next((s for s in self._kept.values() if s.slot == slot), None)

    def available(self) -> int:
        """Slots a new sequence can have: free ones and those of kept sequences."""
        return len(self.session.cache.free_slots()) + len(self._kept)

    # ------------------------------------------------------------------------------------ questions
    def lookup(self, prompt: Seq[int], running: Iterable[Sequence] = (),
               lora: LoraKey = None) -> tuple[Sequence | None, int]:
        """The sequence (kept, or one of ``running``) of adapter key ``lora`` sharing the longest reusable prefix of
        ``prompt`` and that prefix's length, or ``(None, 0)``: at most ``len(prompt) - 1`` tokens, ending where the
        source can return to (``Session.reusable``), at least :data:`MIN_REUSE`. Changes nothing."""
        limit = len(prompt) - 1
        best, best_n = None, 0
        if not self.reuse or limit < MIN_REUSE:
            return None, 0
        for s in list(self._kept.values()) + list(running):
            if lora_of(s) != lora:   # another adapter (or scale): other KV for the same tokens
                continue
            n = common_prefix(s.tokens, prompt, limit)
            if self.align:
                n = min(n, self._exact.get(s.id, 0)) // self.align * self.align
            if n:
                n = self.session.reusable(s, n)
            if n > best_n:
                best, best_n = s, n
        return (best, best_n) if best_n >= MIN_REUSE else (None, 0)

    def longest_prefix(self, prompt: Seq[int], running: Iterable[Sequence] = (), lora: LoraKey = None) -> int:
        """How many leading tokens of ``prompt`` a kept (or ``running``) sequence of adapter key ``lora`` can give
        (the rules of :meth:`lookup`); changes nothing (what a router asks a replica)."""
        return self.lookup(prompt, running, lora)[1]

    # ------------------------------------------------------------------------------------ taking a slot
    def make_room(self) -> None:
        """A free slot: the least recently used kept sequence is evicted when there is none."""
        if not self.session.cache.free_slots() and self._kept:
            self.evict()

    def fresh(self, lora: LoraKey = None) -> Sequence:
        """A new empty sequence running with adapter key ``lora`` (``None``: the base model): in a free slot, else
        in the slot of the least recently used kept sequence. On a lock-step session the new sequence takes the
        lowest slot that no sequence in use holds (see :meth:`_lowest_for_new`)."""
        if lora is not None:
            self.session.lora.get(lora[0])   # an adapter not loaded: refused before any kept sequence is evicted
        self.make_room()
        if self.low_rows:
            self._lowest_for_new()
        if lora is None:
            return self.session.add_sequence()
        return self.session.add_sequence(adapter=lora[0], lora_scale=lora[1])

    def _lowest_for_new(self) -> None:
        """Lock step runs every row up to the highest one fed, kept rows below included (each attends over its
        whole length): so a kept sequence below the lowest free slot moves to the highest free slot
        (``Session.relocate``: the same sequence, its rows moved), and the new sequence takes the slot it leaves.
        Nothing moves on a refusal (the new sequence then takes the lowest free slot)."""
        free = self.session.cache.free_slots()
        below = [k for k in self._kept.values() if free and k.slot < free[0]]
        if below:
            self._relocate(min(below, key=lambda k: k.slot), free[-1])

    def lower(self, seq: Sequence) -> None:
        """Move ``seq``, a sequence in use on a lock-step session, into the lowest slot below it that no other
        sequence in use holds: a free one, or a kept sequence's, which then takes ``seq``'s row in exchange
        (``Session.relocate``: both stay the same sequences, with their tokens, pending tokens and LRU places).
        Nothing moves when no such slot exists, off lock step, or on a refusal."""
        if not self.low_rows:
            return
        open_slots = set(self.session.cache.free_slots()) | {k.slot for k in self._kept.values()}
        target = min((s for s in open_slots if s < seq.slot), default=None)
        if target is not None:
            self._relocate(seq, target)

    def _relocate(self, seq: Sequence, slot: int) -> None:
        try:
            self.session.relocate(seq, slot)
        except QeffKvError:   # a memory that cannot move its rows: everything stays where it is
            pass

    def acquire(self, prompt: Seq[int], running: Iterable[Sequence] = (),
                lora: LoraKey = None) -> tuple[Sequence, int]:
        """The sequence (of adapter key ``lora``) to prefill ``prompt`` into and how many of its leading tokens it
        already holds (copied from a source that stays, the truncated kept source itself, or 0 in a fresh slot);
        see the module docstring."""
        best, n = self.lookup(prompt, running, lora)
        if best is None:
            return self.fresh(lora), 0
        kept = best in self
        must_copy = not kept or n < best.length   # the source stays: running, or kept and longer than the prefix
        if self.copies and must_copy and (self.session.cache.free_slots() or len(self._kept) > kept):
            return self._copied(best, n, kept, lora)
        if not kept:
            return self.fresh(lora), 0
        return self._truncated(best, n)

    def _copied(self, src: Sequence, n: int, kept: bool, lora: LoraKey) -> tuple[Sequence, int]:
        if kept:
            self._kept.move_to_end(src.id)   # the source is the most recently used: not the one evicted
        dst = self.fresh(lora)
        try:
            self.session.copy(src, dst, n)
        except QeffKvError:   # e.g. ring buffers that cannot serve the prefix: prefill it whole in dst
            return dst, 0
        self.reused_tokens += n
        return dst, n

    def _truncated(self, seq: Sequence, n: int) -> tuple[Sequence, int]:
        del self._kept[seq.id]
        self._exact[seq.id] = min(n, self._exact.get(seq.id, 0))
        try:
            self.session.truncate(seq, n)
        except QeffKvError:   # ring buffers: the rewind is refused; prefill from scratch in this slot
            self.session.truncate(seq, 0)
            n = 0
        self._tell(seq, seq.tokens)
        self.reused_tokens += n
        return seq, n

    # ------------------------------------------------------------------------------------ keep, evict, forget
    def held(self, seq: Sequence, exact: bool = True) -> None:
        """``seq``'s prompt is prefilled: tell the listener what it holds (while it runs, it can be a source).
        ``exact``: its prompt was fed in whole prefill chunks from position 0 or an exact prefix (else, with
        ``align``, none of it is reused)."""
        if self.align:
            self._exact[seq.id] = seq.length // self.align * self.align if exact else 0
        if self.reuse:
            self._tell(seq, seq.tokens)

    def release(self, seq: Sequence, keep: bool = True) -> bool:
        """A sequence is done: kept (most recently used) when ``keep``, reuse is on and every token id is known;
        else destroyed. Returns whether it was kept."""
        if keep and self.reuse and seq.alive and seq.length > 0 and all(t >= 0 for t in seq.tokens):
            self.keep(seq)
            return True
        if seq.alive:
            self.remove(seq)
        return False

    def keep(self, seq: Sequence, place: int | None = None) -> None:
        """Keep ``seq`` (a live sequence of the session) as the most recently used, or at ``place`` in the LRU
        order (0: least recently used; a slot action putting a sequence back where it was)."""
        self._kept.pop(seq.id, None)
        if place is None:
            self._kept[seq.id] = seq
        else:
            items = list(self._kept.items())
            items.insert(place, (seq.id, seq))
            self._kept = collections.OrderedDict(items)
        self._tell(seq, seq.tokens)

    def forget(self, seq: Sequence) -> int:
        """Stop keeping ``seq`` (a kept sequence) without destroying it; returns its place in the LRU order."""
        place = list(self._kept).index(seq.id)
        del self._kept[seq.id]
        return place

    def evict(self, seq: Sequence | None = None) -> Sequence:
        """Destroy the kept sequence ``seq`` (default: the least recently used one); returns it."""
        victim = self._kept.pop(seq.id) if seq is not None else self._kept.popitem(last=False)[1]
        self.remove(victim)
        return victim

    def remove(self, seq: Sequence) -> None:
        """Destroy ``seq`` (kept or not) in the session."""
        self._kept.pop(seq.id, None)
        self._exact.pop(seq.id, None)
        self.session.remove_sequence(seq)
        self._tell(seq, ())

    def clear(self) -> None:
        """Destroy every kept sequence."""
        while self._kept:
            self.evict()

    def _tell(self, seq: Sequence, tokens: Seq[int]) -> None:
        if self.listener is None:
            return
        lora = lora_of(seq) if tokens else None
        if lora is None:
            self.listener.holds(seq.id, list(tokens))
        else:   # a sequence of an adapter: its blocks are the adapter's (KV events carry its lora_id)
            self.listener.holds(seq.id, list(tokens), lora=lora)
