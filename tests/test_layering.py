"""The package's house: every module imports only the rooms its room may (MAY_IMPORT, the
README's Layout), with no import cycle, and the predictor and the planner never load torch
(they run before a GPU is spent, on any laptop)."""

from __future__ import annotations

import ast
import subprocess
import sys
from itertools import pairwise
from pathlib import Path

import hethub

PACKAGE = Path(hethub.__file__).parent
# The house, lowest first: each room and the rooms it may import (errors, files, data, messages
# and memo are leaves any room may use). The floors the README's Layout draws; a room missing
# here fails.
LEAVES = {"errors", "files", "data", "messages", "memo"}
MAY_IMPORT: dict[str, set[str]] = {
    **{leaf: set() for leaf in LEAVES},
    "spec": set(),
    "corpus": set(),  # tokenized corpora and data prepare: numpy, torch, tokenizers
    "report": {"spec"},
    "profiles": {"spec", "report"},  # the pure profile store, below the predictor
    "predictor": {"spec", "report", "profiles"},
    "planner": {"spec", "report", "profiles", "predictor"},
    "comm": {"spec"},
    # the runtime reads plans, never the planner nor the predictor
    "runtime": {"spec", "report", "comm", "corpus"},
    "profiler": {"spec", "report", "profiles", "comm", "runtime"},  # torch measurement
    "jobs": {
        "spec",
        "report",
        "profiles",
        "predictor",
        "planner",
        "comm",
        "corpus",
        "runtime",
        "profiler",
    },
    "launchers": {"spec", "runtime"},  # the node agents' scripts: the runtime's node mapping
    "cli": {
        "spec",
        "report",
        "profiles",
        "predictor",
        "planner",
        "comm",
        "corpus",
        "runtime",
        "profiler",
        "jobs",
        "launchers",
    },
    "__init__": set(),
    "__main__": {"cli"},
}


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


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_module_sits_in_a_room_of_the_house():
    unknown = sorted({room(m) for m in imports()} - MAY_IMPORT.keys())
    assert unknown == []


def test_no_module_imports_a_room_it_may_not():
    breaches = [
        f"{module} imports {target}"
        for module, targets in imports().items()
        for target in targets
        if room(target) != room(module)
        and room(target) not in MAY_IMPORT[room(module)] | LEAVES
        and room(target) != "__init__"  # the version string, at the package's top
    ]
    assert breaches == []


def test_the_house_plan_has_no_cycle():
    """The plan itself is a ladder: no room may import one that may import it back."""
    done: set[str] = set()

    def climb(room_: str, path: tuple[str, ...]) -> None:
        assert room_ not in path, " -> ".join([*path, room_])
        for below in MAY_IMPORT[room_]:
            if below not in done:
                climb(below, (*path, room_))
        done.add(room_)

    for room_ in MAY_IMPORT:
        climb(room_, ())


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
        "import sys, hethub.spec, hethub.profiles, hethub.predictor, hethub.planner, "
        "hethub.report.trace;"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_readme_s_layout_lists_the_rooms_of_the_house():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = readme.split("## Layout", 1)[1].split("```", 2)[1]
    listed = set()
    for line in block.splitlines():
        if line and not line[0].isspace():  # a room's first line: its name, then what it is
            names = line.split("  ")[0]
            listed.update(name.strip(" ,/").removesuffix(".py") for name in names.split(","))
    rooms = MAY_IMPORT.keys() - {"__init__", "__main__"}
    assert listed == rooms
