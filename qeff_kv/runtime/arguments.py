"""The checks every public runtime entry point runs on its arguments before reading anything: wrong types, bools
that are not bools, out-of-range integers and unknown onnxruntime providers are refused with one line naming the
argument (:class:`~qeff_kv.errors.RuntimeInputError`), never a bare ``TypeError`` deep inside."""

from __future__ import annotations

import onnxruntime as ort

from .. import validate
from ..errors import RuntimeInputError


def check_providers(providers) -> list[str] | None:
    """``None`` or a list of provider names this onnxruntime has; an unknown one is refused in one line (onnxruntime
    itself would fall back to the CPU with a multi-line warning)."""
    if providers is None:
        return None
    if isinstance(providers, (str, bytes)) or not isinstance(providers, (list, tuple)) \
            or not all(isinstance(p, str) for p in providers) or not providers:
        raise RuntimeInputError(f"providers must be a list of onnxruntime provider names, got {providers!r}")
    available = ort.get_available_providers()
    unknown = [p for p in providers if p not in available]
    if unknown:
        raise RuntimeInputError(f"onnxruntime provider {unknown[0]!r} is not available here (available: "
                                f"{', '.join(available)})")
    return list(providers)


def check_session_args(*, model, ctx_len, prefill_seq_len, max_sequences, inplace, threads, providers,
                       sliding_window, image_token_id) -> None:
    """The arguments of :class:`~qeff_kv.runtime.session.Session` (and what passes them on)."""
    validate.path_like("model", model)
    for label, v in (("ctx_len", ctx_len), ("prefill_seq_len", prefill_seq_len), ("max_sequences", max_sequences),
                     ("sliding_window", sliding_window)):
        validate.optional_int(label, v)
    validate.optional_int("threads", threads, maximum=4096)
    validate.token_id("image_token_id", image_token_id)
    validate.flag("inplace", inplace, optional=True)
    check_providers(providers)
