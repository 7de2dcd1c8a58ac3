"""hethub's pipeline runtime against torch.distributed.pipelining's Schedule1F1B on the same
homogeneous 2-rank plan, and the 2-stage pipeline's speed-up over one process.

Usage: python benchmarks/runtime_overhead.py [--steps N]
Target (issue 4): hethub reaches >= 0.95x Schedule1F1B's throughput. Each process uses one thread.
"""

from __future__ import annotations

import argparse
import datetime
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hethub.profile.spawn import free_port
from hethub.runtime.engine import Engine
from hethub.runtime.model import Stage
from hethub.runtime.topology import build_topology
from hethub.spec import parse_cluster, parse_model, parse_plan

MODEL = {
    "arch": "llama",
    "hidden": 512,
    "layers": 8,
    "heads": 8,
    "kv_heads": 8,
    "vocab": 256,
    "seq_len": 256,
}
MICRO_BATCH, MICRO_BATCHES = 2, 8
CLUSTER = {"groups": [{"name": "cpu", "accelerator": "cpu", "nodes": 1, "devices_per_node": 2}]}
PLAN = {
    "model": "bench",
    "precision": "fp32",  # as torch.distributed.pipelining's stages below
    "global_batch": MICRO_BATCH * MICRO_BATCHES,
    "micro_batch": MICRO_BATCH,
    "pipelines": [
        {
            "count": 1,
            "stages": [
                {"group": "cpu", "tp": 1, "layers": 4},
                {"group": "cpu", "tp": 1, "layers": 4},
            ],
        }
    ],
}


def batch(spec, step):
    gen = torch.Generator().manual_seed(step)
    return torch.randint(
        0, spec.vocab, (MICRO_BATCH * MICRO_BATCHES, spec.seq_len + 1), generator=gen
    )


def hethub_rank(spec, steps):
    plan, cluster = parse_plan(PLAN), parse_cluster(CLUSTER)
    topology = build_topology(plan, cluster)
    engine = Engine.for_job(plan, topology, spec, cluster, seed=0)
    times = []
    for step in range(steps):
        dist.barrier()
        started = time.perf_counter()
        engine.step(batch(spec, step))
        times.append(time.perf_counter() - started)
    return times


def torch_rank(spec, steps):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    rank = dist.get_rank()
    module = Stage.build(spec, 4 * rank, 4, None, is_first=rank == 0, is_last=rank == 1, seed=0)
    stage = PipelineStage(module, rank, 2, torch.device("cpu"))

    def loss_fn(logits, targets):
        return torch.nn.functional.cross_entropy(
            logits.reshape(-1, spec.vocab), targets.reshape(-1)
        )

    schedule = Schedule1F1B(stage, MICRO_BATCHES, loss_fn=loss_fn)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    times = []
    for step in range(steps):
        tokens = batch(spec, step)
        dist.barrier()
        started = time.perf_counter()
        if rank == 0:
            schedule.step(tokens[:, :-1])
        else:
            schedule.step(target=tokens[:, 1:])
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - started)
    return times


def _entry(rank, port, which, steps, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=300)
    )
    spec = parse_model(MODEL, "bench", "bench")
    times = (hethub_rank if which == "hethub" else torch_rank)(spec, steps)
    out[(which, rank)] = times
    dist.destroy_process_group()


def pipeline_seconds(which, steps):
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        out = manager.dict()
        port = free_port()
        procs = [ctx.Process(target=_entry, args=(r, port, which, steps, out)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(600)
            if p.is_alive():
                p.kill()
                raise TimeoutError(f"{which} pipeline did not finish")
        steady = [max(a, b) for a, b in zip(out[(which, 0)], out[(which, 1)])][
            2:
        ]  # two warm-up steps
        return sorted(steady)[len(steady) // 2]


def single_process_seconds(steps):
    torch.set_num_threads(1)
    spec = parse_model(MODEL, "bench", "bench")
    model = Stage.build(spec, 0, spec.layers, None, is_first=True, is_last=True, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times = []
    for step in range(steps):
        tokens = batch(spec, step)
        started = time.perf_counter()
        for micro in tokens.split(MICRO_BATCH):
            (model.loss(model(micro[:, :-1]), micro[:, 1:]) / MICRO_BATCHES).backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - started)
    return sorted(times[2:])[len(times[2:]) // 2]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=7)
    args = parser.parse_args()
    tokens = MICRO_BATCH * MICRO_BATCHES * MODEL["seq_len"]
    ours = pipeline_seconds("hethub", args.steps)
    theirs = pipeline_seconds("torch", args.steps)
    alone = single_process_seconds(args.steps)
    ratio = theirs / ours
    print(
        f"model: llama hidden {MODEL['hidden']}, {MODEL['layers']} layers, "
        f"seq {MODEL['seq_len']}; {MICRO_BATCHES} micro-batches of {MICRO_BATCH}; "
        f"2 ranks x 1 thread, median of {args.steps - 2} steps"
    )
    print(f"hethub 1F1B:                    {ours:.3f} s/step, {tokens / ours:,.0f} tokens/s")
    print(f"torch.distributed.pipelining:   {theirs:.3f} s/step, {tokens / theirs:,.0f} tokens/s")
    print(f"one process (1 thread):         {alone:.3f} s/step, {tokens / alone:,.0f} tokens/s")
    print(
        f"hethub / Schedule1F1B throughput: {ratio:.3f}x (target >= 0.95): "
        f"{'met' if ratio >= 0.95 else 'MISSED'}"
    )
    print(f"2-stage pipeline speed-up over one process: {alone / ours:.2f}x")
    return 0 if ratio >= 0.95 else 1


if __name__ == "__main__":
    raise SystemExit(main())
