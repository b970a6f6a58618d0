"""Build the engine and the app from a :class:`~.config.ServeConfig`, and run them under uvicorn."""

from __future__ import annotations

from pathlib import Path

from ..errors import RuntimeInputError
from .config import ServeConfig
from .engine import Engine
from .sessions import model_name_of, open_session

def build_engine(config: ServeConfig) -> Engine:
    """The local :class:`~.scheduler.Scheduler`, or the disaggregated engine with ``config.disaggregate``."""
    if config.disaggregate:
        from .disagg import start_disaggregated

        return start_disaggregated(config)
    from .scheduler import Scheduler

    session = open_session(config)
    speculation = None
    if config.speculative is not None:
        from .speculation import Speculation, open_drafting, refusal

        why = refusal(session)   # before a draft export is opened
        if why is not None:
            raise RuntimeInputError(why)
        speculation = Speculation(session, open_drafting(config.speculative, session, threads=config.threads),
                                  k=config.speculative_k)
    return Scheduler(session, max_queue=config.max_queue, reuse_prompts=config.reuse_prompts,
                     model_name=config.model_name or model_name_of(config.export_dir),
                     prefill_chunk=config.prefill_chunk, speculation=speculation)


def text_facts(config: ServeConfig):
    """Tokenizer, chat template (None when the export has none: chat requests get a 400) and eos ids."""
    from ..runtime.chat import load_chat_template
    from ..runtime.generate import load_tokenizer
    from ..runtime.model_files import resolve_model
    from .app import TextFacts

    files = resolve_model(config.export_dir)
    if not (files.folder / "tokenizer.json").is_file():
        raise RuntimeInputError(f"qeff-kv serve needs a tokenizer: {files.folder} has no tokenizer.json")
    tok = load_tokenizer(files.folder, required=True)
    try:
        template = load_chat_template(files.folder)
    except RuntimeInputError:
        template = None
    eos = (files.manifest or {}).get("eos_token_id")
    eos_ids = tuple([eos] if isinstance(eos, int) else list(eos or []))
    return TextFacts(tokenizer=tok, chat_template=template, eos_token_ids=eos_ids)


def sampling_defaults(config: ServeConfig):
    """The sampling defaults: the serve flags over the export's generation_config.json over OpenAI's."""
    from ..runtime.model_files import resolve_model
    from .defaults import resolve_defaults

    flags = {k: getattr(config, k) for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                                             "max_tokens")}
    return resolve_defaults(resolve_model(config.export_dir).folder, flags)


def check_max_n(config: ServeConfig, engine: Engine) -> int:
    """``--max-n`` (default: the sequences run at once), refused above them: n choices run side by side."""
    if config.max_n is None:
        return engine.max_sequences
    if config.max_n > engine.max_sequences:
        raise RuntimeInputError(f"--max-n {config.max_n}: the server runs {engine.max_sequences} sequences at once; "
                                f"give at most that (or more --max-sequences)")
    return config.max_n


def check_config(config: ServeConfig) -> None:
    """Refuse bad options before anything is loaded (one line each)."""
    if config.state_dir is not None:
        d = Path(config.state_dir)
        if d.exists() and not d.is_dir():
            raise RuntimeInputError(f"--state-dir {d}: not a folder")
        d.mkdir(parents=True, exist_ok=True)
    if config.api_key is not None and not config.api_key.strip():
        raise RuntimeInputError("--api-key is empty")
    if not 0 <= config.port <= 65535:
        raise RuntimeInputError(f"--port must be in [0, 65535], got {config.port}")
    if config.speculative is not None and config.disaggregate:
        raise RuntimeInputError("--speculative does not go with --disaggregate (the decode replicas decode plainly)")
    if config.speculative_k is not None and config.speculative is None:
        raise RuntimeInputError("--speculative-k goes with --speculative")


def serve(config: ServeConfig, *, on_ready=None) -> None:
    """Run the server until interrupted (uvicorn), then close the engine."""
    import uvicorn

    from .app import create_app

    check_config(config)
    text = text_facts(config)
    defaults = sampling_defaults(config)
    engine = build_engine(config)
    try:
        max_n = check_max_n(config, engine)
        app = create_app(engine, text=text, api_key=config.api_key, state_dir=config.state_dir, defaults=defaults,
                         max_n=max_n, allowed_origins=config.allowed_origins)
        if on_ready is not None:
            on_ready(engine)
        uvicorn.run(app, host=config.host, port=config.port, log_level="warning", timeout_graceful_shutdown=5)
    finally:
        engine.close()
