"""The runtime's rooms leave every collective to hethub.comm: the engine, the pipeline, its sends,
the gradient sync and the optimizer never call torch.distributed themselves (the Communicator
runs each collective and counts its bytes; tests/test_comm.py checks the counts)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import hethub.runtime

RUNTIME = Path(hethub.runtime.__file__).parent
ROOMS = ("engine", "pipeline", "p2p", "grad_sync", "timeline", "optimizer")


def distributed_uses(source: str) -> list[str]:
    """Every import of torch.distributed (or of a name from it) in ``source``, as written."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("torch.distributed")]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
            "torch.distributed"
        ):
            found.append(f"from {node.module} import ...")
    return found


def test_the_check_finds_an_import_of_torch_distributed():
    assert distributed_uses("import torch.distributed as dist") == ["torch.distributed"]
    assert distributed_uses("from torch.distributed import all_reduce") == [
        "from torch.distributed import ..."
    ]
    assert distributed_uses("import torch\nfrom torch import nn") == []


@pytest.mark.parametrize("room", ROOMS)
def test_a_runtime_room_runs_no_collective_of_its_own(room):
    assert distributed_uses((RUNTIME / f"{room}.py").read_text()) == []
