"""Ranks bound to their own cores when they have one each, as profiled and as run."""

import os

import pytest

from hethub.profile.spawn import run_ranks
from hethub.runtime.affinity import cores_for


def test_each_rank_gets_an_equal_contiguous_share_of_the_cores():
    assert [cores_for(r, 2, [0, 1]) for r in range(2)] == [[0], [1]]
    assert [cores_for(r, 2, [3, 5, 6, 7, 9]) for r in range(2)] == [[3, 5], [6, 7]]
    assert cores_for(0, 1, [0, 1]) == [0, 1]


def test_more_ranks_than_cores_are_left_to_the_operating_system():
    assert cores_for(0, 4, [0, 1]) is None
    assert cores_for(3, 3, [0, 1]) is None


def _my_cores(rank: int, world: int) -> list[int]:
    return sorted(os.sched_getaffinity(0))


@pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs Linux and 2 cores to bind 2 ranks apart",
)
def test_profiling_ranks_are_bound_apart_and_oversubscribed_ones_are_not():
    cores = sorted(os.sched_getaffinity(0))
    two = run_ranks(_my_cores, 2, timeout_s=60)
    assert two == [cores_for(0, 2, cores), cores_for(1, 2, cores)]
    assert not set(two[0]) & set(two[1])
    many = len(cores) + 1
    assert run_ranks(_my_cores, many, timeout_s=60) == [cores] * many


def _session(rank: int, world: int) -> bool:
    return os.getsid(0) == os.getpid()


@pytest.mark.skipif(not hasattr(os, "setsid"), reason="sessions are POSIX")
def test_profiling_ranks_run_each_in_a_session_of_its_own_as_torchrun_starts_workers():
    assert run_ranks(_session, 2, timeout_s=60) == [True, True]
