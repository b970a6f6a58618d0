"""Entry point of ``qeff-kv``. The one place where library errors become a one-line message and an exit code."""

from __future__ import annotations

import sys

import click

from qeff_kv import __version__
from qeff_kv.errors import QeffKvError


class _Group(click.Group):
    """Turns :class:`QeffKvError` into ``error: <one line>`` on stderr and its exit code (2).

    ``--debug`` (or ``QEFF_KV_DEBUG=1``) shows the traceback instead.
    """

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except QeffKvError as exc:
            if ctx.obj and ctx.obj.get("debug"):
                raise
            click.echo(f"error: {exc}", err=True)
            sys.exit(exc.exit_code)
        except KeyboardInterrupt:
            click.echo("error: interrupted", err=True)
            sys.exit(130)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "auto_envvar_prefix": "QEFF_KV"})
@click.version_option(__version__, prog_name="qeff-kv")
@click.option("--debug", is_flag=True, help="Show full tracebacks instead of one-line errors.")
@click.pass_context
def main(ctx: click.Context, debug: bool) -> None:
    """Export, rewrite, check and run retained-state KV-cache ONNX graphs."""
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug


def _register() -> None:
    from . import export_cmd, generate_cmd, graph_cmds

    for mod in (export_cmd, graph_cmds, generate_cmd):
        for cmd in mod.COMMANDS:
            main.add_command(cmd)


_register()

if __name__ == "__main__":  # pragma: no cover
    main()
