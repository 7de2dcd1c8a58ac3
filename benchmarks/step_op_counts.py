"""What one training step's gradient accumulation, gradient sync and optimizer update cost in
Python hook calls and torch operators, on a small 2-rank data-parallel plan (tiny-llama, one
8-layer stage per replica, 2 micro-batches each): the counts that a real accelerator pays a
kernel launch (and Python time) for each of, whatever the model's size.

Usage: python benchmarks/step_op_counts.py
Prints, per precision and kind of sync, the stage's parameter count and of one step (the second;
the first allocates the optimizer state): the post-accumulate-grad hook calls during the
backwards, the operators of the whole forward/backward/sync (``gradients``), of the sync alone,
and of the update (``Engine.update``: the optimizer step and the copy into the weights), each
counted as torch dispatches it (views not counted).
"""

from __future__ import annotations

import collections

import torch

from hethub.profiler.op_counts import OpCounter
from hethub.runtime.spawn import run_ranks

CLUSTER = {
    "groups": [{"name": "nv", "accelerator": "a100-80gb", "nodes": 1, "devices_per_node": 2}]
}
KINDS = {"plain": (False, False), "overlapped": (False, True), "sharded": (True, True)}
"""Each kind of sync: (shard_optimizer, overlap_grad_sync)."""


def count_step(rank: int, world: int, precision: str, kind: str) -> dict:
    """On one rank: the counts of its second step (see the module's docstring)."""
    from hethub.runtime.engine import Engine
    from hethub.spec import load_model, parse_cluster, parse_plan
    from hethub.spec.topology import build_topology

    hook_calls = [0]
    register = torch.Tensor.register_post_accumulate_grad_hook

    def counted(self, hook):
        def call(tensor):
            hook_calls[0] += 1
            return hook(tensor)

        return register(self, call)

    torch.Tensor.register_post_accumulate_grad_hook = counted
    sharded, overlapped = KINDS[kind]
    cluster = parse_cluster(CLUSTER, "counts")
    stages = [{"group": "nv", "tp": 1, "layers": 8}]
    plan = parse_plan(
        {
            "model": "tiny-llama",
            "micro_batch": 1,
            "global_batch": 4,
            "precision": precision,
            "shard_optimizer": sharded,
            "overlap_grad_sync": overlapped,
            "pipelines": [{"count": 2, "micro_batches": 2, "stages": stages}],
        }
    )
    spec = load_model("tiny-llama")
    engine = Engine.for_job(plan, build_topology(plan, cluster), spec, cluster, seed=0)
    sync, run = OpCounter(), engine.sync.run

    def counted_run() -> None:
        with sync:
            run()

    engine.sync.run = counted_run
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        tokens = torch.randint(0, spec.vocab, (4, spec.seq_len + 1), generator=gen)
        hook_calls[0], sync.ops = 0, collections.Counter()
        with OpCounter() as step:
            engine.gradients(tokens)
        with OpCounter() as update:
            engine.update()
    return {
        "parameters": len(engine.weights.named),
        "hook_calls": hook_calls[0],
        "gradients_ops": sum(step.ops.values()),
        "sync_ops": dict(sync.ops),
        "update_ops": dict(update.ops),
    }


def main() -> None:
    for precision in ("fp32", "bf16"):
        for kind in KINDS:
            counts = run_ranks(count_step, 2, precision, kind, purpose="counting")[0]
            update = counts.pop("update_ops")
            print(precision, kind, counts, "update_ops:", sum(update.values()), update)


if __name__ == "__main__":
    main()
