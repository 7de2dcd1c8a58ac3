"""The planner's search: structures x plan-wide settings, each made concrete and predicted.

Phase 1 plans every group alone with the whole batch (every TP and pipeline depth, micro-batch
size, recomputation); its best layouts seed phase 2, which tries the heterogeneous structures
(combinations of per-group layouts, and replicas that cross kinds); phase 3 cuts, for two kinds,
each group's share of a replica into stages of two neighbouring TP degrees, under the best plan's
setting. Every candidate gets its layers from the exact partitioner and its micro-batches from the
balanced split, is predicted only if it can beat the best so far, and each phase's best plans are
polished by moving single layers; a plan that does not fit in memory is never kept.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import heapq
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from hethub.planner.candidates import (
    Layout,
    Structure,
    combinations,
    homogeneous,
    mixed,
    mixed_tp,
    tp_degrees,
)
from hethub.planner.costs import (
    Setting,
    StageSlot,
    end_time,
    layer_time,
    stage_caps,
    stage_position,
)
from hethub.planner.partition import (
    chunk_split,
    least_bottleneck,
    partition_chunks,
    relaxed_bottleneck,
    stage_times,
)
from hethub.planner.split import ReplicaTiming, split_micro_batches
from hethub.predictor import Prediction, default_calibration, predict
from hethub.predictor.calibration import Calibration
from hethub.predictor.iteration import check_precision
from hethub.predictor.memory import fits, headroom_gb
from hethub.predictor.profiled import core_sharing, for_precision
from hethub.predictor.stage import StagePosition
from hethub.profiles.store import Profiles
from hethub.spec.cluster import ClusterSpec, DeviceGroup
from hethub.spec.model import ModelSpec
from hethub.spec.plan import (
    PipelineLayout,
    Plan,
    Precision,
    Recompute,
    StageSpec,
    stage_chunk_layers,
    uniform_layers,
)
from hethub.spec.schedules import (
    Schedule,
    chunks_per_stage,
    in_flight_micro_batches,
    stage_model_chunks,
)
from hethub.spec.topology import data_parallel_degrees

ZERO_BUBBLE = (Schedule.ZB_H1, Schedule.ZBV)
"""The zero-bubble schedules the search tries on the structures it has predicted."""
MICRO_BATCH_SIZES = (1, 2, 4)
VIRTUAL_STAGES = (1, 2, 4)  # chunks per stage (interleaved 1F1B) where the layers allow
MAX_STAGES = 32  # deeper pipelines only add bubble at any batch a plan can have
KEEP_PER_GROUP = 3  # per group and setting, the best layouts phase 2 combines
UNPLACEABLE_PRICED = (
    200  # when no plan fits, how many unplaceable structures to price for the error
)

SEARCHED_RECOMPUTE = (Recompute.NONE, Recompute.FULL)
"""The recomputations the search tries, each for a whole plan: selective, which saves only the
attention kernel's log-sum-exp with flash kernels (spec.layer_ops), would price half as many
plans again for next to no memory; the per-stage choice is the search's next step (issue 28)."""

Progress = Callable[[str, int, int], None]


@dataclass(frozen=True, slots=True)
class Ranked:
    plan: Plan
    prediction: Prediction


@dataclass(slots=True)
class Overflow:
    """The candidate that came closest to fitting, for the error when none fits."""

    over_gb: float
    need_gb: float
    group: str
    accelerator: str
    capacity_gb: float
    summary: str


@dataclass(frozen=True, slots=True)
class SearchQuery:
    """What a search was asked: planner.bound plans each group alone under the same options."""

    cluster: ClusterSpec
    model: ModelSpec
    global_batch: int
    model_ref: str
    calibration: Calibration
    profiles: Profiles | None
    """Already selected for ``precision``."""
    precision: Precision
    prune: bool = True


@dataclass(slots=True)
class SearchResult:
    ranked: list[Ranked]
    """Fitting plans, fastest first (each structure and setting at most once)."""
    group_best: dict[str, Ranked | None]
    """Each group's best plan alone with the whole global batch (phase 1)."""
    candidates_evaluated: int
    search_time_s: float
    query: SearchQuery
    closest: Overflow | None = None
    timed_out: bool = False

    @property
    def best(self) -> Ranked | None:
        return self.ranked[0] if self.ranked else None


@dataclass(slots=True)
class _Search:
    cluster: ClusterSpec
    model: ModelSpec
    model_ref: str
    global_batch: int
    deadline: float
    progress: Progress | None
    calibration: Calibration
    profiles: Profiles | None = None
    evaluated: int = 0
    timed_out: bool = False
    ranked: list[Ranked] = field(default_factory=list)
    closest: Overflow | None = None
    best_time: float = float("inf")
    """The fastest fitting step predicted so far in this phase: the bar a candidate must beat."""
    unplaceable: list[tuple[Setting, Structure]] = field(default_factory=list)
    """Structures whose layers fit no split in memory (for the error when no plan fits)."""
    prune: bool = True
    """Skip the drafts and predictions that bounds show cannot win (False: make every one, for
    the tests that hold the pruning to the same plans)."""
    predicted: dict[Plan, Prediction] = field(default_factory=dict)
    """Every plan predicted, by plan: the local search comes back to plans it has priced (a
    layer moved there and back, a plan of one phase a neighbour in the next)."""

    def out_of_time(self) -> bool:
        self.timed_out = self.timed_out or time.perf_counter() > self.deadline
        return self.timed_out


def search(
    cluster: ClusterSpec,
    model: ModelSpec,
    global_batch: int,
    *,
    model_ref: str,
    calibration: Calibration | None = None,
    time_limit_s: float | None = None,
    progress: Progress | None = None,
    profiles: Profiles | None = None,
    precision: Precision = Precision.BF16,
    prune: bool = True,
) -> SearchResult:
    """The fastest plans for ``model`` at ``global_batch`` sequences per step on ``cluster``, all
    of ``precision``; ``profiles`` (selected under the job's run conditions) price what they hold
    of that precision's dtype, as in predict(). ``prune`` False drafts and predicts every
    candidate that the bounds would skip as unable to win: the same plans, slower (for tests)."""
    started = time.perf_counter()
    cal = calibration or default_calibration()
    precision = Precision(precision)
    check_precision(cluster, precision)
    if profiles is not None:
        profiles = for_precision(profiles, precision)
    state = _Search(
        cluster,
        model,
        model_ref,
        global_batch,
        started + time_limit_s if time_limit_s else float("inf"),
        progress,
        cal,
        profiles,
        prune=prune,
    )
    # Sequence parallelism wherever a stage has TP (as every Megatron-LM recipe at scale):
    # less memory for the same communication; _neighbours tries each best plan without it.
    # Profiles measure layers without it, so a profiled search leaves it off.
    sequence_parallel = profiles is None and all(
        model.seq_len % tp == 0 for g in cluster.groups for tp in tp_degrees(g, model)
    )
    settings = [
        Setting(
            model=model,
            calibration=cal,
            micro_batch=b,
            recompute=r,
            profiles=profiles,
            precision=precision,
            sequence_parallel=sequence_parallel,
        )
        for b in MICRO_BATCH_SIZES
        if global_batch % b == 0
        for r in SEARCHED_RECOMPUTE
    ]

    group_best: dict[str, Ranked | None] = {}
    seeds: dict[Setting, dict[str, list[Layout]]] = {s: {} for s in settings}
    for group in cluster.groups:
        # Each group is searched exactly as a cluster of that group alone would be: the same jobs,
        # the same bar, so planner.bound may take its best here as the group alone at this batch.
        state.best_time = float("inf")
        jobs = [
            (setting, (layout,))
            for setting in settings
            for layout in homogeneous(group, model, MAX_STAGES)
        ]
        fitting = [(r, jobs[i]) for r, i in _evaluate(state, jobs, f"group {group.name} alone")]
        group_best[group.name] = _refine(state, [r for r, _ in fitting])
        for setting in settings:
            mine = sorted(
                ((r, job[1][0]) for r, job in fitting if job[0] == setting),
                key=lambda x: -_speed(x[0]),
            )
            best_layouts = dict.fromkeys(layout for _, layout in mine)  # interleaved or not
            seeds[setting][group.name] = list(best_layouts)[:KEEP_PER_GROUP]

    if len(cluster.groups) > 1:
        state.best_time = min(
            (r.prediction.iteration_time_s for r in group_best.values() if r), default=float("inf")
        )
        jobs = []
        # A setting under which a group had nothing predicted (its bar came from a better
        # setting) still mixes the group's best layouts of the other settings.
        anywhere = {
            g.name: list(dict.fromkeys(x for s in settings for x in seeds[s].get(g.name, [])))
            for g in cluster.groups
        }
        for setting in settings:
            choices = {
                name: layouts or anywhere[name][:KEEP_PER_GROUP]
                for name, layouts in seeds[setting].items()
            }
            choices = {name: layouts for name, layouts in choices.items() if layouts}
            if not choices:
                continue  # no group came near its best alone under this setting: nor will a mix
            tps = _mixed_tps(cluster, model, choices)
            for structure in combinations(choices) + mixed(
                cluster, model, tps, MAX_STAGES, choices
            ):
                jobs.append((setting, structure))
        found = [r for r, _ in _evaluate(state, jobs, "heterogeneous plans")]
        best = _refine(state, found)
        if best is not None:  # finer mixes of TP degrees, under the best plan's setting
            setting = next(
                s
                for s in settings
                if s.micro_batch == best.plan.micro_batch and s.recompute == best.plan.recompute
            )
            jobs = [(setting, structure) for structure in mixed_tp(cluster, model, MAX_STAGES)]
            _refine(state, [r for r, _ in _evaluate(state, jobs, "mixed TP degrees")])

    if not state.ranked and state.closest is None:
        _closest_unplaceable(state)
    state.ranked.sort(key=lambda r: -_speed(r))
    return SearchResult(
        state.ranked,
        group_best,
        state.evaluated,
        time.perf_counter() - started,
        SearchQuery(cluster, model, global_batch, model_ref, cal, profiles, precision, prune),
        state.closest,
        state.timed_out,
    )


def _mixed_tps(
    cluster: ClusterSpec, model: ModelSpec, choices: dict[str, list[Layout]]
) -> dict[str, list[int]]:
    """TP degrees per group for pipelines that cross kinds: every degree for two groups; for three,
    those of the group's best layouts alone and its widest (fewest stages); beyond, only its best
    (the mixes multiply past any budget otherwise)."""
    out = {}
    for g in cluster.groups:
        every, best = (
            tp_degrees(g, model),
            [layout.slots[0].tp for layout in choices.get(g.name, [])],
        )
        if len(cluster.groups) <= 2:
            out[g.name] = every
        elif len(cluster.groups) == 3:
            out[g.name] = sorted(set(best) | {every[-1]})
        else:
            out[g.name] = best[:1] or every[-1:]
    return out


REFINE_BUDGET = 300  # predictions a phase may spend polishing its best plans
REFINE_ROUNDS = 6


def _refine(state: _Search, found: list[Ranked]) -> Ranked | None:
    """Polish a phase's plans, best first (each setting's best early on), by moving single layers
    across stage boundaries, judged by the predictor itself: the partitioner's objective leaves
    out communication, gradient sync and the optimizer step, which matter for short steps.
    Returns the phase's best plan.

    A neighbour that cannot replace the plan, as its step takes at least as long
    (_compute_floor) or it does not fit in memory (_predict: most moves of a layer onto a stage
    that memory already bounds), is not predicted; it still counts against the budget, so the
    same plans are polished as far as if it were."""
    found = sorted(found, key=_speed, reverse=True)
    best_per_setting = {}
    for ranked in found:
        best_per_setting.setdefault((ranked.plan.micro_batch, ranked.plan.recompute), ranked)
    tried = 0  # neighbours weighed, predicted or not: the budget
    polished = []
    for ranked in dict.fromkeys([*found[:1], *best_per_setting.values(), *found]):
        best = ranked
        for _ in range(REFINE_ROUNDS):
            improved = False
            for plan in _neighbours(best.plan):
                if tried >= REFINE_BUDGET or state.out_of_time():
                    break
                tried += 1
                if state.prune and _compute_floor(state, plan) >= _step_s(best):
                    continue
                candidate = _predict(state, plan)
                if candidate is not None and _speed(candidate) > _speed(best):
                    best, improved = candidate, True
            if not improved:
                break
        polished.append(best)
        if tried >= REFINE_BUDGET or state.out_of_time():
            break
    return max([*found, *polished], key=_speed, default=None)


def _step_s(ranked: Ranked) -> float:
    return ranked.prediction.iteration_time_s


def _compute_floor(state: _Search, plan: Plan) -> float:
    """At most ``plan``'s predicted step: the most, over its pipelines' stages, of a stage's
    forwards and backwards of every micro-batch one after another, after the forwards of the
    first round of chunks before it and followed by their backwards (_stage_floors), priced as
    the predictor prices them. 0 where ranks share the cores, which speeds a stage up while
    others wait."""
    if state.profiles is not None:
        return 0.0
    setting = _setting_of(state, plan)
    return max(
        before + pipeline.micro_batches * work
        for pipeline in plan.pipelines
        for before, work in _stage_floors(
            setting, state.cluster, pipeline.stages, pipeline.schedule
        )
    )


def _fits(state: _Search, plan: Plan) -> bool:
    """Whether every stage of ``plan`` fits in its devices' memory as predict() finds it: the
    same pricing of the same stage shape, micro-batches in flight and optimizer shards."""
    shards = data_parallel_degrees(plan) if plan.shard_optimizer else [1] * len(plan.pipelines)
    for pipeline, shard in zip(plan.pipelines, shards):
        p, m = len(pipeline.stages), pipeline.micro_batches
        for s, stage in enumerate(pipeline.stages):
            setting = _setting_of(state, plan, stage.recompute)
            in_flight = in_flight_micro_batches(pipeline.schedule, s, p, m, stage.chunks)
            group = state.cluster.group(stage.group)
            where = stage_position(pipeline.schedule, s, p)
            if not _stage_fits(setting, group, stage.tp, stage.layers, where, in_flight, shard):
                return False
    return True


@functools.lru_cache(maxsize=65536)
def _stage_fits(
    setting: Setting,
    group: DeviceGroup,
    tp: int,
    layers: int,
    position: StagePosition,
    in_flight: float,
    shards: int,
) -> bool:
    shape = setting.shape(tp, layers, position)
    memory = setting.pricing.memory(group, shape, in_flight=in_flight, optimizer_shards=shards)
    return fits(memory, group.accelerator)


def _setting_of(state: _Search, plan: Plan, recompute: Recompute | None = None) -> Setting:
    """The setting ``plan`` is costed under in ``state``'s search (a stage of it: under its
    own ``recompute``)."""
    return Setting(
        model=state.model,
        calibration=state.calibration,
        micro_batch=plan.micro_batch,
        recompute=recompute or plan.recompute,
        precision=plan.precision,
        sequence_parallel=plan.sequence_parallel,
        profiles=state.profiles,
    )


@functools.lru_cache(maxsize=65536)
def _stage_floors(
    setting: Setting, cluster: ClusterSpec, stages: tuple[StageSpec, ...], schedule: Schedule
) -> tuple[tuple[float, float], ...]:
    """Per stage s: (the forward plus backward of one micro-batch through the model's chunks 0
    to s - 1, its forward plus backward of one micro-batch over all its chunks), each chunk
    priced at its place among the model's chunks, as predict() prices it.

    A stage runs its operations one at a time. Every one of them waits for its micro-batch's
    forward through the model's chunks before the stage's first (chunks 0 to s - 1, on the
    stages before), and its last operation, a backward, is followed by that micro-batch's
    backward through them; the step ends after both, and after the stage's gradient sync and
    optimizer step (predictor.iteration): so the step takes at least the sum."""
    p, chunks = len(stages), len(stages[0].chunks)
    groups = [cluster.group(stage.group) for stage in stages]
    chunk_s = {}  # model chunk -> forward plus backward of one micro-batch
    waited = {}  # model chunk -> what a later stage waits for of it: its forward and backward,
    # its forward alone where backwards split (a zero-bubble stage's last operation may be a W,
    # which the backwards through the chunks before it can overlap)
    mine = stage_model_chunks(schedule, p, chunks)  # each stage's model chunks
    for stage, group, held in zip(stages, groups, mine):
        own = dataclasses.replace(setting, recompute=stage.recompute)
        for g, layers in zip(held, stage.chunks):
            times = own.pricing.work(
                group, own.shape(stage.tp, layers, StagePosition.of(g, p * chunks))
            )
            chunk_s[g] = times.forward_s + times.backward_s
            waited[g] = times.forward_s if schedule.splits_backward else chunk_s[g]
    # a stage's first chunk is the model's s (a chunk c x p + s, or the V's s and 2p - 1 - s)
    floors, before = [], 0.0
    for s in range(p):
        floors.append((before, sum(chunk_s[g] for g in mine[s])))
        before += waited[s]
    return tuple(floors)


def _neighbours(plan: Plan):
    """The plans one step from ``plan``: one layer moved (_layer_moves), or its optimizer
    unsharded (a sharded optimizer's all-gather of the updated weights follows its step, where
    an overlapped all-reduce may have hidden the whole sync; unsharded, it may not fit)."""
    if plan.shard_optimizer:  # first: one candidate, which a spent budget must not skip
        yield dataclasses.replace(plan, shard_optimizer=False, overlap_param_gather=False)
    yield from _recompute_dropped(plan)
    if plan.sequence_parallel:  # it saves memory; its edges' gathers may cost more
        yield dataclasses.replace(plan, sequence_parallel=False)
    yield from _layer_moves(plan)


def _recompute_dropped(plan: Plan):
    """The plan with one recomputing stage recomputing nothing, in every layout holding it, the
    last stages first (they hold the fewest micro-batches in flight, so the likeliest to fit):
    recomputation where memory is short, and only there."""
    for layout in _layouts(plan):
        stages = layout.stages
        for s in reversed(range(len(stages))):
            if stages[s].recompute == Recompute.NONE:
                continue
            changed = tuple(
                dataclasses.replace(st, recompute=Recompute.NONE) if i == s else st
                for i, st in enumerate(stages)
            )
            yield _restaged(plan, layout, changed)


def _layer_moves(plan: Plan):
    """Plans with one layer moved to a neighbouring chunk of the model (a neighbouring stage
    without interleaving), in every layout (replicas that share stages move together, since they
    sync as one)."""
    for layout in _layouts(plan):
        stages, chunk_layers = layout.stages, layout.chunk_layers()
        for g in range(len(chunk_layers) - 1):
            for donor, taker in ((g, g + 1), (g + 1, g)):
                if chunk_layers[donor] == 1:
                    continue
                moved = list(chunk_layers)
                moved[donor] -= 1
                moved[taker] += 1
                split = stage_chunk_layers(layout.schedule, moved, len(stages))
                changed = tuple(
                    StageSpec.of_chunks(st.group, st.tp, chunks, st.recompute)
                    for st, chunks in zip(stages, split)
                )
                yield _restaged(plan, layout, changed)


def _layouts(plan: Plan) -> list[PipelineLayout]:
    """The plan's distinct layouts (stages and schedule), in order: the replicas of one change
    together, since they sync as one."""
    first: dict[tuple, PipelineLayout] = {}
    for pipeline in plan.pipelines:
        first.setdefault((pipeline.stages, pipeline.schedule), pipeline)
    return list(first.values())


def _restaged(plan: Plan, layout: PipelineLayout, stages: tuple[StageSpec, ...]) -> Plan:
    """``plan`` with every pipeline of ``layout``'s stages and schedule holding ``stages``."""
    key = (layout.stages, layout.schedule)
    return dataclasses.replace(
        plan,
        pipelines=tuple(
            dataclasses.replace(pl, stages=stages) if (pl.stages, pl.schedule) == key else pl
            for pl in plan.pipelines
        ),
    )


def _speed(ranked: Ranked) -> float:
    return ranked.prediction.tokens_per_s


@dataclass(frozen=True, slots=True)
class _Draft:
    plan: Plan
    bound: float
    """A lower bound on the plan's step: the slowest replica's m x bottleneck plus a quarter of
    its fill, the fill a v-th as long over v chunks a stage."""
    interleaved_bound: float
    """The same bound at the most chunks a stage its layouts allow: the least any of the
    structure's interleavings can take."""


def _evaluate(
    state: _Search, jobs: list[tuple[Setting, Structure]], phase: str
) -> list[tuple[Ranked, int]]:
    """Predict the jobs' plans (one chunk a stage), most promising first, skipping those that
    cannot beat the bar, then interleave those that came near it (_interleave). Returns the
    fitting plans, each with its job's index.

    A plan's step takes at least m x bottleneck (its slowest stage busy with every micro-batch)
    plus a quarter of the other stages' time per micro-batch (the forwards before it and the
    backwards after it), a v-th of that over v chunks a stage. A structure is predicted unless
    even its most interleaved bound is above the best step predicted so far.

    Drafting (partitioning the layers, splitting the micro-batches) costs more than most
    candidates are worth, so a job is drafted only once its floor (_structure_floor: at most
    its draft's bound) is the least of what is left: the drafts then come in the order of their
    bounds, exactly as if all were drafted first, and those whose floor is above the bar are
    never drafted.
    """
    # (floor or bound, job, how far it is made out, the draft's plan)
    queue: list[tuple[float, int, _Floor, Plan | None]] = []
    unplaceable_before = len(state.unplaceable)
    # A setting's jobs by the first one's index, which stands for them all in the queue.
    members: dict[int, list[int]] = {}
    if state.prune:
        first_of: dict[Setting, int] = {}
        for index, (setting, _) in enumerate(jobs):
            members.setdefault(first_of.setdefault(setting, index), []).append(index)
        for first in members:
            queue.append((_setting_floor(state, jobs[first][0]), first, _Floor.SETTING, None))
    for index, (setting, structure) in enumerate(jobs if not state.prune else ()):
        if state.progress and index % 64 == 0:
            state.progress(phase, index, 2 * len(jobs))
        if state.out_of_time():
            break
        draft = _draft(state, setting, structure, 1)
        if draft is not None:
            queue.append((draft.interleaved_bound, index, _Floor.DRAFTED, draft.plan))
    heapq.heapify(queue)
    results: list[Ranked | None] = [None] * len(jobs)
    done, drafted = 0, set()
    while queue and not state.out_of_time():
        bound, index, known, plan = heapq.heappop(queue)
        if bound >= state.best_time:
            break  # a floor or bound is at most every bound behind it
        if known == _Floor.SETTING:  # the setting's jobs, each by its own floor
            for member in members[index]:
                floor = _structure_floor(state, *jobs[member], _Floor.RELAXED)
                if floor is not None:
                    heapq.heappush(queue, (floor, member, _Floor.RELAXED, None))
            continue
        if known < _Floor.CAPPED:  # make it out further, and queue it again
            floor = _structure_floor(state, *jobs[index], _Floor(known + 1))
            if floor is not None:
                heapq.heappush(queue, (floor, index, _Floor(known + 1), None))
            continue
        if known == _Floor.CAPPED:
            drafted.add(index)
            draft = _draft(state, *jobs[index], 1)
            if draft is not None:
                heapq.heappush(queue, (draft.interleaved_bound, index, _Floor.DRAFTED, draft.plan))
            continue
        if state.progress and done % 16 == 0:
            share = done * len(jobs) // (done + len(queue))
            state.progress(phase, len(jobs) + share, 2 * len(jobs))
        done += 1
        results[index] = _predict(state, plan)
    if state.prune and state.best_time == float("inf"):
        # Nothing fits: the error names the closest candidate of all, so every job is drafted,
        # and those that fit no split go in the jobs' order, as without floors.
        for index in range(len(jobs)):
            if index not in drafted and not state.out_of_time():
                _draft(state, *jobs[index], 1)
        position = {job: index for index, job in reversed(list(enumerate(jobs)))}
        state.unplaceable[unplaceable_before:] = sorted(
            state.unplaceable[unplaceable_before:], key=position.__getitem__
        )
    if state.progress:
        state.progress(phase, 2 * len(jobs), 2 * len(jobs))
    fitting = [(ranked, index) for index, ranked in enumerate(results) if ranked is not None]
    return fitting + _interleave(state, jobs, results)


class _Floor(enum.IntEnum):
    """How far a job in _evaluate's queue is made out: each key is at most the next one's."""

    SETTING = 0  # _setting_floor: every job of one setting at once
    RELAXED = 1  # _structure_floor over _relaxed_bottleneck
    WHOLE = 2  # over _least_bottleneck without memory caps
    CAPPED = 3  # over _least_bottleneck under the draft's memory caps
    DRAFTED = 4  # the draft's bound


def _setting_floor(state: _Search, setting: Setting) -> float:
    """At most _structure_floor of every structure under ``setting``: a stage of TP t on group
    g passes a layer at a rate 1 / layer_time, at most t x r_g, r_g the best rate a device of g
    reaches at any degree, so the layers of all micro-batches take at least their count over
    the rate of every device at its best (the embedding and the head only add). 0 where the
    ranks share the cores."""
    if state.profiles is not None:
        return 0.0
    rate = sum(
        group.devices
        * max(1 / (tp * layer_time(setting, group, tp)) for tp in tp_degrees(group, state.model))
        for group in state.cluster.groups
    )
    total = state.global_batch // setting.micro_batch
    return total * state.model.layers / rate * (1 - FLOOR_MARGIN)


def _structure_floor(
    state: _Search, setting: Setting, structure: Structure, known: _Floor
) -> float | None:
    """At most the bounds of every draft of ``structure``, without drafting it (None: it has no
    draft): the slowest replica takes at least the time at which the layouts, each running
    micro-batches at its least bottleneck, would share them all. The least bottleneck, from
    cheapest and lowest to dearest and highest (``known``): that of layers as real numbers
    (_relaxed_bottleneck), of whole layers, of whole layers under the memory caps
    (_least_bottleneck). 0 where the ranks share the cores (the draft scales its bound by how
    much faster a stage may then run)."""
    total = state.global_batch // setting.micro_batch
    replicas = sum(layout.count for layout in structure)
    if replicas == 0 or total < replicas:
        return None
    if state.profiles is not None:
        return 0.0
    nominal = max(1, total // replicas)
    rate = 0.0
    for layout in structure:
        bottleneck = (
            _relaxed_bottleneck(setting, state.cluster, layout.slots)
            if known == _Floor.RELAXED
            else _least_bottleneck(
                setting, state.cluster, layout, nominal if known == _Floor.CAPPED else None
            )
        )
        if bottleneck is None:
            return None
        rate += layout.count / bottleneck
    return total / rate * (1 - FLOOR_MARGIN)


FLOOR_MARGIN = 1e-9
"""Rounding headroom: a floor must never exceed the bound it stands for."""


@functools.lru_cache(maxsize=65536)
def _stage_costs(
    setting: Setting, cluster: ClusterSpec, slots: tuple[StageSlot, ...]
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Each stage's time per layer and its extra time (embedding, head) per micro-batch, as
    _partition prices them (each kind of stage and place priced once: a pipeline has few)."""
    p = len(slots)
    priced: dict[tuple[StageSlot, StagePosition], tuple[float, float]] = {}
    per_layer, extra = [], []
    for s, slot in enumerate(slots):
        where = (slot, stage_position(setting.schedule, s, p))
        if where not in priced:
            group = cluster.group(slot.group)
            priced[where] = (
                layer_time(setting, group, slot.tp),
                end_time(setting, group, slot.tp, where[1]),
            )
        per_layer.append(priced[where][0])
        extra.append(priced[where][1])
    return tuple(per_layer), tuple(extra)


@functools.lru_cache(maxsize=65536)
def _relaxed_bottleneck(
    setting: Setting, cluster: ClusterSpec, slots: tuple[StageSlot, ...]
) -> float:
    per_layer, extra = _stage_costs(setting, cluster, slots)
    return relaxed_bottleneck(setting.model.layers, per_layer, extra)


@functools.lru_cache(maxsize=65536)
def _least_bottleneck(
    setting: Setting, cluster: ClusterSpec, layout: Layout, micro_batches: int | None
) -> float | None:
    """least_bottleneck of the layout under the memory caps of its draft at ``micro_batches``
    (None: no caps): at most the bottleneck of the draft's split."""
    per_layer, extra = _stage_costs(setting, cluster, layout.slots)
    layers = setting.model.layers
    caps = (
        [layers] * len(layout.slots)
        if micro_batches is None
        else stage_caps(setting, cluster, layout.slots, micro_batches, 1, layout.count)
    )
    return least_bottleneck(layers, per_layer, extra, caps)


def _interleave(
    state: _Search, jobs: list[tuple[Setting, Structure]], plain: list[Ranked | None]
) -> list[tuple[Ranked, int]]:
    """The predicted structures again over 2, 4, ... chunks a stage, and under the zero-bubble
    schedules (ZB-H1 on one chunk a stage, ZBV on two), most promising first.

    Interleaving v chunks a stage shortens a pipeline's fill and drain about v-fold and nothing
    else, so a plan can gain at most (1 - 1 / v) of its pipelines' idle time (a pipeline's time
    less its busiest stage's compute); a zero-bubble schedule at most all of it (its W's fill
    the waits). A variant whose one-chunk step less that gain cannot beat the best step so far
    is never drafted."""
    tries = []
    for index, ranked in enumerate(plain):
        if ranked is None:
            continue
        idle = _idle_s(ranked.prediction)
        step = ranked.prediction.iteration_time_s
        for v in VIRTUAL_STAGES[1:]:
            tries.append((step - idle * (1 - 1 / v), index, v, Schedule.INTERLEAVED_1F1B))
        for schedule in ZERO_BUBBLE:
            if schedule == Schedule.ZBV and state.model.tied_head:
                continue  # check_plan's rule: the V's first stage would hold both ends
            tries.append((step - idle, index, chunks_per_stage(schedule), schedule))
    tries.sort()
    results = []
    for bound, index, v, schedule in tries:
        if bound >= state.best_time or state.out_of_time():
            break
        setting, structure = jobs[index]
        if schedule.splits_backward:
            setting = dataclasses.replace(setting, schedule=schedule)
        draft = _draft(state, setting, structure, v)
        if draft is None or draft.plan.schedule != schedule:
            continue  # no layout of the structure has the layers for v chunks a stage
        if draft.bound < state.best_time and (ranked := _predict(state, draft.plan)):
            results.append((ranked, index))
    return results


def _idle_s(prediction: Prediction) -> float:
    """The longest of the plan's pipelines' idle time: its time less its busiest stage's."""
    busiest: dict[int, float] = {}
    for stage in prediction.stages:
        busiest[stage.pipeline] = max(busiest.get(stage.pipeline, 0.0), stage.compute_s)
    return max(prediction.pipeline_time_s[i] - busy for i, busy in busiest.items())


def chunks_allowed(layout: Layout, layers: int, chunks: int) -> int:
    """``chunks`` a stage where the layout has 2 stages or more and a layer for every chunk,
    else 1."""
    p = len(layout.slots)
    return chunks if p >= 2 and p * chunks <= layers else 1


def _draft(state: _Search, setting: Setting, structure: Structure, chunks: int) -> _Draft | None:
    """Layers per stage (and chunk) and micro-batches per replica for a structure, each layout
    interleaved over ``chunks`` chunks a stage where its layers allow, and lower bounds on its
    step. Replicas of one layout shard their optimizer, overlap their gradient sync with the
    backward and the optimizer's weight gather with the next forwards (sharding frees memory
    for layers; _refine tries each best plan unsharded too)."""
    total = state.global_batch // setting.micro_batch
    replicas = sum(layout.count for layout in structure)
    if replicas == 0 or total < replicas:
        return None
    nominal = max(1, total // replicas)
    layers = state.model.layers
    splits, timings, widths = [], [], []
    for layout in structure:
        v = chunks_allowed(layout, layers, chunks)
        if setting.schedule == Schedule.ZBV and v != chunks:
            return None  # the V needs two chunks on every stage of every layout
        split, times = _partition(setting, state.cluster, layout, nominal, v)
        if split is None:
            if chunks == 1:
                state.unplaceable.append((setting, structure))
            return None
        bottleneck = max(times)
        splits.append(split)
        widths.append((v, chunks_allowed(layout, layers, VIRTUAL_STAGES[-1])))
        timings.append(ReplicaTiming(layout.count, bottleneck, sum(times) - bottleneck))
    shares = split_micro_batches(total, timings)
    if shares is None:
        return None
    pipelines, bound, interleaved_bound = [], 0.0, 0.0
    for layout, split, share, timing, (v, most) in zip(structure, splits, shares, timings, widths):
        stages = tuple(
            StageSpec.of_chunks(slot.group, slot.tp, chunk_layers)
            for slot, chunk_layers in zip(layout.slots, split)
        )
        pipelines += [
            PipelineLayout(count=count, micro_batches=m, stages=stages) for count, m in share
        ]
        busiest = max(m for _, m in share) * timing.bottleneck_s
        if setting.schedule.splits_backward:
            # W's may fill every wait but the busiest stage's own work: no fill is certain
            bound, interleaved_bound = max(bound, busiest), max(interleaved_bound, busiest)
            continue
        bound = max(bound, busiest + timing.fill_s / (4 * v))
        interleaved_bound = max(interleaved_bound, busiest + timing.fill_s / (4 * most))
    data_parallel = any(layout.count > 1 for layout in structure)
    plan = Plan(
        model=state.model_ref,
        global_batch=state.global_batch,
        micro_batch=setting.micro_batch,
        recompute=setting.recompute,
        schedule=(
            Schedule.INTERLEAVED_1F1B
            if setting.schedule != Schedule.ZBV
            and any(len(p.stages[0].chunks) > 1 for p in pipelines)
            else setting.schedule
        ),
        precision=setting.precision,
        shard_optimizer=data_parallel,
        overlap_grad_sync=data_parallel,
        # the sharded optimizer's weight gather behind the next step's forwards: the runtime
        # waits for it wherever weights are read between steps (checkpoints, the end)
        overlap_param_gather=data_parallel,
        sequence_parallel=setting.sequence_parallel,
        pipelines=tuple(pipelines),
    )
    sharing = (
        None
        if state.profiles is None
        else core_sharing(plan, state.cluster, state.model, state.profiles)
    )
    if sharing is not None:
        # ranks sharing the cores compute faster while others wait: so may every stage
        bound *= sharing.alone
        interleaved_bound *= sharing.alone
    return _Draft(plan, bound, min(bound, interleaved_bound))


def _predict(state: _Search, plan: Plan) -> Ranked | None:
    """The plan predicted and kept, if it fits. Once a plan fits, one that _fits shows does not
    is not predicted: it would not be kept, and the closest overflow only matters while none
    fits."""
    if state.prune and state.ranked and not _fits(state, plan):
        return None
    prediction = state.predicted.get(plan)
    if prediction is None:
        state.evaluated += 1
        prediction = predict(
            plan, state.cluster, state.model, calibration=state.calibration, profiles=state.profiles
        )
        state.predicted[plan] = prediction
    if not prediction.fits:
        _note_overflow(state, plan, prediction)
        return None
    ranked = Ranked(plan, prediction)
    state.ranked.append(ranked)
    state.best_time = min(state.best_time, prediction.iteration_time_s)
    return ranked


def _partition(
    setting: Setting, cluster: ClusterSpec, layout: Layout, micro_batches: int, chunks: int
) -> tuple[list[tuple[int, ...]] | None, list[float] | None]:
    """The exact layer split of one layout over ``chunks`` chunks a stage (each stage's layers
    per chunk), and its stages' times per micro-batch."""
    p = len(layout.slots)
    groups = [cluster.group(slot.group) for slot in layout.slots]
    per_layer = [layer_time(setting, g, slot.tp) for g, slot in zip(groups, layout.slots)]
    extra = [
        end_time(setting, g, slot.tp, stage_position(setting.schedule, s, p))
        for s, (g, slot) in enumerate(zip(groups, layout.slots))
    ]
    caps = list(stage_caps(setting, cluster, layout.slots, micro_batches, chunks, layout.count))
    split = partition_chunks(setting.model.layers, per_layer, extra, caps, micro_batches, chunks)
    if split is None:
        return None, None
    if chunks == 1:
        return [(n,) for n in split], stage_times(split, per_layer, extra)
    # The embedding's time is on the first stage's first chunk, the head's on the last's last
    # (under ZBV's V, on the first stage's second chunk).
    chunked = [
        tuple(
            chunk_split(
                n, chunks, per_layer[s], _chunk_extras(setting, groups[s], slot, s, p, chunks)
            )
        )
        for s, (n, slot) in enumerate(zip(split, layout.slots))
    ]
    return chunked, stage_times(split, per_layer, extra)


def _chunk_extras(
    setting: Setting, group: DeviceGroup, slot: StageSlot, stage: int, stages: int, chunks: int
) -> list[float]:
    """The time each of the stage's ``chunks`` chunks spends on the embedding or the head,
    besides its layers: each end where spec.schedules.model_chunk puts the model's first and
    last chunk."""
    held = stage_model_chunks(setting.schedule, stages, chunks)[stage]
    last = stages * chunks - 1
    first_only, last_only = StagePosition.of(0, 2), StagePosition.of(1, 2)
    return [
        end_time(setting, group, slot.tp, first_only) * (g == 0)
        + end_time(setting, group, slot.tp, last_only) * (g == last)
        for g in held
    ]


def _note_overflow(state: _Search, plan: Plan, prediction: Prediction) -> None:
    """Remember by how much the closest candidate overflows which device."""

    def over(stage) -> float:
        return -headroom_gb(stage.memory, state.cluster.group(stage.group).accelerator)

    worst = max(prediction.stages, key=over)
    if state.closest is None or over(worst) < state.closest.over_gb:
        summary = ", ".join(
            f"{p.count}x[{'+'.join(f'{s.group}:tp{s.tp}x{s.layers}' for s in p.stages)}]"
            for p in plan.pipelines
        )
        state.closest = Overflow(
            over(worst),
            worst.memory.total_gb,
            worst.group,
            worst.accelerator,
            state.cluster.group(worst.group).accelerator.usable_memory_gb,
            f"{summary}, micro-batch {plan.micro_batch}, recompute {plan.recompute}",
        )


def _closest_unplaceable(state: _Search) -> None:
    """When nothing fits, price the structures the partitioner could not place (layers split
    evenly) to say by how much the closest one overflows."""
    for setting, structure in state.unplaceable[:UNPLACEABLE_PRICED]:
        total = state.global_batch // setting.micro_batch
        each = max(1, total // sum(layout.count for layout in structure))
        pipelines = tuple(
            PipelineLayout(
                count=layout.count,
                micro_batches=each,
                stages=tuple(
                    StageSpec(group=slot.group, tp=slot.tp, layers=n)
                    for slot, n in zip(
                        layout.slots, uniform_layers(state.model.layers, len(layout.slots))
                    )
                ),
            )
            for layout in structure
        )
        plan = Plan(
            model=state.model_ref,
            global_batch=state.global_batch,
            micro_batch=setting.micro_batch,
            recompute=setting.recompute,
            precision=setting.precision,
            pipelines=pipelines,
        )
        _note_overflow(
            state,
            plan,
            predict(
                plan,
                state.cluster,
                state.model,
                calibration=setting.calibration,
                profiles=state.profiles,
            ),
        )
