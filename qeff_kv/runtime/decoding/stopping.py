"""One token budget and one stop rule, for every loop that generates: ``Session.generate`` / ``stream``
(:mod:`.decode_loop`), :class:`~.speculative.SpeculativeDecoder`, the server's scheduler and its speculative step.

The names: a request *asks* for ``max_tokens`` (the one name in the library, the CLI's ``--max-tokens`` and the
server; None: no limit asked; the library's and the CLI's old ``max_new_tokens`` / ``--max-new-tokens`` are
deprecated aliases for one release: :func:`asked_tokens`); its **budget** is the number of new tokens it may make, decided once when it starts (:func:`token_budget`); what is
left of it during a speculative step is ``budget - generated``.

The rules, as they stood when they were gathered here (issue 38) and as they still are:

* **Context room** (:func:`context_room`). A sequence that holds ``fed`` positions once everything before its first
  new token is fed (cached tokens, the prompt, and a pending token already shown to the caller, which is fed first)
  may make ``ctx_len - fed + 1`` new tokens: each new token is fed before the next one is selected, and the last
  one is never fed. A served prompt: ``fed = len(prompt)``; a handed-off sequence (disaggregated serving, P/D):
  ``fed = seq.length`` (its pending token is its first new token).
* **Budget** (:func:`token_budget`): ``min(max_tokens, room)``, the room when nothing was asked, never below
  ``least``. The server asks for the request's ``max_tokens``, else the server's default (``--max-tokens``, else
  ``generation_config.json``'s ``max_new_tokens``), else nothing; ``max_tokens: 0`` (echo with prompt logprobs)
  scores the prompt and generates nothing (``"length"``). A handed-off sequence has ``least=1``: its pending token
  exists already and is always shown. The runtime checks capacity itself first (``on_capacity="error"`` refuses a
  request that does not fit; ``"stop"`` takes the budget; a prompt that does not fit even with no new token is
  refused either way); a budget below ``max_tokens`` ends as ``"capacity"`` there, where the server (OpenAI)
  says ``"length"``.
* **Stop** (:func:`check_stop`), after each new token: a stop token ends the sequence as ``"stop"``, checked
  before the budget (a stop token that is also the last budgeted token is a ``"stop"``); else reaching the budget
  ends it as ``"length"`` (``"capacity"`` where the caller passes ``asked`` and the room cut the budget below it).
  Stop tokens: the runtime's ``stop_tokens`` (None: the graph's eos ids; ``generate`` adds ``--stop-token`` ids
  and drops the eos ids with ``--ignore-eos``); the server's ``stop_token_ids`` (the tokenizer's eos ids, none with
  ``ignore_eos``; a grammar allows eos only where the text may end). The runtime keeps a stop token in the tokens
  it returns; the server counts it in ``completion_tokens`` but emits no event for it (it has no text).
* **Stop strings** are the HTTP front's (``serve/http/text.StopMatcher``, on the detokenized text): it cuts the
  text, answers ``"stop"`` and cancels the engine's request; no engine sees them.
* **Speculative runs**: a verification step takes at most :func:`draft_limit` drafts (``left - 1``: a run is its
  accepted drafts plus one token), so an accepted run never crosses the budget; the run ends at its first stop
  token (:func:`~.speculative.accept`), so a stop token is always a run's last token. The server emits a run's
  tokens one at a time through the same rule and drops what follows a finish.
"""

from __future__ import annotations

import warnings
from typing import Container

import numpy as np

from qeff_kv.errors import RuntimeInputError

#: a stop token ended the sequence
STOP = "stop"
#: the budget ended it
LENGTH = "length"
#: the context's room ended it before what was asked (the runtime's name; the server says ``"length"``)
CAPACITY = "capacity"


#: what the library's loops ask for when the caller says nothing (``Session.generate``, ``SpeculativeDecoder``)
DEFAULT_MAX_TOKENS = 64


def asked_tokens(max_tokens: int, max_new_tokens: int | None = None, *, stacklevel: int = 3) -> int:
    """The tokens a library call asks for: ``max_tokens``, or the deprecated ``max_new_tokens`` when given (a
    :class:`DeprecationWarning`, the same behaviour; the alias goes after one release)."""
    if max_new_tokens is None:
        return max_tokens
    warnings.warn("max_new_tokens is deprecated: use max_tokens (the same count; the old name goes after one "
                  "release)", DeprecationWarning, stacklevel=stacklevel)
    return max_new_tokens


def check_asked(max_tokens, least: int = 0) -> int:
    """``max_tokens`` checked: an int of at least ``least`` (0 or 1), else a one-line refusal."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, np.integer)) or max_tokens < least:
        kind = "non-negative" if least == 0 else "positive"
        raise RuntimeInputError(f"max_tokens must be a {kind} int, got {max_tokens!r}")
    return int(max_tokens)


def context_room(ctx_len: int, fed: int) -> int:
    """New tokens a sequence of a ``ctx_len`` context may make that holds ``fed`` positions once everything before
    its first new token is fed (see the module docstring)."""
    return ctx_len - fed + 1


def token_budget(max_tokens: int | None, room: int, least: int = 0) -> int:
    """A request's budget: ``max_tokens`` (None: no limit asked) within ``room``, at least ``least``."""
    return max(least, room if max_tokens is None else min(max_tokens, room))


def check_stop(token: int | None, generated: int, budget: int, stops: Container[int],
               asked: int | None = None) -> str | None:
    """Why a sequence ends after making ``token``, its ``generated``-th new token (None and 0: before its first):
    :data:`STOP` for a stop token (checked first), :data:`LENGTH` when ``generated`` reaches ``budget`` (or
    :data:`CAPACITY` when the budget is below ``asked``, the request's ask), else None: it goes on."""
    if token is not None and token in stops:
        return STOP
    if generated >= budget:
        return CAPACITY if asked is not None and budget < asked else LENGTH
    return None


def draft_limit(left: int) -> int:
    """Drafts one verification step may take with ``left`` tokens left in the budget: a run gives its accepted
    drafts and one token more, so it never crosses the budget."""
    return left - 1
