"""The benchmarks' scripts, loaded by their paths for the tests that check them or reuse their
code (the row loader, the baselines). benchmarks/ is not put on sys.path: it would stay there for
the whole session, where its planner.py and baselines.py would shadow any module of those names.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """benchmarks/<name>.py as a module named ``name``, loaded once a session."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # where its dataclasses look their module up
    spec.loader.exec_module(module)
    return module
