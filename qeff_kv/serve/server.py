"""Build the engine and the app from a :class:`~.config.ServeConfig`, and run them under uvicorn."""

from __future__ import annotations

import signal

from qeff_kv.errors import Interrupted, RuntimeInputError
from qeff_kv.serve.config import ServeConfig
from qeff_kv.serve.engine.engine import Engine
from qeff_kv.serve.engine.session_from_config import ServedModel, open_session


def build_engine(config: ServeConfig, model: ServedModel | None = None) -> Engine:
    """The local :class:`~.scheduler.Scheduler`, or the disaggregated engine with ``config.disaggregation``;
    ``model``: the export resolved once by the caller (default: resolved here)."""
    model = model or config.served_model()
    if config.disaggregation is not None:
        from qeff_kv.serve.cluster.disagg import start_disaggregated

        return start_disaggregated(model, config.engine, config.disaggregation, config.events, config.lora)
    from qeff_kv.serve.cluster.kv_events import open_publisher
    from qeff_kv.serve.engine.lora import open_adapters
    from qeff_kv.serve.engine.scheduler import Scheduler
    from qeff_kv.serve.http.images import start as start_images

    session = open_session(config.engine, model, speculative=config.speculation is not None)
    adapters = open_adapters(config.lora, session, model.name)   # --lora-modules read and fitted: one-line refusals
    speculation = open_speculation(config, session)
    kv_events = open_publisher(config.events, kv_dtype=session.layout.kv_dtype)   # an int8 cache salts its hashes
    if kv_events is not None and adapters is not None:
        kv_events.lora_ids = adapters.lora_id   # an adapter's blocks carry its lora_int_id
    connector = None
    try:
        if config.pd is not None:   # vLLM's P/D protocol (serve/pd.py): after the session opened, before serving
            from qeff_kv.serve.cluster.pd import start_connector

            connector = start_connector(config.pd, config.http.host, config.http.port)
        eng = config.engine
        engine = Scheduler(session, max_queue=eng.max_queue, reuse_prompts=eng.reuse_prompts, model_name=model.name,
                           prefill_chunk=eng.prefill_chunk, speculation=speculation, kv_events=kv_events,
                           connector=connector, adapters=adapters, deterministic=eng.deterministic)
        engine.vision = open_vision(session, config)   # a vision-language export: images over HTTP (serve/images.py)
        start_images(engine)   # its processor loaded now, once: no request waits for it or races another loading it
        return engine
    except BaseException:
        if kv_events is not None:
            kv_events.close()
        if connector is not None:
            connector.close()
        raise


def open_speculation(config: ServeConfig, session):
    """The speculative decoding ``config.speculation`` asks for around ``session`` (None: plain decoding)."""
    if config.speculation is None:
        return None
    from qeff_kv.serve.engine.speculative_step import Speculation, open_drafting, refusal

    why = refusal(session)   # before a draft export is opened
    if why is not None:
        raise RuntimeInputError(why)
    spec = config.speculation
    return Speculation(session, open_drafting(spec.speculative, session, threads=config.engine.threads),
                       k=spec.speculative_k)


def open_vision(session, config: ServeConfig):
    """The vision-language model around a served language session (None for a text decoder): what turns a chat
    request's images into the session's image inputs."""
    if session.media is None:
        return None
    from qeff_kv.runtime.vision_language import VisionLanguageModel

    return VisionLanguageModel.around(session, threads=config.engine.threads, device=config.engine.device)


def text_facts(config: ServeConfig, model: ServedModel | None = None):
    """Tokenizer, chat template (None when the export has none: chat requests get a 400) and eos ids of the export
    (``model``: resolved once by the caller; default: resolved here)."""
    from qeff_kv.runtime.text.chat import load_chat_template
    from qeff_kv.runtime.text.tokenizer import load_tokenizer
    from qeff_kv.serve.http.app import TextFacts

    model = model or config.served_model()
    if not (model.folder / "tokenizer.json").is_file():
        raise RuntimeInputError(f"qeff-kv serve needs a tokenizer: {model.folder} has no tokenizer.json")
    tok = load_tokenizer(model.folder, required=True)
    try:
        template = load_chat_template(model.folder)
    except RuntimeInputError:
        template = None
    eos = (model.manifest or {}).get("eos_token_id")
    eos_ids = tuple([eos] if isinstance(eos, int) else list(eos or []))
    return TextFacts(tokenizer=tok, chat_template=template, eos_token_ids=eos_ids)


def sampling_defaults(config: ServeConfig, model: ServedModel | None = None):
    """The sampling defaults: the serve flags over the export's generation_config.json over OpenAI's."""
    return config.sampling.resolve((model or config.served_model()).folder)


def check_max_n(config: ServeConfig, engine: Engine) -> int:
    """``--max-n`` (default: the sequences run at once), refused above them: n choices run side by side."""
    return config.http.max_n_for(engine.max_sequences)


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
    :class:`~qeff_kv.errors.Interrupted`. The export is resolved once, here, and handed down."""
    from qeff_kv.support import fsutil
    from qeff_kv.serve.http.drain import Drain, draining_server, exit_code

    check_config(config)
    model = config.served_model()
    text = text_facts(config, model)
    defaults = sampling_defaults(config, model)
    engine = build_engine(config, model)
    http = config.http
    try:
        max_n = check_max_n(config, engine)
        check_text(text, engine)
        sock = bind(http.host, http.port)
        if http.state_dir is not None:
            fsutil.make_dirs(http.state_dir)
        drain = Drain(engine, grace_seconds(http))
        server = draining_server(uvicorn_config(create_app_of(http, engine, text, defaults, drain, max_n, model)),
                                 drain)
        if on_ready is not None:
            on_ready(engine)
        server.run(sockets=[sock])
    finally:
        engine.close()
    if drain.signal is not None and drain.signal != signal.SIGINT:   # Ctrl-C is the usual way to stop: exit 0
        stopped = f"; {drain.stopped_requests} running request(s) stopped with an error" if drain.stopped_requests \
            else "; every running request finished"
        raise Interrupted(f"terminated ({signal_name(drain.signal)}){stopped}", exit_code(drain.signal))


def grace_seconds(http) -> float:
    """``--drain-seconds``, else the drain's default."""
    from qeff_kv.serve.http.drain import DEFAULT_GRACE_S

    return DEFAULT_GRACE_S if http.drain_seconds is None else http.drain_seconds


def create_app_of(http, engine, text, defaults, drain, max_n: int, model: ServedModel | None = None):
    """The app over ``engine`` with the HTTP section's settings (``model``: its aliases and whether any name is
    answered)."""
    from qeff_kv.serve.http.app import create_app
    from qeff_kv.serve.http.bodies import DEFAULT_MAX_REQUEST_BYTES

    return create_app(engine, text=text, api_key=http.api_key, state_dir=http.state_dir, drain=drain,
                      max_request_bytes=http.max_request_bytes or DEFAULT_MAX_REQUEST_BYTES, defaults=defaults,
                      max_n=max_n, allowed_origins=http.allowed_origins, media_path=http.allowed_local_media_path,
                      max_image_pixels=http.max_image_pixels,
                      model_aliases=model.aliases if model is not None else (),
                      accept_any_model_name=model.any_name if model is not None else False)


def signal_name(sig: int) -> str:
    return signal.Signals(sig).name
