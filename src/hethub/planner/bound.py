"""The theoretical upper bound: each group planned alone on its share of the global batch.

HETHUB (arXiv 2405.16256) measures its plans against a "theoretical upper bound", the sum of what
each kind of accelerator reaches alone; H2 and others call it the sum of homogeneous throughputs.
It only bounds a plan of the whole cluster at the work each kind really gets: a plan shares the
global batch among its groups, so here each group is planned alone by the planner's own search
(the same candidates, predictor and options) on a share of the batch, in whole sequences, and
the shares are those that maximise the sum. No exchange between the groups is priced.

How the shares are found. A group's throughput alone rises with its share and flattens (its
pipelines' fill and its gradient sync spread over more micro-batches), with dips where a share
does not divide into its replicas, micro-batch size or (interleaving) stages. For a sum of rising,
flattening (concave) terms under a fixed total, a split that no transfer between groups improves
is the maximum (the discrete resource-allocation result: Ibaraki and Katoh, "Resource Allocation
Problems", 1988). _climb looks for it coarse to fine: on multiples of half the batch, then of a
quarter, ... down to one sequence, each time the best split within WINDOW steps of every group's
share, exactly (a small knapsack over the groups), re-centred until it stays. Each lattice holds
the coarser ones, so the shares the dips spare (round numbers) are weighed before those between.

Planning a group alone takes the search about half a second at scale, too long for every share
the climb weighs, so the climb reads a stand-in (_StandIn): the search's own figure where it was
run, else the group's best plans found so far (recipes: micro-batch size, recomputation, layouts,
chunks a stage) made concrete at the share (layers partitioned, micro-batches split, as the search
does) and predicted. The search plans each group alone at the whole batch (phase 1 of any search)
and at its share in proportion to that throughput; after each climb it plans every group at the
climb's shares, their plans join the recipes, and the climb runs again, until it ends on shares
already planned (or after MAX_ROUNDS). Where each replica of the search's best plan lies in one
group, the split that plan makes is planned too and weighed with the climb's (a split the bound's
maximum must be at least). The bound is the best split the search itself planned:
each term is the planner's best for that group alone at that share. It is the maximum over the
splits the climb weighs; the stand-in can miss a better split where a group's best plan at it is
unlike every recipe. Where the groups' shares are few (EVERY_SHARE), each group is planned alone
at every share instead, and the bound is exactly the maximum.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from hethub.memo import memo_scope
from hethub.planner.candidates import Layout
from hethub.planner.costs import Setting, StageSlot
from hethub.planner.drafts import make_draft
from hethub.planner.floors import compute_floor
from hethub.planner.search import SearchQuery, SearchResult, search
from hethub.planner.search_state import PricedPlan, SearchState, predict_and_keep
from hethub.spec.plan import Plan

MAX_ROUNDS = 4  # climbs, each followed by the search at its shares; two or three agree
EVERY_SHARE = 32
"""Up to this many (group, share) pairs, every group is planned alone at every share and the
best split is exact; above it, the climb."""
RECIPES_PER_SEARCH = 2  # of each search of a group alone, the best distinct plans kept as recipes


@dataclass(frozen=True, slots=True)
class GroupShare:
    """One group's term of the bound."""

    global_batch: int
    """Sequences per step this group trains alone (0: it is left idle)."""
    tokens_per_s: float
    best: PricedPlan | None
    """The planner's best plan for the group alone at that share (None at 0)."""


@dataclass(frozen=True, slots=True)
class UpperBound:
    tokens_per_s: float
    groups: dict[str, GroupShare]
    whole_batch_tokens_per_s: float
    """The old figure: the sum of each group's best alone with the whole global batch (not a
    bound: any plan of the whole cluster shares the batch among its groups)."""
    whole_batch_groups: dict[str, float]

    def to_json(self) -> dict:
        return {
            "tokens_per_s": self.tokens_per_s,
            "groups": {
                name: {"global_batch": share.global_batch, "tokens_per_s": share.tokens_per_s}
                for name, share in self.groups.items()
            },
            "each_group_whole_batch_tokens_per_s": self.whole_batch_tokens_per_s,
        }


@memo_scope()  # the searches of each group alone share one Memo
def upper_bound(result: SearchResult) -> UpperBound:
    """The bound for the cluster and batch that ``result`` searched (see the module's notes)."""
    query = result.query
    total = query.global_batch
    names = [g.name for g in query.cluster.groups]
    whole = {name: _speed(result.group_best[name]) for name in names}
    stand_in = _StandIn(query)
    for name in names:  # phase 1 of the search planned each group alone at the whole batch
        alone = [r for r in result.ranked if _devices_used(r.plan, name) == _devices(r.plan)]
        stand_in.note(name, total, result.group_best[name], alone)
    # Recipes near where the shares will be: each group planned alone at its share in
    # proportion to its throughput with the whole batch, in round numbers.
    for name, n in _lattice_split(total, whole, max(1, total // (8 * len(names)))).items():
        stand_in.plan(name, n)
    # The split the plan itself makes, where each of its replicas lies in one group: the bound
    # is at least each group alone there (on the scale scenario the climb's split fell 1.7%
    # short of it, its stand-in underrating the MI300X at larger shares).
    own = _plan_shares(result.best.plan, names) if result.best else None
    for name, n in (own or {}).items():
        stand_in.plan(name, n)
    best_split, best_sum = {}, -1.0
    if own:
        best_split, best_sum = own, sum(stand_in.value(name, n) for name, n in own.items())
    exact = total * len(names) <= EVERY_SHARE
    if exact:
        # Few shares: plan each group alone at every one and take the exact best split. A
        # group's throughput dips where a share does not divide into its replicas or
        # micro-batches, and a recipe made concrete at a dip can underrate the group's best
        # there, which the climb reads.
        for name in names:
            for n in range(1, total + 1):
                stand_in.plan(name, n)
        shares = _best_split(total, names, stand_in.value)
        planned = sum(stand_in.value(name, n) for name, n in shares.items())
        if planned > best_sum:
            best_split, best_sum = shares, planned
    for _ in range(0 if exact else MAX_ROUNDS):
        shares = _climb(total, whole, stand_in.value)
        new = [(name, n) for name, n in shares.items() if n and (name, n) not in stand_in.planned]
        for name, n in new:
            stand_in.plan(name, n)
        planned = sum(stand_in.value(name, n) for name, n in shares.items())
        if planned > best_sum:
            best_split, best_sum = shares, planned
        if not new:
            break
    groups = {
        name: GroupShare(n, stand_in.value(name, n), stand_in.planned.get((name, n)))
        for name, n in best_split.items()
    }
    return UpperBound(best_sum, groups, sum(whole.values()), whole)


def _search_alone(query: SearchQuery, name: str, global_batch: int) -> SearchResult:
    """The planner's search of one group as a cluster of its own."""
    alone = dataclasses.replace(
        query.cluster, groups=(query.cluster.group(name),), cross_group_gbps=None
    )
    return search(
        alone,
        query.model,
        global_batch,
        model_ref=query.model_ref,
        calibration=query.calibration,
        profiles=query.profiles,
        precision=query.precision,
        prune=query.prune,
    )


@dataclass(frozen=True, slots=True)
class _Recipe:
    """A plan without its batch: what make_draft makes concrete at any share."""

    setting: Setting
    structure: tuple[Layout, ...]
    chunks: int


def _add_recipes(known: list[_Recipe], ranked: list[PricedPlan], query: SearchQuery) -> None:
    """Add the best RECIPES_PER_SEARCH distinct recipes of ``ranked`` that ``known`` lacks."""
    added = 0
    for r in sorted(ranked, key=_speed, reverse=True):
        plan = r.plan
        counts: dict[tuple[StageSlot, ...], int] = {}
        for pipeline in plan.pipelines:
            slots = tuple(StageSlot(s.group, s.tp) for s in pipeline.stages)
            counts[slots] = counts.get(slots, 0) + pipeline.count
        recipe = _Recipe(
            Setting(
                model=query.model,
                calibration=query.calibration,
                micro_batch=plan.micro_batch,
                recompute=plan.recompute,
                profiles=query.profiles,
                precision=query.precision,
            ),
            tuple(Layout(count, slots) for slots, count in counts.items()),
            max(p.virtual_stages for p in plan.pipelines),
        )
        if recipe not in known:
            known.append(recipe)
            added += 1
            if added == RECIPES_PER_SEARCH:
                return


class _StandIn:
    """A group's throughput alone at a share, as the climb reads it: the search's own figure
    where it was run, else the best of the group's recipes made concrete at the share; where no
    recipe applies (the share does not divide into its micro-batch size, or is smaller than its
    replicas), the search is run there."""

    def __init__(self, query: SearchQuery) -> None:
        self.query = query
        self.planned: dict[tuple[str, int], PricedPlan | None] = {}
        self.recipes: dict[str, list[_Recipe]] = {g.name: [] for g in query.cluster.groups}
        self.made: dict[tuple[str, int], tuple[PricedPlan | None, int]] = {}
        """Per group and share: the best of its recipes made concrete there, and how many of
        its recipes (the first ones: a group's recipes only grow) that is the best of."""

    def note(
        self, name: str, share: int, best: PricedPlan | None, ranked: list[PricedPlan]
    ) -> None:
        """The search's best for ``name`` alone at ``share`` and its other plans (recipes)."""
        self.planned[name, share] = best
        _add_recipes(self.recipes[name], [best, *ranked] if best else ranked, self.query)

    def plan(self, name: str, share: int) -> None:
        if share and (name, share) not in self.planned:
            alone = _search_alone(self.query, name, share)
            self.note(name, share, alone.best, alone.ranked)

    def value(self, name: str, share: int) -> float:
        if share == 0:
            return 0.0
        if (name, share) not in self.planned:
            made = self._made(name, share)
            if made is not None:
                return _speed(made)
            self.plan(name, share)
        return _speed(self.planned[name, share])

    def _made(self, name: str, share: int) -> PricedPlan | None:
        """The best of the group's recipes made concrete at ``share`` (None: none applies).
        Those not weighed there yet are drafted and predicted most promising first; one whose
        step cannot be shorter than the best's (compute_floor) cannot be the best, and is not
        predicted."""
        best, weighed = self.made.get((name, share), (None, 0))
        recipes = self.recipes[name]
        q = self.query
        cluster = dataclasses.replace(q.cluster, groups=(q.cluster.group(name),))
        state = SearchState(
            cluster, q.model, q.model_ref, share, float("inf"), None, q.calibration, q.profiles
        )
        drafts = []
        for index, recipe in enumerate(recipes[weighed:]):
            if share % recipe.setting.micro_batch:
                continue
            draft = make_draft(state, recipe.setting, recipe.structure, recipe.chunks)
            if draft is not None:
                floor = compute_floor(state, draft.plan) if q.prune else 0.0
                drafts.append((floor, index, draft.plan))
        for floor, _, plan in sorted(drafts, key=lambda d: d[:2]):
            if best is not None and floor >= best.prediction.iteration_time_s:
                break
            ranked = predict_and_keep(state, plan)
            if ranked is not None and (best is None or _speed(ranked) > _speed(best)):
                best = ranked
        self.made[name, share] = best, len(recipes)
        return best


def _climb(
    total: int, weights: dict[str, float], value: Callable[[str, int], float]
) -> dict[str, int]:
    """Shares of ``total`` with the highest sum of ``value`` found coarse to fine: from shares in
    proportion to ``weights`` on the coarsest lattice (multiples of the first step, half the
    batch), the best split within WINDOW steps of the current shares (_best_in_window), again
    around it until it stays, then the same with half the step, down to one sequence. Each
    lattice holds the coarser ones, so the shares a group's dips spare (multiples of its replicas
    and micro-batch size, of its stages when it interleaves) are tried before those between."""
    step = 1 << max(0, (total // 2).bit_length() - 1)
    shares = _lattice_split(total, weights, step)
    while step >= 1:
        while (better := _best_in_window(total, shares, step, value)) != shares:
            shares = better
        step //= 2
    return shares


WINDOW = 2  # steps each way around a group's share that _best_in_window tries


def _best_in_window(
    total: int, shares: dict[str, int], step: int, value: Callable[[str, int], float]
) -> dict[str, int]:
    """The split of ``total`` with the highest sum of ``value`` among shares ``shares[g] + j *
    step`` (|j| <= WINDOW, the j summing to 0): a knapsack over the groups, exact."""
    choices = {
        name: [
            (j, centre + j * step)
            for j in range(-WINDOW, WINDOW + 1)
            if 0 <= centre + j * step <= total
        ]
        for name, centre in shares.items()
    }
    worth, chosen = _knapsack(choices, value, 0)
    keep = sum(value(name, n) for name, n in shares.items())
    return chosen if worth > keep * (1 + 1e-12) else shares


def _best_split(total: int, names: list[str], value: Callable[[str, int], float]) -> dict[str, int]:
    """The split of ``total`` among ``names`` with the highest sum of ``value``, exact."""
    choices = {name: [(n, n) for n in range(total + 1)] for name in names}
    return _knapsack(choices, value, total)[1]


def _knapsack(
    choices: dict[str, list[tuple[int, int]]], value: Callable[[str, int], float], target: int
) -> tuple[float, dict[str, int]]:
    """One (cost, share) of each group's ``choices``, their costs summing to ``target``, with the
    highest sum of ``value(group, share)``: a knapsack over the groups, exact."""
    # best[spent] = (sum of value, shares) over the groups so far whose costs sum to ``spent``
    best: dict[int, tuple[float, dict[str, int]]] = {0: (0.0, {})}
    for name, options in choices.items():
        grown: dict[int, tuple[float, dict[str, int]]] = {}
        for spent, (worth, chosen) in best.items():
            for cost, n in options:
                candidate = (worth + value(name, n), {**chosen, name: n})
                if spent + cost not in grown or candidate[0] > grown[spent + cost][0]:
                    grown[spent + cost] = candidate
        best = grown
    return best[target]


def _lattice_split(total: int, weights: dict[str, float], unit: int) -> dict[str, int]:
    """``total`` in proportion to ``weights`` in multiples of the largest power of two not above
    ``unit`` (the remainder to the heaviest group)."""
    unit = 1 << (unit.bit_length() - 1)
    shares = {name: n * unit for name, n in _proportional(total // unit, weights).items()}
    shares[max(weights, key=weights.get)] += total % unit
    return shares


def _proportional(total: int, weights: dict[str, float]) -> dict[str, int]:
    """``total`` in whole units in proportion to ``weights`` (largest remainders)."""
    whole = sum(weights.values()) or 1.0
    exact = {name: total * w / whole for name, w in weights.items()}
    shares = {name: int(x) for name, x in exact.items()}
    for name in sorted(exact, key=lambda n: shares[n] - exact[n])[: total - sum(shares.values())]:
        shares[name] += 1
    return shares


def _plan_shares(plan: Plan, names: list[str]) -> dict[str, int] | None:
    """The sequences per step each group trains in ``plan``, where every replica lies in one
    group (None where one crosses groups: its work is no group's alone)."""
    shares = dict.fromkeys(names, 0)
    for pipeline in plan.pipelines:
        groups = {stage.group for stage in pipeline.stages}
        if len(groups) > 1:
            return None
        shares[groups.pop()] += pipeline.count * pipeline.micro_batches * plan.micro_batch
    return shares


def _devices(plan: Plan) -> int:
    return sum(p.count * p.devices for p in plan.pipelines)


def _devices_used(plan: Plan, group: str) -> int:
    return sum(p.count * sum(s.tp for s in p.stages if s.group == group) for p in plan.pipelines)


def _speed(ranked: PricedPlan | None) -> float:
    return ranked.prediction.tokens_per_s if ranked else 0.0
