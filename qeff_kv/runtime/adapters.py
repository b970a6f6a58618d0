"""A session's LoRA adapters, the verbs (docs/lora.md): ``session.lora``, a :class:`SessionAdapters`.

``session.lora.load(name, PEFT_DIR)`` reads an adapter once (fitted to the graph: its modules, rank, hidden sizes and
base), ``session.lora.use(seq, name, scale)`` makes a sequence run with it (before its first token: a sequence's KV
is its adapter's), ``session.add_sequence(adapter=name)`` does both at once, ``unload`` forgets one no sequence
uses. Every row of a step takes its own sequence's adapter (:class:`~qeff_kv.runtime.execution.adapter_feeds.AdapterFeeds`).
A graph exported without adapters refuses every verb in one line.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from qeff_kv.contract.lora import adapter_name_problem
from qeff_kv.errors import AdapterError, StateAdapterError
from qeff_kv.runtime.memory.hybrid import describe_adapter as describe


class SessionAdapters:
    """The adapter verbs of one :class:`~qeff_kv.runtime.session.Session`."""

    def __init__(self, session):
        self.session = session

    @property
    def feeds(self):
        """The binding's :class:`~qeff_kv.runtime.execution.adapter_feeds.AdapterFeeds`; refused in one line for a
        graph without adapter inputs."""
        feeds = self.session.binding.adapters
        if feeds is None:
            raise AdapterError(f"{self.session.files.onnx_path.name} takes no LoRA adapters: export it with --lora "
                               "name=PEFT_DIR or --max-lora-rank R")
        return feeds

    @property
    def enabled(self) -> bool:
        """Whether the graph takes adapters."""
        return self.session.binding.adapters is not None

    @property
    def names(self) -> list[str]:
        """The adapters loaded, in slot order (none for a graph without adapters)."""
        return list(self.session.binding.adapters.adapters) if self.enabled else []

    def geometry(self):
        """The graph's :class:`~qeff_kv.contract.lora.LoraGeometry` (``None`` without adapters)."""
        return self.session.graph.lora

    def load(self, name: str, source: str | os.PathLike | object):
        """Load adapter ``name`` from a PEFT folder (or an adapter already read); returns the adapter."""
        return self.feeds.load(name, source)

    def unload(self, name: str) -> None:
        """Forget adapter ``name``; refused while a sequence uses it."""
        feeds = self.feeds
        feeds.require(name)
        users = [s.id for s in self.session.cache.sequences if s.adapter == name]
        if users:
            raise AdapterError(f"adapter {name!r} is in use by sequence {users[0]}: remove it first")
        feeds.unload(name)

    def get(self, name: str):
        """The adapter ``name`` (:class:`qeff_kv.tools.adapters.Adapter`), refused in one line when not loaded."""
        return self.feeds.require(name)

    def use(self, seq, name: str | None, scale: float = 1.0) -> None:
        """Run ``seq`` with adapter ``name`` (``None``: the base) at ``scale``; only before its first token, since
        what its cache holds was computed with its adapter."""
        seq = self.session.cache.get(seq)
        check_scale(name, scale)
        if name is not None:
            self.feeds.require(name)
        if seq.length and (name, float(scale)) != (seq.adapter, seq.lora_scale):
            raise AdapterError(f"sequence {seq.id} holds {seq.length} positions computed with "
                               f"{describe(seq.adapter, seq.lora_scale)}; it cannot switch to {describe(name, scale)}")
        seq.adapter, seq.lora_scale = name, float(scale)

    def new_sequence(self, name: str | None, scale: float = 1.0):
        """A new empty sequence running with adapter ``name`` (:meth:`use`; ``None``: the base model, where a scale
        has nothing to scale); nothing is left behind on a refusal."""
        check_scale(name, scale)
        if name is None:
            return self.session.cache.create()
        self.feeds.require(name)
        seq = self.session.cache.create()
        try:
            self.use(seq, name, scale)
        except AdapterError:
            self.session.cache.destroy(seq)
            raise
        return seq

    def identity(self, name: str) -> str:
        """The SHA-256 of adapter ``name``'s weights (what a state computed with it records)."""
        return self.feeds.identity(name)

    def check_state(self, name: str, scale: float, identity: str, where: str) -> None:
        """A state computed with adapter ``name`` (weights ``identity``) at ``scale`` can continue here: the graph
        takes adapters and this session holds ``name`` with those weights; else one line."""
        what = describe(name, scale)
        if not self.enabled:
            raise StateAdapterError(f"{where}: computed with {what}; {self.session.files.onnx_path.name} takes no "
                                    "LoRA adapters")
        held = self.feeds.adapters
        if name not in held:
            raise StateAdapterError(f"{where}: computed with {what}, which this session has not loaded (loaded: "
                                    f"{', '.join(held) or 'none'}); load it first (session.lora.load, --lora)")
        if identity != self.identity(name):
            raise StateAdapterError(f"{where}: computed with {what}, but the adapter loaded as {name!r} "
                                    f"({held[name].path}) has other weights")

    def nbytes(self) -> int:
        """Bytes of the bound adapter stacks (every loaded adapter, at the graph's rank)."""
        return self.feeds.nbytes() if self.enabled else 0

    def summary(self) -> dict:
        """What the session's adapters are (for ``describe`` and ``/v1/models``)."""
        if not self.enabled:
            return {}
        from qeff_kv.tools import adapters as adapters_mod

        return {n: adapters_mod.summary(a) for n, a in self.feeds.adapters.items()}


def check_scale(name: str | None, scale) -> None:
    """A LoRA scale is a finite number, and goes with an adapter (the base model has nothing to scale)."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise AdapterError(f"a LoRA scale must be a finite number, got {scale!r}")
    if name is None and scale != 1.0:
        raise AdapterError(f"lora_scale {scale!r} goes with an adapter; give adapter=NAME")


def adapter_option(text: str) -> tuple[str, str]:
    """``--lora [NAME=]PEFT_DIR`` as ``(name, folder)``: an existing folder as given is the folder (named as it is
    called), else ``NAME=PEFT_DIR``; one line otherwise."""
    if not isinstance(text, (str, os.PathLike)) or not str(text):
        raise AdapterError(f"--lora takes [NAME=]PEFT_DIR, got {text!r}")
    text = os.fspath(text)
    if Path(text).is_dir():
        return Path(text).resolve().name, text
    name, sep, folder = text.partition("=")
    if not sep or not folder:
        raise AdapterError(f"--lora {text}: no such adapter folder (give PEFT_DIR or NAME=PEFT_DIR)")
    if adapter_name_problem(name) is not None:
        raise AdapterError(f"--lora {text}: {adapter_name_problem(name)}")
    return name, folder
