"""The plans the planner is measured against, under the same predictor.

- megatron_uniform: what Megatron-LM does with a mixed cluster, treating it as homogeneous:
  identical replicas over all devices (ranks ordered TP, then DP, then PP over the groups in the
  cluster file's order), the same TP everywhere, layers split evenly, micro-batches split evenly.
- exhaustive_best: every plan of the planner's space, enumerated (for clusters small enough):
  every structure, layer split over 1, 2 or 4 chunks a stage, batch split, sharding on and off.
"""

from __future__ import annotations

import itertools

from hethub.memo import memo_scope
from hethub.planner.candidates import Layout, combinations, homogeneous, mixed, tp_degrees
from hethub.planner.drafts import VIRTUAL_STAGES, chunks_allowed
from hethub.planner.search import MAX_STAGES, MICRO_BATCH_SIZES
from hethub.predictor import Prediction, predict
from hethub.spec import ClusterSpec, ModelSpec
from hethub.spec.plan import PipelineLayout, Plan, StageSpec, stage_chunk_layers, uniform_layers
from hethub.spec.schedules import Schedule


def _best(
    plans, cluster: ClusterSpec, model: ModelSpec
) -> tuple[Plan | None, Prediction | None, int]:
    best_plan = best = None
    count = 0
    for plan in plans:
        count += 1
        prediction = predict(plan, cluster, model)
        if prediction.fits and (best is None or prediction.tokens_per_s > best.tokens_per_s):
            best_plan, best = plan, prediction
    return best_plan, best, count


def _settings(global_batch: int):
    return [(b, r) for b in MICRO_BATCH_SIZES if global_batch % b == 0 for r in ("none", "full")]


@memo_scope()  # one Memo for all the plans it predicts
def megatron_uniform(cluster: ClusterSpec, model: ModelSpec, global_batch: int, model_ref: str):
    """The fastest fitting Megatron-style uniform plan over all devices: (plan, prediction)."""
    common = set.intersection(*(set(tp_degrees(g, model)) for g in cluster.groups))
    owner = [g for g in cluster.groups for _ in range(g.devices)]

    def plans():
        for tp in sorted(common):
            slots = len(owner) // tp
            for p in range(1, min(model.layers, MAX_STAGES, slots) + 1):
                replicas = slots // p
                stages = []
                for s in range(p):  # stage s of every replica: devices [s * replicas * tp, ...)
                    first, last = s * replicas * tp, (s + 1) * replicas * tp - 1
                    if owner[first] is not owner[last]:
                        break  # a stage would straddle two groups
                    stages.append(owner[first].name)
                if len(stages) < p:
                    continue
                for micro_batch, recompute in _settings(global_batch):
                    total = global_batch // micro_batch
                    if total < replicas:
                        continue
                    base, extra = divmod(total, replicas)
                    layers = uniform_layers(model.layers, p)
                    spec = tuple(
                        StageSpec(group=g, tp=tp, layers=n) for g, n in zip(stages, layers)
                    )
                    parts = [(replicas - extra, base), (extra, base + 1)]
                    yield Plan(
                        model=model_ref,
                        global_batch=global_batch,
                        micro_batch=micro_batch,
                        recompute=recompute,
                        pipelines=tuple(
                            PipelineLayout(count=c, micro_batches=m, stages=spec)
                            for c, m in parts
                            if c
                        ),
                    )

    plan, prediction, _ = _best(plans(), cluster, model)
    return plan, prediction


def _compositions(total: int, parts: int, low: list[int] | None = None):
    """Every way to write total as parts positive integers (at least low[i] each)."""
    low = low or [1] * parts
    if parts == 1:
        if total >= low[0]:
            yield (total,)
        return
    for first in range(low[0], total - sum(low[1:]) + 1):
        for rest in _compositions(total - first, parts - 1, low[1:]):
            yield (first, *rest)


@memo_scope()  # one Memo for all the plans it predicts
def exhaustive_best(cluster: ClusterSpec, model: ModelSpec, global_batch: int, model_ref: str):
    """The fastest fitting plan of the whole space: every structure, layer split and batch split.

    Returns (plan, prediction, plans predicted). Only for tiny clusters and models."""
    every = {g.name: homogeneous(g, model, MAX_STAGES) for g in cluster.groups}
    structures = [(layout,) for layouts in every.values() for layout in layouts]
    structures += combinations(every)
    structures += mixed(
        cluster, model, {g.name: tp_degrees(g, model) for g in cluster.groups}, MAX_STAGES, every
    )
    structures = list(dict.fromkeys(structures))

    def plans():
        for structure in structures:
            for micro_batch, recompute in _settings(global_batch):
                total = global_batch // micro_batch
                counts = [layout.count for layout in structure]
                for shares in _compositions(total, len(structure), counts):
                    for chunks in VIRTUAL_STAGES:
                        widths = [
                            chunks_allowed(layout, model.layers, chunks) for layout in structure
                        ]
                        if chunks > 1 and max(widths) == 1:
                            continue  # the same plans as one chunk a stage
                        splits = [
                            list(_compositions(model.layers, len(layout.slots) * v))
                            for layout, v in zip(structure, widths)
                        ]
                        # the schedules that run this many chunks a stage (ZBV: on every layout)
                        schedules = SCHEDULES_BY_CHUNKS[chunks]
                        if chunks == 2 and (min(widths) < 2 or model.tied_head):
                            schedules = schedules[:1]  # ZBV: as check_plan allows it
                        # sequence parallelism only where a stage has TP
                        sequence = (False, True) if any_tp(structure, model) else (False,)
                        for chosen, shard, schedule, sp in itertools.product(
                            itertools.product(*splits), (False, True), schedules, sequence
                        ):
                            yield _plan(
                                structure,
                                chosen,
                                shares,
                                micro_batch,
                                recompute,
                                global_batch,
                                model_ref,
                                shard,
                                schedule,
                                sp,
                            )

    return _best(plans(), cluster, model)


SCHEDULES_BY_CHUNKS = {
    1: (Schedule.ONE_F_ONE_B, Schedule.ZB_H1),
    2: (Schedule.INTERLEAVED_1F1B, Schedule.ZBV),
    4: (Schedule.INTERLEAVED_1F1B,),
}
"""The schedules the exhaustive space tries at each count of chunks a stage (the planner's)."""


def any_tp(structure: tuple[Layout, ...], model: ModelSpec) -> bool:
    """Whether a stage of the structure has TP, and the sequence splits over every such degree
    (sequence parallelism then changes something)."""
    degrees = {slot.tp for layout in structure for slot in layout.slots}
    return max(degrees) > 1 and all(model.seq_len % tp == 0 for tp in degrees)


def _plan(
    structure: tuple[Layout, ...],
    splits,
    shares,
    micro_batch: int,
    recompute: str,
    global_batch: int,
    model_ref: str,
    shard: bool = False,
    schedule: Schedule | None = None,
    sequence_parallel: bool = False,
) -> Plan:
    """``splits``: per layout, the layers of each of the model's chunks, in model order (stage
    s's chunk c is spec.schedules.model_chunk's: c x p + s, or ZBV's V). Replicas of a layout
    overlap their gradient sync (as the planner's plans do: it never delays a step) and, with
    ``shard``, shard their optimizer. ``schedule`` None: 1F1B, interleaved over more chunks."""
    pipelines = []
    for layout, split, share in zip(structure, splits, shares):
        order = schedule or Schedule.INTERLEAVED_1F1B
        stages = tuple(
            StageSpec.of_chunks(slot.group, slot.tp, chunks)
            for slot, chunks in zip(
                layout.slots, stage_chunk_layers(order, split, len(layout.slots))
            )
        )
        base, extra = divmod(share, layout.count)
        pipelines += [
            PipelineLayout(count=c, micro_batches=m, stages=stages)
            for c, m in ((layout.count - extra, base), (extra, base + 1))
            if c
        ]
    data_parallel = any(layout.count > 1 for layout in structure)
    return Plan(
        model=model_ref,
        global_batch=global_batch,
        micro_batch=micro_batch,
        recompute=recompute,
        schedule=schedule
        or (
            Schedule.INTERLEAVED_1F1B
            if any(len(p.stages[0].chunks) > 1 for p in pipelines)
            else Schedule.ONE_F_ONE_B
        ),
        shard_optimizer=shard and data_parallel,
        overlap_param_gather=shard and data_parallel,  # as the planner's sharded plans do
        sequence_parallel=sequence_parallel,
        overlap_grad_sync=data_parallel,
        pipelines=tuple(pipelines),
    )
