"""The package's shape, computed from its own source: every import allowed by the README's
table of who may import whom (lazy imports count; only those under `if TYPE_CHECKING:` do not),
no import cycle, a short top level, no very long file, and a CLI that starts without MLX. Each
check reads the files (and the README's table) as they are, so a change that breaks the layout
fails here, with the modules named."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "rlproxy"
README = PACKAGE.parent / "README.md"
ROOT = "__init__"  # the table's name for the package's own __init__.py


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def type_checking_block(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The package modules PATH imports anywhere (functions included), but not for typing only."""
    here = module_name(path)
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        if type_checking_block(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the importing module's package
                pkg = here.split(".")[: len(here.split(".")) - node.level
                                     + (path.name == "__init__.py")]
                base = ".".join(pkg + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    return {m for m in out if m in known and m != here}


def import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: imports_of(path, set(files)) for name, path in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


# ---- the README's table: which package may import which ----

def unit(module: str) -> str:
    """MODULE's row in the table: its subpackage ("rlproxy.api.chat" -> "api"), or a top-level
    module's own name ("rlproxy.app" -> "app"); the package's __init__ is ROOT."""
    parts = module.split(".")[1:]
    return parts[0] if parts else ROOT


def table_name(written: str) -> str:
    """A name as the README writes it: `api/` -> api, `app.py` -> app, `tinker/ranks.py` ->
    tinker.ranks, `__init__.py` -> __init__."""
    return written.removesuffix("/").removesuffix(".py").replace("/", ".")


def layering_table(readme: str) -> dict[str, set[str] | None]:
    """The Architecture section's "package or module | may import" table: each row's names ->
    the names it may import (None: anything, a composition root). Prose in a cell is skipped;
    only `backticked` names count."""
    section = readme.split("\n## Architecture\n", 1)[1].split("\n## ", 1)[0].splitlines()
    start = next(i for i, line in enumerate(section)
                 if re.match(r"\|\s*package or module\s*\|\s*may import\s*\|", line))
    table: dict[str, set[str] | None] = {}
    for line in section[start + 2:]:
        if not line.startswith("|"):
            break
        rows, imports = (cell.strip() for cell in line.strip().strip("|").split("|"))
        allowed = None if imports.startswith("anything") else {
            table_name(n) for n in re.findall(r"`([^`]+)`", imports)}
        for row in re.findall(r"`([^`]+)`", rows):
            assert table_name(row) not in table, f"{row} has two rows"
            table[table_name(row)] = allowed
    return table


def wrong_way(graph: dict[str, set[str]], table: dict[str, set[str] | None]) -> list[str]:
    """Each import the table does not allow. An allowed single module (`tinker/ranks.py`) lets
    its packages' __init__ in too (importing it runs them); the package's own __init__ is in
    every import anyway."""
    found = []
    for module, imports in sorted(graph.items()):
        row = unit(module)
        allowed = table.get(row, set())
        if allowed is None:
            continue
        for dep in sorted(imports):
            name = dep.removeprefix("rlproxy.")
            if dep == "rlproxy" or unit(dep) in ({row} | allowed) or any(
                    name == a or name.startswith(a + ".") or a.startswith(name + ".")
                    for a in allowed):
                continue
            found.append(f"{module} imports {dep}, but the README's table lets {row} import "
                         f"only {', '.join(sorted(allowed)) or 'nothing of rlproxy'}")
    return found


def test_the_table_check_finds_a_wrong_way_import():
    table = {"kv": {"settings"}, "serving": {"kv"}, "settings": set(), "training": {"tinker.ranks"},
             "tinker": {"training"}}
    assert wrong_way({"rlproxy.kv.cache": {"rlproxy.settings", "rlproxy"},
                      "rlproxy.serving.engine": {"rlproxy.kv.cache", "rlproxy.serving.jobs"}},
                     table) == []
    found = wrong_way({"rlproxy.kv.cache": {"rlproxy.serving.mlx_threads", "rlproxy.settings"}},
                      table)
    assert len(found) == 1 and "rlproxy.kv.cache imports rlproxy.serving.mlx_threads" in found[0]
    assert wrong_way({"rlproxy.training.d": {"rlproxy.tinker", "rlproxy.tinker.ranks"}}, table) == []
    assert len(wrong_way({"rlproxy.training.d": {"rlproxy.tinker.models"}}, table)) == 1


def test_the_readme_table_names_every_package_and_module_that_exists():
    table = layering_table(README.read_text(encoding="utf-8"))
    graph = import_graph()
    units = {unit(m) for m in graph}
    assert set(table) == units, {"missing from the table": sorted(units - set(table)),
                                 "in the table, not in the package": sorted(set(table) - units)}
    modules = units | {m.removeprefix("rlproxy.") for m in graph}
    unknown = {row: sorted(a - modules) for row, a in table.items() if a and a - modules}
    assert unknown == {}


def test_the_readme_table_is_layered():
    """Its rows (without their single-module exceptions) import downwards only."""
    table = layering_table(README.read_text(encoding="utf-8"))
    assert cycles({row: (allowed or set()) & set(table) for row, allowed in table.items()}) == []


def test_every_import_follows_the_readme_table():
    table = layering_table(README.read_text(encoding="utf-8"))
    assert wrong_way(import_graph(), table) == []


# ---- cycles, size, docstrings, start-up ----

def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 50, "the package was not found"
    assert cycles(graph) == []


def test_a_short_top_level_and_no_very_long_file():
    """The table, not a cap, says what belongs where (each top-level module has its own row);
    16 top-level modules and 1,000 lines a file are sanity bounds."""
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 16, top
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > 1000}
    assert long == {}


def test_every_subpackage_says_what_it_owns():
    for init in PACKAGE.rglob("__init__.py"):
        assert ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))), init


def test_the_cli_loads_no_mlx(tmp_path):
    (tmp_path / "conversations.jsonl").write_text("")
    check = ("import sys, runpy\n"
             "sys.argv = ['rlproxy', 'records', 'tail', '--data-dir', sys.argv[1]]\n"
             "import rlproxy.cli\n"
             "loaded = [m for m in sys.modules if m == 'mlx' or m.startswith('mlx.')]\n"
             "assert not loaded, loaded\n"
             "code = rlproxy.cli.main()\n"
             "loaded = [m for m in sys.modules if m == 'mlx' or m.startswith('mlx.')]\n"
             "assert not loaded, ('records tail', loaded)\n")
    out = subprocess.run([sys.executable, "-c", check, str(tmp_path)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
