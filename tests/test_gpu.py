"""One job, one CUDA group and one CPU group, across the bridge (gloo, host-staged): the same
losses and gradients as the single-process reference, in fp32 and in bf16. Runs only where a
CUDA GPU is (benchmarks/gpu_check.py runs it there)."""

from __future__ import annotations

import pytest
import torch

from hethub.runtime.spawn import run_ranks
from hethub.spec.parameters import parameter_counts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CLUSTER = {
    "groups": [
        {"name": "gpu", "accelerator": "h100", "devices_per_node": 1},
        {"name": "cpu", "accelerator": "cpu", "devices_per_node": 1},
    ]
}


def _plan(precision):
    return {
        "model": "tiny-llama",
        "global_batch": 4,
        "micro_batch": 1,
        "precision": precision,
        "pipelines": [
            {
                "count": 1,
                "stages": [
                    {"group": "gpu", "tp": 1, "layers": 4},
                    {"group": "cpu", "tp": 1, "layers": 4},
                ],
            }
        ],
    }


def _rank(rank, world, precision):
    from test_engine import LR, SEED, batches

    from hethub.comm import BRIDGE, local_device
    from hethub.runtime.engine import Engine
    from hethub.spec import load_model, parse_cluster, parse_plan
    from hethub.spec.topology import build_topology

    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 as on the CPU reference
    cluster = parse_cluster(CLUSTER, "gpu test")
    plan = parse_plan(_plan(precision))
    spec = load_model("tiny-llama")
    topology = build_topology(plan, cluster)
    device = local_device(topology.vendors(cluster)[rank], 0)
    assert device.type == ("cuda" if rank == 0 else "cpu")
    engine = Engine.for_job(plan, topology, spec, cluster, seed=SEED, lr=LR, device=device)
    losses, grads = [], None
    for tokens in batches(spec, plan.global_batch):
        losses.append(engine.gradients(tokens))
        if grads is None:
            grads = {name: p.grad.cpu().clone() for name, p in engine.weights.named}
        engine.update()
    return losses, grads, engine.comm.bytes[BRIDGE]


def planned_bridge_bytes(precision, rank):
    """What ``rank`` moves over the bridge in a step, in the plan of a step's transfers
    (spec.collectives.rank_transfers, which the predictor reports): the boundary's messages."""
    from hethub.comm import BRIDGE
    from hethub.spec import load_model, parse_cluster, parse_plan
    from hethub.spec.buckets import BUCKET_BYTES
    from hethub.spec.collectives import comm_bytes, rank_transfers
    from hethub.spec.topology import build_topology

    cluster, plan = parse_cluster(CLUSTER, "gpu test"), parse_plan(_plan(precision))
    topology = build_topology(plan, cluster)
    transfers = rank_transfers(
        plan, topology, load_model("tiny-llama"), topology.vendors(cluster), rank,
        grad_norm=False, cap=BUCKET_BYTES,
    )  # fmt: skip
    return comm_bytes(transfers)[BRIDGE]


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cuda_and_cpu_groups_in_one_job_match_the_reference(precision):
    # As tests/test_engine.py compares a layout: the first step's gradients and the losses of
    # steps in which the reference's loss falls far beyond the tolerance they are compared at.
    from test_engine import (
        BF16_LOSS_RTOL,
        LOSS_MOVES_BY_TOLERANCES,
        STEPS,
        assert_within_bf16_rounding,
        reference,
    )

    ref_losses, ref_grads = reference("tiny-llama", 4, precision)
    loss_rtol = BF16_LOSS_RTOL if precision == "bf16" else 1e-5
    fell = (ref_losses[0] - ref_losses[-1]) / ref_losses[0]
    assert fell > LOSS_MOVES_BY_TOLERANCES * loss_rtol, (ref_losses, loss_rtol)
    exact = reference("tiny-llama", 4, "fp32")[1]
    results = run_ranks(_rank, 2, precision, timeout_s=180, purpose="test")
    for rank, (losses, grads, bridged) in enumerate(results):
        assert bridged == STEPS * planned_bridge_bytes(precision, rank)
        if precision == "bf16":
            # GPU and CPU bf16 kernels round differently, each within bf16's rounding error of
            # the exact gradient, as the layouts' ranks do: the same tolerance holds.
            assert losses == pytest.approx(ref_losses, rel=BF16_LOSS_RTOL)
            for name, grad in grads.items():
                assert_within_bf16_rounding(grad, ref_grads[name], exact[name], name)
            continue
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref_grads[name], msg=name)


@pytest.mark.slow
def test_the_profiler_measures_the_gpu_in_bf16_and_fp32(tmp_path):
    from hethub.profiler.ensure import ProfileRequest, ensure_profiles
    from hethub.profiler.layers import measure_layers
    from hethub.spec import load_model

    gpt = load_model("tiny-gpt")  # runs in bf16 whatever the runtime's Llama rotary does
    request = ProfileRequest(
        model=gpt, device_name="h100", tps=[1], micro_batches=[1, 2], dtype="bf16"
    )
    profiles = ensure_profiles(tmp_path, request, repeats=3)
    assert len(profiles.layers) == 2 and not profiles.links  # no links measured on a GPU
    for profile in profiles.layers.values():
        assert profile.key.device == "h100" and profile.key.dtype == "bf16"
        # measured times: no figure to match, but a time of 0 is no measurement
        assert profile.layer_forward_s > 0 and profile.optimizer_s_per_param > 0
        assert profile.layer_param_bytes == parameter_counts(gpt).layer * 2
    (fp32,) = measure_layers(load_model("tiny-llama"), "h100", [1], [1], repeats=3)
    assert fp32.key.dtype == "fp32" and fp32.layer_backward_s > 0
