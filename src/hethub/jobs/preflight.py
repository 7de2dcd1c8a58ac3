"""The pre-flight check of a job launched on this machine: what it needs of the machine against
what the machine has, before any process starts.

`hethub train` and `hethub validate` outside torchrun start one process per device of the plan,
all of them here. A launch is refused, with its figures, when:

- memory: the ranks of CPU groups share this machine's memory, so their predicted memory,
  summed over every local rank, must fit in the memory available now (MemAvailable of
  /proc/meminfo; elsewhere the physical memory); a device of another kind holds its stage
  itself: the predictor's figure per device against its accelerator's (what `hethub predict`
  marks OVER);
- processes: more than RANKS_PER_CORE processes for each core this process may run on.

--force launches anyway, with one warning line naming what was exceeded.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hethub.errors import HethubError
from hethub.predictor import Prediction
from hethub.predictor.memory import GB, fits, state_bytes
from hethub.report.terminal import plural
from hethub.spec import ClusterSpec, ModelSpec, Plan
from hethub.spec.parameters import parameter_count
from hethub.spec.plan import Precision

RANKS_PER_CORE = 4
"""Local processes allowed per available core: a policy, not a measurement. Each rank runs one
thread; this project's tests run up to 3 ranks on a core (6 on 2 cores) and train. Far past
that, each rank gets a sliver of a core, a step's collectives wait on ranks the OS has not
scheduled, and hundreds of processes exhaust the machine before the first step."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Machine:
    """What this machine offers a local launch."""

    cores: int
    """Cores this process (and the workers it starts) may run on."""
    memory_gb: float
    """Memory available to new processes now, GB."""
    memory_source: str
    """Where ``memory_gb`` was read, in words."""


def this_machine() -> Machine:
    """This machine's cores and available memory, read from the machine itself."""
    from hethub.profiler.conditions import available_cores  # torch: prepare loaded it for the data

    memory_gb, source = _available_memory_gb()
    return Machine(cores=available_cores(), memory_gb=memory_gb, memory_source=source)


def _available_memory_gb() -> tuple[float, str]:
    """MemAvailable of /proc/meminfo (what new processes may take without swapping), else the
    physical memory."""
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            name, _, value = line.partition(":")
            if name == "MemAvailable":
                return int(value.split()[0]) * 1024 / GB, "available (MemAvailable)"
    pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    return pages * page_size / GB, "of physical memory"


def launch_excesses(
    plan: Plan, cluster: ClusterSpec, prediction: Prediction, machine: Machine
) -> list[str]:
    """What a local launch of ``plan`` (predicted as ``prediction``) needs beyond ``machine``, one
    phrase each; empty: it fits."""
    processes = sum(p.count * p.devices for p in plan.pipelines)
    found = [_processes_excess(processes, "the plan starts", machine)]
    found.append(_host_memory_excess(plan, cluster, prediction, machine))
    found.append(_device_memory_excess(cluster, prediction))
    return [phrase for phrase in found if phrase]


def unplanned_excesses(
    cluster: ClusterSpec, model: ModelSpec, precision: Precision, machine: Machine
) -> list[str]:
    """What any plan of ``model`` on ``cluster`` (all CPU groups) needs beyond ``machine``, known
    before the planner runs: a process per device of the cluster (profiling it starts as many),
    and the model's weights, gradients and optimizer states held once at least."""
    found = [_processes_excess(cluster.devices, "profiling the cluster starts", machine)]
    per_parameter = sum(state_bytes(precision))
    need_gb = parameter_count(model) * per_parameter / GB
    if need_gb > machine.memory_gb:
        found.append(
            f"training {model.name} in {precision} needs at least {need_gb:,.1f} GB "
            f"({parameter_count(model):,} parameters x {per_parameter} bytes of weights, "
            f"gradients and optimizer states), this machine has {machine.memory_gb:,.1f} GB "
            f"{machine.memory_source}"
        )
    return [phrase for phrase in found if phrase]


def refuse_or_warn(excesses: list[str], *, force: bool, warn: Callable[[str], None]) -> None:
    """Refuse a launch that exceeds this machine (HethubError, one line), or with ``force`` warn
    in one line and let it go."""
    if not excesses:
        return
    what = "; ".join(excesses)
    if not force:
        raise HethubError(f"this machine cannot run the job: {what} (--force launches it anyway)")
    warn(f"warning: launching anyway (--force), although {what}")


def _processes_excess(processes: int, who_starts: str, machine: Machine) -> str | None:
    most = RANKS_PER_CORE * machine.cores
    if processes <= most:
        return None
    return (
        f"{who_starts} {plural(processes, 'process', 'processes')} on this machine, more than "
        f"{most} ({RANKS_PER_CORE} for each of its {plural(machine.cores, 'core')})"
    )


def _host_memory_excess(
    plan: Plan, cluster: ClusterSpec, prediction: Prediction, machine: Machine
) -> str | None:
    """The CPU groups' ranks share this machine's memory: their predicted memory, summed."""
    ranks, need_gb = 0, 0.0
    for stage in prediction.stages:
        if cluster.group(stage.group).accelerator.vendor != "cpu":
            continue
        replicas = plan.pipelines[stage.pipeline].count * stage.tp
        ranks += replicas
        need_gb += replicas * stage.memory.total_gb
    if need_gb <= machine.memory_gb:
        return None
    return (
        f"its {plural(ranks, 'CPU rank')} {'needs' if ranks == 1 else 'need'} {need_gb:,.1f} GB "
        f"of memory as predicted, "
        f"this machine has {machine.memory_gb:,.1f} GB {machine.memory_source}"
    )


def _device_memory_excess(cluster: ClusterSpec, prediction: Prediction) -> str | None:
    """A device of another kind than CPU holds its stage alone: per device, as hethub predict."""
    over = [
        (stage, cluster.group(stage.group).accelerator)
        for stage in prediction.stages
        if cluster.group(stage.group).accelerator.vendor != "cpu"
        and not fits(stage.memory, cluster.group(stage.group).accelerator)
    ]
    if not over:
        return None
    stage, accelerator = max(over, key=lambda o: o[0].memory.total_gb / o[1].usable_memory_gb)
    others = f" ({len(over)} stages over, this the most)" if len(over) > 1 else ""
    return (
        f"stage {stage.pipeline}.{stage.position} (group {stage.group}) needs "
        f"{stage.memory.total_gb:,.1f} GB a device, its {accelerator.name} has "
        f"{accelerator.usable_memory_gb:,.1f} GB usable ({accelerator.memory_gb:,.1f} GB less "
        f"its runtime's reserve){others}"
    )
