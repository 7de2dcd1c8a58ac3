"""Predictions per second of a 768-device, two-kind plan: Llama-140B, 16 stages, 64 micro-batches.

Usage: python benchmarks/predictor_speed.py [--seconds S]
Target (issue 2): >= 1,000 predictions per second on one core. The planner calls the predictor in
its inner loop, so every call here is a full prediction of a plan it has not seen: each one varies
the layer split, so no memoised stage cost can answer for the whole plan.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from hethub.memo import memo_scope
from hethub.predictor import predict
from hethub.spec import check_plan, load_cluster, load_model, parse_plan

CLUSTER = Path(__file__).resolve().parents[1] / "examples" / "clusters" / "hethub-768.yaml"


def plan_768(shift: int) -> dict:
    """6 replicas of 16 stages of TP 8: one on the MI250X group (128 devices), five on the other
    kind (640 devices); ``shift`` moves layers between the first and last stages."""
    amd = [6 + (1 if i < 0 else 0) for i in range(16)]
    acc = [6] * 16
    amd[0] -= shift % 3
    amd[-1] += shift % 3
    acc[1] -= shift % 2
    acc[-2] += shift % 2
    return {
        "model": "llama-140b",
        "global_batch": 384,
        "micro_batch": 1,
        "recompute": "full",
        "pipelines": [
            {
                "count": 1,
                "micro_batches": 64,
                "stages": [{"group": "amd", "tp": 8, "layers": n} for n in amd],
            },
            {
                "count": 5,
                "micro_batches": 64,
                "stages": [{"group": "acc_b", "tp": 8, "layers": n} for n in acc],
            },
        ],
    }


@memo_scope()  # the predictions share one Memo, as a search's do
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="how long to measure")
    args = parser.parse_args()
    cluster, model = load_cluster(CLUSTER), load_model("llama-140b")
    plans = [parse_plan(plan_768(shift)) for shift in range(6)]
    for plan in plans:
        check_plan(plan, cluster, model)
    first = predict(plans[0], cluster, model)
    print(
        f"plan: {first.devices} devices, 2 kinds, 16 stages, 64 micro-batches per replica; "
        f"predicted {first.iteration_time_s:.2f} s/step, {first.tokens_per_s:,.0f} tokens/s"
    )
    count, started = 0, time.perf_counter()
    while time.perf_counter() - started < args.seconds:
        for plan in plans:
            predict(plan, cluster, model)
        count += len(plans)
    elapsed = time.perf_counter() - started
    rate = count / elapsed
    print(
        f"{count} predictions in {elapsed:.2f} s: {rate:,.0f} predictions/s on one core "
        f"({1e3 / rate:.3f} ms each); target >= 1,000: {'met' if rate >= 1000 else 'MISSED'}"
    )
    return 0 if rate >= 1000 else 1


if __name__ == "__main__":
    raise SystemExit(main())
