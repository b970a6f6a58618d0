"""LoRA adapters served (docs/lora.md#serving): the section of the serve options, the table of the adapters a server
serves, how a request's ``model`` / ``lora`` field becomes the adapter its sequence runs with, and the engine
thread's load and unload.

* :class:`LoraSection`: ``--lora-modules name=PEFT_DIR`` (vLLM's flag, also its JSON form ``{"name": .., "path":
  ..}``), ``--max-loras N`` (adapters loaded at once), ``--allow-runtime-lora-updating`` (or vLLM's environment
  variable ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``: the load and unload routes).
* :class:`AdapterTable`: the adapters served, each with a **stable id** given at load, in turn: the
  ``--lora-modules`` in their order get ``0, 1, ...`` (llama-server's ids of its ``--lora`` files, what a request's
  ``lora: [{"id", "scale"}]`` names), adapters loaded at run time the next ones; ``lora_int_id = id + 1`` is
  vLLM's integer id of an adapter (0: none), what KV events carry as ``lora_id``. An id is never given twice by one
  server, so an adapter unloaded and loaded again gets a new one (its weights may differ). Also llama-server's
  global scales (``POST /lora-adapters``), which a request without ``lora`` naming the base model runs with.
* **One adapter per request**: the graph takes one adapter per row, so a request runs with at most one adapter at
  one scale; ``lora`` listing two adapters with non-zero scales is refused in one line. Scale 0 is the base model.
* :func:`load` / :func:`unload` run on the engine thread, between two turns (the scheduler's control actions); an
  adapter a running or waiting request uses is not unloaded (refused: the request would change under it), and the
  kept sequences of the adapter are dropped before it goes.
"""

from __future__ import annotations

import json
import math
import os
import threading
from dataclasses import dataclass

from qeff_kv.errors import AdapterError, RuntimeInputError

#: vLLM's switch of the load and unload routes, honoured as ``--allow-runtime-lora-updating``
ENV_RUNTIME_UPDATING = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
#: adapters loaded at once when ``--max-loras`` is not given
DEFAULT_MAX_LORAS = 8


@dataclass
class LoraSection:
    """The LoRA section of the serve options (a section of :class:`qeff_kv.serve.config.ServeConfig`)."""
    #: adapters served from the start: ``name=PEFT_DIR`` or ``{"name": .., "path": ..}`` each, in llama-server's id
    #: order (0, 1, ...)
    lora_modules: tuple[str, ...] = ()
    #: adapters loaded at once; loading one more is refused
    max_loras: int = DEFAULT_MAX_LORAS
    #: POST /v1/load_lora_adapter and /v1/unload_lora_adapter (also with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)
    allow_runtime_lora_updating: bool = False

    def __post_init__(self) -> None:
        mods = self.lora_modules
        self.lora_modules = (mods,) if isinstance(mods, str) else tuple(mods or ())

    def modules(self) -> list[tuple[str, str]]:
        """``(name, path)`` of each ``--lora-modules`` entry, in order."""
        return [parse_module(spec) for spec in self.lora_modules]

    def runtime_updating(self) -> bool:
        """Whether the load and unload routes work: the flag, or vLLM's environment variable set true."""
        env = os.environ.get(ENV_RUNTIME_UPDATING, "").strip().lower()
        return bool(self.allow_runtime_lora_updating) or env in ("1", "true", "yes", "on")

    def check(self) -> None:
        """Refuse bad values in one line each, before anything is loaded."""
        if isinstance(self.max_loras, bool) or not isinstance(self.max_loras, int) or self.max_loras < 1:
            raise RuntimeInputError(f"--max-loras must be a positive integer, got {self.max_loras!r}")
        names = [name for name, _ in self.modules()]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise RuntimeInputError(f"--lora-modules names adapter {twice[0]!r} twice")
        if len(names) > self.max_loras:
            raise RuntimeInputError(f"--lora-modules names {len(names)} adapters; --max-loras is {self.max_loras}")


def parse_module(spec: str) -> tuple[str, str]:
    """One ``--lora-modules`` entry: ``name=PEFT_DIR`` or vLLM's JSON ``{"name": .., "path": ..}`` (its
    ``base_model_name`` is accepted and not read: the adapter's own config names its base)."""
    text = str(spec).strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except ValueError:
            obj = None
        if not isinstance(obj, dict) or set(obj) - {"name", "path", "base_model_name"} \
                or not isinstance(obj.get("name"), str) or not isinstance(obj.get("path"), str):
            raise RuntimeInputError(f"--lora-modules {text!r}: the JSON form is {{\"name\": NAME, \"path\": PEFT_DIR}}")
        name, path = obj["name"], obj["path"]
    else:
        name, sep, path = text.partition("=")
        if not sep:
            raise RuntimeInputError(f"--lora-modules {text!r}: give NAME=PEFT_DIR (or {{\"name\": .., \"path\": ..}})")
    if not path.strip():
        raise RuntimeInputError(f"--lora-modules {text!r}: the adapter's folder is empty")
    return check_name(name), path


def check_name(name) -> str:
    """An adapter name: what requests give as ``model`` (1-256 printable characters, no blanks at its ends)."""
    if not isinstance(name, str) or not name or len(name) > 256 or not name.isprintable() or name != name.strip():
        raise AdapterError(f"an adapter name must be 1-256 printable characters without blanks at its ends, got "
                           f"{name!r}")
    return name


@dataclass(frozen=True)
class ServedAdapter:
    """One adapter served: ``id`` (llama-server's, stable, see the module docstring), ``name`` (the model id of
    its requests), ``path`` (the PEFT folder)."""

    id: int
    name: str
    path: str

    @property
    def lora_int_id(self) -> int:
        """vLLM's integer id of the adapter (0 is none): KV events' ``lora_id``."""
        return self.id + 1


class AdapterTable:
    """The adapters a server serves over a graph with adapter inputs (thread-safe: the HTTP threads read it, the
    engine thread changes it). ``base``: the base model's name; ``max_loras``: adapters at once; ``updating``: the
    load and unload routes are on."""

    def __init__(self, base: str, max_loras: int = DEFAULT_MAX_LORAS, updating: bool = False):
        self.base, self.max_loras, self.updating = base, max_loras, updating
        self._lock = threading.Lock()
        self._by_name: dict[str, ServedAdapter] = {}
        self._scales: dict[str, float] = {}   # llama-server's global scales (0: not applied)
        self._next_id = 0
        self._mixed_steps = 0

    # ---- what is served
    def get(self, name) -> ServedAdapter | None:
        with self._lock:
            return self._by_name.get(name) if isinstance(name, str) else None

    def listed(self) -> list[ServedAdapter]:
        """The adapters, by id."""
        with self._lock:
            return sorted(self._by_name.values(), key=lambda a: a.id)

    def names(self) -> list[str]:
        return [a.name for a in self.listed()]

    def lora_id(self, name: str) -> int | None:
        """The ``lora_int_id`` of adapter ``name`` (None: not served)."""
        adapter = self.get(name)
        return None if adapter is None else adapter.lora_int_id

    def add(self, name: str, path: str) -> ServedAdapter:
        """Serve adapter ``name`` from ``path`` under the next id (already read and loaded by the caller)."""
        with self._lock:
            self._check_room(name)
            adapter = ServedAdapter(self._next_id, name, str(path))
            self._next_id += 1
            self._by_name[name] = adapter
            self._scales[name] = 0.0
            return adapter

    def check_room(self, name: str) -> None:
        """Refuse (one line) an adapter ``name`` that cannot be added: a name served already, the base model's,
        or one more than ``--max-loras``."""
        with self._lock:
            self._check_room(name)

    def _check_room(self, name: str) -> None:
        check_name(name)
        if name == self.base:
            raise AdapterError(f"{name!r} is the base model's name; give the adapter another")
        if name in self._by_name:
            raise AdapterError(f"the LoRA adapter {name!r} has already been loaded")
        if len(self._by_name) >= self.max_loras:
            raise AdapterError(f"{len(self._by_name)} adapters are loaded, the most this server holds "
                               f"(--max-loras {self.max_loras}); unload one first")

    def remove(self, name: str) -> None:
        with self._lock:
            self._by_name.pop(name, None)
            self._scales.pop(name, None)

    # ---- llama-server's global scales
    def scales(self) -> list[dict]:
        """``GET /lora-adapters``: ``[{"id", "path", "scale", "name"}]`` by id."""
        with self._lock:
            return [{"id": a.id, "path": a.path, "scale": self._scales.get(a.name, 0.0), "name": a.name}
                    for a in sorted(self._by_name.values(), key=lambda a: a.id)]

    def set_scales(self, pairs) -> None:
        """``POST /lora-adapters``: ``((id, scale), ...)`` become the global scales, every adapter not listed 0;
        at most one non-zero (one adapter per request)."""
        chosen = self.choose(pairs)
        with self._lock:
            self._scales = {n: 0.0 for n in self._by_name}
            if chosen is not None:
                self._scales[chosen[0]] = chosen[1]

    def choose(self, pairs) -> tuple[str, float] | None:
        """The adapter and scale ``((id, scale), ...)`` selects (None: the base model), refused in one line for an
        unknown id or two adapters with non-zero scales."""
        with self._lock:
            by_id = {a.id: a for a in self._by_name.values()}
        picked = []
        for i, scale in pairs:
            if i not in by_id:
                ids = ", ".join(str(k) for k in sorted(by_id)) or "none"
                raise AdapterError(f"no LoRA adapter has id {i} (ids: {ids})")
            if scale != 0:
                picked.append((by_id[i].name, float(scale)))
        if len(picked) > 1:
            raise AdapterError(f"lora gives {len(picked)} adapters a non-zero scale; a request runs with one adapter "
                               "(the graph takes one adapter per row)")
        return picked[0] if picked else None

    # ---- a request
    def resolve(self, model: str | None, pairs) -> tuple[str, float] | None:
        """The adapter and scale a request runs with (None: the base model): ``model`` naming an adapter runs it
        at scale 1 (vLLM); ``pairs``, llama-server's ``lora`` field ``((id, scale), ...)``, choose one (every
        adapter it leaves out at 0); neither: the global scales (``POST /lora-adapters``; all 0 at start)."""
        if model is not None and model != self.base:
            if pairs is not None:
                raise AdapterError("give the adapter either as model or in lora, not both")
            if self.get(model) is None:
                raise AdapterError(f"the LoRA adapter {model!r} is not loaded")
            return model, 1.0
        if pairs is not None:
            return self.choose(pairs)
        with self._lock:
            on = [(n, s) for n, s in self._scales.items() if s != 0]
        return on[0] if on else None

    # ---- figures
    def note_step(self, keys) -> None:
        """A decode step ran rows of these adapter keys: counted when they are more than one."""
        if len(set(keys)) > 1:
            with self._lock:
                self._mixed_steps += 1

    def stats(self) -> dict:
        with self._lock:
            return {"lora_adapters": len(self._by_name), "lora_mixed_steps": self._mixed_steps}


def check_scale(scale) -> float:
    """A finite scale, as a float."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise AdapterError(f"a LoRA scale must be a finite number, got {scale!r}")
    return float(scale)


# ============================================================================================ the session's side
def open_adapters(section: LoraSection, session, base: str) -> AdapterTable | None:
    """The table of a server over ``session``, the ``--lora-modules`` loaded (each read, fitted to the graph:
    a one-line refusal names the first that is not), or None for a graph without adapter inputs (where
    ``--lora-modules`` is refused in one line)."""
    modules = section.modules()
    if not session.lora.enabled:
        if modules:
            raise AdapterError(f"--lora-modules needs a graph with LoRA inputs; {session.files.onnx_path.name} has "
                               "none (export it with --lora name=PEFT_DIR or --max-lora-rank R)")
        return None
    table = AdapterTable(base, section.max_loras, section.runtime_updating())
    for name, path in modules:
        table.check_room(name)
        session.lora.load(name, path)
        table.add(name, path)
    return table


def served_table(section: LoraSection, base: str) -> AdapterTable:
    """The table of an engine whose replicas load the ``--lora-modules`` themselves (the disaggregated engine:
    every replica the same, in the same order, so the ids agree); nothing is updated at run time there."""
    table = AdapterTable(base, section.max_loras, updating=False)
    for name, path in section.modules():
        table.add(name, path)
    return table


def read(path: str, name: str):
    """The PEFT folder ``path`` read as adapter ``name`` (off the engine thread: reading is the slow part)."""
    from qeff_kv.tools.adapters import read_adapter

    return read_adapter(path, name=name)


def load(session, table: AdapterTable, name: str, adapter) -> ServedAdapter:
    """On the engine thread: ``adapter`` (read by :func:`read`) loaded as ``name`` and served."""
    table.check_room(name)
    session.lora.load(name, adapter)
    try:
        return table.add(name, str(adapter.path))
    except BaseException:
        session.lora.unload(name)
        raise


def unload(session, table: AdapterTable, prefix_cache, requests, name: str) -> None:
    """On the engine thread: adapter ``name`` no longer served; refused while one of ``requests`` (the running and
    waiting ones) uses it. Its kept sequences are dropped first."""
    if table.get(name) is None:
        raise AdapterError(f"the LoRA adapter {name!r} cannot be found")
    users = sum(1 for r in requests if r.lora is not None and r.lora[0] == name)
    if users:
        raise AdapterError(f"the LoRA adapter {name!r} is in use by {users} running or waiting request(s); unload it "
                           "when they have finished")
    for seq in [s for s in prefix_cache.kept if s.adapter == name]:
        prefix_cache.evict(seq)
    session.lora.unload(name)
    table.remove(name)


def adopt(session, seq, lora: tuple[str, float] | None) -> None:
    """A sequence imported from a state (a P/D hand-off) runs with the request's adapter key ``lora``: refused in
    one line when the state says another, or when the adapter is not loaded here."""
    name, scale = lora if lora is not None else (None, 1.0)
    held = getattr(seq, "adapter", None)
    if held is not None and (held, float(seq.lora_scale)) != (name, float(scale)):
        raise AdapterError(f"the state was computed with adapter {held!r}, the request runs "
                           f"{'the base model' if name is None else repr(name)}")
    if name is not None:
        session.lora.get(name)   # a one-line refusal when this server does not hold it
    seq.adapter, seq.lora_scale = name, float(scale)
