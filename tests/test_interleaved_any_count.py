"""Interleaved 1F1B at micro-batch counts that are not a multiple of the stages, run by the
runtime against the single-process reference (tests/test_engine.py's check, at its fp32
tolerances: first-step gradients with assert_close, the losses within 1e-5). Its groups of at
least p micro-batches (spec.schedules.micro_batch_groups) are one longer group, or uneven."""

from __future__ import annotations

import pytest
from test_engine import PLANS, check_against_reference, stage

from hethub.spec.buckets import BUCKET_BYTES
from hethub.spec.schedules import micro_batch_groups

ANY_COUNT_PLANS = {
    "interleaved v 2 over pp 3, 4 micro-batches, across vendors": (
        "tiny-llama",
        {
            "global_batch": 4,
            "schedule": "interleaved-1f1b",
            "pipelines": [
                {
                    "count": 1,
                    "micro_batches": 4,
                    "virtual_stages": 2,
                    "stages": [
                        stage("nv", 1, [2, 1]),
                        stage("amd", 1, [1, 2]),
                        stage("nv", 1, [1, 1]),
                    ],
                }
            ],
        },
    ),
    "interleaved v 2 over pp 2, 7 micro-batches in groups of 3, 2 and 2": (
        "tiny-llama",
        {
            "global_batch": 7,
            "schedule": "interleaved-1f1b",
            "pipelines": [
                {
                    "count": 1,
                    "micro_batches": 7,
                    "virtual_stages": 2,
                    "stages": [stage("nv", 1, [3, 1]), stage("amd", 1, [2, 2])],
                }
            ],
        },
    ),
}


def test_the_plans_have_groups_longer_than_the_pipeline():
    groups = {}
    for name, (_, fields) in ANY_COUNT_PLANS.items():
        (layout,) = fields["pipelines"]
        groups[name] = micro_batch_groups(len(layout["stages"]), layout["micro_batches"])
    assert list(groups.values()) == [[4], [3, 2, 2]]


@pytest.mark.slow
@pytest.mark.parametrize("name", ANY_COUNT_PLANS)
def test_any_micro_batch_count_matches_the_single_process_reference(name, monkeypatch):
    monkeypatch.setitem(PLANS, name, ANY_COUNT_PLANS[name])
    check_against_reference(name, BUCKET_BYTES)
