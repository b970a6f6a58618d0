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


def _module_name(path: Path, root: Path = PKG) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
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


# ------------------------------------------------------------------------------------------- wings
#: every layer folder has a written room order (issue 48)
LAYER_WINGS = ("contract", "support", "graph", "tools", "export", "runtime", "serve")
#: the nested wings whose order matters: the exporter's sub-folders (a pre-quantized reader must not climb to the
#: graph rewrite, a fact must not reach for a target, ...)
NESTED_WINGS = ("export/facts", "export/modeling", "export/targets", "export/weights", "export/weights/prequant")


def documented_wings() -> dict[str, list[list[str]]]:
    """``wing -> its levels, bottom to top, each a list of rooms`` from the tables under "## The wings" of
    docs/architecture.md (a wing: ``export`` or a nested one, ``export/weights/prequant``; a room: ``naming.py``
    for a module, ``passes/`` for a sub-folder, relative to the wing)."""
    text = DOC.read_text()
    section = text[text.index("## The wings"):]
    section = section[:section.index("\n## ", 3)]
    wings: dict[str, list[list[str]]] = {}
    wing = None
    for line in section.splitlines():
        if line.startswith("### "):
            wing = re.findall(r"`([^`]+)`", line)[0].removeprefix("qeff_kv/").strip("/")
            wings[wing] = []
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if wing is not None and line.lstrip().startswith("|") and len(cells) >= 2 and cells[0].isdigit():
            assert int(cells[0]) == len(wings[wing]), f"{wing}: levels out of order at {line!r}"
            wings[wing].append(re.findall(r"`([^`]+)`", cells[1]))
    return wings


def module_imports(path: Path, mod: str, modules) -> list[tuple[str, int]]:
    """``(qeff_kv module, line)`` of every import in a file (inside functions too), each to the module it names:
    ``from a.b import c`` is ``a.b.c`` when that is a module, else ``a.b`` (the nearest module above a name)."""
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]

    def nearest(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [nearest(a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            stem = node.module or ""
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                stem = ".".join(base + ([node.module] if node.module else []))
            names = [f"{stem}.{a.name}" if f"{stem}.{a.name}" in modules else nearest(stem) for a in node.names]
        out += sorted({(n, node.lineno) for n in names if n is not None and n.startswith("qeff_kv")})
    return out


def room_of(module: str, wing: str, root: Path = PKG) -> str | None:
    """The room of ``wing`` a module lies in (``qeff_kv.export.facts.family`` -> ``facts/`` in ``export``), the
    wing's face ``__init__.py``, or None outside the wing."""
    prefix = ["qeff_kv", *wing.split("/")]
    parts = module.split(".")
    if parts[:len(prefix)] != prefix:
        return None
    rest = parts[len(prefix):]
    if not rest:
        return "__init__.py"
    return f"{rest[0]}/" if (root / wing / rest[0]).is_dir() else f"{rest[0]}.py"


def wing_offenders(wing: str, levels: list[list[str]], root: Path = PKG) -> list[str]:
    """Every import inside ``wing`` that does not run down its documented levels (``path:line from-room ->
    to-room``), a room importing the wing's face, every room no level names and every named room that is not
    there. The face (``__init__.py``) may import any room; a room may import only itself and lower levels."""
    level = {room: i for i, rooms in enumerate(levels) for room in rooms}
    folder = root / wing
    present = {f"{p.name}/" for p in folder.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    present |= {p.name for p in folder.glob("*.py") if p.name != "__init__.py"}
    out = [f"{wing}/{r}: in no level of the {wing} order in docs/architecture.md" for r in sorted(present - set(level))]
    out += [f"{wing}/{r}: named in the {wing} order but not there" for r in sorted(set(level) - present)]
    modules = {_module_name(p, root): p for p in root.rglob("*.py")}
    for mod, path in sorted(modules.items()):
        here = room_of(mod, wing, root)
        if here is None or here == "__init__.py":
            continue
        for target, line in module_imports(path, mod, modules):
            there = room_of(target, wing, root)
            if there is None or there == here:
                continue
            if there == "__init__.py" or there not in level or level.get(here, -1) <= level[there]:
                where = "its face" if there == "__init__.py" else f"level {level.get(there, '?')}"
                out.append(f"{path.relative_to(root)}:{line} {here} -> {there} "
                           f"({wing}: level {level.get(here, '?')} imports {where})")
    return out


def test_every_layer_folder_has_a_room_order():
    wings = documented_wings()
    missing = set(LAYER_WINGS + NESTED_WINGS) - set(wings)
    assert not missing, f"no room order in docs/architecture.md for {sorted(missing)}"
    for wing, levels in wings.items():
        assert (PKG / wing / "__init__.py").exists(), f"{wing}: no such package"
        rooms = [r for rooms in levels for r in rooms]
        assert len(rooms) == len(set(rooms)), f"{wing}: a room on two levels"


@pytest.mark.parametrize("wing", list(documented_wings()))
def test_rooms_import_only_down_their_wing(wing):
    """issue 48: inside each wing (a layer folder, and the nested ones whose order matters) the rooms run in the
    documented levels, bottom to top; imports inside functions count."""
    offenders = wing_offenders(wing, documented_wings()[wing])
    assert offenders == [], "upward or unplaced in docs/architecture.md's wing order:\n" + "\n".join(offenders)


def test_wing_check_finds_an_upward_import_and_an_unplaced_room(tmp_path):
    root = tmp_path / "qeff_kv"
    for rel, text in {"__init__.py": "", "w/__init__.py": "from qeff_kv.w import top\n", "w/low.py": "",
                      "w/mid/__init__.py": "", "w/mid/a.py": "def f():\n    from qeff_kv.w import top\n",
                      "w/top.py": "from qeff_kv.w.mid import a\nfrom . import low\n",
                      "w/stray.py": "import qeff_kv.w\n", "w/ok.py": "from qeff_kv.w.low import x\n",
                      "w/side.py": "from .mid import a\n"}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    assert wing_offenders("w", [["low.py", "gone.py"], ["mid/", "ok.py", "side.py"], ["top.py"]], root) == [
        "w/stray.py: in no level of the w order in docs/architecture.md",
        "w/gone.py: named in the w order but not there",
        "w/mid/a.py:2 mid/ -> top.py (w: level 1 imports level 2)",
        "w/side.py:1 side.py -> mid/ (w: level 1 imports level 1)",
        "w/stray.py:1 stray.py -> __init__.py (w: level ? imports its face)"]
