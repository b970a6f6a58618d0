"""A time and size budget for rendering chat templates (untrusted Jinja2 code read from a model folder).

Jinja2's sandbox keeps a template away from Python internals and caps one ``range`` at 100,000 items, but nested
loops still run for hours and ``'x' * 10**10``, ``'x'|center(10**10)`` or a string doubled in a loop fill the
memory. :func:`render` runs a compiled template under a budget:

* **time**: a trace function on the template's own frames (Jinja2 compiles a template to Python code named
  ``<template>``) counts its lines and raises :class:`BudgetExceeded` once :data:`TIME_BUDGET_S` has passed, so
  a looping template stops within a fraction of a second of its budget (the loop itself is interrupted);
* **size**: the operators ``*``, ``**``, ``+`` and ``%``, every method call and every filter are checked before
  they run (no integer argument above :data:`MAX_CHARS`: the ``center``/``ljust``/``'%*s'`` kind) and after (no
  string or list above :data:`MAX_CHARS`); strings and lists held in the template's variables and namespaces
  are checked while it runs, and the output is accumulated up to :data:`MAX_CHARS`.

Whatever is exceeded ends the render with :class:`BudgetExceeded`, whose message is one line.
"""

from __future__ import annotations

import functools
import operator
import sys
import time

#: Seconds a chat template may take to render (real templates take milliseconds).
TIME_BUDGET_S = 2.0
#: Characters (or list items) any value, and the rendered prompt, may hold: far beyond any context length.
MAX_CHARS = 4 * 2**20

_TEMPLATE_FILE = "<template>"


class BudgetExceeded(Exception):
    """A template went past its time or size budget."""


def _too_big(value) -> bool:
    return isinstance(value, (str, bytes, list, tuple, dict)) and len(value) > MAX_CHARS


def _check_args(args, kwargs, what: str) -> None:
    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > MAX_CHARS:
            raise BudgetExceeded(f"{what} with argument {a} (values are capped at {MAX_CHARS} characters)")


def _check_result(value, what: str):
    if _too_big(value):
        raise BudgetExceeded(f"{what} built a value of {len(value)} items (the cap is {MAX_CHARS})")
    return value


def _binop(op: str, left, right):
    if op == "**":
        if isinstance(right, (int, float)) and isinstance(left, (int, float)) and abs(right) > 64 and abs(left) > 1:
            raise BudgetExceeded(f"'{left} ** {right}' is too large")
        return left ** right
    if op == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * max(n, 0) > MAX_CHARS:
                raise BudgetExceeded(f"repeating a value of {len(seq)} items {n} times exceeds the cap of "
                                     f"{MAX_CHARS}")
        return _check_result(left * right, "'*'")
    if op == "+":
        if isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)) \
                and len(left) + len(right) > MAX_CHARS:
            raise BudgetExceeded(f"'+' would build a value of {len(left) + len(right)} items (the cap is {MAX_CHARS})")
        return left + right
    if op == "%":
        if isinstance(left, str):
            _check_args(right if isinstance(right, tuple) else (right,), {}, "'%' formatting")
        return _check_result(left % right, "'%' formatting")
    return _BINOPS[op](left, right)


_BINOPS = {"-": operator.sub, "/": operator.truediv, "//": operator.floordiv}


def guard_filter(func):
    """A filter checked before (integer arguments) and after (result size) it runs."""

    what = f"filter {getattr(func, '__name__', 'filter').removeprefix('do_')!r}"

    @functools.wraps(func)
    def guarded(*args, **kwargs):
        _check_args(args, kwargs, what)
        return _check_result(func(*args, **kwargs), what)

    return guarded


def sandbox_class():
    """An ``ImmutableSandboxedEnvironment`` subclass whose operators and calls are size-checked."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BudgetedSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "**", "+", "%"])

        def call_binop(self, context, operator_, left, right):
            return _binop(operator_, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja2's signature
            _check_args(args, kwargs, f"calling {getattr(__obj, '__name__', type(__obj).__name__)!r}")
            out = super().call(__context, __obj, *args, **kwargs)
            return _check_result(out, f"calling {getattr(__obj, '__name__', type(__obj).__name__)!r}")

    return BudgetedSandbox


class _Tracer:
    """Counts the template's lines; past the deadline (or with a huge value in its variables) it raises."""

    def __init__(self, seconds: float):
        self.deadline = time.monotonic() + seconds
        self.seconds = seconds
        self.lines = 0

    def __call__(self, frame, event, arg):   # the global trace function: only template frames get a local one
        if frame.f_code.co_filename == _TEMPLATE_FILE:
            return self._local
        return None

    def _local(self, frame, event, arg):
        if event == "line":
            self.lines += 1
            if self.lines & 7 == 0:   # every 8 lines: a value at most doubled 2-3 times meanwhile
                if time.monotonic() > self.deadline:
                    raise BudgetExceeded(f"rendering took more than {self.seconds:g} s (a loop that does not end?)")
                for value in frame.f_locals.values():
                    self._check_value(value)
        return self._local

    @staticmethod
    def _check_value(value) -> None:
        if _too_big(value):
            raise BudgetExceeded(f"a template variable grew to {len(value)} items (the cap is {MAX_CHARS})")
        attrs = getattr(value, "_Namespace__attrs", None)   # {% set ns = namespace(...) %}
        if isinstance(attrs, dict):
            for v in attrs.values():
                if _too_big(v):
                    raise BudgetExceeded(f"a namespace value grew to {len(v)} items (the cap is {MAX_CHARS})")


def render(compiled, variables: dict, *, seconds: float | None = None) -> str:
    """``compiled.render(**variables)`` within the time and size budget; :class:`BudgetExceeded` past it."""
    tracer = _Tracer(TIME_BUDGET_S if seconds is None else seconds)
    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        parts, size = [], 0
        for chunk in compiled.generate(**variables):
            size += len(chunk)
            if size > MAX_CHARS:
                raise BudgetExceeded(f"the rendered prompt exceeds {MAX_CHARS} characters")
            parts.append(chunk)
        return "".join(parts)
    finally:
        sys.settrace(previous)
