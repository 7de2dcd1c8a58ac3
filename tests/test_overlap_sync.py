"""The overlaps of issue 28's item 3 against the single-process reference: a cross-layout
gradient sync whose part inside each vendor runs during the backwards, and a sharded optimizer
whose all-gather of the weights runs during the next step's forwards. Each is exact (fp32 first
step gradients with assert_close, the losses within 1e-5), and each is held to its structure:
the collectives started before the last backward, the gathers waited inside the forwards."""

from __future__ import annotations

import pytest
from test_engine import PLANS, check_against_reference, stage

OVERLAPPED_PLANS = {
    "cross-layout sync overlapped, two vendors, tp 2, tied head": (
        "tiny-gpt",
        {
            "global_batch": 5,
            "overlap_grad_sync": True,
            "pipelines": [
                {"count": 1, "micro_batches": 3, "stages": [stage("nv", 1, 4), stage("amd", 1, 4)]},
                {"count": 1, "micro_batches": 2, "stages": [stage("amd", 2, 8)]},
            ],
        },
    ),
    "cross-layout sync overlapped, 2 replicas per vendor": (
        "tiny-llama",
        {
            "global_batch": 4,
            "overlap_grad_sync": True,
            "pipelines": [
                {"count": 2, "micro_batches": 1, "stages": [stage("nv", 1, 8)]},
                {"count": 2, "micro_batches": 1, "stages": [stage("amd", 1, 8)]},
            ],
        },
    ),
    "sharded, param gather overlapped, tp 2, two replicas": (
        "tiny-llama",
        {
            "global_batch": 4,
            "shard_optimizer": True,
            "overlap_param_gather": True,
            "pipelines": [
                {"count": 2, "micro_batches": 2, "stages": [stage("nv", 2, 5), stage("amd", 1, 3)]}
            ],
        },
    ),
}
PLANS.update(OVERLAPPED_PLANS)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(OVERLAPPED_PLANS))
def test_overlapped_layout_matches_the_single_process_reference(name):
    check_against_reference(name, 4096)
