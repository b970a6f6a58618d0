"""Build the engine and the app from a :class:`~.config.ServeConfig`, and run them under uvicorn."""

from __future__ import annotations

import signal

from qeff_kv.errors import Interrupted, RuntimeInputError
from qeff_kv.serve.config import ServeConfig
from qeff_kv.serve.engine.engine import Engine
from qeff_kv.serve.engine.session_from_config import model_name_of, open_session

def build_engine(config: ServeConfig) -> Engine:
    """The local :class:`~.scheduler.Scheduler`, or the disaggregated engine with ``config.disaggregate``."""
    if config.disaggregate:
        from qeff_kv.serve.cluster.disagg import start_disaggregated

        return start_disaggregated(config)
    from qeff_kv.serve.cluster.kv_events import open_publisher
    from qeff_kv.serve.engine.scheduler import Scheduler

    session = open_session(config)
    speculation = None
    if config.speculative is not None:
        from qeff_kv.serve.engine.speculative_step import Speculation, open_drafting, refusal

        why = refusal(session)   # before a draft export is opened
        if why is not None:
            raise RuntimeInputError(why)
        speculation = Speculation(session, open_drafting(config.speculative, session, threads=config.threads),
                                  k=config.speculative_k)
    kv_events = open_publisher(config)
    connector = None
    try:
        if config.kv_role is not None:   # vLLM's P/D protocol (serve/pd.py): after the session opened, before serving
            from qeff_kv.serve.cluster.pd import start_connector

            connector = start_connector(config)
        engine = Scheduler(session, max_queue=config.max_queue, reuse_prompts=config.reuse_prompts,
                           model_name=config.model_name or model_name_of(config.export_dir),
                           prefill_chunk=config.prefill_chunk, speculation=speculation, kv_events=kv_events,
                           connector=connector)
        engine.vision = open_vision(session, config)   # a vision-language export: images over HTTP (serve/images.py)
        return engine
    except BaseException:
        if kv_events is not None:
            kv_events.close()
        if connector is not None:
            connector.close()
        raise


def open_vision(session, config: ServeConfig):
    """The vision-language model around a served language session (None for a text decoder): what turns a chat
    request's images into the session's image inputs."""
    if session.media is None:
        return None
    from qeff_kv.runtime.vision_language import VisionLanguageModel

    return VisionLanguageModel.around(session, threads=config.threads, device=config.device)


def text_facts(config: ServeConfig):
    """Tokenizer, chat template (None when the export has none: chat requests get a 400) and eos ids."""
    from qeff_kv.runtime.text.chat import load_chat_template
    from qeff_kv.runtime.text.tokenizer import load_tokenizer
    from qeff_kv.runtime.model_files import resolve_model
    from qeff_kv.serve.http.app import TextFacts

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
    from qeff_kv.runtime.model_files import resolve_model
    from qeff_kv.serve.engine.defaults import resolve_defaults

    return resolve_defaults(resolve_model(config.export_dir).folder, config.sampling_flags())


def check_max_n(config: ServeConfig, engine: Engine) -> int:
    """``--max-n`` (default: the sequences run at once), refused above them: n choices run side by side."""
    if config.max_n is None:
        return engine.max_sequences
    if config.max_n > engine.max_sequences:
        raise RuntimeInputError(f"--max-n {config.max_n}: the server runs {engine.max_sequences} sequences at once; "
                                f"give at most that (or more --max-sequences)")
    return config.max_n


def check_config(config: ServeConfig) -> None:
    """:meth:`ServeConfig.check`: bad options refused before anything is loaded (one line each)."""
    config.check()


def check_text(text, engine) -> None:
    """The tokenizer gives no id the model cannot read (a tokenizer of another model, or a larger vocabulary)."""
    vocab = getattr(engine, "vocab_size", None)
    if vocab is None:
        vocab = getattr(getattr(engine, "session", None), "vocab_size", None)
    get_vocab = getattr(text.tokenizer, "get_vocab", None)
    ids = get_vocab(with_added_tokens=True).values() if get_vocab is not None else ()
    size = max(ids) + 1 if ids else None
    if vocab and size and size > vocab:
        raise RuntimeInputError(f"the tokenizer's ids reach {size - 1}, the model's vocabulary holds {vocab}: ids >= "
                                f"{vocab} would be refused mid-request (a tokenizer of another model?)")


def bind(host: str, port: int):
    """The listening socket (bound before the server says it serves: a port in use is one line)."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise RuntimeInputError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    except (TypeError, ValueError, UnicodeError) as exc:   # e.g. a host name socket cannot read
        sock.close()
        raise RuntimeInputError(f"cannot listen on {host}:{port}: {exc}") from None
    return sock


def uvicorn_config(app, **kw):
    """uvicorn's settings for the app: its h11 protocol answering malformed requests in OpenAI's error shape."""
    import uvicorn

    from qeff_kv.serve.http.http_errors import JsonErrorH11Protocol

    kw.setdefault("log_level", "warning")
    kw.setdefault("timeout_graceful_shutdown", 5)
    if JsonErrorH11Protocol is not None:
        kw.setdefault("http", JsonErrorH11Protocol)
    return uvicorn.Config(app, **kw)


def serve(config: ServeConfig, *, on_ready=None) -> None:
    """Run the server until SIGTERM or SIGINT, which drain it (:mod:`.drain`), then close the engine and raise
    :class:`~qeff_kv.errors.Interrupted`."""
    from qeff_kv.support import fsutil
    from qeff_kv.serve.http.app import create_app
    from qeff_kv.serve.http.bodies import DEFAULT_MAX_REQUEST_BYTES
    from qeff_kv.serve.http.drain import DEFAULT_GRACE_S, Drain, draining_server, exit_code

    check_config(config)
    text = text_facts(config)
    defaults = sampling_defaults(config)
    engine = build_engine(config)
    try:
        max_n = check_max_n(config, engine)
        check_text(text, engine)
        sock = bind(config.host, config.port)
        if config.state_dir is not None:
            fsutil.make_dirs(config.state_dir)
        drain = Drain(engine, DEFAULT_GRACE_S if config.drain_seconds is None else config.drain_seconds)
        app = create_app(engine, text=text, api_key=config.api_key, state_dir=config.state_dir, drain=drain,
                         max_request_bytes=config.max_request_bytes or DEFAULT_MAX_REQUEST_BYTES,
                         defaults=defaults, max_n=max_n, allowed_origins=config.allowed_origins,
                         media_path=config.allowed_local_media_path)
        server = draining_server(uvicorn_config(app), drain)
        if on_ready is not None:
            on_ready(engine)
        server.run(sockets=[sock])
    finally:
        engine.close()
    if drain.signal is not None and drain.signal != signal.SIGINT:   # Ctrl-C is the usual way to stop: exit 0
        stopped = f"; {drain.stopped_requests} running request(s) stopped with an error" if drain.stopped_requests \
            else "; every running request finished"
        raise Interrupted(f"terminated ({signal_name(drain.signal)}){stopped}", exit_code(drain.signal))


def signal_name(sig: int) -> str:
    return signal.Signals(sig).name
