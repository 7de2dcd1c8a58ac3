"""bf16 against fp32: the training step time of the default model (local-llama, the model of
`hethub train` with no arguments) on this machine, one process, one thread, the runtime's own
stage and recipe (runtime.precision), the precisions interleaved so that both see the same
machine.

Usage: python benchmarks/precision_speed.py [--steps N] [--micro-batch B]
What it checks: the rule by which the local default run (examples/clusters/local-hetero.yaml's
plan) picks its precision, bf16 where torch has bf16 kernels for this CPU, else fp32
(hethub.jobs.planned_precision): the precision it picks should be the faster one here.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hethub.runtime.model import Stage
from hethub.runtime.precision import MasterWeights, cpu_has_bf16_kernels
from hethub.spec import load_model
from hethub.spec.plan import Precision


def step_seconds(precision: Precision, micro_batch: int, steps: int) -> tuple[float, float]:
    """The median of ``steps`` timed steps (forward, backward, AdamW, the bf16 copy) after one
    warm-up, and the last loss."""
    spec = load_model("local-llama")
    stage = Stage.build(spec, 0, spec.layers, None, is_first=True, is_last=True, seed=0)
    weights = MasterWeights(stage, precision)
    optimizer = torch.optim.AdamW(weights.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    times, loss = [], None
    for _ in range(steps + 1):
        tokens = torch.randint(0, spec.vocab, (micro_batch, spec.seq_len + 1), generator=gen)
        started = time.perf_counter()
        weights.zero_grad()
        loss = stage.loss(stage(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        optimizer.step()
        weights.copy_to_model()
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:]), loss.item()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--micro-batch", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)  # as a rank of a local run
    rounds = {Precision.FP32: [], Precision.BF16: []}
    for _ in range(3):
        for precision, seconds in rounds.items():
            seconds.append(step_seconds(precision, args.micro_batch, args.steps)[0])
    fp32, bf16 = (statistics.median(rounds[p]) for p in (Precision.FP32, Precision.BF16))
    print(
        f"local-llama, micro-batch {args.micro_batch}, 1 thread, median of 3 rounds x {args.steps}"
    )
    print(f"fp32: {fp32:.3f} s/step   bf16: {bf16:.3f} s/step   bf16 speed-up {fp32 / bf16:.2f}x")
    faster = Precision.BF16 if bf16 < fp32 else Precision.FP32
    kernels = cpu_has_bf16_kernels()
    picked = Precision.BF16 if kernels else Precision.FP32
    print(f"the faster here: {faster}")
    print(
        f"torch has bf16 kernels for this CPU: {'yes' if kernels else 'no'}, so hethub train "
        f"picks {picked}{'' if picked is faster else ': NOT the faster'}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
