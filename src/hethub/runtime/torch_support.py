"""The torch hethub runs on: the range it supports, checked where a command needs torch, the
installed build, which `hethub --version` names, and every corner of torch outside its public
API that hethub reaches (private names, torchrun's launcher, log template and agent store), each
with the torch it was checked on: the one room to look in when a torch release breaks one.

hethub keeps the torch that is installed (a vendor's CUDA, ROCm, torch_npu or XPU build), so it
checks the version instead of pinning it. Nothing here imports torch at import time, so that
`hethub --version`, and the commands that never run torch (plan, predict), stay without it.
"""

from __future__ import annotations

import importlib.util
import re

from hethub.errors import HethubError

# The oldest torch with every API hethub calls: torch.distributed.all_gather_single and
# reduce_scatter_single (the sharded optimizer and its profile) are new in 2.13. Keep these in
# step with pyproject.toml's torch requirement.
MINIMUM = (2, 13)
NEXT_MAJOR = 3  # a new major may change the APIs hethub calls: not supported until tested
SUPPORTED = f">={MINIMUM[0]}.{MINIMUM[1]},<{NEXT_MAJOR}"
FIX = (
    "install a torch in that range built for your accelerator (the README gives each vendor's "
    "pip line), e.g. on a CPU: pip install torch==2.13.0 --index-url "
    "https://download.pytorch.org/whl/cpu"
)


def check_torch_version(version: str) -> None:
    """Raise HethubError, in one line, unless ``version`` (torch.__version__, e.g. 2.13.0+cpu or
    a vendor's 2.14.0a0+git1234) is in the supported range; only major.minor count."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise HethubError(f"cannot read the installed torch's version {version!r}")
    major_minor = (int(match[1]), int(match[2]))
    if MINIMUM <= major_minor and major_minor[0] < NEXT_MAJOR:
        return
    why = (
        "a new major version may change the APIs it calls"
        if major_minor[0] >= NEXT_MAJOR
        else f"it calls APIs new in {MINIMUM[0]}.{MINIMUM[1]}"
    )
    raise HethubError(
        f"torch {version} is installed, hethub supports torch {SUPPORTED} ({why}): " + FIX
    )


def require_supported_torch() -> None:
    """Raise HethubError, in one line, unless a torch of the supported range is installed; the
    commands that need torch call this before any of their torch code runs."""
    if importlib.util.find_spec("torch") is None:
        raise HethubError(f"torch is not installed, hethub supports torch {SUPPORTED}: {FIX}")
    import torch

    check_torch_version(torch.__version__)


def describe_build(
    version: str,
    *,
    cuda: str | None = None,
    hip: str | None = None,
    xpu: str | None = None,
    npu: str | None = None,
) -> str:
    """torch's version and the accelerator its build is for, e.g. ``torch 2.13.0+cpu, CPU build``
    or ``torch 2.13.0+rocm7.2, ROCm 7.2 build``; ``npu`` is torch_npu's version where installed.
    """
    if hip:
        build = f"ROCm {'.'.join(hip.split('.')[:2])} build"
    elif cuda:
        build = f"CUDA {cuda} build"
    elif xpu:
        build = "Intel XPU build"
    else:
        build = "CPU build"
    if npu:  # torch_npu runs on top of torch's CPU build
        build += f", with torch_npu {npu} for Ascend NPUs"
    return f"torch {version}, {build}"


def installed_torch() -> str:
    """The installed torch's version and build (see describe_build), or ``torch not installed``."""
    if importlib.util.find_spec("torch") is None:
        return "torch not installed"
    import torch

    npu = None
    if importlib.util.find_spec("torch_npu") is not None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            npu = version("torch-npu")
        except PackageNotFoundError:  # built from source without metadata
            npu = "(version unknown)"
    return describe_build(
        torch.__version__,
        cuda=torch.version.cuda,
        hip=torch.version.hip,
        xpu=getattr(torch.version, "xpu", None),
        npu=npu,
    )


# torch's private corners -------------------------------------------------------------------------
# Every name hethub reaches with a leading underscore in torch, and every torch behaviour it reads
# from outside an API, is reached here and nowhere else (tests/test_torch_support.py holds the rest
# of src/ to that). torch is a range, and any of these may change in a minor release: each says
# what hethub needs it for, why the public API does not do it, and the torch it was checked on.
# Each imports torch when called, so that this module stays importable without torch.

CHECKED_ON = "2.13"
"""The torch (major.minor) every wrapper below was last checked on."""


def stage_backward_input(outputs, output_grads, inputs, weights):
    """torch.distributed.pipelining._backward.stage_backward_input: a chunk's backward to its
    inputs only (B of a zero-bubble schedule), keeping what the weights' backward (W) needs; its
    result as torch returns it (the inputs' gradients, the weights' param groups).

    Private because torch.distributed.pipelining keeps its split backward internal to its own
    schedules; hethub runs its own schedule over the same split. Checked on torch 2.13."""
    from torch.distributed.pipelining._backward import stage_backward_input as split

    return split(outputs, output_grads, inputs, weights)


def grad_accumulator(tensor):
    """The autograd node that gives ``tensor`` its gradient: its grad_fn, or for a leaf its
    AccumulateGrad (torch.distributed.pipelining._backward._get_grad_fn_or_grad_acc).

    No public API returns a leaf's AccumulateGrad node; torch's own split backward reaches it the
    same way (a view's grad_fn). Checked on torch 2.13."""
    from torch.distributed.pipelining._backward import _get_grad_fn_or_grad_acc

    return _get_grad_fn_or_grad_acc(tensor)


def fused_optimizer_devices() -> list[str]:
    """The device types with torch's fused optimizer kernels (``fused=True`` of torch.optim).

    torch.optim decides this with torch.utils._foreach_utils._get_fused_kernels_supported_devices
    and has no public query; hethub asks the same function, so it picks fused where torch.optim
    would. Checked on torch 2.13."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    return _get_fused_kernels_supported_devices()


def foreach_mul_(tensors, factor) -> None:
    """torch._foreach_mul_: every tensor of ``tensors`` times ``factor`` (a number or a tensor),
    in place, in one launch per device and dtype rather than one per tensor.

    The foreach ops have no public name; torch.optim and clip_grad_norm_ call them the same way.
    Checked on torch 2.13."""
    import torch

    torch._foreach_mul_(tensors, factor)


def foreach_copy_(targets, sources) -> None:
    """torch._foreach_copy_: each of ``targets`` copied from its ``sources``, in one launch per
    device and dtype (see foreach_mul_ for why it is private). Checked on torch 2.13."""
    import torch

    torch._foreach_copy_(targets, sources)


def foreach_add_(targets, sources) -> None:
    """torch._foreach_add_: each of ``sources`` added into its ``targets``, in one launch per
    device and dtype (see foreach_mul_ for why it is private). Checked on torch 2.13."""
    import torch

    torch._foreach_add_(targets, sources)


def foreach_zero_(tensors) -> None:
    """torch._foreach_zero_: every tensor of ``tensors`` zeroed, in one launch per device and
    dtype (see foreach_mul_ for why it is private). Checked on torch 2.13."""
    import torch

    torch._foreach_zero_(tensors)


def queue_backward_callback(callback) -> None:
    """Run ``callback`` once the backward in progress has finished (autograd's engine calls it,
    in the backward's thread): Variable._execution_engine.queue_callback.

    A gradient hook runs before the gradient is accumulated; only the engine's callback queue
    runs after the whole backward, and torch has no public name for it (DDP and FSDP call the
    same). Checked on torch 2.13."""
    import torch

    torch.autograd.Variable._execution_engine.queue_callback(callback)


def mkldnn_bf16_supported() -> bool:
    """Whether oneDNN has bf16 kernels for this CPU (torch.ops.mkldnn._is_mkldnn_bf16_supported);
    AttributeError or RuntimeError where torch was built without oneDNN.

    torch.backends.mkldnn says only whether oneDNN is there, not whether this CPU's bf16 runs on
    it. Checked on torch 2.13."""
    import torch

    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def is_compiled(module) -> bool:
    """Whether nn.Module.compile was called on ``module`` (its ``_compiled_call_impl`` is set).

    nn.Module.compile compiles in place and leaves no public mark. Checked on torch 2.13."""
    return module._compiled_call_impl is not None


def dynamo_unique_graphs() -> int:
    """How many distinct graphs dynamo has compiled in this process so far
    (torch._dynamo.utils.counters["stats"]["unique_graphs"]).

    torch._dynamo keeps its statistics in this private counter only. Checked on torch 2.13."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def dispatch_mode_class() -> type:
    """torch.utils._python_dispatch.TorchDispatchMode: the base of a mode that sees every
    operator dispatched below autograd (the profiler's counters subclass it).

    torch documents the mode (docs' "extending torch") but exports it from a private module
    only. Checked on torch 2.13."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def tree_leaves(tree) -> list:
    """The leaves of a nest of tuples, lists and dicts (an operator's outputs):
    torch.utils._pytree.tree_leaves, which knows every container torch returns.

    torch has no public pytree module in this range. Checked on torch 2.13."""
    from torch.utils._pytree import tree_leaves as leaves

    return leaves(tree)


def fake_store():
    """A store for torch's ``fake`` process-group backend, whose collectives return at once and
    move nothing (torch.testing._internal.distributed.fake_pg.FakeStore); importing it registers
    the backend.

    torch ships the backend for its own tests only. Checked on torch 2.13."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def storage_key(storage) -> int:
    """Which allocation an untyped storage is (its C++ object's address, ``_cdata``): equal for
    every view of one allocation, and on the meta device too, which has no data pointer.

    data_ptr() is 0 for every meta storage, and torch has no public identity of a storage.
    Checked on torch 2.13."""
    return storage._cdata


PRIVATE_ATEN_OPS = (
    "_scaled_dot_product_flash_attention",  # the flash attention kernel of an accelerator
    "_scaled_dot_product_flash_attention_for_cpu",  # the CPU's flash attention kernel
    "_local_scalar_dense",  # a tensor's scalar read by the host (item, bool, float)
    "_to_copy",  # a copy to another dtype or device (.to)
)
"""aten's operators with a leading underscore that hethub names: the kernels scaled_dot_product_
attention picks (spec.layer_ops prices them by name) and the operators the op counter tells
apart. aten names its kernels so; their names are not promised. Checked on torch 2.13."""


def private_aten_op(name: str):
    """torch.ops.aten's overload packet ``name``, one of PRIVATE_ATEN_OPS."""
    if name not in PRIVATE_ATEN_OPS:
        raise ValueError(f"{name!r} is not one of torch_support.PRIVATE_ATEN_OPS")
    import torch

    return getattr(torch.ops.aten, name)


# torchrun's launcher ---------------------------------------------------------------------------
# `hethub train` runs torchrun's launch in its own process and learns of a worker's failure as the
# agent reads it: from torchelastic's own record of it (the RunResult's ProcessFailure: the rank,
# its exit code and its error file), through a LocalElasticAgent whose _monitor_workers (one of
# the methods torchelastic's docs name for an agent's implementors) hands each failed result on
# before the agent restarts the workers. elastic_launch makes its agent itself, so launch() makes
# the rendezvous handler, the WorkerSpec and the agent as torch.distributed.launcher.api's
# launch_agent does, from the same LaunchConfig. Checked on torch 2.13
# (tests/test_torch_support.py holds launch_agent's steps to these).


def launch(config, entrypoint: str, args: list[str], on_failure) -> None:
    """Run ``entrypoint`` with ``args`` on this node's workers as torchrun would with ``config``
    (torch.distributed.run.config_from_args'); ``on_failure(rank, exitcode, error_file)`` is told
    each time the workers fail, with the first failure (error_file: the worker's torchelastic
    error file, None where it wrote none), before the agent restarts them or gives up. Raises
    torchelastic's ChildFailedError when they failed past their restarts, and its
    SignalException when the agent took a death signal."""
    import os

    from torch.distributed.elastic.agent.server.api import WorkerSpec, WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    class ReportingAgent(LocalElasticAgent):
        def _monitor_workers(self, worker_group):
            result = super()._monitor_workers(worker_group)
            if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
                on_failure(*first_failure(result.failures))
            return result

    # The signals the workers' process context turns into a SignalException (launch_agent too).
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = config.signals_to_handle
    rendezvous = RendezvousParameters(
        backend=config.rdzv_backend,
        endpoint=config.rdzv_endpoint,
        **_same_names(config, "run_id", "min_nodes", "max_nodes", "local_addr"),
        **config.rdzv_configs,
    )
    spec = WorkerSpec(
        local_world_size=config.nproc_per_node,
        entrypoint=entrypoint,
        args=tuple(args),
        rdzv_handler=get_rendezvous_handler(rendezvous),
        **_same_names(config, "role", "max_restarts", "monitor_interval", "local_addr"),
    )
    agent = ReportingAgent(
        spec=spec,
        **_same_names(config, "logs_specs", "start_method", "log_line_prefix_template"),
    )
    closing = True
    try:
        result = agent.run()
        if result.is_failed():
            raise ChildFailedError(name=entrypoint, failures=result.failures)
    except SignalException:
        # a death signal leaves the rendezvous open, as launch_agent does: closing it would
        # close this run id's rendezvous for good
        closing = False
        raise
    finally:
        if closing:
            spec.rdzv_handler.shutdown()


def _same_names(config, *names: str) -> dict:
    """The LaunchConfig's fields that torchelastic's classes take under the same names."""
    return {name: getattr(config, name) for name in names}


def first_failure(failures: dict) -> tuple[int | None, int | None, str | None]:
    """(rank, exit code, error file) of the first of torchelastic's ProcessFailures (by its
    timestamp); Nones for a failure without one (an unhealthy group)."""
    if not failures:
        return None, None, None
    rank, failure = min(failures.items(), key=lambda item: item[1].timestamp)
    return rank, failure.exitcode, failure.error_file


# torchrun's agent log --------------------------------------------------------------------------
# `hethub train` learns from the agent's log when the agent took a first Ctrl-C: the elastic
# agent tells it in its log alone. The record is told apart by its message template, which torch
# may reword in any release: should it change, the agent's log still holds everything and only
# hethub's own line goes unsaid. Checked on torch 2.13 (tests/test_torch_support.py finds it in
# the installed torch's source).

DEATH_SIGNAL = "Received %s death signal"
"""torch.distributed.elastic.agent.server.api: the agent took a SIGINT or SIGTERM and shuts
its workers down."""


def is_death_signal(record) -> bool:
    """Whether an agent's log record says it took a death signal (DEATH_SIGNAL)."""
    return str(record.msg).startswith(DEATH_SIGNAL)


# torchrun's agent store ------------------------------------------------------------------------
# How a worker reaches the store its torchrun agent hosts: torch.distributed.elastic's
# LocalElasticAgent says in TORCHELASTIC_USE_AGENT_STORE whether it shares its rendezvous's
# TCPStore with the workers, and MASTER_ADDR and MASTER_PORT are then that store, which outlives
# a restart of the workers. The variable is the agent's own, not a documented one. Checked on
# torch 2.13.


def agent_store_shared() -> bool:
    """Whether this process's torchrun agent shares its store (TORCHELASTIC_USE_AGENT_STORE is
    True: the c10d or static rendezvous, TORCH_DISABLE_SHARE_RDZV_TCP_STORE unset)."""
    import os

    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)


def agent_store(timeout):
    """A client of the agent's store (a TCPStore at MASTER_ADDR:MASTER_PORT), waiting at most
    ``timeout`` (a timedelta) for a key; only where agent_store_shared()."""
    import os

    import torch.distributed as dist

    return dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
    )
