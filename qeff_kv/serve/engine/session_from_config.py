"""The engine's sections of the serve options (sections of :class:`qeff_kv.serve.config.ServeConfig`), the served
model resolved once, and the session a serving engine drives, opened from them (shared by the local scheduler and
the disaggregated replicas, below both).

* :class:`EngineSection`: what shapes the session and the scheduler (sequences, threads, device, queue, context,
  chunking, prompt reuse, recurrent checkpoints, the model's name);
* :class:`SpeculativeSection`: speculative decoding (absent: plain decoding);
* :class:`ServedModel`: the export resolved once at start-up (its path, folder, manifest and served name), handed
  down to the local engine, the disaggregated replicas and the HTTP front end.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from qeff_kv.errors import RuntimeInputError
from qeff_kv.runtime.execution import ep_proofs

#: sequences served at once on a graph without batch_index (lock step) when --max-sequences is not given
DEFAULT_LOCKSTEP_SEQUENCES = 4


@dataclass
class EngineSection:
    #: sequences generated at once (slots of a continuous-batching graph, or rows run in lock step); default:
    #: the export's full_batch_size, else 4
    max_sequences: int | None = None
    #: onnxruntime intra-op threads (default: onnxruntime's choice)
    threads: int | None = None
    #: where the graph runs: "cpu", or "cuda" (for the kinds proved there: qeff_kv/runtime/execution/ep_proofs.py)
    device: str = "cpu"
    #: requests waiting for a sequence slot beyond which new ones get 429
    max_queue: int = 64
    ctx_len: int | None = None
    prefill_seq_len: int | None = None
    #: prompt tokens fed per engine turn, between two decode steps (default: the prefill length), or "auto"
    prefill_chunk: int | str | None = None
    #: keep finished sequences and start new prompts from their longest common prefix
    reuse_prompts: bool = True
    #: batch-invariant serving: a request's tokens equal the same request alone (one graph run per sequence and
    #: decode step, exact prompt reuse, chunks of whole prefill lengths)
    deterministic: bool = False
    #: recurrent/hybrid graphs: checkpoint the recurrent state every N positions, keep at most N per sequence
    #: (None: the runtime's defaults); prompt reuse returns to checkpoints
    checkpoint_every: int | None = None
    max_checkpoints: int | None = None
    #: the name /v1/models lists and requests give as "model" (default: the export folder's name)
    model_name: str | None = None
    #: vLLM's --served-model-name NAME [NAME ...]: the first is the name answers report and /v1/models lists
    #: first, the others aliases requests may give (listed too); a string is one name
    served_model_name: list[str] | str | None = None
    #: llama-server's behaviour: a request naming any other model is answered by this one (its answer repeats the
    #: name asked for); a LoRA adapter's name still selects the adapter
    accept_any_model_name: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.served_model_name, str):
            self.served_model_name = [self.served_model_name]
        elif self.served_model_name is not None:   # a list or tuple; empty (the command line's default): none
            self.served_model_name = list(self.served_model_name) or None

    def check(self) -> None:
        """Refuse bad values in one line each, before anything is loaded."""
        ep_proofs.require(ep_proofs.resolve(self.device, None))   # a device proved for no graph kind: refused now
        if self.model_name is not None:
            _check_name(self.model_name, "--model-name")
        if self.deterministic and self.prefill_chunk == "auto":
            raise RuntimeInputError("--deterministic does not go with --prefill-chunk auto (its chunks follow the "
                                    "timing); give a number of tokens")
        if self.served_model_name is not None:
            if self.model_name is not None:
                raise RuntimeInputError("give --served-model-name or --model-name, not both")
            for name in self.served_model_name:
                _check_name(name, "--served-model-name")
            if len(set(self.served_model_name)) != len(self.served_model_name):
                raise RuntimeInputError(f"--served-model-name: a name given twice in {self.served_model_name}")

    def names(self) -> tuple[str, ...]:
        """The names given (``--served-model-name``, else ``--model-name``); empty: the export's name."""
        if self.served_model_name:
            return tuple(self.served_model_name)
        return (self.model_name,) if self.model_name is not None else ()

    def session_options(self) -> dict:
        """The :class:`~qeff_kv.runtime.Session` keywords every serving session takes from the section (the
        checkpoint options only where given: a graph without recurrent state takes none)."""
        kw = dict(ctx_len=self.ctx_len, prefill_seq_len=self.prefill_seq_len, threads=self.threads,
                  device=self.device)
        if self.checkpoint_every is not None or self.max_checkpoints is not None:
            kw.update(checkpoint_every=self.checkpoint_every, max_checkpoints=self.max_checkpoints)
        return kw


def _check_name(name, flag: str) -> None:
    if not isinstance(name, str) or not name.strip() or len(name) > 256 or not name.isprintable():
        raise RuntimeInputError(f"{flag} must be 1-256 printable characters, got {name!r}")


@dataclass
class SpeculativeSection:
    """Present with ``--speculative``."""
    #: speculative decoding on a graph exported with --speculative-tokens K: "lookup" (prompt lookup) or the
    #: folder of a draft export of the same tokenizer
    speculative: str
    #: drafts per sequence and step (default and maximum: the graph's K)
    speculative_k: int | None = None

    #: the field whose value turns the section on
    SWITCH = "speculative"

    @staticmethod
    def refuse_without(given: list[str]) -> None:
        """Options of the section given while it is absent: refused in one line."""
        if given:
            raise RuntimeInputError("--speculative-k goes with --speculative")

    def check(self) -> None:
        """Nothing to refuse before the export is read (the drafts are checked against the graph's K then)."""


@dataclass(frozen=True)
class ServedModel:
    """The export served, resolved once at start-up."""
    #: the export folder or .onnx file as given (what a :class:`~qeff_kv.runtime.Session` opens)
    path: str
    #: the export's folder (tokenizer, chat template, generation_config.json)
    folder: Path
    #: the export's manifest (None: a graph without one)
    manifest: dict | None
    #: the name answers report and /v1/models lists first (``--served-model-name``'s first, ``--model-name``,
    #: else the export's name)
    name: str
    #: further names requests may give (``--served-model-name``'s others)
    aliases: tuple[str, ...] = ()
    #: any other name is this model too (``--accept-any-model-name``)
    any_name: bool = False


def served_model(export: str, model_name: str | None = None, aliases=(), any_name: bool = False) -> ServedModel:
    """``export`` resolved (a one-line error for a bad path) into the :class:`ServedModel`."""
    from qeff_kv.runtime.model_files import resolve_model

    files = resolve_model(export)
    return ServedModel(path=export, folder=files.folder, manifest=files.manifest,
                       name=model_name or model_name_of(export), aliases=tuple(aliases), any_name=any_name)


def open_session(section: EngineSection, model: ServedModel | str, *, speculative: bool = False):
    """The session of ``model`` with the ``section``'s options (``speculative``: one sequence by default, as
    lock-step rows cannot verify drafts), warmed up (:meth:`~qeff_kv.runtime.Session.warm_up`: the first requests
    do not pay onnxruntime's first-run costs)."""
    path = model if isinstance(model, str) else model.path
    session = _open(section, path, speculative)
    _check_checkpoint_options(section, session, path)
    session.warm_up()
    return session


def open_prefill_session(section: EngineSection, model: ServedModel | str):
    """The session of a disaggregated prefill replica on ``model``: the export's own sequence count (the replica
    prefills one request at a time and keeps the rest for prompt reuse) with the serving options that shape the
    cache, the chunking and the recurrent checkpoints (``--checkpoint-every``, ``--max-checkpoints``: prompt reuse
    on the prefill replica returns to them, as on a single host)."""
    from qeff_kv.runtime import Session

    path = model if isinstance(model, str) else model.path
    session = Session(path, **section.session_options())
    _check_checkpoint_options(section, session, path)
    session.warm_up()
    return session


def _check_checkpoint_options(section: EngineSection, session, path: str) -> None:
    if (section.checkpoint_every is not None or section.max_checkpoints is not None) and not session.recurrent:
        raise RuntimeInputError("--checkpoint-every and --max-checkpoints go with a recurrent or hybrid export; "
                                f"{Path(path).name} has no recurrent state")


def _open(section: EngineSection, path: str, speculative: bool):
    from qeff_kv.runtime import Session

    kw = section.session_options()
    if section.max_sequences is not None:
        return Session(path, max_sequences=section.max_sequences, **kw)
    # continuous-batching graphs: the manifest's full_batch_size; others: a few rows in lock step where possible
    # (not with speculative decoding: lock-step rows cannot verify drafts, so one sequence)
    session = Session(path, **kw)
    if session.continuous_batching or session.max_sequences > 1 or speculative:
        return session
    del session
    try:
        return Session(path, max_sequences=DEFAULT_LOCKSTEP_SEQUENCES, **kw)
    except RuntimeInputError as exc:
        if "lock-step" not in str(exc):
            raise
        return Session(path, **kw)


def model_name_of(export_dir: str) -> str:
    p = Path(export_dir).resolve()
    return p.name if p.is_dir() else p.stem
