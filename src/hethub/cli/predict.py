"""`hethub predict`: iteration time, throughput and memory of a plan on a cluster, before a GPU
is spent."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hethub.cli.args import positive_int
from hethub.cli.summary import PROFILES_HELP, describe, note_missing, priced_by, read_profiles
from hethub.errors import HethubError
from hethub.memo import memo_scope
from hethub.predictor import predict
from hethub.predictor.traffic import predicted_traffic
from hethub.report.terminal import plural
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
from hethub.spec.plan import (
    DEFAULT_PRECISION,
    PRECISIONS,
    RECOMPUTE,
    SCHEDULES,
    UniformLayout,
    uniform_plan,
)

SHORTHAND = ("tp", "pp", "dp", "micro_batch", "global_batch", "virtual_stages")
SWITCHES = {
    "shard_optimizer": "split the optimizer state across the data-parallel replicas",
    "overlap_grad_sync": "sync gradient buckets during the backwards",
    "overlap_param_gather": "gather a sharded optimizer's weights during the next forwards",
    "sequence_parallel": "split the norms' and residuals' activations over the TP ranks",
}
"""The shorthand plan's on/off fields, each a flag of its own name."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "predict",
        help="predict iteration time, throughput and memory of a plan",
        description="Predict one optimizer step of a plan on a cluster. Give a plan file, or for a "
        "cluster of one group the shorthand --tp --pp --dp --micro-batch --global-batch.",
    )
    parser.add_argument("--cluster", required=True, help="cluster YAML file")
    parser.add_argument(
        "--model",
        help="preset name, model YAML, or HuggingFace model folder (overrides the plan's model)",
    )
    parser.add_argument("--plan", help="plan YAML file")
    for flag in SHORTHAND:
        parser.add_argument(
            f"--{flag.replace('_', '-')}",
            dest=flag,
            type=positive_int,
            help=f"shorthand plan: {flag.replace('_', ' ')}",
        )
    parser.add_argument(
        "--recompute",
        choices=RECOMPUTE,
        default="none",
        help="shorthand plan: every stage's recomputation (selective: the attention's inner part)",
    )
    parser.add_argument(
        "--schedule",
        choices=SCHEDULES,
        help="shorthand plan: schedule (default 1f1b; interleaved-1f1b with --virtual-stages)",
    )
    for flag, what in SWITCHES.items():
        parser.add_argument(
            f"--{flag.replace('_', '-')}", action="store_true", help=f"shorthand plan: {what}"
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


@memo_scope()  # the prediction and its traffic share one Memo
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
                {
                    **prediction.to_json(),
                    **predicted_traffic(plan, cluster, model),
                    **({"profiles": profiles.source} if profiles else {}),
                },
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


def resolve_plan(args: argparse.Namespace, cluster: ClusterSpec) -> tuple[Plan, ModelSpec, str]:
    """The plan from --plan or the shorthand flags, checked against the cluster and the model."""
    given = [
        flag
        for flag in (*SHORTHAND, "precision", "schedule", *SWITCHES)
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
    zbv = args.schedule == "zbv"
    if zbv and not args.virtual_stages:
        v = 2  # the V: two chunks a stage
    if pp * v > model.layers:
        given = f"--pp = {pp}" if v == 1 else f"--pp x --virtual-stages = {pp} x {v}"
        raise HethubError(
            f"{given}: at most one {'stage' if v == 1 else 'chunk'} per layer "
            f"(the model has {plural(model.layers, 'layer')})"
        )
    if v > 1 and pp < 2:
        raise HethubError(
            f"--virtual-stages = {v}: more than one chunk per stage needs --pp 2 or more"
        )
    schedule = args.schedule or ("interleaved-1f1b" if v > 1 else "1f1b")
    if v > 1 and schedule not in ("interleaved-1f1b", "zbv") or zbv and v != 2:
        raise HethubError(
            f"--virtual-stages = {v}: more than one chunk per stage needs --schedule "
            f"interleaved-1f1b (any count) or zbv (2), not {schedule}"
        )
    if args.global_batch % (dp * args.micro_batch):
        raise HethubError(
            f"--global-batch = {args.global_batch}: must be a multiple of --dp x --micro-batch "
            f"({dp} x {args.micro_batch} = {dp * args.micro_batch})"
        )
    layout = UniformLayout(cluster.groups[0].name, tp, pp, dp, model.layers, virtual_stages=v)
    plan = uniform_plan(
        layout,
        model=args.model,
        micro_batch=args.micro_batch,
        global_batch=args.global_batch,
        recompute=args.recompute,
        schedule=schedule,
        precision=getattr(args, "precision", None) or DEFAULT_PRECISION,
        **{flag: getattr(args, flag) for flag in SWITCHES},
    )
    check_plan(plan, cluster, model, "command line")
    return plan, model, "command line"
