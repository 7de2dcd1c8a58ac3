"""Which devices run which stage: the one placement the predictor prices and the runtime uses.

Inside each group, every stage of every pipeline layout gets a block of ``count x tp`` devices
(its replicas side by side: stage-major, like Megatron-LM's rank order, so that a stage's
data-parallel peers share nodes). Blocks are laid out widest TP first, and a TP group that would
straddle two nodes starts on the next node instead (with TP degrees that are powers of two,
that never leaves a gap).
"""

from __future__ import annotations

from typing import NamedTuple

from hethub.errors import SpecError
from hethub.spec.cluster import ClusterSpec
from hethub.spec.plan import Plan


class StageBlock(NamedTuple):
    """The devices of one stage of one pipeline layout, inside its group (a named tuple: the
    predictor places every plan it prices)."""

    pipeline: int
    stage: int
    group: str
    tp: int
    starts: tuple[int, ...]
    """Per replica, the group-device index of its first TP rank
    (node = index // devices_per_node)."""

    def devices(self, replica: int) -> range:
        """The group-device indices of one replica's TP ranks."""
        return range(self.starts[replica], self.starts[replica] + self.tp)

    @property
    def replicas(self) -> int:
        return len(self.starts)

    @property
    def first_device(self) -> int:
        return self.starts[0]

    @property
    def last_device(self) -> int:
        return self.starts[-1] + self.tp - 1


def place(plan: Plan, cluster: ClusterSpec, source: str = "") -> list[list[StageBlock]]:
    """The block of every stage, indexed [pipeline][stage]; SpecError if a group runs out of
    devices."""
    wanted = [
        (i, s, stage.group, stage.tp, pipeline.count)
        for i, pipeline in enumerate(plan.pipelines)
        for s, stage in enumerate(pipeline.stages)
    ]
    blocks: dict[tuple[int, int], StageBlock] = {}
    used: dict[str, int] = {}
    for i, s, group, tp, count in sorted(wanted, key=lambda w: (w[2], -w[3], w[0], w[1])):
        per_node = cluster.group(group).devices_per_node
        cursor, starts = used.get(group, 0), []
        for _ in range(count):
            # Keep a TP group inside one node (or, for the measured runs that span nodes, on whole
            # nodes).
            if (
                (cursor // per_node != (cursor + tp - 1) // per_node)
                if tp <= per_node
                else cursor % per_node
            ):
                cursor = (cursor // per_node + 1) * per_node
            starts.append(cursor)
            cursor += tp
        blocks[(i, s)] = StageBlock(i, s, group, tp, tuple(starts))
        used[group] = cursor
    _check_group_sizes(wanted, used, cluster, source)
    return [[blocks[(i, s)] for s in range(len(p.stages))] for i, p in enumerate(plan.pipelines)]


def _check_group_sizes(
    wanted: list[tuple[int, int, str, int, int]],
    placed: dict[str, int],
    cluster: ClusterSpec,
    source: str,
) -> None:
    """The device-count rule: SpecError where a group has fewer devices than the plan's stages
    take side by side, or (with gaps that keep each TP group inside a node) once placed."""
    if all(devices <= cluster.group(name).devices for name, devices in placed.items()):
        return  # placing only adds gaps: the stages side by side fit too (the predictor's path)
    needed: dict[str, int] = {}
    for _, _, group, tp, count in wanted:  # in the plan's order: the first group over is named
        needed[group] = needed.get(group, 0) + count * tp
    for name, devices in needed.items():
        group = cluster.group(name)
        if devices > group.devices:
            raise SpecError(
                source,
                "pipelines",
                f"{devices} devices of group {name!r}",
                f"a plan may use at most the group's {group.devices} devices "
                f"({group.nodes} nodes x {group.devices_per_node})",
            )
    for name, devices in placed.items():
        group = cluster.group(name)
        if devices > group.devices:
            raise SpecError(
                source,
                "pipelines",
                f"{devices} devices of group {name!r} once every TP group sits inside one node",
                f"a plan may use at most the group's {group.devices} devices",
            )
