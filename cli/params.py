"""Option types shared by the commands: integers are range-checked while the command line is parsed, so an
absurd value (negative, zero, beyond 64 bits, beyond what any buffer can hold) is a one-line usage error.

Numbers are ASCII: click's own INT and FLOAT types take whatever Python's ``int()``/``float()`` take (Arabic-Indic
digits such as ``١٦``, ``1_000``, ``+5``, ``nan``); these refuse them in one line.
"""

from __future__ import annotations

import math
import re

import click

from qeff_kv.tools.compile_config import PRECISIONS
from qeff_kv.support.limits import MAX_DIM, MAX_INT64

_INT = re.compile(r"-?[0-9]+")
_FLOAT = re.compile(r"-?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")


class AsciiIntRange(click.IntRange):
    """An integer range whose command-line text must be ASCII digits (an optional leading ``-``)."""

    def convert(self, value, param, ctx):
        if isinstance(value, str) and not _INT.fullmatch(value):
            self.fail(f"{value!r} is not an integer (ASCII digits 0-9)", param, ctx)
        return super().convert(value, param, ctx)


class AsciiFloat(click.ParamType):
    """A finite decimal number in ASCII (``0.7``, ``1e-3``); ``nan``, ``inf`` and non-ASCII digits are refused."""

    name = "float"

    def convert(self, value, param, ctx):
        if isinstance(value, float) and math.isfinite(value):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if not isinstance(value, str) or not _FLOAT.fullmatch(value):
            self.fail(f"{value!r} is not a decimal number (ASCII digits, e.g. 0.7)", param, ctx)
        out = float(value)
        if not math.isfinite(out):
            self.fail(f"{value!r} is out of range", param, ctx)
        return out


#: ctx_len, prefill_seq_len, batch sizes, slots: 1 .. 2**31-1.
DIM = AsciiIntRange(min=1, max=MAX_DIM)
#: --sliding-window: the window W of a graph's ring buffers (axis 'sliding_window'): 1 .. 2**31-1.
SLIDING_WINDOW = DIM
#: counts that may be zero (max_tokens, top_k): 0 .. 2**31-1.
COUNT = AsciiIntRange(min=0, max=MAX_DIM)
#: token ids and seeds: 0 .. 2**63-1.
ID = AsciiIntRange(min=0, max=MAX_INT64)
#: onnxruntime intra-op threads.
THREADS = AsciiIntRange(min=1, max=4096)
#: MatMulNBits accuracy level.
ACCURACY_LEVEL = AsciiIntRange(min=0, max=4)
FLOAT = AsciiFloat()
PRECISION = click.Choice(list(PRECISIONS))

#: the click type of each sampling field given as one value (``qeff_kv.runtime.decoding.sampling.FIELDS``; the
#: repeatable ``--logit-bias ID=BIAS`` is declared where it is taken)
SAMPLING_TYPES = {"temperature": FLOAT, "top_k": COUNT, "top_p": FLOAT, "seed": ID, "min_p": FLOAT,
                  "repetition_penalty": FLOAT, "presence_penalty": FLOAT, "frequency_penalty": FLOAT}


def sampling_options(helps: dict[str, str], defaults=None):
    """The click options of sampling fields, named as the fields (``top_k`` -> ``--top-k``), in the order of
    ``helps`` (field -> help). ``defaults``: a ``SamplingParams`` whose values are the defaults (shown), or ``None``
    (every option defaults to ``None``: left to the library)."""
    def declare(fn):
        for name, text in reversed(helps.items()):
            default = None if defaults is None else getattr(defaults, name)
            fn = click.option(f"--{name.replace('_', '-')}", name, type=SAMPLING_TYPES[name], default=default,
                              show_default=default is not None, help=text)(fn)
        return fn
    return declare
