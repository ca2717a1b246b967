"""The import graph, read from the source (ast, no imports run): no first-party module imports in a circle,
projects/ runs one way (models <- blobs, datasets <- lifecycle <- services <- validation, training <- tasks),
notify.py is an outbox every layer may use, and engine/ imports nothing of the platform (no Django).
Imports inside functions count: one placed there to dodge a circle is still a circle."""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIRST_PARTY = ("accounts", "config", "engine", "frontend", "projects", "uploads", "workers")
# projects/ services, lowest first: each imports only modules of the layers below its own.
LAYERS = (
    ("projects.models", "projects.notify", "projects.curves"),
    ("projects.blob_store",),  # where blob bytes live (a bucket): below blobs and storage, which use it
    ("projects.blobs", "projects.shares", "projects.selectors"),
    ("projects.datasets", "projects.storage"),
    ("projects.stages",),
    ("projects.swarms",),
    ("projects.lifecycle", "projects.ring"),
    ("projects.services",),
    ("projects.pipeline",),
    ("projects.validation", "projects.training", "projects.baseline"),
    ("projects.tasks",),
)
PLATFORM = (
    "django",
    "channels",
    "celery",
    "rest_framework",
    "config",
    "projects",
    "workers",
    "frontend",
    "accounts",
    "uploads",
)

Graph = Mapping[str, set[str]]


def _modules() -> dict[str, Path]:
    modules = {}
    for package in FIRST_PARTY:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imported(name: str, path: Path) -> Iterator[str]:
    """Every name `path` imports, anywhere in it (functions too), relative imports resolved: `from a import b`
    gives a.b, which _owner reduces to module a when b is no module of its own."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[: len(package) - node.level + 1], *([base] if base else [])])
            yield from (f"{base}.{alias.name}" for alias in node.names)


def _graph(modules: Mapping[str, Path]) -> dict[str, set[str]]:
    """First-party module -> the first-party modules it imports (names resolved to the deepest module)."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = {_owner(target, modules) for target in _imported(name, path)}
        graph[name] = {t for t in targets if t and t != name}
    return graph


def _owner(target: str, modules: Mapping[str, Path]) -> str:
    while target and target not in modules:
        target = target.rpartition(".")[0]
    return target


def _cycle(graph: Graph) -> list[str]:
    """One circle of imports as [a, b, ..., a], or [] if there is none (depth-first search)."""
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return [*path[path.index(nxt) :], nxt]
            found = visit(nxt) if nxt not in state else []
            if found:
                return found
        state[node] = "done"
        path.pop()
        return []

    for start in sorted(graph):
        found = visit(start) if start not in state else []
        if found:
            return found
    return []


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return _graph(_modules())


def test_the_cycle_finder_finds_circles_and_only_circles() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_imports_inside_functions_are_read(graph: Graph) -> None:
    # projects.apps imports projects.tasks only inside AppConfig.ready.
    assert "projects.tasks" in graph["projects.apps"]
    assert {"projects.lifecycle", "projects.notify", "projects.services"} <= graph["projects.training"]


def test_no_first_party_module_imports_in_a_circle(graph: Graph) -> None:
    assert _cycle(graph) == [], " -> ".join(_cycle(graph))


def test_projects_services_import_only_the_layers_below_theirs(graph: Graph) -> None:
    rank = {name: level for level, layer in enumerate(LAYERS) for name in layer}
    upward = [
        f"{name} imports {target}"
        for name, level in rank.items()
        for target in sorted(graph[name])
        if target.startswith("projects") and rank.get(target, len(LAYERS)) >= level
    ]
    assert upward == []


def test_notify_is_an_outbox_that_imports_no_other_module_of_projects(graph: Graph) -> None:
    assert {target for target in graph["projects.notify"] if target.startswith("projects")} == set()


def test_engine_imports_nothing_of_the_platform() -> None:
    modules = _modules()
    found = [
        f"{name} imports {target}"
        for name, path in modules.items()
        if name.split(".")[0] == "engine"
        for target in _imported(name, path)
        if target.split(".")[0] in PLATFORM
    ]
    assert found == []
