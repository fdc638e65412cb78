"""The import contracts of the tree, read from the source (no import runs): no module takes
part in an import circle, `shared` imports no tier, the api imports no worker (and no worker
the api), and the pure cores import neither torch nor Redis, not even through another module.
Every import counts, also those inside functions or under TYPE_CHECKING."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("shared", "api", "workers", "redserve")
PURE_CORES = ("workers.scheduler.core", "workers.detokenizer.core")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def _imported(path: Path, name: str) -> Iterator[str]:
    """Every module `path` imports, absolute (relative imports resolved against `name`)."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")[: len(name.split(".")) - node.level + is_package]
                base = ".".join([*anchor, base] if base else anchor)
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def _graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(project module -> project modules it imports, project module -> top-level packages)."""
    modules = _modules()
    inner: dict[str, set[str]] = {}
    outer: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set(_imported(path, name))
        inner[name] = {t for t in targets if t in modules and t != name}
        outer[name] = {t.split(".")[0] for t in targets}
    return inner, outer


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def _under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_the_graph_sees_the_tree() -> None:
    inner, outer = _graph()
    assert "workers.scheduler.engine.model_runner" in inner
    assert "workers.scheduler.core.scheduler" in inner["workers.scheduler.loop"]
    assert "torch" in outer["workers.scheduler.engine.model_runner"]


def test_no_module_takes_part_in_an_import_circle() -> None:
    inner, _ = _graph()
    circles = sorted(name for name in inner if name in _reachable(inner, name))
    assert not circles


# The jobs tier sends batch lines through an api app of its own (an api replica in its
# process): that one module may import the api.
JOBS_API_CLIENT = "workers.batch.fleet_client"


def test_shared_imports_no_tier_and_the_api_no_worker() -> None:
    inner, _ = _graph()
    rules = [
        ("shared", ("api", "workers", "redserve")),
        ("api", ("workers",)),
        ("workers", ("api",)),
    ]
    broken = [
        (name, target)
        for package, banned in rules
        for name, targets in inner.items()
        if _under(name, package)
        for target in targets
        if any(_under(target, b) for b in banned)
        and not (name == JOBS_API_CLIENT and _under(target, "api"))
    ]
    assert not broken


def test_pure_cores_reach_neither_torch_nor_redis() -> None:
    inner, outer = _graph()
    broken = {}
    for name in inner:
        if any(_under(name, core) for core in PURE_CORES):
            reached = {name} | _reachable(inner, name)
            roots = set().union(*(outer[m] for m in reached)) & {"torch", "redis"}
            if roots:
                broken[name] = sorted(roots)
    assert not broken


def test_tests_share_helpers_only_through_tests_support() -> None:
    borrowed = sorted(
        (str(path.relative_to(ROOT)), target)
        for path in (ROOT / "tests").rglob("*.py")
        for target in _imported(path, _module_name(path))
        if _under(target, "tests") and not _under(target, "tests.support")
    )
    assert not borrowed
