"""The package's layers: no import cycle between modules, no import from a lower layer up.

Every `import` and `from ... import` in every module counts, including those inside
functions and under `TYPE_CHECKING` (a cycle through a type hint is still a cycle of
ideas). `from pkg import name` depends on the module `pkg.name` when there is one, else on
`pkg`. A package's `__init__` may re-export its own modules; a module never imports its
own package's `__init__`, so those edges make no cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "dorarl"

LAYERS: list[tuple[str, ...]] = [
    ("dorarl", "errors", "config", "data", "run_layout"),
    ("controller",),
    ("engine", "trainer", "tasks"),
    ("record", "report"),
    ("driver",),
    ("runtime", "sim"),
    ("jobs", "bench", "models", "simulate"),
    ("cli", "__main__"),
]
"""Bottom to top: a module may import its own layer (without a cycle) and those below."""


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _package_of(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _targets(node: ast.AST, name: str, path: Path, known: set[str]) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:  # relative: from the module's package, `level - 1` packages up
        package = _package_of(name, path).split(".")
        package = package[: len(package) - (node.level - 1)]
        base = ".".join(package + ([base] if base else []))
    found = []
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        found.append(sub if sub in known else base)
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the dorarl modules it imports (resolved to the nearest known module)."""
    mods = modules()
    known = set(mods)
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for target in _targets(node, name, path, known):
                while target and target not in known:
                    target = target.rpartition(".")[0]
                if target.startswith("dorarl") and target != name:
                    deps.add(target)
        graph[name] = deps
    return graph


def part_of(module: str) -> str:
    """The top-level part a module belongs to ('dorarl.runtime.recovery.engine_recovery' -> 'runtime')."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "dorarl"


def layer_of(module: str) -> int:
    part = part_of(module)
    for level, names in enumerate(LAYERS):
        if part in names:
            return level
    raise AssertionError(f"{module}: part {part!r} is in no layer of LAYERS")


def _is_reexport(src: str, dst: str, graph: dict[str, set[str]]) -> bool:
    """A package's __init__ importing one of its own modules."""
    return dst.startswith(src + ".") and (ROOT.parent / Path(*src.split("."))).is_dir()


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan), as a sorted list."""
    edges = {m: {d for d in deps if not _is_reexport(m, d, graph)} for m, deps in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return [
        f"{src} (layer {layer_of(src)}) imports {dst} (layer {layer_of(dst)})"
        for src, deps in sorted(graph.items())
        for dst in sorted(deps)
        if layer_of(dst) > layer_of(src)
    ]


def test_every_part_has_a_layer():
    for module in modules():
        layer_of(module)


def test_no_import_cycle_between_modules():
    found = cycles(import_graph())
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_no_cycle_between_parts():
    """Parts (top-level packages) depend on each other one way, within a layer too."""
    graph = import_graph()
    parts: dict[str, set[str]] = {}
    for src, deps in graph.items():
        parts.setdefault(f"dorarl.{part_of(src)}", set()).update(
            f"dorarl.{part_of(d)}" for d in deps if part_of(d) != part_of(src)
        )
    found = cycles(parts)
    assert not found, "parts that import each other:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_no_import_goes_up_the_layers():
    found = upward_imports(import_graph())
    assert not found, "imports from a lower layer to a higher one:\n" + "\n".join(found)


@pytest.mark.parametrize(
    ("graph", "expected"),
    [
        ({"dorarl.a": {"dorarl.b"}, "dorarl.b": {"dorarl.a"}}, [["dorarl.a", "dorarl.b"]]),
        ({"dorarl.a": {"dorarl.b"}, "dorarl.b": set()}, []),
    ],
)
def test_the_cycle_finder_finds_two_module_cycles(graph, expected):
    assert cycles(graph) == expected


def test_function_level_and_relative_imports_count():
    graph = import_graph()
    # dorarl.trainer's lazy attribute loader names its homes by string, not by import;
    # a function-level import is seen (jobs.train imports jobs.ray_run inside a function)
    assert "dorarl.jobs.ray_run" in graph["dorarl.jobs.train"]
