"""Why a plan of the whole cluster beats the upper bound, read off the plans themselves.

The bound (planner.bound) sums each group's best plan alone on its share of the batch. A plan of
the whole cluster can do what no group alone can: use devices that no factorisation of a group's
TP x PP x DP uses, put a memory-short group's stages where few micro-batches are in flight (so it
runs a narrower TP degree, a larger micro-batch or no recomputation), or idle less of its device
time in pipeline fill and drain. why_above compares the plan with each group's plan alone and
says which of these hold, with their figures.
"""

from __future__ import annotations

from dataclasses import dataclass

from hethub.planner.bound import UpperBound
from hethub.planner.search_state import PricedPlan
from hethub.predictor.results import StagePrediction
from hethub.spec.cluster import ClusterSpec
from hethub.spec.plan import Plan, Recompute
from hethub.spec.schedules import in_flight_micro_batches


@dataclass(frozen=True, slots=True)
class _GroupIn:
    """What one group does in a plan."""

    devices: int
    tps: tuple[int, ...]
    """The TP degrees of its stages, narrowest first."""
    most_in_flight: float
    """The most micro-batches in flight on any of its stages (the activations it holds)."""
    most_layers: int
    """The most layers on any of its stages."""


def why_above(bound: UpperBound, best: PricedPlan, cluster: ClusterSpec) -> list[str]:
    """How ``best`` can beat ``bound``: what its replicas are and what each group alone does,
    then every advantage of the plan over the groups alone that the plans show."""
    plan, alone = best.plan, {n: s.best for n, s in bound.groups.items() if s.best is not None}
    lines = [
        f"its replicas: {_replicas(plan)}; alone, "
        + "; ".join(f"{name}: {_replicas(solo.plan, name)}" for name, solo in alone.items())
    ]
    for name, solo in alone.items():
        mixed, single = _group_in(plan, name), _group_in(solo.plan, name)
        if mixed.devices > single.devices:
            lines.append(
                f"it uses {mixed.devices} {name} devices, {name} alone {single.devices} of its "
                f"{cluster.group(name).devices}: no layout of {name} alone uses them all"
            )
        if mixed.tps and mixed.tps[0] < single.tps[0]:
            room = []  # what lets its memory hold the model at the narrower degree
            if mixed.most_in_flight < single.most_in_flight:
                room.append(
                    f"at most {mixed.most_in_flight:g} micro-batches in flight on a stage, "
                    f"{single.most_in_flight:g} alone"
                )
            if mixed.most_layers < single.most_layers:
                room.append(
                    f"at most {mixed.most_layers} layers a stage, {single.most_layers} alone"
                )
            memory = cluster.group(name).accelerator.usable_memory_gb
            lines.append(
                f"{name} runs TP {_degrees(mixed.tps)} in it, TP {_degrees(single.tps)} alone "
                f"(less time in TP all-reduces)"
                + (
                    f": its devices' {memory:.1f} usable GB hold " + " and ".join(room)
                    if room
                    else ""
                )
            )
        spread = _uneven(best, name), _uneven(solo, name)
        if spread[1] is not None and spread[0] is not None and spread[1][0] > spread[0][0]:
            (_, mixed_low, mixed_high, _), (_, low, high, fewest) = spread
            memory = cluster.group(name).accelerator.usable_memory_gb
            lines.append(
                f"{name}'s stages alone hold {low} to {high} layers (its {low}-layer stage "
                f"{fewest.memory.total_gb:.1f} of {memory:.1f} usable GB), in it {mixed_low} to "
                f"{mixed_high}: alone, its stages are less even"
            )
        if plan.micro_batch > solo.plan.micro_batch:
            lines.append(
                f"its micro-batch is {plan.micro_batch} sequences, {name}'s alone "
                f"{solo.plan.micro_batch}"
            )
        if plan.recompute == Recompute.NONE and solo.plan.recompute != Recompute.NONE:
            lines.append(f"it recomputes nothing, {name} alone recomputes {solo.plan.recompute}")
    idle, idle_alone = best.prediction.bubble_fraction, _idle_alone(alone)
    if idle < idle_alone:
        lines.append(
            f"it idles {100 * idle:.1f}% of its device time in pipeline fill and drain, the "
            f"groups alone {100 * idle_alone:.1f}% ("
            + ", ".join(
                f"{name} {100 * solo.prediction.bubble_fraction:.1f}%"
                for name, solo in alone.items()
            )
            + ")"
        )
    return lines


def _uneven(ranked: PricedPlan, name: str) -> tuple[float, int, int, StagePrediction] | None:
    """How unevenly the plan loads the group's devices (most over fewest layers a device), its
    fewest and most layers a stage, and the stage with the fewest a device; None where the
    group has no stage."""
    stages = [s for s in ranked.prediction.stages if s.group == name]
    if not stages:
        return None
    fewest = min(stages, key=lambda s: s.layers / s.tp)
    most = max(stages, key=lambda s: s.layers / s.tp)
    spread = (most.layers / most.tp) / (fewest.layers / fewest.tp)
    return spread, min(s.layers for s in stages), max(s.layers for s in stages), fewest


def _idle_alone(alone: dict[str, PricedPlan]) -> float:
    """The groups' bubble alone, weighted by the devices each plan uses (as a plan's is)."""
    devices = {name: solo.prediction.devices for name, solo in alone.items()}
    total = sum(devices.values()) or 1
    return sum(devices[n] * solo.prediction.bubble_fraction for n, solo in alone.items()) / total


def _replicas(plan: Plan, only: str | None = None) -> str:
    """Its replicas, layout by layout: count, devices (of group ``only``, else by group),
    stages and micro-batches each."""
    parts = []
    for pipeline in plan.pipelines:
        devices: dict[str, int] = {}
        for stage in pipeline.stages:
            devices[stage.group] = devices.get(stage.group, 0) + stage.tp
        where = str(devices[only]) if only else " + ".join(f"{n} {d}" for n, d in devices.items())
        parts.append(
            f"{pipeline.count} x {where} devices in {len(pipeline.stages)} stages, "
            f"{pipeline.micro_batches} micro-batches each"
        )
    return "; ".join(parts)


def _group_in(plan: Plan, name: str) -> _GroupIn:
    devices, tps, in_flight, layers = 0, set(), 0.0, 0
    for pipeline in plan.pipelines:
        p = len(pipeline.stages)
        for s, stage in enumerate(pipeline.stages):
            if stage.group != name:
                continue
            devices += pipeline.count * stage.tp
            tps.add(stage.tp)
            held = in_flight_micro_batches(
                plan.schedule, s, p, pipeline.micro_batches, stage.chunks
            )
            in_flight, layers = max(in_flight, held), max(layers, stage.layers)
    return _GroupIn(devices, tuple(sorted(tps)), in_flight, layers)


def _degrees(tps: tuple[int, ...]) -> str:
    return "/".join(str(t) for t in tps)
