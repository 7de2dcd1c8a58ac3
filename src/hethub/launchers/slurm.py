"""A Slurm heterogeneous job (sbatch(1), "#SBATCH hetjob") for a launch: one component per group
the plan runs on, one agent per node, each started by its component's `srun --het-group`."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, replace

from hethub.errors import HethubError
from hethub.launchers.agents import Launch, indexed_agent_command, start_lines
from hethub.spec.cluster import (
    SLURM_TIME_RULE,
    ClusterSpec,
    DeviceGroup,
    SlurmSettings,
    slurm_time_seconds,
)

DEFAULT_SIGNAL_S = 120
"""Seconds before the time limit at which Slurm sends the agents SIGTERM (--signal-seconds): the
workers stop after the current step and checkpoint it, within torchrun's shutdown timeout (30 s).
Slurm may send it up to 60 s early (sbatch(1)), never late: a step and a checkpoint fit in 120 s
on most runs; give more for long steps or large checkpoints."""


NODE_ADDR = r"sed -n 's/.*NodeAddr=\([^ ]*\).*/\1/p'"
"""Reads NodeAddr out of `scontrol show node`."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SlurmJob:
    """The job-wide Slurm settings of a launch."""

    defaults: SlurmSettings
    """The flags' settings, for each group whose ``slurm:`` section lacks them."""
    signal_s: int


def component_settings(cluster: ClusterSpec, group: str, defaults: SlurmSettings) -> SlurmSettings:
    """A group's Slurm settings: its cluster file's ``slurm:`` section, the flags for the rest."""
    own = cluster.group(group).slurm or SlurmSettings()
    taken = {
        field: getattr(own, field) if getattr(own, field) is not None else getattr(defaults, field)
        for field in SlurmSettings.__slots__
    }
    return replace(own, **taken)


def _check(group: str, settings: SlurmSettings, signal_s: int) -> None:
    """A component Slurm can run and warn: a time limit, and the warning inside it."""
    if settings.time is None:
        raise HethubError(
            f"group {group}: no Slurm time limit: give 'time' in its slurm: section of the "
            f"cluster file, or --time (the warning before the limit, --signal-seconds "
            f"{signal_s}, is counted from it)"
        )
    limit = slurm_time_seconds(
        settings.time, HethubError(f"--time = {settings.time!r}: {SLURM_TIME_RULE}")
    )
    if signal_s >= limit:
        raise HethubError(
            f"group {group}: --signal-seconds = {signal_s} is not below its time limit "
            f"{settings.time} ({limit} s): the warning must come before the limit"
        )


def slurm_script(launch: Launch, cluster: ClusterSpec, job: SlurmJob) -> str:
    """The batch script: the components' #SBATCH headers, then one srun per component."""
    headers, sruns = [], []
    for index, group_name in enumerate(launch.groups):
        group = cluster.group(group_name)
        nodes = launch.group_nodes(group_name)
        settings = component_settings(cluster, group_name, job.defaults)
        _check(group_name, settings, job.signal_s)
        if index:
            headers.append("#SBATCH hetjob")
        headers += _component(launch, group, len(nodes), settings, job.signal_s, index)
        sruns += _srun(launch, index, group_name)
    return "\n".join(
        [
            "#!/bin/bash",
            "# A Slurm heterogeneous job written by `hethub launch`: one component per group, one",
            "# hethub agent (torchrun, with `hethub train` as its workers) per node, from the",
            "# cluster and plan files copied beside this script:",
            f"#   cluster {launch.cluster_file}",
            f"#   plan    {launch.plan_file}",
            "# Submit it with sbatch. This folder must be on storage every node sees (shared",
            "# storage): every node reads the files here, at these paths.",
            *headers,
            "",
            "set -euo pipefail",
            "# The run folder must be on storage every node sees (checkpoints, metrics, the plan):",
            "# a requeued or resubmitted job resumes from its newest checkpoint.",
            start_lines(launch),
            "# The agents meet on the first node of the first component.",
            'RDZV_HOST=$(scontrol show hostnames "$SLURM_JOB_NODELIST_HET_GROUP_0" | head -n1)',
            "# Its address as Slurm reaches it (NodeAddr: the node's name unless set otherwise).",
            'RDZV_ADDR=$(scontrol show node "$RDZV_HOST" | ' + NODE_ADDR + ")",
            f'export RDZV_ENDPOINT="${{RDZV_ADDR:-$RDZV_HOST}}:{launch.port}"',
            "# A requeued job keeps its id: each start meets afresh (SLURM_RESTART_COUNT).",
            'export RDZV_ID="hethub-$SLURM_JOB_ID-${SLURM_RESTART_COUNT:-0}"',
            "",
            "agents=()",
            *sruns,
            "status=0",
            'for agent in "${agents[@]}"; do wait "$agent" || status=$?; done',
            'exit "$status"',
            "",
        ]
    )


def _component(
    launch: Launch,
    group: DeviceGroup,
    nodes: int,
    settings: SlurmSettings,
    signal_s: int,
    index: int,
) -> list[str]:
    """One component's #SBATCH lines."""
    devices = f"{group.devices_per_node} {group.accelerator.name}"
    lines = [
        f"# component {index}: group {group.name}, {nodes} node(s) of {devices} device(s)",
        f"#SBATCH --job-name={launch.name}",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --cpus-per-task={settings.cpus_per_node or group.devices_per_node}",
    ]
    if group.accelerator.vendor != "cpu":
        lines.append(f"#SBATCH --gpus-per-node={group.devices_per_node}")
    for field in ("partition", "constraint", "account", "time"):
        if getattr(settings, field) is not None:
            lines.append(f"#SBATCH --{field}={getattr(settings, field)}")
    if group.hosts is not None:
        lines.append(f"#SBATCH --nodelist={','.join(group.hosts[:nodes])}")
    # Not B:: the signal goes to the job steps (the agents), which pass it to their workers.
    lines += [f"#SBATCH --signal=TERM@{signal_s}", "#SBATCH --requeue"]
    return lines


def _srun(launch: Launch, index: int, group: str) -> list[str]:
    """One component's agents: one task per node, which knows its node from SLURM_NODEID and
    exports the group's variables on that node (the comments: those left to the admin)."""
    command = indexed_agent_command(launch, group, "SLURM_NODEID", start='"$@"')
    environment = launch.environment(group)
    return [
        f"# component {index}: group {group}, in {environment.python}",
        *(line for line in environment.lines() if line.startswith("#")),
        f"srun --het-group={index} --ntasks-per-node=1 bash -c {shlex.quote(command)} agent "
        + '"${START[@]}" &',
        "agents+=($!)",
    ]
