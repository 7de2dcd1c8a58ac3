"""Ranks sharing a machine's cores: the fluid simulation, how the profiles give the sharing, and
its place in the prediction and the planner's bound."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hethub.planner import search
from hethub.planner.candidates import homogeneous
from hethub.planner.costs import Setting
from hethub.planner.drafts import VIRTUAL_STAGES, make_draft
from hethub.planner.search_state import SearchState
from hethub.predictor import default_calibration, predict
from hethub.predictor.profiled import core_sharing, missing_profiles
from hethub.predictor.schedule import schedule_order, simulate
from hethub.predictor.sharing import CoreSharing, SharedLayout, simulate_shared
from hethub.profiles import empty_profiles
from hethub.spec import parse_cluster
from hethub.spec.plan import Precision, Recompute
from tests.test_profile import TINY, key_of, layer_profile, link_profile, plan_of

durations = st.floats(min_value=0.01, max_value=10.0, allow_nan=False)


def layout(schedule, f, b, sends, m, ranks=None, speed=None):
    p = len(f)
    return SharedLayout(
        order=schedule_order(schedule, p, m),
        forward_s=f,
        backward_s=b,
        send_forward_s=sends,
        send_backward_s=sends,
        ranks=ranks or [1] * p,
        speed=speed or [1.0] * p,
    )


@settings(max_examples=100, deadline=None)
@given(
    data=st.data(),
    p=st.integers(1, 5),
    m=st.integers(1, 12),
    schedule=st.sampled_from(["1f1b", "gpipe"]),
    slow=st.booleans(),
)
def test_without_a_speed_up_from_fewer_ranks_it_is_the_fixed_duration_simulation(
    data, p, m, schedule, slow
):
    # alone = 1: an operation takes as long whoever else computes, so durations are fixed; an
    # emulated speed splits each into computing and sleeping without changing its length.
    f = data.draw(st.lists(durations, min_size=p, max_size=p))
    b = data.draw(st.lists(durations, min_size=p, max_size=p))
    sends = data.draw(st.lists(st.floats(0, 1), min_size=p - 1, max_size=p - 1))
    speed = [0.5 if slow and s % 2 else 1.0 for s in range(p)]
    shared = layout(schedule, f, b, sends, m, speed=speed)
    ((start, end),) = simulate_shared(
        [shared], CoreSharing(cores=1, ranks=p + 1, least=1, alone=1.0)
    )
    expected = simulate(shared.order, f, b, sends, sends, every_op=True)
    assert end == pytest.approx(expected, rel=1e-9, abs=1e-12)
    for (s, kind, _), a, z in zip(shared.order.ops, start, end):
        assert z - a == pytest.approx((b if kind else f)[s], rel=1e-9)


def test_operations_whose_times_spread_make_a_longer_step_than_their_means():
    # A pipeline waits for the later of two varying operations at every dependency, so the mean
    # step over draws exceeds the step of mean operations; a stage alone in a chain (p = 1)
    # adds its draws up, and their mean is the mean.
    pipeline = layout("1f1b", [1.0, 1.0, 1.0, 1.0], [2.0, 2.0, 2.0, 2.0], [0.0] * 3, 8)
    fixed = CoreSharing(cores=1, ranks=5, least=1, alone=1.0)
    spread = dataclasses.replace(fixed, spread_s=0.3)  # a 1 s operation varies by about 55%
    ((_, fixed_end),) = simulate_shared([pipeline], fixed)
    ((_, spread_end),) = simulate_shared([pipeline], spread)
    assert max(spread_end) > 1.03 * max(fixed_end)
    assert simulate_shared([pipeline], spread) == simulate_shared([pipeline], spread)  # seeded
    alone = layout("1f1b", [1.0], [2.0], [], 8)
    ((_, alone_end),) = simulate_shared([alone], dataclasses.replace(fixed, ranks=2, spread_s=0.3))
    assert max(alone_end) == pytest.approx(24.0, rel=0.1)


def test_two_ranks_on_one_core_split_it_and_the_one_left_goes_twice_as_fast():
    # Durations are as measured with both ranks computing; alone, a rank takes half as long.
    sharing = CoreSharing(cores=1, ranks=2, least=1, alone=0.5)
    a = layout("1f1b", [1.0], [0.0], [], 1)
    b = layout("1f1b", [0.5], [0.0], [], 1)
    (_, end_a), (_, end_b) = simulate_shared([a, b], sharing)
    assert end_b[0] == pytest.approx(0.5)  # both computing: as measured
    assert end_a[0] == pytest.approx(0.5 + 0.5 * 0.5)  # the half left, alone at twice the speed
    assert sharing.slowdown(1) == 0.5 and sharing.slowdown(2) == 1.0


def test_the_time_is_linear_in_the_ranks_computing_between_the_two_measured_ends():
    sharing = CoreSharing(cores=2, ranks=6, least=2, alone=0.4)
    expected = {1: 0.4, 2: 0.4, 3: 0.55, 4: 0.7, 5: 0.85, 6: 1.0}
    for k, share in expected.items():
        assert sharing.slowdown(k) == pytest.approx(share)


def test_an_emulated_stage_sleeps_without_taking_a_core():
    # One core, two single-stage ranks: the emulated one (speed 0.5) computes 0.5 s of its 1 s,
    # then sleeps as long; while it sleeps the other has the core to itself.
    sharing = CoreSharing(cores=1, ranks=2, least=1, alone=0.5)
    slow = layout("1f1b", [1.0], [0.0], [], 1, speed=[0.5])
    fast = layout("1f1b", [1.0], [0.0], [], 1)
    (_, end_slow), (_, end_fast) = simulate_shared([slow, fast], sharing)
    assert end_slow[0] == pytest.approx(1.0)  # computed 0.5 s sharing the core, then slept 0.5 s
    assert end_fast[0] == pytest.approx(0.5 + 0.5 * 0.5)  # half done at 0.5 s, the rest alone


def test_a_replicated_stage_counts_all_of_its_ranks():
    sharing = CoreSharing(cores=2, ranks=4, least=1, alone=0.25)
    wide = layout("1f1b", [1.0], [0.0], [], 1, ranks=[4])
    ((_, end),) = simulate_shared([wide], sharing)
    assert end[0] == pytest.approx(1.0)  # four ranks computing: as measured
    narrow = layout("1f1b", [1.0], [0.0], [], 1, ranks=[2])
    ((_, end),) = simulate_shared([narrow], sharing)
    assert end[0] == pytest.approx(0.5)  # two: a third of the way from alone (0.25) to all (1)


CPU4 = parse_cluster(
    {"groups": [{"name": "cpu", "accelerator": "cpu", "nodes": 1, "devices_per_node": 4}]}, "cpu4"
)


def four_on_two(*, with_alone=True, spread_s=0.0):
    """Profiles of a 2-core machine for a local run of 4 ranks (and, ``with_alone``, of 1 rank);
    ``spread_s``: the 4 ranks' passes' spread."""
    many = layer_profile(
        key_of(concurrent_ranks=4),
        layer_forward_s=0.024,
        layer_backward_s=0.040,
        cores=2,
        layer_time_spread=spread_s,
    )
    alone = layer_profile(
        key_of(concurrent_ranks=1), layer_forward_s=0.010, layer_backward_s=0.018, cores=2
    )
    items = [many, link_profile(4)] + ([alone] if with_alone else [])
    return empty_profiles("test").merged(items).select(concurrent_ranks=4)


def test_the_sharing_comes_from_the_profiles_of_all_ranks_and_of_one_alone():
    plan = plan_of([("cpu", 1)] * 4, micro_batches=8)
    sharing = core_sharing(plan, CPU4, TINY, four_on_two())
    assert sharing == CoreSharing(cores=2, ranks=4, least=1, alone=pytest.approx(0.028 / 0.064))
    assert (
        core_sharing(plan, CPU4, TINY, four_on_two(with_alone=False)).alone == 0.5
    )  # the fair share
    assert not missing_profiles(plan, CPU4, TINY, four_on_two())
    spread = four_on_two(spread_s=2e-3)  # a profile's spread of its passes reaches the sharing
    assert core_sharing(plan, CPU4, TINY, spread).spread_s == pytest.approx(2e-3)
    (note,) = missing_profiles(plan, CPU4, TINY, four_on_two(with_alone=False))
    assert "1 rank at once" in note and "share of the 2 cores is taken as fair" in note
    two = dataclasses.replace(four_on_two(), concurrent_ranks=2)
    assert core_sharing(plan_of([("cpu", 2)] * 2), CPU4, TINY, two) is None  # a core per rank
    unrecorded = (
        empty_profiles("test")
        .merged([layer_profile(key_of(concurrent_ranks=4))])
        .select(concurrent_ranks=4)
    )
    assert (
        core_sharing(plan, CPU4, TINY, unrecorded) is None
    )  # cores not recorded: nothing to share


def test_a_pipeline_of_more_ranks_than_cores_is_predicted_faster_through_its_fill_and_drain():
    plan = plan_of([("cpu", 1)] * 4, micro_batches=8)
    shared = predict(plan, CPU4, TINY, profiles=four_on_two(), timeline=True)
    # The same profiles with no core count recorded: every operation takes its all-at-once time.
    unshared = (
        empty_profiles("test")
        .merged(
            [dataclasses.replace(p, cores=None) for p in four_on_two().layers.values()]
            + [link_profile(4)]
        )
        .select(concurrent_ranks=4)
    )
    fixed = predict(plan, CPU4, TINY, profiles=unshared)
    assert [s.forward_s for s in shared.stages] == [s.forward_s for s in fixed.stages]
    # Fewer ranks computing in the fill and drain go faster than the profiled all-at-once time...
    assert shared.iteration_time_s < fixed.iteration_time_s
    # ...but never faster than alone (0.028 s of 0.064 s), and never slower than all at once.
    for stage in shared.stages:
        ops = [
            e
            for e in shared.timeline
            if e.stage == stage.position and e.kind in ("forward", "backward")
        ]
        assert stage.compute_s == pytest.approx(sum(e.end_s - e.start_s for e in ops))
        nominal = 8 * (stage.forward_s + stage.backward_s)
        assert 0.028 / 0.064 * nominal <= stage.compute_s < nominal


def test_the_planners_bound_stays_below_the_shared_prediction():
    # The planner skips a plan whose lower bound is above the best step so far; with ranks sharing
    # the cores, a plan of fewer ranks than the machine was profiled for computes faster than its
    # profiled durations, and its bound must shrink with it, or the skip could lose the best plan.
    profiles = (
        empty_profiles("test")
        .merged(
            [
                layer_profile(
                    key_of(concurrent_ranks=c, micro_batch=b),
                    layer_forward_s=0.006 * c,
                    layer_backward_s=0.012 * c,
                    cores=2,
                )
                for c in (1, 2, 4)
                for b in (1, 2, 4)
            ]
            + [link_profile(4)]
        )
        .select(concurrent_ranks=4)
    )
    state = SearchState(
        CPU4, TINY, "tiny-llama", 16, float("inf"), None, default_calibration(), profiles
    )
    checked = 0
    for b in (1, 2, 4):
        setting = Setting(
            model=TINY,
            calibration=default_calibration(),
            micro_batch=b,
            recompute=Recompute.NONE,
            profiles=profiles,
            precision=Precision.FP32,  # the profiles' dtype: fp32 plans are priced by them
        )
        for layout in homogeneous(CPU4.groups[0], TINY, 4):
            for chunks in VIRTUAL_STAGES:
                draft = make_draft(state, setting, (layout,), chunks)
                if draft is not None:
                    step = predict(draft.plan, CPU4, TINY, profiles=profiles).iteration_time_s
                    assert draft.interleaved_bound <= draft.bound <= step
                    checked += 1
    assert checked >= 12
    best = search(
        CPU4, TINY, 16, model_ref="tiny-llama", profiles=profiles, precision=Precision.FP32
    ).best
    assert best.prediction == predict(best.plan, CPU4, TINY, profiles=profiles)
