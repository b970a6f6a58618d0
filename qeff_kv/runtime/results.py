"""What :class:`qeff_kv.runtime.Session` returns: :class:`Generation`, :class:`Timings`, :class:`TokenEvent`."""

from __future__ import annotations

from dataclasses import dataclass, field

from qeff_kv.runtime.memory.hybrid import Sequence


# ============================================================================================ results
@dataclass
class Generation:
    """The outcome of :meth:`Session.generate` for one sequence."""

    sequence: Sequence
    tokens: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    finish_reason: str | None = None  # "stop" | "length" | "capacity" | "prefill"

    def to_json(self) -> dict:
        return {"tokens": list(self.tokens), "prompt_tokens": self.prompt_tokens,
                "finish_reason": self.finish_reason, "length": self.sequence.length}


@dataclass
class Timings:
    prefill_s: float = 0.0
    decode_s: float = 0.0
    prefill_tokens: int = 0
    decode_steps: int = 0
    #: graph runs of the prefills (a prefill runs one per prefill length of its tokens)
    prefill_runs: int = 0
    decode_tokens: int = 0
    #: rows the decode steps ran (lock step runs rows no sequence was fed in: more than the tokens decoded)
    decode_rows: int = 0
    #: vision-language models: time in the vision stage and images encoded (runtime/vision.py)
    vision_s: float = 0.0
    images: int = 0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0

    def to_json(self) -> dict:
        return {"prefill_s": round(self.prefill_s, 6), "decode_s": round(self.decode_s, 6),
                "prefill_tokens": self.prefill_tokens, "decode_steps": self.decode_steps,
                "decode_tokens": self.decode_tokens,
                "decode_tokens_per_s": round(self.decode_tokens_per_s, 3),
                **({"vision_s": round(self.vision_s, 6), "images": self.images} if self.images else {})}


@dataclass(frozen=True)
class TokenEvent:
    """One token produced by :meth:`Session.stream`: ``index`` is the request's position in the call."""

    index: int
    token: int
    sequence: Sequence
