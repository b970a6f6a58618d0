"""Keep what libraries print out of the user's terminal: one refusal is one line.

torch's ONNX exporter prints the whole traced graph (hundreds of lines) to stdout before raising on an operator it
cannot express; onnxruntime logs its own error line (from C++, to file descriptor 2) before raising on a graph it
cannot load. :func:`library_output` runs such a call with Python's ``sys.stdout``/``sys.stderr`` *and* file
descriptors 1 and 2 sent to a temporary file: on success the text is dropped, on an exception it is attached to it
as ``exc.library_output`` (the one-line message stays as it is).

``qeff-kv --debug`` (or ``QEFF_KV_DEBUG=1``) turns capturing off (:func:`set_passthrough`): the libraries' full text
is then printed where it happens, with the traceback. Capturing redirects process-wide file descriptors, so it
stands aside while a non-daemon thread other than the main one runs (a multi-threaded host keeps the libraries'
output in its own logs); daemon threads (tqdm's monitor, Ray's, a server's) do not stop it.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import tempfile
import threading
from typing import Iterator

_PASSTHROUGH = False


def set_passthrough(on: bool) -> None:
    """``True``: :func:`library_output` captures nothing (``--debug``)."""
    global _PASSTHROUGH
    _PASSTHROUGH = bool(on)


#: packages whose own warnings (deprecations, tracer notes) are theirs to fix, not the user's to read
LIBRARIES = r"(torch|transformers|onnx|onnxscript|onnx_ir|onnxruntime|huggingface_hub|accelerate|gguf|tokenizers|" \
            r"safetensors|numpy|ray|uvicorn|fastapi|starlette|pydantic)(\.|$)"


def quiet_library_warnings() -> None:
    """Keep the libraries' Python warnings out of a command's output (``--debug`` shows them): every warning
    raised from a library module, and every FutureWarning or DeprecationWarning wherever it is attributed (a
    decorator's ``stacklevel`` often names the caller's frame). qeff-kv's own warnings still show."""
    import warnings

    warnings.filterwarnings("ignore", module=LIBRARIES)
    for category in (FutureWarning, DeprecationWarning, PendingDeprecationWarning):
        warnings.filterwarnings("ignore", category=category)


def passthrough() -> bool:
    return _PASSTHROUGH or os.environ.get("QEFF_KV_DEBUG", "") not in ("", "0")


#: onnxruntime's log severities: 2 warning, 3 error, 4 fatal
ORT_WARNING, ORT_FATAL = 2, 4


def onnxruntime_log_severity() -> int:
    """The least severity onnxruntime's own loggers (a session's ``log_severity_level``, the default logger's
    ``set_default_logger_severity``) print at: fatal only, so its ``[E:onnxruntime...]`` lines (a node that fails
    at run time logs one from C++ before the exception we turn into one line) never reach the terminal; with
    ``--debug`` its warnings and errors show too."""
    return ORT_WARNING if passthrough() else ORT_FATAL


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        with contextlib.suppress(Exception):
            if stream is not None:
                stream.flush()
    with contextlib.suppress(Exception):   # C stdio buffers (std::cout, printf) of the libraries
        import ctypes

        ctypes.CDLL(None).fflush(None)


def _other_threads() -> bool:
    """Whether a thread other than the main one is working for the host: a non-daemon thread (a host's own
    workers). Daemon threads (tqdm's monitor that a transformers progress bar leaves running, Ray's and a
    server's background threads) do not stop capturing: a command line that loaded a model keeps its one line."""
    main = threading.main_thread()
    return any(t is not main and not t.daemon and t.is_alive() for t in threading.enumerate())


@contextlib.contextmanager
def library_output() -> Iterator[None]:
    """Capture everything printed inside (Python streams and file descriptors 1 and 2).

    Not while a non-daemon thread other than the main one runs (see the module docstring)."""
    if passthrough() or _other_threads():
        yield
        return
    _flush()
    py_text = io.StringIO()
    with tempfile.TemporaryFile() as fd_text:
        saved = []
        try:
            for fd in (1, 2):
                saved.append((fd, os.dup(fd)))
                os.dup2(fd_text.fileno(), fd)
        except OSError:   # no such descriptors (an embedding host): capture the Python streams only
            for fd, copy in saved:
                os.dup2(copy, fd)
                os.close(copy)
            saved = []
        try:
            with contextlib.redirect_stdout(py_text), contextlib.redirect_stderr(py_text):
                yield
        except BaseException as exc:
            _flush()
            fd_text.seek(0)
            text = fd_text.read().decode("utf-8", "replace") + py_text.getvalue()
            with contextlib.suppress(AttributeError, TypeError):
                exc.library_output = text
            raise
        finally:
            _flush()
            for fd, copy in saved:
                os.dup2(copy, fd)
                os.close(copy)
