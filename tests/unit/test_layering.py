"""The rules of the house on imports, checked on the source (README, "Layout").

Every import statement counts: at the top of a module, under ``TYPE_CHECKING`` and inside
functions, since a lazy import still ties the two modules together. Each test lists every
offence it finds, not the first.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("broker", "node", "fallback")
#: What ``fallback`` may import of the project: the wire protocol and the errors.
FALLBACK_MAY_IMPORT = {"broker.protocol", "broker.errors"}
#: Modules at the top of ``node/`` (``__init__`` not counted); the rest live in
#: subpackages named for their concern.
NODE_TOP_LEVEL_MAX = 15


def module_name(path: Path) -> str:
    """``node/sandbox/cgroups.py`` -> ``node.sandbox.cgroups``; a package is its ``__init__``."""
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    """Every module of the three packages, by dotted name."""
    return {
        module_name(path): path for pkg in PACKAGES for path in sorted((REPO / pkg).rglob("*.py"))
    }


@dataclass(frozen=True)
class ImportStatement:
    """One ``import`` (``module`` None) or ``from MODULE import NAMES`` statement."""

    line: int
    module: str | None
    level: int
    names: tuple[str, ...]


@dataclass(frozen=True)
class Scan:
    """What the checks here read of one source file."""

    imports: tuple[ImportStatement, ...]
    sys_path_lines: tuple[int, ...]  # where ``sys.path`` is used


@functools.cache
def scan(path: Path) -> Scan:
    """``path`` parsed once for all the checks (each walks the same files; parsing them
    was most of their time). Only these facts are kept: every file's whole syntax tree
    kept alive made the garbage collector's passes, and the run, slower than parsing."""
    imports, sys_path = [], []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = tuple(alias.name for alias in node.names)
            imports.append(ImportStatement(node.lineno, None, 0, names))
        elif isinstance(node, ast.ImportFrom):
            names = tuple(alias.name for alias in node.names)
            imports.append(ImportStatement(node.lineno, node.module or "", node.level, names))
        elif (
            isinstance(node, ast.Attribute)
            and node.attr == "path"
            and isinstance(node.value, ast.Name)
            and node.value.id == "sys"
        ):
            sys_path.append(node.lineno)
    return Scan(tuple(imports), tuple(sys_path))


def imported(module: str, path: Path, known: set[str]) -> Iterator[tuple[str, int]]:
    """The project modules ``module`` imports, with the line of each import.

    ``from a.b import c`` names the module ``a.b.c`` when that is one, else ``a.b``.
    """
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in scan(path).imports:
        if node.module is None:
            targets = list(node.names)
        else:
            base = node.module
            if node.level:  # relative: resolved against this module's package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [f"{base}.{a}" if f"{base}.{a}" in known else base for a in node.names]
        for target in targets:
            # ``import a.b.c`` of a name inside a module: the longest known prefix.
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != module:
                yield target, node.line


@functools.cache
def import_graph() -> tuple[dict[str, set[str]], dict[tuple[str, str], str]]:
    """Edges between project modules, and where each edge is written (``path:line``);
    built once per run (the checks only read it)."""
    modules = project_modules()
    known = set(modules)
    edges: dict[str, set[str]] = {m: set() for m in modules}
    where: dict[tuple[str, str], str] = {}
    for module, path in modules.items():
        for target, line in imported(module, path, known):
            edges[module].add(target)
            where.setdefault((module, target), f"{path.relative_to(REPO)}:{line}")
    return edges, where


def strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of the graph (iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(edges[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def offences(rule: str, pairs: list[tuple[str, str]], where: dict[tuple[str, str], str]) -> str:
    return rule + ":\n" + "\n".join(f"  {where[p]}: {p[0]} -> {p[1]}" for p in sorted(pairs))


def test_broker_never_imports_node_or_fallback() -> None:
    edges, where = import_graph()
    bad = [
        (src, dst)
        for src, targets in edges.items()
        if src.split(".")[0] == "broker"
        for dst in targets
        if dst.split(".")[0] in ("node", "fallback")
    ]
    assert not bad, offences("broker imports node or fallback", bad, where)


def test_fallback_imports_only_the_protocol_and_the_errors() -> None:
    edges, where = import_graph()
    bad = [
        (src, dst)
        for src, targets in edges.items()
        if src.split(".")[0] == "fallback"
        for dst in targets
        if dst.split(".")[0] != "fallback" and dst not in FALLBACK_MAY_IMPORT
    ]
    assert not bad, offences(
        "fallback imports beyond broker.protocol and broker.errors", bad, where
    )


def test_no_import_cycles() -> None:
    edges, where = import_graph()
    cycles = [c for c in strongly_connected(edges) if len(c) > 1]
    lines = []
    for cycle in cycles:
        members = set(cycle)
        lines.append("cycle among " + ", ".join(cycle) + ":")
        lines += [
            f"  {where[(src, dst)]}: {src} -> {dst}"
            for src in cycle
            for dst in sorted(edges[src] & members)
        ]
    assert not cycles, "\n".join(lines)


def test_package_inits_are_docstrings_only() -> None:
    """No facades: a package's ``__init__`` holds at most its docstring, so every
    name is imported from the module that defines it."""
    bad = []
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("__init__.py")):
            body = ast.parse(path.read_text()).body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                body = body[1:]
            if body:
                bad.append(f"  {path.relative_to(REPO)}:{body[0].lineno}")
    assert not bad, "package __init__ with code:\n" + "\n".join(bad)


def test_node_keeps_few_modules_at_its_top_level() -> None:
    top = sorted(p.stem for p in (REPO / "node").glob("*.py") if p.name != "__init__.py")
    assert len(top) <= NODE_TOP_LEVEL_MAX, (
        f"node/ has {len(top)} top-level modules (at most {NODE_TOP_LEVEL_MAX}): {top}; "
        "group them into a subpackage named for their concern"
    )


def test_no_script_or_test_edits_sys_path() -> None:
    """The harness is ``node.testing``: scripts and tests import it like any module."""
    bad = []
    for path in sorted([*(REPO / "scripts").rglob("*.py"), *(REPO / "tests").rglob("*.py")]):
        bad += [f"  {path.relative_to(REPO)}:{line}" for line in scan(path).sys_path_lines]
    assert not bad, "sys.path used:\n" + "\n".join(bad)


def test_the_checker_sees_every_kind_of_import(tmp_path: Path) -> None:
    """Top-level, ``TYPE_CHECKING``, function-local, ``from pkg import module`` and
    relative imports all make an edge, and a two-module loop is a component."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "import node.config\n"
        "from node.sandbox import cgroupfs\n"
        "from . import engine\n"
        "if TYPE_CHECKING:\n"
        "    from node.pool import WorkerPool\n"
        "def f() -> None:\n"
        "    from broker.errors import ConfigError\n"
    )
    probe = tmp_path / "probe.py"  # read as if it were node/probe.py
    probe.write_text(source)
    known = {"node", "node.config", "node.sandbox", "node.sandbox.cgroupfs", "node.engine"}
    known |= {"node.pool", "broker.errors", "node.probe"}
    found = {target for target, _ in imported("node.probe", probe, known)}
    assert found == {
        "node.config",
        "node.sandbox.cgroupfs",
        "node.engine",
        "node.pool",
        "broker.errors",
    }
    loop = {"a": {"b"}, "b": {"a", "c"}, "c": set()}
    assert sorted(strongly_connected(loop)) == [["a", "b"], ["c"]]


def test_tests_never_import_the_tests_directory_as_a_package() -> None:
    """``tests`` is no package: ``from tests.conftest import X`` works only where the
    repository happens to be on ``sys.path`` (a PYTHONPATH), never in CI. Shared test
    values live in ``node.testing``; unit helpers are imported as ``brokerkit``."""
    bad = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        for node in scan(path).imports:
            names = list(node.names) if node.module is None else [node.module]
            if any(n == "tests" or n.startswith("tests.") for n in names):
                bad.append(f"  {path.relative_to(REPO)}:{node.line}")
    assert not bad, "imports of the tests directory:\n" + "\n".join(bad)


def test_test_modules_have_unique_basenames() -> None:
    """pytest imports test modules by basename (no ``__init__.py``): two
    ``test_x.py`` in different tiers stop the whole suite at collection."""
    seen: dict[str, Path] = {}
    clashes = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        if path.name == "conftest.py":
            continue
        if path.name in seen:
            clashes.append(f"  {seen[path.name].relative_to(REPO)} and {path.relative_to(REPO)}")
        seen[path.name] = path
    assert not clashes, "same basename:\n" + "\n".join(clashes)
