"""The house rules that a reader of the code relies on (docs/architecture.md): no import circle inside
``qeff_kv`` (counting imports inside functions too), imports only down the documented layers, no module over
~500 lines, targets behind one registry."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "qeff_kv"
#: no module over 500 lines (issue 38)
MAX_LINES = 500
#: no function over 60 lines anywhere in the package: a function (docstring and decorators' body included) of more
#: is split by responsibility (issue 38)
MAX_FUNCTION_LINES = 60
#: what ``ls`` shows: the layers as folders, a few loose modules at the package's top, short folders (issue 38)
MAX_LOOSE_AT_TOP = 6
MAX_MODULES_IN_A_FOLDER = 15


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    """``module -> the qeff_kv modules it imports`` (any import statement anywhere in the file)."""
    modules = {_module_name(p): p for p in PKG.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[:len(base) - (node.level - 1)]
                    stem = ".".join(base + ([node.module] if node.module else []))
                else:
                    stem = node.module or ""
                targets = [stem] + [f"{stem}.{a.name}" for a in node.names]
            for t in targets:
                if t in modules and t != mod:
                    graph[mod].add(t)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _is_package_reexport(a: str, b: str) -> bool:
    """A package's ``__init__`` re-exporting its own submodule is not a circle of meaning."""
    return b.startswith(a + ".") or a.startswith(b + ".")


def test_no_import_circle_in_the_exporter():
    graph = import_graph()
    export = {m: {t for t in ts if t.startswith("qeff_kv.export") and not _is_package_reexport(m, t)}
              for m, ts in graph.items() if m.startswith("qeff_kv.export")}
    assert cycles(export) == []


def test_no_import_circle_in_the_package():
    graph = import_graph()
    assert cycles({m: {t for t in ts if not _is_package_reexport(m, t)} for m, ts in graph.items()}) == []


def test_cycle_finder_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_over_the_limit():
    long = {str(p.relative_to(PKG)): n for p in PKG.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_the_package_top_shows_the_layers():
    """``ls qeff_kv/``: the layer folders and at most six loose modules (the package, errors, the public doors)."""
    loose = sorted(p.name for p in PKG.glob("*.py"))
    assert len(loose) <= MAX_LOOSE_AT_TOP, loose
    folders = {p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert {"contract", "graph", "tools", "support", "export", "runtime", "serve"} <= folders


def test_no_folder_holds_more_than_15_modules():
    crowded = {str(d.relative_to(PKG)) or ".": n for d in [PKG, *PKG.rglob("*")] if d.is_dir()
               and (n := len(list(d.glob("*.py")))) > MAX_MODULES_IN_A_FOLDER}
    assert crowded == {}


def test_the_public_doors_are_the_modules_they_name():
    """``qeff_kv.naming``, ``qeff_kv.rewrite`` and ``qeff_kv.testing`` (documented imports) are the very modules
    of their layer folders, not copies."""
    import importlib
    for door, home in [("naming", "contract.naming"), ("rewrite", "tools.rewrite"), ("testing", "tools.testing")]:
        assert importlib.import_module(f"qeff_kv.{door}") is importlib.import_module(f"qeff_kv.{home}")


def long_functions(folder: Path, limit: int = MAX_FUNCTION_LINES, root: Path = PKG) -> dict[str, int]:
    """``"path:line name" -> lines`` of every function (methods and nested functions too) over ``limit`` lines."""
    out = {}
    for p in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    out[f"{p.relative_to(root)}:{node.lineno} {node.name}"] = lines
    return out


def test_no_function_over_60_lines_in_the_package():
    long = long_functions(PKG)
    assert long == {}, "split by responsibility: " + ", ".join(f"{k} ({n} lines)" for k, n in long.items())


def test_long_function_finder_counts_lines(tmp_path):
    (tmp_path / "m.py").write_text("def short():\n    return 1\n\n\nclass C:\n    def long(self):\n"
                                   + "        x = 1\n" * 3 + "        return x\n")
    assert long_functions(tmp_path, limit=4, root=tmp_path) == {"m.py:6 long": 5}
    assert long_functions(tmp_path, limit=5, root=tmp_path) == {}


def test_every_target_is_one_module_behind_the_registry():
    from qeff_kv.export import options, targets

    assert options.TARGETS == targets.NAMES == ("portable", "onnxruntime", "onnxruntime-fused")
    for name, info in targets.REGISTRY.items():
        source = (PKG / "export" / "targets" / f"{info.module}.py").read_text()
        assert "TARGET = " in source and f'name = "{name}"' in source


def test_registry_gives_each_target_its_class():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from qeff_kv.export import targets
    from qeff_kv.export.targets.base import Target

    classes = [targets.get(name) for name in targets.NAMES]
    assert [c.name for c in classes] == list(targets.NAMES)
    assert all(issubclass(c, Target) and c is not Target for c in classes)
    assert [c.fills_padding for c in classes] == [True, True, False]   # GQA overwrites padded slots itself


def test_every_package_is_installed():
    """A package folder missing from pyproject's explicit list works in a checkout and is absent from a wheel."""
    import tomllib

    project = tomllib.loads((PKG.parent / "pyproject.toml").read_text())
    listed = set(project["tool"]["setuptools"]["packages"])
    folders = {_module_name(p) for p in PKG.rglob("__init__.py")}
    assert folders - listed == set()


def test_only_the_adapter_imports_transformers_in_the_exporter():
    """transformers' internals are reached through qeff_kv/export/transformers_adapter.py alone (issue: a new
    transformers release broke export from five places at once)."""
    offenders = []
    for p in (PKG / "export").rglob("*.py"):
        if p.name == "transformers_adapter.py":
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            offenders += [f"{p.relative_to(PKG)}: {n}" for n in names if n.split(".")[0] == "transformers"]
    assert offenders == []


# ------------------------------------------------------------------------------------------- layers
DOC = PKG.parent / "docs" / "architecture.md"


def documented_layers() -> list[tuple[str, list[str], set[str]]]:
    """``(layer, its rooms, the layers it may import)`` from the table under "## The layers" of
    docs/architecture.md, in its order (rooms: ``naming.py`` for a module, ``passes/`` for a package, relative to
    ``qeff_kv/``)."""
    text = DOC.read_text()
    section = text[text.index("## The layers"):]
    section = section[:section.index("\n## ", 3)]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or cells[0] in ("layer", "") or set(cells[0]) <= {"-"}:
            continue
        rooms = [r.removeprefix("qeff_kv/") for r in re.findall(r"`([^`]+)`", cells[1])]
        may = {m.strip() for m in cells[2].split(",") if m.strip()}
        rows.append((cells[0], rooms, may))
    return rows


def layer_of(module: str, rows) -> str | None:
    """The documented layer of a module name (``qeff_kv.serve.http.app`` -> ``serve``), or None."""
    rel = module.split(".")[1:]
    for name, rooms, _ in rows:
        for room in rooms:
            if room == "__init__.py" and not rel:
                return name
            if room.endswith("/") and rel[:len(room.rstrip("/").split("/"))] == room.rstrip("/").split("/"):
                return name
            if room.endswith(".py") and rel == room[:-3].split("/"):
                return name
    return None


def direction_offenders(graph: dict[str, set[str]], rows) -> list[str]:
    """Every import that runs up or across the documented layers, and every module no layer names."""
    out = []
    allowed = {name: may | {name} for name, _, may in rows}
    for mod, targets in sorted(graph.items()):
        here = layer_of(mod, rows)
        if here is None:
            out.append(f"{mod}: in no layer of docs/architecture.md")
            continue
        for t in sorted(targets):
            there = layer_of(t, rows)
            if there is not None and there not in allowed[here]:
                out.append(f"{mod} ({here}) imports {t} ({there})")
    return out


def test_the_documented_layers_are_a_stack():
    rows = documented_layers()
    names = [n for n, _, _ in rows]
    assert names[:3] == ["contract", "graph", "tools"] and "runtime" in names
    for i, (name, _, may) in enumerate(rows):   # a layer may import only layers above it in the table
        assert may <= set(names[:i]), f"{name} may import {may - set(names[:i])}, not above it"


def test_imports_run_only_down_the_documented_layers():
    """issue 28: circles were checked, direction was not (export/checkpoint.py imported the runtime)."""
    assert direction_offenders(import_graph(), documented_layers()) == []


def test_direction_check_finds_an_upward_import():
    rows = documented_layers()
    graph = {"qeff_kv.export.checkpoint": {"qeff_kv.runtime.model_files"},
             "qeff_kv.contract.naming": {"qeff_kv.graph.graphio"},
             "qeff_kv.serve.http.app": {"qeff_kv.runtime.session"}, "qeff_kv.nowhere": set()}
    assert direction_offenders(graph, rows) == [
        "qeff_kv.contract.naming (contract) imports qeff_kv.graph.graphio (graph)",
        "qeff_kv.export.checkpoint (export) imports qeff_kv.runtime.model_files (runtime)",
        "qeff_kv.nowhere: in no layer of docs/architecture.md"]
