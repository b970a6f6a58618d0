"""What a fresh machine installs (docs/dependencies.md): every requirement of pyproject has a tested upper bound,
constraints.txt pins every one of them inside its range, and the README's commands and .ci/run install with it."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

packaging = pytest.importorskip("packaging.requirements")
from packaging.requirements import Requirement  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def _key(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirements() -> list[tuple[str, Requirement]]:
    out = [("core", Requirement(r)) for r in PROJECT["dependencies"]]
    for extra, reqs in PROJECT["optional-dependencies"].items():
        out += [(extra, Requirement(r)) for r in reqs if not r.startswith("qeff-kv[")]
    return out


def _pins() -> dict[str, str]:
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not NAME==VERSION"
            pins[_key(name)] = version
    return pins


def test_every_requirement_has_a_tested_upper_bound():
    loose = [f"{extra}: {req}" for extra, req in _requirements()
             if not any(s.operator in ("<", "<=", "==", "~=") for s in req.specifier)]
    assert loose == []


def test_constraints_pin_every_requirement_inside_its_range():
    pins = _pins()
    missing = [f"{extra}: {req.name}" for extra, req in _requirements() if _key(req.name) not in pins]
    assert missing == []
    outside = [f"{extra}: {req} vs {pins[_key(req.name)]}" for extra, req in _requirements()
               if not req.specifier.contains(pins[_key(req.name)], prereleases=True)]
    assert outside == []


def test_readme_and_ci_install_with_the_constraints():
    readme = (REPO / "README.md").read_text()
    installs = [i for i in re.findall(r"pip install [^&\n]*", readme) if "--no-deps" not in i]
    assert installs, "the README has no install command"
    assert [i for i in installs if "-c constraints.txt" not in i] == []
    ci = (REPO / ".ci" / "run").read_text()
    assert "-c constraints.txt" in ci
    test_command = next(line for line in readme.splitlines() if "python -m pytest" in line)
    assert test_command in ci   # .ci/run runs exactly the README's test command
