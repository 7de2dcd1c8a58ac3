"""`hethub train`: train a plan on this machine (starting the workers through torchrun) or, under
torchrun, on one node or many."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from hethub.errors import HethubError
from hethub.spec import check_plan, load_cluster, load_model, load_plan


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("train", help="train a plan with torch.distributed",
                            description="Train the plan's model. Outside torchrun it starts one local worker "
                                        "per device of the plan through torchrun; under torchrun it runs.")
    parser.add_argument("--cluster", required=True, help="cluster YAML file")
    parser.add_argument("--plan", required=True, help="plan YAML file")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps (default 10)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the batches")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    parser.add_argument("--data", help="a text file, a folder of text files, or a .bin of uint16 tokens "
                                       "(default: the standard library's pydoc texts)")
    parser.add_argument("--run-dir", default=None, help="where to write the run (default runs/<plan name>)")
    parser.add_argument("--json", action="store_true", help="one JSON object per step on stdout")
    parser.add_argument("--timeout", type=float, default=120, help="seconds a collective may wait for a peer")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.steps <= 0:
        raise HethubError(f"--steps = {args.steps}: must be a positive integer")
    cluster = load_cluster(args.cluster)
    plan = load_plan(args.plan)
    model = load_model(plan.model, relative_to=Path(args.plan).parent, source=args.plan)
    check_plan(plan, cluster, model, args.plan)
    from hethub.runtime.data import builtin_corpus, check_tokens, load_tokens
    from hethub.runtime.topology import build_topology

    tokens = load_tokens(args.data) if args.data else builtin_corpus()  # bad data stops before any process
    check_tokens(tokens, args.data or "the built-in corpus", model.vocab, model.seq_len, plan.global_batch)
    topology = build_topology(plan, cluster)
    if "LOCAL_RANK" not in os.environ:
        return _launch(args, topology.world_size)
    return _worker(args, cluster, plan, model, topology, tokens)


def _launch(args: argparse.Namespace, world: int) -> int:
    """Start the local workers through torchrun (c10d rendezvous on this machine)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
               "-m", "hethub", *_argv(args)]
    code = subprocess.run(command, check=False).returncode
    if code:
        print(f"hethub train: error: a worker failed and torchrun stopped the {world} workers (exit {code}); "
              f"the failing worker's message is above", file=sys.stderr)
    return code


def _argv(args: argparse.Namespace) -> list[str]:
    out = ["train", "--cluster", args.cluster, "--plan", args.plan, "--steps", str(args.steps), "--seed",
           str(args.seed), "--lr", str(args.lr), "--timeout", str(args.timeout)]
    if args.run_dir:
        out += ["--run-dir", args.run_dir]
    if args.data:
        out += ["--data", args.data]
    return out + (["--json"] if args.json else [])


def _worker(args, cluster, plan, model, topology, corpus) -> int:
    import torch
    import torch.distributed as dist

    from hethub.comm import BRIDGE, NATIVE, Communicator, local_devices
    from hethub.runtime.data import global_batch
    from hethub.runtime.engine import Engine

    world = int(os.environ["WORLD_SIZE"])
    if world != topology.world_size:
        raise HethubError(f"{args.plan}: the plan needs {topology.world_size} processes, torchrun started {world} "
                          f"(give --nproc-per-node x nodes = {topology.world_size})")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    try:
        comm = Communicator(topology, cluster)
        devices = local_devices([cluster.group(r.group).accelerator.vendor for r in topology.ranks])
        engine = Engine(plan, topology, model, comm, seed=args.seed, lr=args.lr, devices=devices)
        rank = dist.get_rank()
        for step in range(args.steps):
            tokens = global_batch(corpus, step, plan.global_batch, model.seq_len, args.seed)
            started = time.perf_counter()
            loss = engine.step(tokens)
            elapsed = time.perf_counter() - started
            moved = torch.tensor([comm.bytes[NATIVE], comm.bytes[BRIDGE]], dtype=torch.float64)
            dist.all_reduce(moved)
            if rank == 0:
                record = {"step": step + 1, "loss": loss, "iteration_time_s": elapsed,
                          "tokens_per_s": plan.global_batch * model.seq_len / elapsed,
                          "comm_bytes": {NATIVE: int(moved[0]), BRIDGE: int(moved[1])}}
                print(json.dumps(record) if args.json else
                      f"step {step + 1}: loss {loss:.4f}, {elapsed:.3f} s, {record['tokens_per_s']:,.0f} tokens/s",
                      flush=True)
        if rank == 0:
            run_dir = Path(args.run_dir or Path("runs") / Path(args.plan).stem)
            run_dir.mkdir(parents=True, exist_ok=True)
            summary = {"run_dir": str(run_dir), "world_size": world, "ranks": [
                {"rank": r.rank, "replica": r.replica, "stage": r.stage, "group": r.group,
                 "layers": [r.first_layer, r.first_layer + r.layers]} for r in topology.ranks]}
            print(json.dumps(summary) if args.json else f"run directory: {run_dir}", flush=True)
    finally:
        dist.destroy_process_group()
    return 0
