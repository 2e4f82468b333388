"""The shape of the package: who may import whom, and that every documented name exists.

The folders are meant to be read as the data flow (scheduling decides,
execution runs, the engine joins them); these checks keep later work from
quietly bending that shape.
"""

from __future__ import annotations

import ast
import importlib
import json
import re
from pathlib import Path

import pytest

import cbcore

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "cbcore"
OUTSIDE = ("cbcore.policies", "cbcore.backends", "cbcore_")  # plugins: built-in folders and contrib packages


def _imports(path: Path) -> set[str]:
    """Every module a file imports, including lazy imports inside functions and TYPE_CHECKING blocks."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def _modules(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.py"))


def test_scheduling_imports_nothing_from_execution() -> None:
    bad = {
        f"{p.relative_to(ROOT)} imports {m}"
        for p in _modules(PKG / "scheduling")
        for m in _imports(p)
        if m.startswith(("cbcore.execution", "cbcore.engine", "torch.nn", "transformers"))
    }
    assert not bad, sorted(bad)


def test_execution_takes_only_the_plan_from_scheduling() -> None:
    bad = {
        f"{p.relative_to(ROOT)} imports {m}"
        for p in _modules(PKG / "execution")
        for m in _imports(p)
        if (m.startswith("cbcore.scheduling") and not m.startswith("cbcore.scheduling.plan"))
        or m.startswith("cbcore.engine")
    }
    assert not bad, sorted(bad)


def test_core_imports_no_plugin_except_to_register_it() -> None:
    core = [*PKG.glob("*.py"), *_modules(PKG / "scheduling"), *_modules(PKG / "execution"), *_modules(PKG / "models")]
    bad = {
        f"{p.relative_to(ROOT)} imports {m}"
        for p in core
        if p.name != "plugins.py"  # registration: the one place that loads the built-in plugin folders
        for m in _imports(p)
        if m.startswith(OUTSIDE)
    }
    assert not bad, sorted(bad)


def test_the_import_rule_check_sees_lazy_imports(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from cbcore.execution.runner import ModelRunner\n")
    assert "cbcore.execution.runner" in _imports(probe)


@pytest.mark.parametrize("name", cbcore.__all__)
def test_every_public_name_imports_from_the_top(name: str) -> None:
    assert getattr(cbcore, name) is not None


def _documented_modules() -> set[str]:
    texts = [p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]]
    refs = set()
    for text in texts:
        refs.update(re.findall(r"\bcbcore(?:\.[A-Za-z_]+)+", text))
        refs.update(m.replace("/", ".")[:-3] for m in re.findall(r"\bcbcore/[\w/]+\.py", text))
    return refs


def _resolve(ref: str) -> object:
    """A dotted reference is a module or an attribute of one (``cbcore.testing.run_equivalence``)."""
    parts = ref.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(ref)


@pytest.mark.parametrize("ref", sorted(_documented_modules()))
def test_every_module_path_in_the_docs_exists(ref: str) -> None:
    _resolve(ref)


# -- no import cycle, few top-level modules ---------------------------------------------------

#: Where each cbcore package lives in the source tree (the build maps policies/ and backends/ in).
SOURCES = {"cbcore": PKG, "cbcore.policies": ROOT / "policies", "cbcore.backends": ROOT / "backends"}
MAX_TOP_LEVEL_MODULES = 8


def _module_files() -> dict[str, Path]:
    files = {}
    for package, folder in SOURCES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join((package, *parts))
            files[name.removesuffix(".__init__")] = path
    return files


def import_graph(files: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the cbcore modules it imports (``from a import b`` counts as ``a.b`` when that is a module)."""
    return {name: {m for m in _imports(path) if m in files} - {name} for name, path in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_inside_cbcore() -> None:
    """Counting lazy and TYPE_CHECKING imports too: a cycle hidden in a function is still a cycle."""
    assert cycles(import_graph(_module_files())) == []


def test_the_cycle_check_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_top_of_cbcore_has_at_most_eight_modules() -> None:
    top = sorted(p.name for p in PKG.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top


# -- small files ------------------------------------------------------------------------------

MAX_LINES = 400
#: Files over the limit today, each with what brings it under: the entry goes when the file does,
#: and the test below fails until it does, so the list can only shrink.
OVER_THE_LIMIT: dict[str, str] = {}  # path -> why it is still longer (none today)


def _source_files() -> list[Path]:
    """Every Python and C source of the package, the plugin folders and the contrib packages (not tests)."""
    folders = [PKG, ROOT / "policies", ROOT / "backends", *sorted(ROOT.glob("contrib/*/cbcore_*"))]
    return sorted(p for folder in folders for p in folder.rglob("*") if p.suffix in (".py", ".c", ".h"))


def test_no_source_file_is_longer_than_400_lines() -> None:
    lengths = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in _source_files()}
    assert len(lengths) > 100 and "cbcore/engine_core.py" in lengths and "contrib/vtc/cbcore_vtc/policy.py" in lengths
    too_long = {path: n for path, n in lengths.items() if n > MAX_LINES and path not in OVER_THE_LIMIT}
    assert not too_long, f"split these into files of one concept each: {too_long}"
    fixed = {path for path in OVER_THE_LIMIT if lengths.get(path, 0) <= MAX_LINES}
    assert not fixed, f"{sorted(fixed)} no longer over {MAX_LINES} lines (or gone): remove them from OVER_THE_LIMIT"


def test_the_results_file_names_what_each_run_measured_where_and_how() -> None:
    """docs/results/benchmarks.json keeps the run history the docs left: each record a run with its figures."""
    runs = json.loads((ROOT / "docs" / "results" / "benchmarks.json").read_text())["runs"]
    assert runs
    for run in runs:
        assert run["study"] and run["machine"] and run["command"], run["study"]
        assert run["rows"] and all(isinstance(row, dict) and row for row in run["rows"]), run["study"]
    dated = [run for run in runs if run["date"]]
    assert all(run["commit"] for run in dated)
