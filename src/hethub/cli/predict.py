"""`hethub predict`: iteration time, throughput and memory of a plan on a cluster, before a GPU
is spent."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hethub.cli.args import positive_int
from hethub.errors import HethubError
from hethub.predictor import Prediction, predict
from hethub.predictor.profiled import missing_profiles
from hethub.profile.store import Profiles, all_cpu, load_profiles, select_for_run
from hethub.report.terminal import render_table
from hethub.report.text import plural
from hethub.report.trace import write_trace
from hethub.spec import (
    ClusterSpec,
    ModelSpec,
    Plan,
    check_plan,
    load_cluster,
    load_model,
    load_plan,
)
from hethub.spec.plan import PRECISIONS, RECOMPUTE, SCHEDULES, uniform_plan
from hethub.spec.schedules import Schedule

SHORTHAND = ("tp", "pp", "dp", "micro_batch", "global_batch", "virtual_stages")
PROFILES_HELP = (
    "price with the measured profiles in DIR (hethub profile), under the run conditions of the "
    "runtime: the plan's precision as dtype, 1 thread per rank, and as many ranks computing "
    "at once as the {what} has devices when every group's accelerator is a CPU (a local run: "
    "all ranks share this machine), else 1; "
    "what DIR lacks is priced by the analytic model, with a note on stderr"
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "predict",
        help="predict iteration time, throughput and memory of a plan",
        description="Predict one optimizer step of a plan on a cluster. Give a plan file, or for a "
        "cluster of one group the shorthand --tp --pp --dp --micro-batch --global-batch.",
    )
    parser.add_argument("--cluster", required=True, help="cluster YAML file")
    parser.add_argument("--model", help="preset name or model YAML (overrides the plan's model)")
    parser.add_argument("--plan", help="plan YAML file")
    for flag in SHORTHAND:
        parser.add_argument(
            f"--{flag.replace('_', '-')}",
            dest=flag,
            type=positive_int,
            help=f"shorthand plan: {flag.replace('_', ' ')}",
        )
    parser.add_argument(
        "--recompute", choices=RECOMPUTE, default="none", help="shorthand plan: recomputation"
    )
    parser.add_argument(
        "--schedule",
        choices=SCHEDULES,
        help="shorthand plan: schedule (default 1f1b; interleaved-1f1b with --virtual-stages)",
    )
    parser.add_argument(
        "--shard-optimizer",
        action="store_true",
        help="shorthand plan: split the optimizer state across the data-parallel replicas",
    )
    parser.add_argument(
        "--overlap-grad-sync",
        action="store_true",
        help="shorthand plan: sync gradient buckets during the backwards",
    )
    parser.add_argument(
        "--precision",
        choices=PRECISIONS,
        help="shorthand plan: bf16 (mixed precision, the default) or fp32 (a plan file gives its "
        "own precision)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--trace", metavar="FILE", help="write the simulated timeline as a Chrome trace"
    )
    parser.add_argument("--profiles", metavar="DIR", help=PROFILES_HELP.format(what="plan"))
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    cluster = load_cluster(args.cluster)
    plan, model, source = resolve_plan(args, cluster)
    devices = sum(p.count * p.devices for p in plan.pipelines)
    profiles = read_profiles(args.profiles, cluster, devices)
    missing = note_missing(plan, cluster, model, profiles, "predict")
    prediction = predict(plan, cluster, model, timeline=bool(args.trace), profiles=profiles)
    if args.trace:
        try:
            write_trace(
                Path(args.trace), prediction.timeline, title=f"hethub predict: {model.name}"
            )
        except OSError as error:
            raise HethubError(
                f"--trace = {args.trace!r}: cannot write the trace file ({error.strerror})"
            ) from None
    if args.json:
        print(
            json.dumps(
                {**prediction.to_json(), **({"profiles": profiles.source} if profiles else {})},
                indent=2,
            )
        )
    else:
        print(
            describe(
                prediction, plan, cluster, model, source, priced_by(cluster, profiles, missing)
            )
        )
    return 0


def read_profiles(directory: str | None, cluster: ClusterSpec, devices: int) -> Profiles | None:
    """The profiles of ``directory`` (None: none given) selected for a runtime job of ``devices``
    devices on ``cluster`` (hethub.profile.select_for_run); predict() and search() look them up
    under each plan's precision."""
    if directory is None:
        return None
    return select_for_run(load_profiles(directory), cluster, devices)


def note_missing(
    plan: Plan, cluster: ClusterSpec, model: ModelSpec, profiles: Profiles | None, command: str
) -> int:
    """One line on stderr per piece of the plan the profiles lack (priced by the analytic model);
    how many. No profiles: none noted, the whole plan is analytic (priced_by says so)."""
    notes = missing_profiles(plan, cluster, model, profiles) if profiles is not None else []
    for note in notes:
        print(f"hethub {command}: note: {note}", file=sys.stderr)
    return len(notes)


def priced_by(cluster: ClusterSpec, profiles: Profiles | None, missing: int) -> str:
    """What the figures rest on, and how far they may be from the hardware, in one line."""
    if profiles is not None:
        where = f"measured profiles in {profiles.source}"
        if missing:
            return (
                f"{where}, but {plural(missing, 'missing profile')} priced by the analytic "
                f"model (the notes on stderr)"
            )
        return where
    if all_cpu(cluster):
        # A CPU's GEMM efficiency, launch cost and core sharing are nowhere in the catalog: on a
        # 2-core machine a local-llama plan measured at 0.47 s a step was 0.07 s analytic (0.46 s
        # from this machine's profiles).
        return (
            "the analytic model, not calibrated for this machine: it can be several times off; "
            "measure it with hethub profile --model M and add --profiles runs/profiles"
        )
    return (
        "the analytic model, from the catalog's public figures: under 8% mean error on 1,481 "
        "measured A100 iterations (benchmarks/predictor_accuracy.py); other accelerators are "
        "not checked against measurements"
    )


def resolve_plan(args: argparse.Namespace, cluster: ClusterSpec) -> tuple[Plan, ModelSpec, str]:
    """The plan from --plan or the shorthand flags, checked against the cluster and the model."""
    given = [
        flag
        for flag in (*SHORTHAND, "precision", "schedule", "shard_optimizer", "overlap_grad_sync")
        if getattr(args, flag, None) not in (None, False)
    ]
    if args.plan:
        if given:
            raise HethubError(
                f"--{given[0].replace('_', '-')}: the shorthand flags and --plan exclude each other"
            )
        plan = load_plan(args.plan)
        model = load_model(
            args.model or plan.model,
            relative_to=None if args.model else Path(args.plan).parent,
            source=args.plan if not args.model else "--model",
        )
        check_plan(plan, cluster, model, args.plan)
        return plan, model, args.plan
    missing = [flag for flag in ("micro_batch", "global_batch") if getattr(args, flag) is None]
    if missing or not args.model:
        need = ["--model"] * (not args.model) + [f"--{m.replace('_', '-')}" for m in missing]
        raise HethubError(
            f"give --plan FILE, or the shorthand plan with {', '.join(need)} "
            f"(and --tp/--pp/--dp, default 1)"
        )
    if len(cluster.groups) != 1:
        raise HethubError(
            f"{args.cluster}: the shorthand plan needs a cluster of one group "
            f"(it has {len(cluster.groups)}: {', '.join(cluster.group_names)}); write a plan file"
        )
    model = load_model(args.model, source="--model")
    tp, pp, dp, v = (getattr(args, flag) or 1 for flag in ("tp", "pp", "dp", "virtual_stages"))
    if pp * v > model.layers:
        given = f"--pp = {pp}" if v == 1 else f"--pp x --virtual-stages = {pp} x {v}"
        raise HethubError(
            f"{given}: at most one {'stage' if v == 1 else 'chunk'} per layer "
            f"(the model has {plural(model.layers, 'layer')})"
        )
    if v > 1 and pp < 2:
        raise HethubError(f"--virtual-stages = {v}: interleaving needs --pp 2 or more")
    schedule = args.schedule or ("interleaved-1f1b" if v > 1 else "1f1b")
    if v > 1 and schedule != "interleaved-1f1b":
        raise HethubError(
            f"--virtual-stages = {v}: more than one chunk per stage needs --schedule "
            f"interleaved-1f1b (not {schedule})"
        )
    if args.global_batch % (dp * args.micro_batch):
        raise HethubError(
            f"--global-batch = {args.global_batch}: must be a multiple of --dp x --micro-batch "
            f"({dp} x {args.micro_batch} = {dp * args.micro_batch})"
        )
    plan = uniform_plan(
        model=args.model,
        group=cluster.groups[0].name,
        tp=tp,
        pp=pp,
        dp=dp,
        micro_batch=args.micro_batch,
        global_batch=args.global_batch,
        recompute=args.recompute,
        schedule=schedule,
        precision=getattr(args, "precision", None) or "bf16",
        layers=model.layers,
        virtual_stages=v,
        shard_optimizer=args.shard_optimizer,
        overlap_grad_sync=args.overlap_grad_sync,
    )
    check_plan(plan, cluster, model, "command line")
    return plan, model, "command line"


def schedule_text(plan: Plan) -> str:
    """The schedule, its chunks per stage where it interleaves, and the sync's options."""
    text = str(plan.schedule)
    chunks = sorted({p.virtual_stages for p in plan.pipelines})
    if plan.schedule == Schedule.INTERLEAVED_1F1B:
        text += f" (virtual stages {'/'.join(map(str, chunks))})"
    if plan.shard_optimizer:
        text += ", sharded optimizer"
    if plan.overlap_grad_sync:
        text += ", overlapped grad sync"
    return text


def describe(
    prediction: Prediction,
    plan: Plan,
    cluster: ClusterSpec,
    model: ModelSpec,
    source: str,
    basis: str,
) -> str:
    """A readable summary: one row per stage, then the step as a whole."""
    header = [
        "pipeline",
        "stage",
        "group",
        "accelerator",
        "tp",
        "layers",
        "micro-batches",
        "fwd ms",
        "bwd ms",
        "compute s",
        "grad sync ms",
        "memory GB",
    ]
    rows = []
    for s in prediction.stages:
        layout = plan.pipelines[s.pipeline]
        capacity = cluster.group(s.group).accelerator.memory_gb
        flag = "" if s.memory.total_gb <= capacity else "  OVER"
        rows.append(
            [
                f"{s.pipeline} (x{layout.count})",
                str(s.position),
                s.group,
                s.accelerator,
                str(s.tp),
                "+".join(map(str, layout.stages[s.position].chunks)),
                str(layout.micro_batches),
                f"{s.forward_s * 1e3:.2f}",
                f"{s.backward_s * 1e3:.2f}",
                f"{s.compute_s:.3f}",
                f"{s.grad_sync_s * 1e3:.1f}",
                f"{s.memory.total_gb:.1f} / {capacity:g}{flag}",
            ]
        )
    p = prediction
    params = model.parameter_count()
    size = (
        f"{params / 1e9:.2f}B" if params >= 1e9 else f"{params / 1e6:.1f}M"
    )  # local models are millions
    lines = [
        (
            f"model {model.name} ({size} parameters), plan {source}: "
            f"global batch {plan.global_batch} x {model.seq_len} tokens, "
            f"{plan.precision}, micro-batch {plan.micro_batch}, "
            f"recompute {plan.recompute}, {schedule_text(plan)}, "
            f"{plural(p.devices, 'device')}"
        ),
        "",
        render_table(header, rows),
        "",
        f"iteration time       {p.iteration_time_s:.4f} s",
        f"throughput           {p.tokens_per_s:,.0f} tokens/s",
        f"model TFLOP/s/device {p.model_tflops_per_device:.1f}",
        f"pipeline bubble      {100 * p.bubble_fraction:.1f}%",
        f"peak memory          {p.peak_memory_gb:.1f} GB per device",
        "fits in memory       "
        + ("yes" if p.fits else "NO: a stage needs more memory than its device has"),
        f"priced by            {basis}",
    ]
    return "\n".join(lines)
