"""The server's sampling defaults: what a request that leaves a sampling field out gets.

Each field comes from, in order: the ``qeff-kv serve`` flag (``--temperature``, ``--top-p``, ``--top-k``,
``--min-p``, ``--repetition-penalty``, ``--max-tokens``), else the export's ``generation_config.json`` (the Hugging
Face file the exporter copies beside the graph; its ``temperature``, ``top_p``, ``top_k``, ``min_p``,
``repetition_penalty`` and ``max_new_tokens``, like vLLM's ``--generation-config auto``; ``do_sample`` is not
read, as in vLLM), else:

* when that file gives none of the four sampling fields (``temperature``, ``top_p``, ``top_k``, ``min_p``; the
  export has no generation config, or one without sampling), llama-server's defaults for them (temperature 0.8,
  top_k 40, top_p 0.95, min_p 0.05: :data:`LLAMA_SERVER`), which keep a small model's sampled text sane; a model
  whose authors chose some of them gets OpenAI's neutral values for the others;
* OpenAI's defaults for the rest (temperature 1, top_p 1, no top_k / min_p / repetition penalty, as many tokens as
  the context holds; the chat page sends its own token limit, :data:`PAGE_MAX_TOKENS`).

``/v1/models`` and ``/health`` show the result and where each value came from (``flag``,
``generation_config.json``, ``llama-server`` or ``openai``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from qeff_kv.support import fsutil
from qeff_kv.errors import RuntimeInputError
from qeff_kv.runtime.decoding.sampling import DEFAULTED, SamplingParams

#: generation_config.json key -> SamplingDefaults field
GENERATION_CONFIG_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
#: OpenAI's defaults of the fields a server default fills (:data:`~qeff_kv.runtime.decoding.sampling.DEFAULTED`) and
#: max_tokens
OPENAI = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, "max_tokens": None}
#: llama-server's sampling defaults (its ``common_params_sampling``), used where the export's generation config
#: gives none of these fields
LLAMA_SERVER = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
#: the token limit the chat page (``GET /``) sends when its field is empty and the server has no default
#: ``max_tokens`` (a page answer must end: a small model sampling without a limit runs for minutes)
PAGE_MAX_TOKENS = 1024


@dataclass(frozen=True)
class SamplingDefaults:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    #: None: as many as the context holds
    max_tokens: int | None = None
    #: field -> "flag" | "generation_config.json" | "llama-server" | "openai"
    source: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        # the same bounds as a request's (a default that a request could not give is refused at start-up)
        SamplingParams(**{k: getattr(self, k) for k in DEFAULTED})
        if self.max_tokens is not None and (isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int)
                                            or self.max_tokens < 1):
            raise RuntimeInputError(f"the default max_tokens must be an int >= 1, got {self.max_tokens!r}")

    def shown(self) -> dict:
        """What ``/v1/models`` and ``/health`` show: the values and each one's source."""
        values = {k: getattr(self, k) for k in OPENAI}
        return {**values, "source": {k: self.source.get(k, "openai") for k in OPENAI}}


def read_generation_config(folder: Path) -> dict:
    """The sampling fields of ``folder/generation_config.json`` (``{}`` when there is none); a one-line error for a
    file that is not JSON or a value of the wrong kind."""
    path = Path(folder) / "generation_config.json"
    if not path.is_file():
        return {}
    cfg = fsutil.read_json_object(path, RuntimeInputError)
    out = {}
    for key, name in GENERATION_CONFIG_KEYS.items():
        v = cfg.get(key)
        if v is None:
            continue
        integral = name in ("top_k", "max_tokens")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or (
                integral and v != int(v)):
            raise RuntimeInputError(f"{path}: {key} must be {'an integer' if integral else 'a number'}, got {v!r}")
        out[name] = int(v) if integral else float(v)
    return out


def resolve_defaults(folder: Path | None, flags: dict) -> SamplingDefaults:
    """``flags`` (field -> value or None: the serve options) over ``generation_config.json`` over llama-server's
    sampling (where that file gives no sampling field) over OpenAI's."""
    from_file = read_generation_config(folder) if folder is not None else {}
    llama = {} if any(k in from_file for k in LLAMA_SERVER) else LLAMA_SERVER
    fallback = {**OPENAI, **llama}
    values, source = {}, {}
    for name, fallback_value in fallback.items():
        if flags.get(name) is not None:
            values[name], source[name] = flags[name], "flag"
        elif name in from_file:
            values[name], source[name] = from_file[name], "generation_config.json"
        else:
            values[name], source[name] = fallback_value, "llama-server" if name in llama else "openai"
    if values["top_k"] is not None and values["top_k"] < 0:   # HF's "no limit" spelled -1 (vLLM's too)
        values["top_k"] = 0
    try:
        return SamplingDefaults(**values, source=source)
    except RuntimeInputError as exc:
        given = ", ".join(f"{k} from {v}" for k, v in source.items() if v not in ("openai", "llama-server"))
        raise RuntimeInputError(f"sampling defaults ({given}): {exc}") from None


@dataclass
class SamplingSection:
    """The sampling defaults section of the serve options (a section of
    :class:`qeff_kv.serve.config.ServeConfig`): the flags, each None where not given (then generation_config.json,
    else OpenAI's or llama-server's: :func:`resolve_defaults`)."""
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    #: default max_tokens (None: generation_config.json's max_new_tokens, else what the context holds)
    max_tokens: int | None = None

    def check(self) -> None:
        """Nothing to refuse before the export is read: the bounds are a request's, checked with the export's
        generation_config.json (:func:`resolve_defaults`)."""

    def flags(self) -> dict:
        """The sampling defaults given (field -> value, ``None`` where not given): the sampling fields a server
        default fills (:data:`~qeff_kv.runtime.decoding.sampling.DEFAULTED`) and ``max_tokens``."""
        return {k: getattr(self, k) for k in (*DEFAULTED, "max_tokens")}

    def resolve(self, folder: Path | None) -> SamplingDefaults:
        """The defaults: these flags over the export's generation_config.json over OpenAI's."""
        return resolve_defaults(folder, self.flags())
