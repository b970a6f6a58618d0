"""The session a serving engine drives, opened from a :class:`~.config.ServeConfig` (shared by the local
scheduler and the disaggregated replicas, below both)."""

from __future__ import annotations

from pathlib import Path

from qeff_kv.errors import RuntimeInputError
from qeff_kv.serve.config import ServeConfig

#: sequences served at once on a graph without batch_index (lock step) when --max-sequences is not given
DEFAULT_LOCKSTEP_SEQUENCES = 4


def open_session(config: ServeConfig, export: str | None = None):
    """The session for ``config`` (``export``: another export folder, e.g. the prefill replicas'), warmed up
    (:meth:`~qeff_kv.runtime.Session.warm_up`: the first requests do not pay onnxruntime's first-run costs)."""
    session = _open(config, export)
    _check_checkpoint_options(config, session, export)
    session.warm_up()
    return session


def open_prefill_session(config: ServeConfig, export: str):
    """The session of a disaggregated prefill replica on ``export``: the export's own sequence count (the replica
    prefills one request at a time and keeps the rest for prompt reuse) with the serving options that shape the
    cache, the chunking and the recurrent checkpoints (``--checkpoint-every``, ``--max-checkpoints``: prompt reuse
    on the prefill replica returns to them, as on a single host)."""
    from qeff_kv.runtime import Session

    session = Session(export, **session_options(config))
    _check_checkpoint_options(config, session, export)
    session.warm_up()
    return session


def session_options(config: ServeConfig) -> dict:
    """The :class:`~qeff_kv.runtime.Session` keywords every serving session takes from ``config`` (the checkpoint
    options only where given: a graph without recurrent state takes none)."""
    kw = dict(ctx_len=config.ctx_len, prefill_seq_len=config.prefill_seq_len, threads=config.threads,
              device=config.device)
    if config.checkpoint_every is not None or config.max_checkpoints is not None:
        kw.update(checkpoint_every=config.checkpoint_every, max_checkpoints=config.max_checkpoints)
    return kw


def _check_checkpoint_options(config: ServeConfig, session, export: str | None) -> None:
    if (config.checkpoint_every is not None or config.max_checkpoints is not None) and not session.recurrent:
        raise RuntimeInputError("--checkpoint-every and --max-checkpoints go with a recurrent or hybrid export; "
                                f"{Path(export or config.export_dir).name} has no recurrent state")


def _open(config: ServeConfig, export: str | None):
    from qeff_kv.runtime import Session

    model = export or config.export_dir
    kw = session_options(config)
    if config.max_sequences is not None:
        return Session(model, max_sequences=config.max_sequences, **kw)
    # continuous-batching graphs: the manifest's full_batch_size; others: a few rows in lock step where possible
    # (not with speculative decoding: lock-step rows cannot verify drafts, so one sequence)
    session = Session(model, **kw)
    if session.continuous_batching or session.max_sequences > 1 or config.speculative is not None:
        return session
    del session
    try:
        return Session(model, max_sequences=DEFAULT_LOCKSTEP_SEQUENCES, **kw)
    except RuntimeInputError as exc:
        if "lock-step" not in str(exc):
            raise
        return Session(model, **kw)


def model_name_of(export_dir: str) -> str:
    p = Path(export_dir).resolve()
    return p.name if p.is_dir() else p.stem
