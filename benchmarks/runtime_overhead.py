"""hethub's pipeline runtime against torch.distributed.pipelining on the same homogeneous 2-rank
plan: 1F1B against Schedule1F1B, interleaved 1F1B (2 chunks a rank) against
ScheduleInterleaved1F1B, ZB-H1 (one chunk a rank) against ScheduleInterleavedZeroBubble over
one stage a rank (torch's zero-bubble schedule for any stage count, ZB-H2's order), ZBV (2
chunks a rank in a V) against ScheduleZBVZeroBubble, and the 2-stage pipeline's speed-up over
one process.

Usage: python benchmarks/runtime_overhead.py [--steps N] [--only 1f1b,interleaved,zb-h1,zbv]
Targets: hethub reaches >= 0.95x Schedule1F1B's throughput (issue 4), >= 0.95x
ScheduleInterleaved1F1B's (issue 17), and >= 0.95x torch's zero-bubble schedules' (issue 28).
Each process uses one thread.

The machine is shared and its speed drifts by 20% and more over minutes, so each comparison runs
hethub and torch in the same two processes, one step each in turn (the order swapped every
round), after one warm-up step each: both see the same moments of the machine.
"""

from __future__ import annotations

import argparse
import datetime
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hethub.runtime.engine import Engine
from hethub.runtime.model import Stage
from hethub.runtime.spawn import rendezvous_store
from hethub.spec import parse_cluster, parse_model, parse_plan
from hethub.spec.schedules import Schedule, chunks_per_stage, model_chunk
from hethub.spec.topology import build_topology

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
CHUNKS = 2  # interleaved and ZBV: model chunks per rank (virtual_stages)
RANKS = 2
TIMEOUT_S = 600  # a collective's wait, and the rendezvous store's


def chunks_a_rank(schedule: str) -> int:
    """Model chunks a rank holds under ``schedule``: CHUNKS where it takes any count."""
    return chunks_per_stage(Schedule(schedule)) or CHUNKS


def plan(schedule: str) -> dict:
    """The homogeneous 2-rank plan: 4 layers a stage, or under interleaving and ZBV 2 chunks of
    2."""
    interleaved = schedule == "interleaved-1f1b"
    layers, chunks = MODEL["layers"] // RANKS, chunks_a_rank(schedule)
    per_stage = [layers // chunks] * chunks if chunks > 1 else layers
    return {
        "model": "bench",
        "precision": "fp32",  # as torch.distributed.pipelining's stages below
        "schedule": schedule,
        "global_batch": MICRO_BATCH * MICRO_BATCHES,
        "micro_batch": MICRO_BATCH,
        "pipelines": [
            {
                "count": 1,
                **({"virtual_stages": CHUNKS} if interleaved else {}),
                "stages": [{"group": "cpu", "tp": 1, "layers": per_stage}] * RANKS,
            }
        ],
    }


# which comparison: (hethub's schedule, torch's schedule class)
COMPARISONS = {
    "1f1b": ("1f1b", "Schedule1F1B"),
    "interleaved": ("interleaved-1f1b", "ScheduleInterleaved1F1B"),
    "zb-h1": ("zb-h1", "ScheduleInterleavedZeroBubble"),
    "zbv": ("zbv", "ScheduleZBVZeroBubble"),
}


NAMES = {"interleaved-1f1b": "interleaved 1F1B", "zb-h1": "ZB-H1", "zbv": "ZBV"}
"""How the lines below name hethub's schedules."""


def batch(spec, step):
    gen = torch.Generator().manual_seed(step)
    return torch.randint(
        0, spec.vocab, (MICRO_BATCH * MICRO_BATCHES, spec.seq_len + 1), generator=gen
    )


def hethub_runner(spec, schedule):
    """One step of hethub's engine on this rank, given the step's tokens."""
    plan_spec, cluster = parse_plan(plan(schedule)), parse_cluster(CLUSTER)
    topology = build_topology(plan_spec, cluster)
    engine = Engine.for_job(plan_spec, topology, spec, cluster, seed=0)
    return engine.step


def torch_runner(spec, schedule_name, schedule):
    """One step of torch.distributed.pipelining's schedule (and AdamW) on this rank: its chunk c
    is the model's chunk model_chunk(schedule, rank, ranks, c) (stage index), as hethub lays out
    hethub's ``schedule``: rank + c x ranks interleaved, a V under ZBV."""
    from torch.distributed import pipelining
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti

    rank, chunks = dist.get_rank(), chunks_a_rank(schedule)
    stages = RANKS * chunks
    per_chunk = spec.layers // stages
    multi = issubclass(getattr(pipelining, schedule_name), PipelineScheduleMulti)
    modules, pipeline_stages = [], []
    for c in range(chunks):
        index = model_chunk(Schedule(schedule), rank, RANKS, c)
        module = Stage.build(
            spec,
            per_chunk * index,
            per_chunk,
            None,
            is_first=index == 0,
            is_last=index == stages - 1,
            seed=0,
        )
        modules.append(module)
        pipeline_stages.append(pipelining.PipelineStage(module, index, stages, torch.device("cpu")))

    def loss_fn(logits, targets):
        return torch.nn.functional.cross_entropy(
            logits.reshape(-1, spec.vocab), targets.reshape(-1)
        )

    schedule_class = getattr(pipelining, schedule_name)
    runner = schedule_class(
        pipeline_stages if multi else pipeline_stages[0], MICRO_BATCHES, loss_fn=loss_fn
    )
    optimizer = torch.optim.AdamW([p for m in modules for p in m.parameters()], lr=1e-3)
    holds_first = any(s.is_first for s in pipeline_stages)
    holds_last = any(s.is_last for s in pipeline_stages)

    def step(tokens):
        if holds_first and holds_last:
            runner.step(tokens[:, :-1], target=tokens[:, 1:])
        elif holds_first:
            runner.step(tokens[:, :-1])
        else:
            runner.step(target=tokens[:, 1:])
        optimizer.step()
        optimizer.zero_grad()

    return step


def _entry(rank, port, comparison, steps, out):
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)  # the parent's
    dist.init_process_group("gloo", store=store, rank=rank, world_size=RANKS, timeout=timeout)
    spec = parse_model(MODEL, "bench", "bench")
    schedule, torch_schedule = COMPARISONS[comparison]
    runners = {
        "hethub": hethub_runner(spec, schedule),
        "torch": torch_runner(spec, torch_schedule, schedule),
    }
    times = {which: [] for which in runners}
    for step in range(steps):  # step 0 is each one's warm-up (torch fixes its shapes there)
        tokens = batch(spec, step)
        for which in ("hethub", "torch") if step % 2 == 0 else ("torch", "hethub"):
            dist.barrier()
            started = time.perf_counter()
            runners[which](tokens)
            times[which].append(time.perf_counter() - started)
    out[rank] = times
    dist.destroy_process_group()


def pipeline_seconds(comparison, steps):
    """Step seconds (the slower rank's, after the warm-up) of hethub and of torch, in order."""
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        out = manager.dict()
        store = rendezvous_store(TIMEOUT_S)  # bound now, held until the ranks are done
        procs = [
            ctx.Process(target=_entry, args=(r, store.port, comparison, steps, out))
            for r in range(RANKS)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(3600)
            if p.is_alive():
                p.kill()
                raise TimeoutError(f"{comparison} pipelines did not finish")
            if p.exitcode:
                raise RuntimeError(f"{comparison}: a rank failed (exit {p.exitcode})")
        return {
            which: [max(a, b) for a, b in zip(out[0][which], out[1][which])][1:]
            for which in ("hethub", "torch")
        }


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
    return sorted(times[1:])[len(times[1:]) // 2]  # after one warm-up step, as the pipelines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--steps", type=int, default=6, help="steps of each, the first a warm-up (default 6)"
    )
    parser.add_argument(
        "--only",
        default=",".join(COMPARISONS),
        help=f"comma-separated comparisons to run, of {', '.join(COMPARISONS)} (default: all)",
    )
    args = parser.parse_args()
    chosen = args.only.split(",")
    unknown = set(chosen) - set(COMPARISONS)
    if unknown:
        parser.error(f"unknown comparison(s): {', '.join(sorted(unknown))}")
    tokens = MICRO_BATCH * MICRO_BATCHES * MODEL["seq_len"]
    print(
        f"model: llama hidden {MODEL['hidden']}, {MODEL['layers']} layers, "
        f"seq {MODEL['seq_len']}; {MICRO_BATCHES} micro-batches of {MICRO_BATCH}; "
        f"{RANKS} ranks x 1 thread, hethub and torch alternating, "
        f"median of {args.steps - 1} steps each",
        flush=True,
    )
    met = True
    for comparison in chosen:
        schedule, torch_schedule = COMPARISONS[comparison]
        seconds = pipeline_seconds(comparison, args.steps)
        ours, theirs = (sorted(seconds[w])[len(seconds[w]) // 2] for w in ("hethub", "torch"))
        each = " ".join(f"{a:.2f}/{b:.2f}" for a, b in zip(seconds["hethub"], seconds["torch"]))
        print(f"{comparison}: each step, hethub/torch s: {each}")
        ratio = theirs / ours
        met = met and ratio >= 0.95
        if comparison == "1f1b":  # the lines as issue 4's benchmark printed them
            alone = single_process_seconds(args.steps)
            print(
                f"hethub 1F1B:                    {ours:.3f} s/step, {tokens / ours:,.0f} tokens/s"
            )
            print(
                f"torch.distributed.pipelining:   {theirs:.3f} s/step, "
                f"{tokens / theirs:,.0f} tokens/s"
            )
            print(
                f"one process (1 thread):         {alone:.3f} s/step, "
                f"{tokens / alone:,.0f} tokens/s"
            )
            print(
                f"hethub / Schedule1F1B throughput: {ratio:.3f}x (target >= 0.95): "
                f"{'met' if ratio >= 0.95 else 'MISSED'}"
            )
            print(f"2-stage pipeline speed-up over one process: {alone / ours:.2f}x", flush=True)
            continue
        print(
            f"hethub {NAMES[schedule]} ({chunks_a_rank(schedule)} chunk(s) a rank): "
            f"{ours:.3f} s/step, {tokens / ours:,.0f} tokens/s"
        )
        print(
            f"torch.distributed.pipelining {torch_schedule}: {theirs:.3f} s/step, "
            f"{tokens / theirs:,.0f} tokens/s"
        )
        print(f"hethub / {torch_schedule} throughput: {ratio:.2f}x")
        print(f"target >= 0.95x: {'met' if ratio >= 0.95 else 'MISSED'}", flush=True)
    return 0 if met else 1


if __name__ == "__main__":
    raise SystemExit(main())
