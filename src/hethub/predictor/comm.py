"""Communication time: alpha-beta costs of collectives and point-to-point sends per link class.

Link classes: the intra-node link (NVLink, xGMI, HCCS), the scale-out network (each device's share
of its node's network), and the host-staged bridge between groups of different vendors (device to
host over PCIe, the network between hosts, host to device: three copies one after the other).
"""

from __future__ import annotations

from hethub.predictor.calibration import Calibration
from hethub.spec.cluster import ClusterSpec, DeviceGroup
from hethub.spec.collectives import Kind, ring_steps


def intra_node_bw(group: DeviceGroup, cal: Calibration) -> float:
    """Bytes/s one device moves over its intra-node link in a collective (the group's measured
    figure where the cluster file gives one)."""
    return group.link_gb_s * 1e9 * cal.link_efficiency


def network_bw(group: DeviceGroup, cal: Calibration) -> float:
    """Bytes/s one device moves over its share of the node's network."""
    return group.network_gb_s_per_device * 1e9 * cal.network_efficiency


def cross_group_bw(cluster: ClusterSpec, a: DeviceGroup, b: DeviceGroup, cal: Calibration) -> float:
    """Bytes/s between a device of group a and one of group b (on different nodes).

    Same vendor: the network, device to device. Different vendors: no collective library spans
    both, so the bytes are staged through host memory and sent over gloo: three copies in series.
    """
    per_device = cluster.cross_gbps(a, b) / 8.0 / max(a.devices_per_node, b.devices_per_node)
    network = per_device * 1e9 * cal.network_efficiency
    if not is_bridged(a, b):
        return network
    host_a = a.accelerator.host_link_gb_s * 1e9
    host_b = b.accelerator.host_link_gb_s * 1e9
    return 1.0 / (1.0 / host_a + 1.0 / network + 1.0 / host_b)


def is_bridged(a: DeviceGroup, b: DeviceGroup) -> bool:
    """Traffic between the groups goes through the host-staged bridge."""
    return a.accelerator.vendor != b.accelerator.vendor


def ring_allreduce_time(nbytes: float, ranks: int, bandwidth: float, cal: Calibration) -> float:
    """Ring all-reduce: reduce-scatter then all-gather, 2(n-1) steps of nbytes/n each
    (spec.collectives.ring_steps, the runtime's count)."""
    if ranks <= 1:
        return 0.0
    steps = ring_steps(Kind.ALL_REDUCE, ranks)
    return steps * (nbytes / ranks / bandwidth + cal.collective_latency_us * 1e-6)


def hierarchical_allreduce_time(
    nbytes: float, per_node: int, nodes: int, group: DeviceGroup, cal: Calibration
) -> float:
    """All-reduce over ``per_node`` ranks on each of ``nodes`` nodes of one group.

    Reduce-scatter inside the node, all-reduce of each 1/per_node shard across nodes (every
    device on its own share of the network, all at once), all-gather inside the node.
    """
    link = intra_node_bw(group, cal)
    inside = ring_allreduce_time(nbytes, per_node, link, cal)
    across = ring_allreduce_time(nbytes / per_node, nodes, network_bw(group, cal), cal)
    return inside + across


def group_allreduce_time(
    nbytes: float,
    ranks: int,
    group: DeviceGroup,
    cal: Calibration,
    ranks_per_node: int | None = None,
) -> float:
    """All-reduce over ``ranks`` devices of one group, packed ``ranks_per_node`` to a node."""
    if ranks <= 1:
        return 0.0
    per_node = min(ranks, ranks_per_node or group.devices_per_node)
    nodes = -(-ranks // per_node)
    if nodes == 1:
        return ring_allreduce_time(nbytes, ranks, intra_node_bw(group, cal), cal)
    return hierarchical_allreduce_time(nbytes, per_node, nodes, group, cal)


def group_all_gather_time(nbytes: float, ranks: int, group: DeviceGroup, cal: Calibration) -> float:
    """All-gather (or reduce-scatter) of ``nbytes`` (the whole tensor, each rank holding or
    keeping 1/ranks of it) over ``ranks`` devices of one group: half an all-reduce of the same
    tensor, which a ring runs as a reduce-scatter then an all-gather (sequence parallelism's
    collectives, in place of the TP all-reduces)."""
    return group_allreduce_time(nbytes, ranks, group, cal) / 2


def p2p_time(nbytes: float, bandwidth: float, cal: Calibration) -> float:
    """One point-to-point message."""
    return nbytes / bandwidth + cal.collective_latency_us * 1e-6
