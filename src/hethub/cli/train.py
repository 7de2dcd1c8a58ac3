"""`hethub train`: train a plan on this machine (starting the workers through torchrun) or, under
torchrun, on one node or many. With no cluster and no plan it plans and trains a small Llama on
the built-in two-kind local cluster: a newcomer's first run."""

from __future__ import annotations

import argparse
import os
import statistics
import sys

from hethub.cli.agent import DEFAULT_MAX_RESTARTS, launch
from hethub.cli.args import add_job_arguments, node, non_negative_int
from hethub.errors import HethubError
from hethub.jobs import Job, plan_devices, prepare
from hethub.memo import memo_scope
from hethub.messages import logger
from hethub.report.terminal import plural
from hethub.runtime.rundir import DEFAULT_SETTINGS
from hethub.spec.parameters import parameter_count


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "train",
        help="train a plan with torch.distributed",
        description="Train the plan's model. Outside torchrun it starts one local worker "
        "per device of the plan through torchrun; under torchrun it runs. "
        "With no --cluster and --plan: plans and trains a small Llama on two "
        "emulated kinds of device on this machine.",
    )
    add_job_arguments(parser)
    parser.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue a run from its latest checkpoint (under its plan, or another --plan)",
    )
    # Not "--node": torchrun parses its whole command line first, and refuses --node as an
    # ambiguous abbreviation of its --node-rank (Python 3.11's argparse), wherever it stands.
    parser.add_argument(
        "--this-node",
        type=node,
        metavar="GROUP:INDEX",
        help="under torchrun on several nodes: which node of the cluster this one is (its "
        "group, and its index among the group's nodes from 0); without it, this host's name "
        "in the group's hosts",
    )
    parser.add_argument(
        "--max-restarts",
        type=non_negative_int,
        default=DEFAULT_MAX_RESTARTS,
        help="restart the workers this many times after a failure; they resume from the "
        f"latest checkpoint (default {DEFAULT_MAX_RESTARTS}; under your own torchrun, give "
        "torchrun --max-restarts)",
    )
    parser.add_argument(
        "--trace-every",
        metavar="N",
        type=non_negative_int,
        help="also write trace.json every N steps while the run goes on, the measured timeline "
        "of the step just done, so a long run's trace can be opened as it runs (default "
        f"{DEFAULT_SETTINGS.trace_every}: only at the end; on --resume, the run's unless given)",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="build every rank of --plan on --cluster in this one process (fake process groups, "
        "meta tensors: no data moved, no memory allocated), check its sends and receives and "
        "its memory against the prediction, print one line per stage and train nothing",
    )
    parser.set_defaults(run=run)


@memo_scope()  # the run's preparation: its prediction, traffic and checks share one Memo
def run(args: argparse.Namespace) -> int:
    if args.dry_run:
        return _dry_run(args)
    if (
        "LOCAL_RANK" in os.environ
    ):  # started by the user's torchrun: every rank prepares, rank 0 writes
        if not args.resume and not (args.cluster and args.plan and args.run_dir):
            raise HethubError(
                "under torchrun give --cluster, --plan and --run-dir (a folder every node sees), "
                "or --resume RUN_DIR"
            )
        try:
            job = prepare(
                args, measure=False, write=os.environ.get("RANK", "0") == "0", local_launch=False
            )
        except HethubError as error:  # the other nodes' processes would wait for this one
            from hethub.runtime.nodes import post_refusal_to_peers

            post_refusal_to_peers(error, args.this_node, args.timeout or DEFAULT_SETTINGS.timeout_s)
            raise
        rank = _claim_plan_rank(args.this_node, job)
        from hethub.runtime.worker import run_job  # torch

        return run_job(
            job.run,
            job.settings,
            job.cluster,
            job.plan,
            job.model,
            resume=job.resume_from is not None,
            as_json=args.json,
            rank=rank,
        )
    if args.this_node:
        group, index = args.this_node
        raise HethubError(
            f"--this-node = '{group}:{index}': only under the user's torchrun, one per "
            f"node; outside torchrun, hethub train starts every process on this machine"
        )
    job = prepare(args, say=_say)
    _announce(job, args)
    code = launch(job, as_json=args.json, max_restarts=args.max_restarts)
    if code == 0:
        _closing(job, args)
    return code


def _dry_run(args: argparse.Namespace) -> int:
    """``--dry-run``: runtime.dry_run over the plan, against the predictor's memory."""
    import json
    from pathlib import Path

    from hethub.predictor.iteration import predict
    from hethub.runtime.dry_run import dry_run  # torch
    from hethub.spec import check_plan, load_cluster, load_model, load_plan
    from hethub.spec.topology import build_topology

    if not (args.cluster and args.plan):
        raise HethubError("--dry-run needs --cluster and --plan: it builds that plan's ranks")
    cluster = load_cluster(args.cluster)
    plan = load_plan(args.plan)
    model = load_model(
        plan.model, relative_to=Path(args.plan).parent, source=args.plan, seq_len=args.seq_len
    )
    check_plan(plan, cluster, model, args.plan)
    topology = build_topology(plan, cluster)
    predicted = predict(plan, cluster, model).stages
    result = dry_run(plan, topology, model, cluster, predicted)
    if args.json:
        print(json.dumps(result.to_json()))
        return 0
    for s in result.stages:
        print(
            f"pipeline {s.pipeline} stage {s.stage:>2} {s.group}: {plural(len(s.ranks), 'rank')} "
            f"({s.ranks[0]}..{s.ranks[-1]}), {s.memory_gb:.2f} GB, "
            f"predicted {s.predicted_memory_gb:.2f} GB, {s.verdict}"
        )
    print(
        f"dry run: {plural(result.ranks, 'rank')} built, "
        f"{plural(result.messages, 'message')} a step matched, "
        f"{plural(result.collectives, 'collective')} agreed by their ranks"
    )
    return 0


def _say(message: str) -> None:
    logger("train").info(message)


def _announce(job: Job, args: argparse.Namespace) -> None:
    p = job.prediction
    start = f"from step {job.resume_from} " if job.resume_from is not None else ""
    lines = [
        (
            f"{job.model.name} ({parameter_count(job.model) / 1e6:.1f}M parameters), "
            f"{plural(plan_devices(job.plan), 'rank')}, {plural(job.settings.steps, 'step')} "
            f"{start}into {job.run.path}"
        ),
        f"plan: {job.plan.summary()}",
        (
            f"predicted {p.iteration_time_s:.2f} s/step, {p.tokens_per_s:,.0f} tokens/s, "
            f"from {job.basis}"
        ),
    ]
    if job.emulated:
        lines.append(
            "emulated: "
            + ", ".join(
                f"group {g.name} at {g.speed:g}x this machine's speed"
                for g in job.cluster.groups
                if g.speed is not None
            )
            + " (compute stretched; not real hardware)"
        )
    for line in lines:
        _say(line)


def _closing(job: Job, args: argparse.Namespace) -> None:
    records = job.run.read_metrics()
    out = sys.stderr if args.json else sys.stdout
    if records:
        first, last = records[0]["loss"], records[-1]["loss"]
        measured = statistics.median(r["iteration_time_s"] for r in records)
        print(
            f"loss {first:.3f} -> {last:.3f} ({100 * (last - first) / first:+.1f}%); "
            f"median step {measured:.2f} s measured, "
            f"{job.prediction.iteration_time_s:.2f} s predicted"
            + (" (emulated speeds)" if job.emulated else ""),
            file=out,
        )
        evaluated = [r["eval_loss"] for r in records if r.get("eval_loss") is not None]
        if evaluated:
            print(f"validation loss {evaluated[0]:.3f} -> {evaluated[-1]:.3f}", file=out)
    run = job.run.path
    print(
        f"run directory: {run}/ (plan.yaml, metrics.jsonl, trace.json, loss.png, checkpoints/)",
        file=out,
    )
    print(
        f"resume it with: hethub train --resume {run} --steps {job.settings.steps + 20}", file=out
    )


def _claim_plan_rank(node, job: Job) -> int:
    """Under the user's torchrun: this process's plan rank, from its node."""
    from hethub.runtime.nodes import claim_plan_rank
    from hethub.spec.topology import build_topology

    return claim_plan_rank(
        node, job.cluster, build_topology(job.plan, job.cluster), job.settings.timeout_s
    )
