"""What the CLI's bad-input tests assert, shared by the tests of every folder that drives ``qeff-kv`` through click's
runner: one ``error: ...`` line, the exit code, no traceback, nothing written (tests/cli/test_bad_inputs.py)."""

from __future__ import annotations

import stat
from pathlib import Path

from click.testing import CliRunner

from qeff_kv_cli.main import main


def cli(*args, env=None):
    return CliRunner().invoke(main, [str(a) for a in args], env=env)


def one_error(res, *needles, code: int = 2) -> str:
    """Exit ``code``, exactly one stderr line ``error: ...`` naming every needle, no traceback."""
    assert res.exit_code == code, (res.exit_code, res.output, res.exception)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("error: "), lines[0]
    for n in needles:
        assert n in lines[0], (n, lines[0])
    assert "Traceback" not in res.output
    assert not isinstance(res.exception, Exception) or isinstance(res.exception, SystemExit)
    return lines[0]


def tree(folder: Path) -> dict[str, tuple]:
    """Every entry under ``folder`` with its kind, size and mtime: to assert nothing was written."""
    out = {}
    for p in sorted(folder.rglob("*")):
        st_ = p.lstat()
        out[str(p.relative_to(folder))] = (stat.S_IFMT(st_.st_mode), st_.st_size, st_.st_mtime_ns)
    return out
