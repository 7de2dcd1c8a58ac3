"""torch's private corners in one room: every access to a private torch name in src/ is in
hethub.runtime.torch_support, and every one of its wrappers works on the installed torch (so a
minor release that moves one fails here, not in a long run)."""

from __future__ import annotations

import ast
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hethub.runtime import torch_support

SRC = Path(__file__).resolve().parents[1] / "src" / "hethub"
ROOM = SRC / "runtime" / "torch_support.py"

PRIVATE_OF_TORCH_OBJECTS = frozenset({"_cdata", "_execution_engine", "_compiled_call_impl"})
"""Private names reached on an object torch made rather than on torch itself: a storage's,
Variable's, an nn.Module's (an attribute chain the root of which is not a torch name)."""

AWAITING_MOVE: frozenset = frozenset()
"""Accesses in files another engineer owns just now, to move into torch_support (then remove the
entry: the test fails on an entry that no longer matches anything)."""


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _root(node: ast.expr) -> str | None:
    """The name an attribute chain starts from (``torch`` of ``torch.ops.aten.x().y``)."""
    while isinstance(node, ast.Attribute | ast.Call | ast.Subscript):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _dotted(node: ast.expr) -> str:
    return ast.unparse(node)


def private_torch_accesses(source: str) -> list[tuple[int, str]]:
    """(line, what) for every access in ``source`` to a private torch name: an import of a
    torch module with a private part, or of a private name from a torch module; an attribute
    with a leading underscore on a chain rooted at a torch name (torch, a name imported from
    torch or bound to a chain rooted at one, e.g. ``aten = torch.ops.aten``); and the private
    attributes of torch's objects (PRIVATE_OF_TORCH_OBJECTS)."""
    tree = ast.parse(source)
    torch_names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    torch_names.add((alias.asname or alias.name).split(".")[0])
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            torch_names.update(alias.asname or alias.name for alias in node.names)
    for node in ast.walk(tree):  # module-level aliases: aten = torch.ops.aten
        if isinstance(node, ast.Assign) and _root(node.value) in torch_names:
            torch_names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "torch" and any(_private(p) for p in parts):
                    found.append((node.lineno, alias.name))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            private = any(_private(p) for p in node.module.split("."))
            for alias in node.names:
                if private or _private(alias.name):
                    found.append((node.lineno, f"{node.module}.{alias.name}"))
        elif (
            isinstance(node, ast.Attribute)
            and _private(node.attr)
            and (_root(node.value) in torch_names or node.attr in PRIVATE_OF_TORCH_OBJECTS)
        ):
            found.append((node.lineno, _dotted(node)))
    return sorted(found)


def test_every_private_torch_access_is_in_torch_support():
    outside, awaiting = [], set()
    for path in sorted(SRC.rglob("*.py")):
        if path == ROOM:
            continue
        name = path.relative_to(SRC).as_posix()
        for line, what in private_torch_accesses(path.read_text(encoding="utf-8")):
            if (name, what) in AWAITING_MOVE:
                awaiting.add((name, what))
            else:
                outside.append(f"src/hethub/{name}:{line}: {what}")
    assert not outside, "private torch names outside runtime/torch_support.py:\n" + "\n".join(
        outside
    )
    assert awaiting == AWAITING_MOVE, f"moved already: {sorted(AWAITING_MOVE - awaiting)}"


def test_the_room_itself_holds_private_accesses():
    # The scan finds them where they are: in the room, one per wrapper.
    found = {what for _, what in private_torch_accesses(ROOM.read_text(encoding="utf-8"))}
    assert "torch.utils._python_dispatch.TorchDispatchMode" in found
    assert "storage._cdata" in found
    assert "torch.autograd.Variable._execution_engine" in found


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from torch.utils._pytree import tree_leaves\n", [(1, "torch.utils._pytree.tree_leaves")]),
        ("import torch._dynamo\n", [(1, "torch._dynamo")]),
        ("from torch.optim import _functional\n", [(1, "torch.optim._functional")]),
        ("import torch\nx = torch.ops.aten._to_copy\n", [(2, "torch.ops.aten._to_copy")]),
        (
            "import torch\naten = torch.ops.aten\nop = aten._local_scalar_dense.default\n",
            [(3, "aten._local_scalar_dense")],
        ),
        ("import torch as t\nt._foreach_mul_(xs, 2)\n", [(2, "t._foreach_mul_")]),
        ("key = tensor.untyped_storage()._cdata\n", [(1, "tensor.untyped_storage()._cdata")]),
        (
            "from torch.autograd import Variable\nVariable._execution_engine.queue_callback(f)\n",
            [(2, "Variable._execution_engine")],
        ),
        # Not private: dunders, public names, and a private name of hethub's own.
        ("import torch\ntorch.__version__\ntorch.nn.Linear\n", []),
        ("from hethub.runtime.model import _CpuRmsNorm\nself._hooks\n", []),
    ],
)
def test_the_scan_finds_what_is_private(source, expected):
    assert private_torch_accesses(source) == expected


def test_torch_support_imports_no_torch():
    code = "import sys, hethub.runtime.torch_support; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_the_wrappers_work_on_the_installed_torch():
    torch_support.check_torch_version(torch.__version__)
    assert torch_support.CHECKED_ON == f"{torch_support.MINIMUM[0]}.{torch_support.MINIMUM[1]}"
    assert "cpu" in torch_support.fused_optimizer_devices()
    xs = [torch.ones(2), torch.ones(3)]
    torch_support.foreach_mul_(xs, 3.0)
    torch_support.foreach_add_(xs, [torch.ones(2), torch.ones(3)])
    assert [x.tolist() for x in xs] == [[4.0, 4.0], [4.0, 4.0, 4.0]]
    ys = [torch.zeros(2), torch.zeros(3)]
    torch_support.foreach_copy_(ys, xs)
    assert ys[1].tolist() == [4.0, 4.0, 4.0]
    torch_support.foreach_zero_(ys)
    assert ys[0].tolist() == [0.0, 0.0]
    assert isinstance(torch_support.mkldnn_bf16_supported(), bool)

    weight = torch.nn.Parameter(torch.ones(2))
    assert type(torch_support.grad_accumulator(weight)).__name__ == "AccumulateGrad"
    ran = []

    def hook(_):
        torch_support.queue_backward_callback(lambda: ran.append(weight.grad is not None))

    weight.register_hook(hook)
    (weight * 2).sum().backward()
    assert ran == [True]  # after the backward: the gradient was accumulated by then

    layer = torch.nn.Linear(2, 2)
    assert not torch_support.is_compiled(layer)
    layer.compile()
    assert torch_support.is_compiled(layer)
    assert isinstance(torch_support.dynamo_unique_graphs(), int)

    base = torch.zeros(4)
    assert torch_support.storage_key(base[1:].untyped_storage()) == torch_support.storage_key(
        base.untyped_storage()
    )
    assert torch_support.tree_leaves((base, [1, {"a": 2}])) == [base, 1, 2]
    assert issubclass(torch_support.dispatch_mode_class(), object)
    for name in torch_support.PRIVATE_ATEN_OPS:
        assert torch_support.private_aten_op(name).default is not None
    with pytest.raises(ValueError, match="PRIVATE_ATEN_OPS"):
        torch_support.private_aten_op("_not_one")
    assert torch_support.fake_store() is not None


def test_the_launchers_steps_are_the_installed_torchs():
    """torch_support.launch makes what torch's launch_agent makes, from the same LaunchConfig,
    and the agent asks _monitor_workers for each result before it restarts the workers."""
    import inspect

    import torch.distributed.elastic.agent.server.api as agent_api
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.launcher.api import launch_agent

    launcher = inspect.getsource(launch_agent)
    for step in (
        "RendezvousParameters(",
        "WorkerSpec(",
        "LocalElasticAgent(",
        "agent.run()",
        "ChildFailedError(",
        "except SignalException:",
        "spec.rdzv_handler.shutdown()",
        'os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = config.signals_to_handle',
    ):
        assert step in launcher, step
    run = inspect.getsource(agent_api.SimpleElasticAgent._invoke_run)
    assert run.index("self._monitor_workers(") < run.index("self._restart_workers(")
    assert inspect.signature(LocalElasticAgent._monitor_workers).parameters.keys() == {
        "self",
        "worker_group",
    }
    agent = inspect.getsource(agent_api)
    assert f'"{torch_support.DEATH_SIGNAL}, shutting down workers"' in agent


LAUNCH = """
import json, sys
from torch.distributed.run import config_from_args, parse_args
from hethub.runtime import torch_support
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

config, entrypoint, args = config_from_args(parse_args([
    "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0", "--rdzv-id=t",
    "--nproc-per-node=2", "--max-restarts=1", "--monitor-interval=0.1",
    "--log-dir=" + sys.argv[1], sys.argv[2],
]))
told = []
try:
    torch_support.launch(config, entrypoint, args, lambda *failure: told.append(failure[:2]))
except ChildFailedError as error:
    rank, failure = error.get_first_failure()
    print(json.dumps({"told": told, "end": [rank, failure.exitcode]}))
"""
WORKER = """
import os, signal, sys, time
if os.environ["LOCAL_RANK"] == "1":
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(60)  # rank 0 waits: the agent stops it when rank 1 dies
"""


@pytest.mark.slow
def test_launch_tells_each_failure_from_torchelastics_record(tmp_path):
    """A worker killed in each of two attempts (one restart): launch tells both failures, with
    the rank and the signal from torchelastic's ProcessFailure, before the restart and at the
    end, and the run ends in ChildFailedError naming it."""
    import json

    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    done = subprocess.run(
        [sys.executable, "-c", LAUNCH, str(tmp_path / "logs"), str(worker)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"told": [[1, -9], [1, -9]], "end": [1, -9]}


def test_first_failure_is_the_earliest():
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    late = ProcessFailure(local_rank=0, pid=10, exitcode=1, error_file="/nonexistent")
    early = ProcessFailure(local_rank=3, pid=11, exitcode=-9, error_file="/nonexistent")
    late.timestamp, early.timestamp = 200, 100
    assert torch_support.first_failure({0: late, 3: early}) == (3, -9, early.error_file)
    assert torch_support.first_failure({}) == (None, None, None)


def test_the_agent_gives_torchs_loggers_their_levels_back(tmp_path):
    from hethub.cli.agent import AgentLog

    quiet = logging.getLogger("torch.distributed.elastic.hethub_test")
    quiet.setLevel(logging.ERROR)
    before = {
        name: logging.getLogger(name).level
        for name in logging.root.manager.loggerDict
        if name.startswith("torch.distributed")
    }
    with AgentLog(tmp_path / "agent.log", None, max_restarts=0):
        assert quiet.level == logging.INFO
        quiet.info("said in the log")
    after = {name: logging.getLogger(name).level for name in before}
    assert after == before
    assert "said in the log" in (tmp_path / "agent.log").read_text()
