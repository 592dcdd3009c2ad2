"""The packages stay layered: read from the source with ast (nothing is imported), packtools imports
no package above it, the client library neither the worker nor the daemon nor the benchmarks, no
library package the benchmarks or the `expertpack` command, and no package's modules import each
other in a cycle (imports inside functions count: they are a cycle put off, not removed; those
under `if TYPE_CHECKING:` do not, they never run), and no test module imports another."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator

import pytest

from .conftest import REPO

# package folder -> the expertpack packages its modules must not import
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "packtools": ("worker", "client", "daemon", "bench", "cli"),
    "client": ("worker", "daemon", "bench", "cli"),
    "daemon": ("worker", "bench", "cli"),
    "worker": ("daemon", "planner", "bench", "cli"),
    "planner": ("bench", "cli"),
    "bench": ("cli",),
}
PACKAGES = ("packtools", "packtools/synth", "client", "daemon", "worker", "worker/serve", "worker/engine",
            "worker/nn", "worker/models", "worker/experts", "worker/weights", "worker/kernels", "planner",
            "bench", "cli")


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(("expertpack", *(parts[:-1] if parts[-1] == "__init__" else parts)))


def imports(path: Path) -> set[str]:
    """Every module `path` imports, absolute, anywhere in it; `from P import n` gives P and P.n
    (n may be a submodule)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            out.add(base)
            out.update(f"{base}.{alias.name}" for alias in node.names)
    return out


def walk(node: ast.AST) -> Iterator[ast.AST]:
    """ast.walk, less the bodies of `if TYPE_CHECKING:` (annotations only, never run)."""
    yield node
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and ast.unparse(child.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            for sub in child.orelse:
                yield from walk(sub)
            continue
        yield from walk(child)


def sources(folder: str) -> list[Path]:
    return sorted((REPO / folder).glob("*.py"))


def test_the_sources_are_found() -> None:
    assert "expertpack.cli.eval_args" in imports(REPO / "cli" / "main.py")
    assert "expertpack.packtools.synth.presets" in imports(REPO / "packtools" / "synth" / "writer.py")
    assert all(sources(folder) for folder in PACKAGES)


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_no_package_imports_one_above_it(folder: str) -> None:
    above = tuple(f"expertpack.{name}" for name in FORBIDDEN[folder])
    bad = {f"{path.relative_to(REPO)} imports {m}"
           for path in (REPO / folder).rglob("*.py") for m in imports(path)
           if any(m == a or m.startswith(a + ".") for a in above)}
    assert not bad, "\n".join(sorted(bad))


def test_no_modules_import_each_other_in_a_cycle() -> None:
    """Across every package at once: a cycle between rooms (worker/weights -> worker/kernels ->
    worker/weights) is as much a cycle as one inside a folder. An import of a module's own package
    (`from . import x` names the package being set up) is no edge."""
    paths = [p for folder in PACKAGES for p in sources(folder)]
    graph = {module_name(p): imports(p) for p in paths}
    graph = {m: {d for d in deps if d in graph and d != m and not m.startswith(d + ".")}
             for m, deps in graph.items()}
    state: dict[str, str] = {}  # module -> "open" while on the path, "done" after

    def visit(m: str, path: list[str]) -> None:
        state[m] = "open"
        for d in sorted(graph[m]):
            if state.get(d) == "open":
                pytest.fail("import cycle: " + " -> ".join(path[path.index(d):] + [m, d]))
            if d not in state:
                visit(d, path + [m])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [])


def test_no_test_module_imports_another() -> None:
    """What test modules share lives in tests/helpers/ or a conftest.py: importing a test module
    runs it and, under pytest, can bring its fixtures into the importer unseen, and ties an edit
    of one test module to the tests of another. Imports inside functions count, as above."""
    def name(module: str) -> str:  # module_name() puts every module under expertpack.; these are tests.*
        return module.removeprefix("expertpack.")

    paths = sorted((REPO / "tests").rglob("*.py"))
    test_modules = {name(module_name(p)) for p in paths if p.name.startswith("test_")}
    assert "tests.helpers.engine" in {name(m) for m in imports(REPO / "tests" / "worker" / "test_multi_device.py")}
    bad = {f"{p.relative_to(REPO)} imports {name(m)}" for p in paths for m in imports(p)
           if name(m) in test_modules and name(m) != name(module_name(p))}
    assert not bad, "\n".join(sorted(bad))
