"""gateway/'s parts import downwards only: the rows of the picture in docs/architecture.md's
Layout, top to bottom. A part imports parts on lower rows, never one on its own row or above, so
no two parts import each other, however indirectly."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

GATEWAY = Path(__file__).resolve().parents[1] / "gateway"

# A part is a folder or a module at gateway/'s root; `gateway` is the package's own __init__.py.
ROWS = [
    ("__main__",),
    ("cli",),
    ("app", "login"),
    ("admin", "routes"),
    ("accounting", "upstream", "mock"),
    ("storage",),
    ("ops",),
    ("server", "runtime"),
    ("config", "clock", "gateway"),
]
ROW = {part: row for row, parts in enumerate(ROWS) for part in parts}


def part_of(module: str) -> str:
    """The part that `gateway.x.y` is in: x, or `gateway` for the package itself."""
    names = module.split(".")
    return names[1] if len(names) > 1 else "gateway"


def gateway_imports(path: Path) -> set[str]:
    """The gateway modules `path` imports, anywhere in it (inside a function too): `from gateway
    import clock` is gateway.clock when gateway/clock.py exists, else the package itself."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.split(".")[0] == "gateway"}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "gateway":
            assert node.level == 0, f"{path}: a relative import, which this check could not follow"
            for alias in node.names:
                module = f"{node.module}.{alias.name}"
                below = GATEWAY.joinpath(*module.split(".")[1:])
                found.add(module if below.is_dir() or below.with_suffix(".py").exists() else node.module)
    return found


def part_imports() -> dict[str, dict[str, list[str]]]:
    """Each part → each other part it imports → the files that do."""
    graph: dict[str, dict[str, list[str]]] = {}
    for path in sorted(GATEWAY.rglob("*.py")):
        relative = path.relative_to(GATEWAY.parent)
        part = part_of(".".join(relative.with_suffix("").parts).removesuffix(".__init__"))
        graph.setdefault(part, {})
        for module in gateway_imports(path):
            if part_of(module) != part:
                graph[part].setdefault(part_of(module), []).append(str(relative))
    return graph


def test_every_part_of_the_gateway_has_its_row():
    assert sorted(part_imports()) == sorted(ROW)


def test_a_part_imports_only_the_parts_below_it():
    upward = [
        f"{', '.join(files)} ({part}) imports {imported}"
        for part, imports in part_imports().items()
        for imported, files in imports.items()
        if ROW[imported] <= ROW[part]
    ]
    assert upward == []


def test_no_parts_import_each_other_in_a_circle():
    graph = {part: set(imports) for part, imports in part_imports().items()}
    graphlib.TopologicalSorter(graph).prepare()  # raises CycleError, naming the circle
