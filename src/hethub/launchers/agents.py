"""The node agents of a launch: which nodes of the cluster run one (the plan's), and the one
torchrun command each runs, with `hethub train` as its workers."""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from hethub.errors import HethubError
from hethub.launchers.environment import GroupEnvironment
from hethub.runtime.nodes import node_ranks
from hethub.spec.cluster import ClusterSpec
from hethub.spec.topology import Topology


@dataclass(frozen=True, kw_only=True, slots=True)
class AgentNode:
    """One node that runs an agent: its group, its index among the group's nodes, and the plan
    ranks it runs (torchrun's --nproc-per-node)."""

    group: str
    node: int
    processes: int


@dataclass(frozen=True, kw_only=True, slots=True)
class Launch:
    """What every node's agent is given: the same files and flags on every node."""

    name: str
    """The job's name (Slurm's --job-name, the rendezvous id)."""
    cluster_file: str
    """Absolute path of the cluster file, the same on every node (the copy in the launch's
    folder, or in the JobSet's ConfigMap)."""
    plan_file: str
    """Absolute path of the plan file, the same on every node."""
    run_dir: str
    """The run folder: on storage that every node sees."""
    train_flags: tuple[str, ...]
    """`hethub train`'s flags for a new run (steps, seed, data, ...); a resumed run keeps its
    own."""
    environments: dict[str, GroupEnvironment]
    """Each group's Python (with hethub and its vendor's torch) and environment variables."""
    port: int
    """The rendezvous port on the first node."""
    max_restarts: int
    nodes: tuple[AgentNode, ...]
    """In the cluster's group order, then node order."""

    def environment(self, group: str) -> GroupEnvironment:
        return self.environments[group]

    def group_nodes(self, group: str) -> tuple[AgentNode, ...]:
        return tuple(n for n in self.nodes if n.group == group)

    @property
    def groups(self) -> tuple[str, ...]:
        """The groups the plan runs on, in the cluster's order."""
        return tuple(dict.fromkeys(n.group for n in self.nodes))


def agent_nodes(topology: Topology, cluster: ClusterSpec) -> tuple[AgentNode, ...]:
    """The nodes the plan runs ranks on, in the cluster's order. A group's are its first nodes
    (placement fills them in order), so node i of a group is the i-th node Slurm gives it."""
    ranks = node_ranks(topology)
    nodes = []
    for group in cluster.groups:
        used = sorted(node for name, node in ranks if name == group.name)
        if used != list(range(len(used))):
            raise HethubError(
                f"group {group.name}: the plan runs on its nodes {used}, not on its first "
                f"{len(used)}: a launch numbers a group's nodes from 0 without gaps"
            )
        nodes += [
            AgentNode(group=group.name, node=i, processes=len(ranks[group.name, i])) for i in used
        ]
    return tuple(nodes)


NEW_OR_RESUMED = """\
# A run folder that already holds this run (a requeued or resubmitted job, a restarted node)
# resumes from its newest complete checkpoint; otherwise the run starts.
if [ -e "$RUN_DIR/run.json" ]; then
  START=(--resume "$RUN_DIR")
else
  START=({new})
fi"""


def start_lines(launch: Launch) -> str:
    """The shell lines that set RUN_DIR and START, `hethub train`'s flags: a new run, or the
    run folder's own run resumed."""
    new = ["--cluster", launch.cluster_file, "--plan", launch.plan_file, *launch.train_flags]
    new_text = " ".join(shlex.quote(a) for a in new) + ' --run-dir "$RUN_DIR"'
    return f"RUN_DIR={shlex.quote(launch.run_dir)}\n" + NEW_OR_RESUMED.format(new=new_text)


def agent_command(
    launch: Launch,
    group: str,
    *,
    processes: str,
    this_node: str,
    endpoint: str,
    rdzv_id: str,
    start: str,
) -> str:
    """The agent's command line, in ``group``'s Python: torchrun's launcher, through node_agent
    (which says a stop by a signal or a failure in one line), with `hethub train` as its workers.
    ``processes`` (the node's plan ranks), ``this_node``, ``endpoint``, ``rdzv_id`` and ``start``
    (`hethub train`'s start flags) are shell words, expanded where the agent starts."""
    return " ".join(
        [
            shlex.quote(launch.environment(group).python),
            "-m hethub.launchers.node_agent",
            f"--nnodes={len(launch.nodes)}",
            f"--nproc-per-node={processes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={rdzv_id}",
            f"--max-restarts={launch.max_restarts}",
            "-m hethub train",
            f"--this-node={this_node}",
            start,
        ]
    )


def indexed_agent_command(launch: Launch, group: str, node_index: str, start: str) -> str:
    """What each node of ``group`` runs where its scheduler gives the node's index in the shell
    variable ``node_index`` (Slurm's SLURM_NODEID, an Indexed Job's JOB_COMPLETION_INDEX): its
    agent, exec'd, after the group's exports (set on the node itself, where the scheduler's own
    device visibility is) and the array of the nodes' process counts where the plan fills the
    group's nodes unevenly, from which each node reads its own."""
    counts = [node.processes for node in launch.group_nodes(group)]
    prefix, processes = launch.environment(group).exports(), str(counts[0])
    if len(set(counts)) > 1:
        prefix += f"processes=({' '.join(map(str, counts))}); "
        processes = f'"${{processes[${node_index}]}}"'
    return (
        prefix
        + "exec "
        + agent_command(
            launch,
            group,
            processes=processes,
            this_node=shlex.quote(f"{group}:") + f'"${node_index}"',
            endpoint='"$RDZV_ENDPOINT"',
            rdzv_id='"$RDZV_ID"',
            start=start,
        )
    )
