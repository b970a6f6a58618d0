"""Entry point of ``qeff-kv``. The one place where library errors become a one-line message and an exit code."""

from __future__ import annotations

import signal
import sys
import threading

import click

from qeff_kv import __version__
from qeff_kv.support import capture
from qeff_kv.errors import QeffKvError


class _OneLineError(click.ClickException):
    """A usage error shown as the project's one line ``error: ...`` (click's own format is four lines)."""

    exit_code = 2

    def show(self, file=None) -> None:
        click.echo(f"error: {self.message}", err=True)


def _one_line(exc: click.ClickException, prog: str | None) -> click.ClickException:
    if isinstance(exc, (_OneLineError, click.exceptions.NoArgsIsHelpError)):
        return exc  # already one line, or a bare command that shows its help
    msg = " ".join(exc.format_message().split())
    if isinstance(exc, click.UsageError):
        ctx = exc.ctx
        name = ctx.command_path if ctx is not None else (prog or "qeff-kv")
        msg = f"{msg} (see '{name} -h')"
    err = _OneLineError(msg)
    err.exit_code = exc.exit_code
    return err


class _Group(click.Group):
    """Turns :class:`QeffKvError` into ``error: <one line>`` on stderr and its exit code (2); click's usage
    errors (unknown option, bad value...) become the same one line with exit code 2.

    ``--debug`` (or ``QEFF_KV_DEBUG=1``) shows the traceback instead.
    """

    def make_context(self, info_name, args, parent=None, **extra):
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except click.ClickException as exc:
            raise _one_line(exc, info_name) from None

    def invoke(self, ctx: click.Context):
        previous = _handle_sigterm()
        try:
            return super().invoke(ctx)
        except click.ClickException as exc:
            raise _one_line(exc, ctx.command_path) from None
        except QeffKvError as exc:
            if ctx.obj and ctx.obj.get("debug"):
                raise
            click.echo(f"error: {exc}", err=True)
            sys.exit(exc.exit_code)
        except Terminated:
            click.echo("error: terminated (SIGTERM); nothing was left half-written", err=True)
            sys.exit(128 + signal.SIGTERM)
        except KeyboardInterrupt:
            click.echo("error: interrupted", err=True)
            sys.exit(130)
        finally:
            if previous is not _LEFT_ALONE:
                signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the program is, like SIGINT's KeyboardInterrupt: every ``finally`` and ``with`` on
    the way out runs (staging folders and temporary files are removed)."""


def _raise_terminated(signum, frame):
    raise Terminated()


def _handle_sigterm():
    """Route SIGTERM to :class:`Terminated` while a command runs (main thread only); returns the handler to
    restore, or :data:`_LEFT_ALONE`."""
    if threading.current_thread() is not threading.main_thread():
        return _LEFT_ALONE
    try:
        return signal.signal(signal.SIGTERM, _raise_terminated)
    except (ValueError, OSError):
        return _LEFT_ALONE


_LEFT_ALONE = object()


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "auto_envvar_prefix": "QEFF_KV"})
@click.version_option(__version__, prog_name="qeff-kv")
@click.option("--debug", is_flag=True,
              help="Show full tracebacks, and what torch and onnxruntime print, instead of one-line errors.")
@click.pass_context
def main(ctx: click.Context, debug: bool) -> None:
    """Export, rewrite, check and run retained-state KV-cache ONNX graphs."""
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug
    capture.set_passthrough(debug)   # --debug: what libraries print is shown, not captured
    if not capture.passthrough():
        capture.quiet_library_warnings()   # --debug: the libraries' warnings too


def _register() -> None:
    from . import export_cmd, generate_cmd, graph_cmds, serve_cmd

    for mod in (export_cmd, graph_cmds, generate_cmd, serve_cmd):
        for cmd in mod.COMMANDS:
            main.add_command(cmd)


_register()

if __name__ == "__main__":  # pragma: no cover
    main()
