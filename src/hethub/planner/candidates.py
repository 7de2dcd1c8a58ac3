"""The structures the planner tries: which devices of which groups form the stages of each layout.

A structure fixes, for each layout, its replica count and its stages' groups and TP degrees; the
layers per stage and the micro-batches per replica are chosen later for each structure.

- homogeneous: replicas of one group, ``pp`` stages of TP ``tp`` (each group alone; also the
  fastest-group-alone baseline);
- combinations: one homogeneous layout per group (or none: a group may stay idle), replicas of
  unlike layouts side by side;
- mixed: identical replicas that cross kinds, ``k_g`` stages of TP ``tp_g`` on each group in turn
  (the HETHUB pipeline), optionally with each group's leftover devices as replicas of their own.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from hethub.planner.costs import StageSlot
from hethub.spec.cluster import ClusterSpec, DeviceGroup
from hethub.spec.hashing import hashed_once
from hethub.spec.model import ModelSpec


@dataclass(frozen=True, slots=True)
@hashed_once()  # a key of the planner's caches
class Layout:
    """``count`` identical replicas whose stages are ``slots``."""

    count: int
    slots: tuple[StageSlot, ...]


Structure = tuple[Layout, ...]


def tp_degrees(group: DeviceGroup, model: ModelSpec) -> list[int]:
    """TP degrees a stage of the group may use: inside a node, dividing the heads, the KV heads,
    the vocabulary and the ffn features (spec.check's rule)."""
    return [
        t
        for t in range(1, group.devices_per_node + 1)
        if group.devices_per_node % t == 0
        and all(n % t == 0 for n in (model.heads, model.kv_heads, model.vocab, model.ffn_hidden))
    ]


def homogeneous(group: DeviceGroup, model: ModelSpec, max_stages: int) -> list[Layout]:
    """Every (tp, pp) layout of the group alone, as many replicas as its devices allow."""
    layouts = []
    for tp in tp_degrees(group, model):
        for pp in range(1, min(model.layers, max_stages, group.devices // tp) + 1):
            layouts.append(Layout(group.devices // (tp * pp), (StageSlot(group.name, tp),) * pp))
    return layouts


def combinations(choices: dict[str, list[Layout]]) -> list[Structure]:
    """One layout (or none) per group, at least two groups used."""
    names = list(choices)
    out = []
    for picks in itertools.product(*[[None, *choices[name]] for name in names]):
        used = tuple(layout for layout in picks if layout is not None)
        if len(used) >= 2:
            out.append(used)
    return out


def mixed(
    cluster: ClusterSpec,
    model: ModelSpec,
    tps: dict[str, list[int]],
    max_stages: int,
    leftovers: dict[str, list[Layout]],
) -> list[Structure]:
    """Replicas that cross kinds: for every order of the groups, every replica count and TP choice,
    each group gives ``devices // (count * tp)`` stages to every replica; each group's leftover
    devices may form replicas of the group's own best layouts that fit in them."""
    groups = cluster.groups
    # Fewer stages than a group's devices allow can balance integer layers better; the devices
    # left over may form replicas of their own.
    cut_patterns = [tuple(0 for _ in groups)] + [
        tuple(cut if i == j else 0 for i in range(len(groups)))
        for j in range(len(groups))
        for cut in (1, 2)
    ]
    out: list[Structure] = []
    for tp_choice in itertools.product(*[tps[g.name] for g in groups]):
        tp_of = {g.name: t for g, t in zip(groups, tp_choice)}
        for count in _replica_counts(groups, tp_of, max_stages):
            most = {g.name: g.devices // (count * tp_of[g.name]) for g in groups}
            for cuts in cut_patterns:
                stages_of = {g.name: most[g.name] - cut for g, cut in zip(groups, cuts)}
                if any(cut and stages_of[g.name] <= 0 for g, cut in zip(groups, cuts)):
                    continue  # cutting a group to nothing repeats a structure without it
                used = [g for g in groups if stages_of[g.name] > 0]
                if len(used) < 2 or sum(stages_of[g.name] for g in used) > min(
                    model.layers, max_stages
                ):
                    continue
                rest = {
                    g.name: g.devices - count * stages_of[g.name] * tp_of[g.name] for g in groups
                }
                extra = tuple(
                    layout
                    for layout in (
                        _fit_leftover(leftovers.get(name, []), devices)
                        for name, devices in rest.items()
                    )
                    if layout is not None
                )
                slot_of = {g.name: StageSlot(g.name, tp_of[g.name]) for g in used}
                for order in _orders(used):
                    slots = tuple(
                        itertools.chain.from_iterable(
                            (slot_of[g.name],) * stages_of[g.name] for g in order
                        )
                    )
                    out.append((Layout(count, slots),))
                    if extra:
                        out.append((Layout(count, slots), *extra))
    return out


def _orders(groups: list[DeviceGroup]) -> list[tuple[DeviceGroup, ...]]:
    """Orders of the groups along a pipeline: every order of two or three groups; beyond that, the
    orders by device memory (the first stage holds the most activations) and by speed, both ways."""
    if len(groups) <= 3:
        return list(itertools.permutations(groups))
    by_memory = tuple(sorted(groups, key=lambda g: (g.accelerator.memory_gb, g.name)))
    by_speed = tuple(sorted(groups, key=lambda g: (g.accelerator.bf16_tflops, g.name)))
    return list(dict.fromkeys([by_memory, by_memory[::-1], by_speed, by_speed[::-1]]))


def _replica_counts(
    groups: tuple[DeviceGroup, ...], tp_of: dict[str, int], max_stages: int
) -> list[int]:
    """Replica counts at which some group's stages per replica change (the only ones worth
    trying)."""
    counts = set()
    for g in groups:
        per_tp = g.devices // tp_of[g.name]
        for stages in range(1, max_stages + 1):
            if per_tp // stages >= 1:
                counts.add(per_tp // stages)
    smallest = min(g.devices // tp_of[g.name] for g in groups)
    return sorted(c for c in counts if c <= smallest)


def _fit_leftover(best: list[Layout], devices: int) -> Layout | None:
    """The first of a group's best layouts that fits in ``devices`` devices, with as many replicas
    as fit."""
    for layout in best:
        per_replica = sum(slot.tp for slot in layout.slots)
        if devices >= per_replica:
            return Layout(devices // per_replica, layout.slots)
    return None


def mixed_tp(cluster: ClusterSpec, model: ModelSpec, max_stages: int) -> list[Structure]:
    """Replicas that cross two kinds, each group's share of a replica cut into stages of two
    neighbouring TP degrees (t and 2t, narrower first): more stage speeds than one degree gives,
    so integer layers balance better across unlike devices."""
    if len(cluster.groups) != 2:
        return []
    counts = [
        c
        for c in range(1, min(g.devices for g in cluster.groups) + 1)
        if all(g.devices % c == 0 for g in cluster.groups)
    ]
    out: list[Structure] = []
    for count in counts:
        segments = [_segments(g, model, g.devices // count, max_stages) for g in cluster.groups]
        for parts in itertools.product(*segments):
            if sum(len(part) for part in parts) > min(model.layers, max_stages):
                continue
            for order in (parts, parts[::-1]):
                out.append((Layout(count, order[0] + order[1]),))
    return out


def _segments(
    group: DeviceGroup, model: ModelSpec, devices: int, max_stages: int
) -> list[tuple[StageSlot, ...]]:
    """The ways to cut ``devices`` devices of a group into stages of TP t and 2t."""
    degrees = tp_degrees(group, model)
    found = []
    for narrow in degrees:
        wide = 2 * narrow
        if wide not in degrees:
            continue
        for n_wide in range(devices // wide + 1):
            rest = devices - n_wide * wide
            if (
                rest % narrow
                or rest // narrow + n_wide > max_stages
                or rest // narrow + n_wide == 0
            ):
                continue
            found.append(
                (StageSlot(group.name, narrow),) * (rest // narrow)
                + (StageSlot(group.name, wide),) * n_wide
            )
    return list(dict.fromkeys(found))
