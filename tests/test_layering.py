"""The package's floors: every module imports only from its own floor or the floors below, with
no import cycle, and the predictor and the planner never load torch (they run before a GPU is
spent, on any laptop)."""

from __future__ import annotations

import ast
import subprocess
import sys
from itertools import pairwise
from pathlib import Path

import hethub

PACKAGE = Path(hethub.__file__).parent
# Lowest first. errors and files (atomic writes) are leaves that any floor may use.
FLOORS = [
    {"errors", "files", "data"},
    {"spec"},
    {"comm", "report"},
    {"runtime"},
    {"profile"},
    {"predictor"},
    {"planner"},
    {"cli", "__main__", "__init__"},
]
FLOOR = {part: level for level, parts in enumerate(FLOORS) for part in parts}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports() -> dict[str, set[str]]:
    """Every hethub module and the hethub modules it imports, anywhere in its file."""
    found: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets.add(node.module)
            elif isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
        found[module_name(path)] = {t for t in targets if t.split(".")[0] == "hethub"}
    return found


def floor(module: str) -> int:
    parts = module.split(".")
    return FLOOR[parts[1] if len(parts) > 1 else "__init__"]


def test_every_module_sits_on_a_known_floor():
    assert all(floor(module) >= 0 for module in imports())


def test_no_module_imports_from_a_floor_above_its_own():
    upward = [
        f"{module} imports {target}"
        for module, targets in imports().items()
        for target in targets
        if floor(target) > floor(module)
    ]
    assert upward == []


def test_no_import_cycles():
    graph = imports()

    def resolve(target: str) -> str | None:
        # "from hethub.spec import x" depends on the package module hethub.spec
        return target if target in graph else None

    edges = {m: {t for t in map(resolve, ts) if t and t != m} for m, ts in graph.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for nxt in sorted(edges[module]):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join([*path[path.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
    # A package's __init__ re-exporting its modules is not a cycle of logic; drop those.
    cycles = [c for c in cycles if not _through_package_init(c, graph)]
    assert cycles == []


def _through_package_init(cycle: str, graph: dict[str, set[str]]) -> bool:
    """A cycle that closes only through a package's own __init__ (module -> its package)."""
    steps = cycle.split(" -> ")
    return any(b == a.rsplit(".", 1)[0] for a, b in pairwise(steps))


def test_the_predictor_and_the_planner_never_load_torch():
    code = (
        "import sys, hethub.spec, hethub.predictor, hethub.planner, hethub.report.trace;"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
