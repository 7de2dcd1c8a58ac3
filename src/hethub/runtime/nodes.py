"""Which plan rank each process of a multi-node torchrun job is, whatever order its nodes joined in.

torchrun's c10d rendezvous numbers the nodes in the order of their descriptors (host address,
then agent pid), and each node's processes after them: not by the cluster file's groups. A
plan's ranks are laid out group by group, node by node (hethub.spec.topology), so a node of
group ``b`` that happens to sort first would run group ``a``'s stages. Instead, each process
says which node it is (``--this-node GROUP:INDEX``, or its host name in the group's ``hosts``), the
processes tell each other through torchrun's own TCPStore before the process group exists, and
every one of them computes the same answer: the plan rank of (group, node, LOCAL_RANK) is the
LOCAL_RANK-th rank of that node of the plan, in device order. A launch that does not fit the plan
is refused on every node, with the same line, before training.

``plan_ranks`` is the pure mapping (no processes); ``claim_plan_rank`` the exchange, under torchrun.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from hethub.errors import HethubError
from hethub.messages import logger
from hethub.report.terminal import plural
from hethub.spec.cluster import ClusterSpec
from hethub.spec.fields import suggestion
from hethub.spec.topology import Topology

Node = tuple[str, int]
"""(group name, index of the node inside its group, from 0)."""


@dataclass(frozen=True, slots=True)
class Claim:
    """What one process of the job says about itself."""

    group: str
    node: int
    local_rank: int
    local_world_size: int
    """Processes torchrun started on this node (--nproc-per-node)."""
    host: str


def node_name(node: Node) -> str:
    return f"{node[0]}:{node[1]}"


def node_ranks(topology: Topology) -> dict[Node, tuple[int, ...]]:
    """Every node of the plan that runs ranks: its plan ranks, in device order. Placement fills
    each node's devices from its first (hethub.spec.placement only skips to the next node), so
    the i-th of them runs on the node's device i: LOCAL_RANK is the device index too."""
    ranks: dict[Node, list[tuple[int, int]]] = {}
    for r in topology.ranks:
        ranks.setdefault((r.group, r.node), []).append((r.device, r.rank))
    return {node: tuple(rank for _, rank in sorted(found)) for node, found in ranks.items()}


def check_node(node: Node, cluster: ClusterSpec, given: str) -> None:
    """The node names a group of the cluster and one of its nodes; ``given`` says where the
    node came from (the flag, or the host's entry), for the message."""
    group, index = node
    if group not in cluster.group_names:
        raise HethubError(
            f"{given}: no group {group!r} in {cluster.source or 'the cluster'}"
            f"{suggestion(group, cluster.group_names)}; its groups: "
            f"{', '.join(cluster.group_names)}"
        )
    nodes = cluster.group(group).nodes
    if not 0 <= index < nodes:
        raise HethubError(
            f"{given}: group {group!r} has {plural(nodes, 'node')}: INDEX counts them from 0, "
            f"so it is 0 to {nodes - 1}"
        )


def check_claim(claim: Claim, topology: Topology, cluster: ClusterSpec, given: str) -> None:
    """One process's claim fits the plan: a node of the cluster, as many processes on it as the
    plan has ranks there (what a process can check alone, before the exchange)."""
    node = (claim.group, claim.node)
    check_node(node, cluster, given)
    wanted = len(node_ranks(topology).get(node, ()))
    if claim.local_world_size != wanted:
        started = plural(claim.local_world_size, "process", "processes")
        if wanted == 0:
            rule = f"the plan uses no device of node {node_name(node)}: start no torchrun there"
        else:
            rule = (
                f"the plan has {plural(wanted, 'rank')} on node {node_name(node)}: "
                f"give its torchrun --nproc-per-node {wanted}"
            )
        raise HethubError(f"{given}: torchrun started {started} on {claim.host}, {rule}")


def check_world(world: int, topology: Topology) -> None:
    """WORLD_SIZE is the plan's: said with each node's process count, which is what to fix."""
    if world != topology.world_size:
        counts = ", ".join(
            f"{node_name(node)} {len(ranks)}" for node, ranks in node_ranks(topology).items()
        )
        raise HethubError(
            f"torchrun started {plural(world, 'process', 'processes')}, the plan needs "
            f"{topology.world_size}: one torchrun per node of the plan, each with "
            f"--nproc-per-node its ranks ({counts})"
        )


def plan_ranks(claims: Sequence[Claim], topology: Topology, cluster: ClusterSpec) -> list[int]:
    """The plan rank of every process, indexed by torchrun's rank (``claims[i]`` is torchrun
    rank i's). HethubError where the launch does not fit the plan; every process computes this
    from the same claims, so all of them say the same."""
    check_world(len(claims), topology)
    for rank, claim in enumerate(claims):
        check_claim(claim, topology, cluster, f"torchrun rank {rank} (node {_claimed(claim)})")
    owner: dict[tuple[str, int, int], int] = {}
    for rank, claim in enumerate(claims):
        key = (claim.group, claim.node, claim.local_rank)
        if key in owner:
            first = owner[key]
            raise HethubError(
                f"node {_claimed(claim)} local rank {claim.local_rank} is claimed twice, by "
                f"torchrun rank {first} on {claims[first].host} and torchrun rank {rank} on "
                f"{claim.host}: give each node's torchrun its own --this-node GROUP:INDEX"
            )
        owner[key] = rank
    ranks = node_ranks(topology)
    missing = [node for node in ranks if (*node, 0) not in owner]
    if missing:  # with every claim checked, only when the count is right and nodes are not
        raise HethubError(f"no process claimed {_nodes(missing)} of the plan")
    return [ranks[(c.group, c.node)][c.local_rank] for c in claims]


def node_of_host(cluster: ClusterSpec, names: Sequence[str]) -> Node | None:
    """The node whose entry in its group's ``hosts`` is one of ``names`` (this machine's host
    name, its fully qualified name; compared ignoring case, as DNS does), or None."""
    wanted = {name.lower() for name in names if name}
    found = [
        (group.name, index)
        for group in cluster.groups
        for index, host in enumerate(group.hosts or ())
        if host.lower() in wanted
    ]
    if len(found) > 1:
        raise HethubError(
            f"this host ({' or '.join(sorted(wanted))}) is {_nodes(found)} in the hosts of "
            f"{cluster.source or 'the cluster'}: give --this-node GROUP:INDEX to say which"
        )
    return found[0] if found else None


def claim_plan_rank(
    node: Node | None,
    cluster: ClusterSpec,
    topology: Topology,
    timeout_s: float,
    command: str = "hethub train",
) -> int:
    """Under torchrun, before torch.distributed.init_process_group: this process's plan rank,
    found from its node (``--this-node``, else its host in the cluster's ``hosts``) and every
    process's claim, for hethub.runtime.supervision.init_process_group's ``rank``. With one
    torchrun node and no node given torchrun's rank is the plan's, as on one machine.
    ``command`` starts the line each node prints."""
    if node is None and int(os.environ.get("GROUP_WORLD_SIZE", "1")) == 1:
        return int(os.environ["RANK"])
    check_world(int(os.environ["WORLD_SIZE"]), topology)  # every process sees it: no exchange
    host = socket.gethostname()
    try:
        claim = _claim(node, cluster, topology, host)
    except HethubError as error:
        post_refusal_to_peers(error, node, timeout_s)
        raise
    posted = _exchange(asdict(claim), timeout_s)
    for rank, value in enumerate(posted):
        if value and "refused" in value:
            refused = value["refused"]
            raise HethubError(f"torchrun rank {rank} on {value['host']} refused: {refused}")
    if None in posted:
        joined = {(value["group"], value["node"]) for value in posted if value}
        absent = [n for n in node_ranks(topology) if n not in joined]
        silent = [rank for rank, value in enumerate(posted) if value is None]
        raise HethubError(
            f"{_nodes(absent) if absent else 'a process'} did not join within {timeout_s:g} s "
            f"(--timeout): torchrun {_ranks(silent)} "
            f"never said which node {'it is' if len(silent) == 1 else 'they are'} "
            f"(see the log of {'its node' if len(silent) == 1 else 'their nodes'})"
        )
    claims = [Claim(**value) for value in posted]
    ranks = plan_ranks(claims, topology, cluster)
    if claim.local_rank == 0:  # one line per node: where torchrun's order met the plan's
        here = [r for r, c in enumerate(claims) if (c.group, c.node) == (claim.group, claim.node)]
        logger(command.removeprefix("hethub ")).info(
            f"node {_claimed(claim)} on {host}: torchrun "
            f"{_ranks(here)} {'is' if len(here) == 1 else 'are'} plan "
            f"{_ranks([ranks[r] for r in here])}"
        )
    plan_rank = ranks[int(os.environ["RANK"])]
    return plan_rank


def post_refusal_to_peers(error: HethubError, node: Node | None, timeout_s: float) -> None:
    """A process that refuses the job before it could claim its node (its node's files, its
    flags) posts why in its place, so that every node stops at once and says why, where the
    others would wait for its claim until --timeout. It returns once every process has posted
    (at most ``timeout_s``): the store lives in torchrun's first node's agent, which stops as soon
    as its processes do. Nothing to do where claim_plan_rank would not exchange."""
    if node is None and int(os.environ.get("GROUP_WORLD_SIZE", "1")) == 1:
        return
    with contextlib.suppress(HethubError):  # this process's own reason is what it says
        _exchange({"refused": str(error), "host": socket.gethostname()}, timeout_s)


def _claim(node: Node | None, cluster: ClusterSpec, topology: Topology, host: str) -> Claim:
    """This process's claim, from --this-node or else its host in the cluster's hosts, checked
    as far as one process can."""
    if node is not None:
        given = f"--this-node = {node_name(node)!r}"
    else:
        node = node_of_host(cluster, (host, socket.getfqdn()))
        if node is None:
            first = topology.ranks[0]
            raise HethubError(
                f"torchrun started {plural(int(os.environ['GROUP_WORLD_SIZE']), 'node')} and "
                f"this one ({host}) does not say which node of the plan it is: give --this-node "
                f"GROUP:INDEX (e.g. --this-node {first.group}:{first.node}), or each group's hosts "
                f"in {cluster.source or 'the cluster file'}"
            )
        given = f"host {host!r} (node {node_name(node)} in the cluster's hosts)"
    claim = Claim(
        node[0], node[1], int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"]), host
    )
    check_claim(claim, topology, cluster, given)
    return claim


def _exchange(mine: dict, timeout_s: float) -> list[dict | None]:
    """Post this process's claim in torchrun's TCPStore under its torchrun RANK and read every
    process's, waiting at most ``timeout_s`` for them all; None where one never came."""
    import torch.distributed as dist  # only under torchrun: the pure functions stay light

    from hethub.runtime.torch_support import agent_store, agent_store_shared

    if not agent_store_shared():
        # Without the agent's store, MASTER_PORT is where init_process_group's rank 0 will serve
        # one: there is nothing to meet at before it, and rank 0 is what is being decided.
        raise HethubError(
            "--this-node and hosts need torchrun's shared TCPStore (TORCHELASTIC_USE_AGENT_STORE "
            "is not True here): leave TORCH_DISABLE_SHARE_RDZV_TCP_STORE unset, and use the "
            "c10d or static rendezvous"
        )
    deadline = time.monotonic() + timeout_s
    address = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    # The agent's store outlives a restart of the workers: keys of this attempt only.
    prefix = (
        f"hethub.nodes/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/"
        f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    )
    keys = [f"{prefix}{rank}" for rank in range(int(os.environ["WORLD_SIZE"]))]
    try:
        store = agent_store(datetime.timedelta(seconds=timeout_s))
        store.set(prefix + os.environ["RANK"], json.dumps(mine))
        try:
            left = max(deadline - time.monotonic(), 0.001)
            store.wait(keys, datetime.timedelta(seconds=left))
        except dist.DistStoreError:  # a timeout: the caller says which nodes never came
            pass
        return [json.loads(store.get(key)) if store.check([key]) else None for key in keys]
    except dist.DistNetworkError as error:  # unreachable, or its node's agent stopped
        raise HethubError(
            f"lost torchrun's store at {address} (its node's torchrun stopped, or it is "
            f"unreachable from {socket.gethostname()}): {str(error).splitlines()[0]}"
        ) from None


def _claimed(claim: Claim) -> str:
    return node_name((claim.group, claim.node))


def _nodes(nodes: Sequence[Node]) -> str:
    names = ", ".join(node_name(n) for n in nodes)
    return f"node {names}" if len(nodes) == 1 else f"nodes {names}"


def _ranks(ranks: Sequence[int]) -> str:
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, ranks))}"
