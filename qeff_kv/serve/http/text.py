"""Text on the frontend side: an incremental detokenizer and a stop-string matcher.

:class:`Detokenizer` turns generated token ids into text as they come. It decodes a short window of recent
tokens and emits what the newest token added, so a token's leading space survives (decoding a token alone drops
it in SentencePiece-style tokenizers) and a multi-byte character split across tokens is held until it is
complete (the partial text ends with U+FFFD). The concatenated output equals decoding all the tokens at once.

:class:`StopMatcher` finds stop strings in the streamed text and withholds any tail that could be the start of
one, so a client never sees part of a stop string.
"""

from __future__ import annotations

from typing import Iterable

_INCOMPLETE = "\ufffd"


class Detokenizer:
    """Incremental decoding with a ``tokenizers.Tokenizer`` (special tokens skipped unless told otherwise)."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0      # start of the window decoded for context
        self._read = 0        # tokens whose text has been emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token: int) -> str:
        """Append one token; returns the new text (possibly empty while a character is incomplete)."""
        self.ids.append(int(token))
        before = self._decode(self.ids[self._prefix:self._read])
        after = self._decode(self.ids[self._prefix:])
        if len(after) > len(before) and not after.endswith(_INCOMPLETE):
            self._prefix, self._read = self._read, len(self.ids)
            return after[len(before):]
        return ""

    def flush(self) -> str:
        """Text held back at the end (an incomplete character is emitted as decoded)."""
        before = self._decode(self.ids[self._prefix:self._read])
        after = self._decode(self.ids[self._prefix:])
        self._prefix = self._read = len(self.ids)
        return after[len(before):] if len(after) > len(before) else ""


class StopMatcher:
    """Cut the stream at the first stop string; hold back a tail that could begin one."""

    def __init__(self, stops: Iterable[str] = ()):
        self.stops = [s for s in stops if s]
        self.held = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """The text safe to emit now; after a stop string is found, :attr:`stopped` is set and the rest dropped."""
        if self.stopped:
            return ""
        buf = self.held + text
        if not self.stops:
            self.held = ""
            return buf
        first = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if first >= 0:
            self.stopped = True
            self.held = ""
            return buf[:first]
        keep = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:k]):
                    keep = k
                    break
        self.held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep]

    def flush(self) -> str:
        """At the end of generation: the held tail was not a stop string after all."""
        out, self.held = ("" if self.stopped else self.held), ""
        return out
