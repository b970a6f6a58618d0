"""The checks every public runtime entry point runs on its arguments before reading anything: wrong types, bools
that are not bools, out-of-range integers and unknown onnxruntime providers are refused with one line naming the
argument (:class:`~qeff_kv.errors.RuntimeInputError`), never a bare ``TypeError`` deep inside. Which execution
providers a graph kind may run on is :mod:`.ep_proofs`'s (asked once the graph is read, before it is loaded)."""

from __future__ import annotations

from typing import Iterable

import numpy as np
import onnxruntime as ort

from qeff_kv.support import validate
from qeff_kv.errors import RuntimeInputError
from qeff_kv.runtime.execution import ep_proofs


def check_providers(providers, device=None) -> list[str]:
    """The providers a session runs on (``device``'s, ``"cpu"`` by default, or ``providers``), well formed; whether
    they are proved for the graph is asked once it is read (:func:`.ep_proofs.require`), then whether this
    onnxruntime has them (:func:`require_available`)."""
    if device is not None and not isinstance(device, str):
        raise RuntimeInputError(f"device must be a string ('cpu' or 'cuda'), got {device!r}")
    if providers is not None and (isinstance(providers, (str, bytes)) or not isinstance(providers, (list, tuple))
                                  or not all(isinstance(p, str) for p in providers) or not providers):
        raise RuntimeInputError(f"providers must be a list of onnxruntime provider names, got {providers!r}")
    providers = ep_proofs.resolve(device, providers)
    require_available(providers, known=True)
    return providers


def require_available(providers: list[str], known: bool = False) -> None:
    """Each of ``providers`` present in this onnxruntime (``known``: at least a name onnxruntime knows, built here or
    not); one missing is refused in one line (onnxruntime itself would fall back to the CPU with a multi-line
    warning)."""
    available = ort.get_available_providers()
    names = set(ort.get_all_providers()) | set(available) if known else available
    unknown = [p for p in providers if p not in names]
    if unknown:
        raise RuntimeInputError(f"onnxruntime provider {unknown[0]!r} is not available here (available: "
                                f"{', '.join(available)})")


def check_session_args(*, model, ctx_len, prefill_seq_len, max_sequences, inplace, threads, providers,
                       sliding_window, image_token_id, device=None, executor="onnxruntime") -> list[str]:
    """The arguments of :class:`~qeff_kv.runtime.session.Session` (and what passes them on); returns the
    providers it runs on."""
    validate.path_like("model", model)
    for label, v in (("ctx_len", ctx_len), ("prefill_seq_len", prefill_seq_len), ("max_sequences", max_sequences),
                     ("sliding_window", sliding_window)):
        validate.optional_int(label, v)
    validate.optional_int("threads", threads, maximum=4096)
    validate.token_id("image_token_id", image_token_id)
    validate.flag("inplace", inplace, optional=True)
    if executor not in ("onnxruntime", "reference"):
        raise RuntimeInputError(f"executor must be 'onnxruntime' or 'reference', got {executor!r}")
    return check_providers(providers, device)


def check_tokens(tokens, vocab_size: int | None) -> list[int]:
    """Token ids as a list of ints inside the vocabulary ``[0, vocab_size)``; anything else refused in one line."""
    if isinstance(tokens, np.ndarray) and tokens.ndim != 1:
        raise RuntimeInputError(f"token ids must be a 1-D sequence, got an array of shape {tokens.shape}")
    if isinstance(tokens, (str, bytes, dict)) or not isinstance(tokens, Iterable):
        raise RuntimeInputError(f"token ids must be a list of ints, got {type(tokens).__name__}")
    out = []
    for t in tokens:
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
            raise RuntimeInputError(f"token ids must be ints, got {t!r}")
        if t < 0 or (vocab_size is not None and t >= vocab_size):
            raise RuntimeInputError(f"token id {t} is outside the vocabulary [0, {vocab_size})" if vocab_size
                                    else f"token id {t} is negative")
        out.append(int(t))
    return out


def check_prefill(seq, tokens, *, vocab_size: int | None, ctx_len: int, images=None, text_only: bool = True
                  ) -> list[int]:
    """A prompt's token ids to append to ``seq``, refused in one line when empty, out of the vocabulary, past the
    capacity ``ctx_len``, or with images on a text decoder (``text_only``)."""
    toks = check_tokens(tokens, vocab_size)
    if not toks:
        raise RuntimeInputError("prefill needs at least one token")
    if seq.length + len(toks) > ctx_len:
        raise RuntimeInputError(
            f"sequence {seq.id} holds {seq.length} positions; {len(toks)} more tokens exceed the capacity "
            f"ctx_len={ctx_len}")
    if images is not None and text_only:
        raise RuntimeInputError("images were given but the graph is a text decoder")
    return toks


def chunk_padding(start: int, n: int, plan: list[tuple[int, int]] | None, *, seq_len: int,
                  fixed_seq_len: int | None, ctx_len: int, pad_short: bool,
                  pad_ring: bool) -> list[tuple[int, int, bool]]:
    """``(offset, count, padded)`` for feeding ``n`` tokens from position ``start`` in chunks of ``seq_len`` (or in
    the chunks ``plan``: ``(offset, count)``). A short chunk is padded to ``seq_len`` where the graph fixes it, or
    where ``pad_short`` (the peer's graphs are padded as its own runner pads them; our exports run a short last
    chunk at its own length: padding costs the compute of the padded rows). Never padded past the capacity: padding
    rows of peer graphs may write slot ``ctx_len-1``, which must not happen while it receives a real token (nor, in
    the peer's rings, slot ``C-1`` at all, ``pad_ring`` false); a fixed ``seq_len`` that leaves no other way is
    refused in one line."""
    out = []
    for off, cnt in plan if plan is not None else [(o, min(seq_len, n - o)) for o in range(0, n, seq_len)]:
        padded = cnt < seq_len and (fixed_seq_len is not None or pad_short)
        if padded and (start + off + seq_len > ctx_len or not pad_ring):
            if fixed_seq_len is None:
                padded = False
            elif start + off + cnt == ctx_len:
                raise RuntimeInputError(
                    f"the last prefill chunk would fill position {ctx_len - 1} alongside padding, and "
                    f"the graph fixes seq_len={fixed_seq_len}; use a prompt one token shorter")
        out.append((off, cnt, padded))
    return out
