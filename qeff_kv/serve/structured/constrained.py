"""Constrained decoding: a per-request allowed-token mask from a grammar (structured output, forced tool calls).

The grammar work is llguidance's (a Rust library with an abi3 wheel and no Python dependencies: no torch, no
transformers): it compiles a JSON schema, a regular expression or a Lark grammar against the export's tokenizer and,
at each step, answers which token ids may come next. This module is the only one that imports it.

* :class:`GrammarSpec` says what the output must match (``json_schema``, ``json_object``, ``regex``, ``lark``).
* :class:`Grammars` holds llguidance's tokenizer, built once from the export's ``tokenizers`` JSON
  (``Tokenizer.to_str()``; no transformers), and compiles a spec into a :class:`TokenConstraint`, or raises
  :class:`ConstraintError` naming why the library cannot compile it (the HTTP layer answers 400).
* :class:`TokenConstraint` is the scheduler's hook: before sampling a constrained row it asks :meth:`allowed`
  (a boolean mask over the logits' vocabulary, computed by llguidance as a bitmask and unpacked with numpy: no
  Python loop over the vocabulary); after the token is chosen it calls :meth:`advance`. The end-of-sequence ids
  are allowed only while the grammar accepts, and once the grammar can take nothing more only they are allowed,
  so a constrained generation ends exactly when the grammar is satisfied (or at ``max_tokens``).

JSON is compiled with fixed separators (``", "`` and ``": "``, no free whitespace): a small model cannot then spend
its budget on blank lines inside a JSON value.

Bounds (a hostile grammar must not stall other requests): llguidance's own limits are set, not left to its defaults
(:data:`LIMIT_SETTINGS`: per-step lexer fuel and Earley items bound each mask to a few milliseconds, the first
step's fuel and the grammar's size bound compilation); :meth:`Grammars.compile` computes the first mask too (in
the compiling thread, not the engine's) and takes a trial first token on a copy; a grammar that fails there, or
that can match nothing (a schema that only references itself: ``{"$ref": "#"}``), is a :class:`ConstraintError`.
A grammar that fails later (a limit met mid-generation) marks its constraint :attr:`TokenConstraint.failed`, which
the HTTP layer answers as the request's fault (``invalid_grammar``), never the server's.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import numpy as np

from qeff_kv.errors import MissingDependencyError, RuntimeInputError

#: llguidance's JSON compiler options for every schema: no free whitespace between JSON tokens
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
KINDS = ("json_schema", "json_object", "regex", "lark")
#: llguidance's ``LLParserLimits`` for every grammar (its stated speeds: lexer fuel ~14-50k/ms, items ~20k/ms):
#: one mask step costs at most ~4 ms of lexer work and ~2.5 ms of parsing; building the lexer ~5 ms; the lexer's
#: states (1-2 kB each) at most ~100 MB; the grammar at most 100,000 symbols (its default 500,000 lets a
#: 10,000-property schema cost minutes of CPU). ``verbose_errors`` off: messages carry no parser dumps.
LIMIT_SETTINGS = {"max_items_in_row": 2000, "initial_lexer_fuel": 200_000, "step_lexer_fuel": 50_000,
                  "step_max_items": 50_000, "max_lexer_states": 50_000, "max_grammar_size": 100_000,
                  "verbose_errors": False}


class ConstraintError(RuntimeInputError):
    """A grammar, schema or regex the library cannot compile (one line saying why)."""


class GrammarFailure(RuntimeInputError):
    """A compiled grammar that failed while generating (a limit met, no token allowed): the request's fault."""


@dataclass(frozen=True)
class GrammarSpec:
    """What a constrained output must match: ``kind`` in :data:`KINDS` and its ``source`` (a schema dict for
    ``json_schema``, a pattern for ``regex``, Lark text for ``lark``, ignored for ``json_object``)."""

    kind: str
    source: object = None

    def grammar(self) -> str:
        """llguidance's grammar text for this spec (not yet checked)."""
        from llguidance import LLMatcher

        if self.kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
        if self.kind == "json_schema":
            try:
                return LLMatcher.grammar_from_json_schema(self.source, overrides=JSON_OPTIONS)
            except (ValueError, TypeError) as exc:
                raise ConstraintError(f"the JSON schema is not valid: {exc}") from None
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.source)
        if self.kind == "lark":
            return LLMatcher.grammar_from_lark(self.source)
        raise ConstraintError(f"unknown grammar kind {self.kind!r} (one of {', '.join(KINDS)})")


def lark_json(schema: dict) -> str:
    """``%json{...}``: a JSON schema inside a Lark grammar, with :data:`JSON_OPTIONS`."""
    return "%json" + json.dumps({**schema, "x-guidance": JSON_OPTIONS})


def lark_string(text: str) -> str:
    """A Lark string literal matching ``text`` exactly."""
    return json.dumps(text)


class Grammars:
    """llguidance's tokenizer for one export, and the compiler of :class:`GrammarSpec` into constraints.

    Args:
        tokenizer: the export's ``tokenizers.Tokenizer``.
        eos_token_ids: the ids that end a generation (allowed only where the grammar accepts).
        vocab_size: the logits' width when known (default: the tokenizer's size with added tokens).
    """

    def __init__(self, tokenizer, eos_token_ids, vocab_size: int | None = None):
        try:
            from llguidance import LLTokenizer
        except ImportError:
            raise MissingDependencyError("structured output needs the 'llguidance' package "
                                         "(pip install 'qeff-kv[serve]')") from None
        eos = [int(t) for t in eos_token_ids]
        if not eos:
            raise RuntimeInputError("structured output needs the export's eos_token_id (none in its manifest)")
        n = max(int(vocab_size or 0), tokenizer.get_vocab_size(with_added_tokens=True), max(eos) + 1)
        self.vocab_size = n
        self.eos_token_ids = tuple(eos)
        self.tokenizer = LLTokenizer(tokenizer.to_str(), n_vocab=n, eos_token=eos)

    def compile(self, spec: GrammarSpec) -> "TokenConstraint":
        """A fresh constraint for one request, its first mask computed; :class:`ConstraintError` naming why when it
        cannot compile, fails on its first step, or can match no text at all."""
        from llguidance import LLMatcher, LLParserLimits

        matcher = LLMatcher(self.tokenizer, spec.grammar(), log_level=0, limits=LLParserLimits(**LIMIT_SETTINGS))
        if matcher.is_error():
            raise ConstraintError(_first_line(matcher.get_error()))
        constraint = TokenConstraint(matcher, self.vocab_size)
        try:
            first = constraint.allowed(self.vocab_size)
        except GrammarFailure as exc:
            raise ConstraintError(f"the grammar fails on its first step or matches no text ({exc})") from None
        others = first.copy()
        others[[t for t in self.eos_token_ids if t < others.size]] = False
        if not matcher.is_accepting() and not others.any():
            raise ConstraintError("the grammar matches no text (a schema or rule that only refers to itself?)")
        if others.any():   # a trial step on a copy: a grammar over the limits mostly fails here, before any answer
            trial = matcher.deep_copy()
            if not trial.consume_token(int(np.flatnonzero(others)[0])) or trial.is_error():
                raise ConstraintError(f"the grammar fails on its first token: {_first_line(trial.get_error())}")
        constraint.first = first
        return constraint


def _first_line(message: str) -> str:
    """llguidance's message on one line: its text lines, without the source excerpts and ``^`` pointers."""
    lines = [s.strip() for s in str(message).replace("<non-verbose/>", "").splitlines()]
    lines = [s for s in lines if s and s.strip("^ ") and not re.match(r"^\d+\s*\|", s) and not s.startswith("|")]
    text = " ".join(lines)
    return (text[:400] + "...") if len(text) > 400 else text or "the grammar does not compile"


class TokenConstraint:
    """One request's grammar state. The scheduler calls :meth:`allowed` before sampling and :meth:`advance` with
    the chosen token after; nothing else. Used by one thread at a time (the engine's)."""

    def __init__(self, matcher, vocab_size: int, failures: list | None = None):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self._bits = np.zeros(((vocab_size + 31) // 32,), dtype=np.int32)
        #: the mask of the first step, computed where the grammar was compiled (used once, by the first call)
        self.first: np.ndarray | None = None
        self._failures = failures if failures is not None else []   # shared with the forks (``n`` choices)

    @property
    def failed(self) -> str | None:
        """Why this grammar (or a fork of it) failed while generating, else None."""
        return self._failures[0] if self._failures else None

    def _fail(self, message: str):
        self._failures.append(message)
        return GrammarFailure(message)

    def allowed(self, width: int) -> np.ndarray:
        """Which of ``width`` logits may be chosen next (bool ``[width]``; ids past the tokenizer: never)."""
        if self.first is not None:
            first, self.first = self.first, None
            if first.size == width:
                return first
        if self.matcher.is_error():
            raise self._fail(f"the grammar failed: {_first_line(self.matcher.get_error())}")
        self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        if self.matcher.is_error():
            raise self._fail(f"the grammar failed: {_first_line(self.matcher.get_error())}")
        bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")
        mask = np.zeros(width, dtype=bool)
        n = min(width, self.vocab_size)
        mask[:n] = bits[:n]
        if not mask.any():
            raise self._fail("the grammar allows no token of this model's vocabulary")
        return mask

    def advance(self, token: int) -> None:
        """The chosen token (one :meth:`allowed` permitted)."""
        if not self.matcher.consume_token(int(token)):
            raise self._fail(f"token {token} is not allowed by the grammar: {_first_line(self.matcher.get_error())}")

    def fork(self) -> "TokenConstraint":
        """An independent copy of this state (one per ``n`` choice), reporting its failure to this one's."""
        twin = TokenConstraint(self.matcher.deep_copy(), self.vocab_size, self._failures)
        twin.first = None if self.first is None else self.first.copy()
        return twin

    @property
    def accepting(self) -> bool:
        """The text so far is a complete match."""
        return bool(self.matcher.is_accepting())
