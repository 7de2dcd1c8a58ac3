"""`hethub validate`: the prediction of a plan against a real run of it on this machine.

The prediction is made before the run, from this machine's profiles (measured first if none
match): never from the run it is compared with. The first step is a warm-up and is left out
of the measured figures.
"""

from __future__ import annotations

import argparse
import json
import statistics

from hethub.cli.agent import launch
from hethub.cli.args import positive_finite_float, positive_int, seed, timeout_seconds
from hethub.errors import HethubError
from hethub.jobs import Job, prepare
from hethub.messages import logger
from hethub.profiles.machine import default_profiles_dir
from hethub.report.terminal import plural, render_table
from hethub.spec import Plan, load_cluster

DEFAULT_TOLERANCE_PERCENT = 25.0
"""How far the measured iteration may be from the predicted one, in percent of the measured,
before validate says the prediction failed: beyond the noise of a single run of a good
prediction on a shared machine (docs/predictor.md: each round's error of
benchmarks/predictor_vs_runtime.py), well short of what it is meant to catch, profiles of
another time or machine, off by a factor. hethub train's warning of stale profiles uses the
same figure."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "validate",
        help="predicted vs measured iteration time of a plan on this machine",
        description="Profile this machine if needed, predict the plan from the profiles, run "
        "it for --steps steps and compare: iteration time, and per stage compute, "
        "communication and idle time.",
    )
    parser.add_argument(
        "--cluster", required=True, help="cluster YAML file whose groups run on this machine's CPU"
    )
    parser.add_argument("--plan", required=True, help="plan YAML file")
    parser.add_argument(
        "--steps",
        type=positive_int,
        default=5,
        help="steps to run, the first a warm-up (default 5)",
    )
    parser.add_argument("--seed", type=seed, default=0, help="seed of the weights and the batches")
    parser.add_argument("--data", help="training data (default: the built-in corpus)")
    parser.add_argument("--run-dir", help="where the run is written (default runs/<plan name>)")
    parser.add_argument(
        "--profiles",
        default=str(default_profiles_dir()),
        help=f"this machine's profiles (default {default_profiles_dir()})",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object at the end")
    parser.add_argument(
        "--timeout",
        type=timeout_seconds,
        default=120,
        help="seconds a collective may wait for a peer",
    )
    parser.add_argument(
        "--tolerance",
        type=positive_finite_float,
        default=DEFAULT_TOLERANCE_PERCENT,
        metavar="PERCENT",
        help="exit 1 when the predicted iteration time is off the measured by more than PERCENT "
        f"percent of the measured (default {DEFAULT_TOLERANCE_PERCENT:g})",
    )
    parser.add_argument(
        "--repeats",
        type=positive_int,
        help="timed repeats of each layer pass and link message when it profiles this machine "
        "(default hethub profile's: 30 and 15); fewer is quicker and noisier",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.steps < 2:
        raise HethubError(
            f"--steps = {args.steps}: validate needs at least 2 (the first is a warm-up)"
        )
    job_args = argparse.Namespace(
        cluster=args.cluster,
        plan=args.plan,
        model=None,
        global_batch=None,
        steps=args.steps,
        seed=args.seed,
        lr=None,
        data=args.data,
        run_dir=args.run_dir,
        checkpoint_every=args.steps,
        keep_checkpoints=None,
        profiles=args.profiles,
        json=False,
        timeout=args.timeout,
        resume=None,
        repeats=args.repeats,
    )
    others = [g.name for g in load_cluster(args.cluster).groups if g.accelerator.vendor != "cpu"]
    if others:
        raise HethubError(
            f"--cluster = {args.cluster!r}: validate measures this machine, so every group "
            f"must run on its CPU (accelerator: cpu); group {others[0]!r} does not"
        )
    job = prepare(
        job_args,
        say=logger("validate").info,
    )
    code = launch(job, as_json=False, max_restarts=0)  # a measurement: a failure is the answer
    if code:
        return code
    report = compare(job, args.tolerance)
    if args.json:
        print(json.dumps(report))
        if not report["within_tolerance"]:
            logger("validate").warning(verdict(report))
    else:
        print(describe(report, job.plan))
    return 0 if report["within_tolerance"] else 1


def compare(job: Job, tolerance_percent: float = DEFAULT_TOLERANCE_PERCENT) -> dict:
    """Predicted vs measured: the iteration (median of the steps after the warm-up), each stage,
    and whether the iteration's error is within ``tolerance_percent``."""
    records = job.run.read_metrics()[1:]
    measured = statistics.median(r["iteration_time_s"] for r in records)
    p = job.prediction
    stages = []
    for s in p.stages:
        times = [
            next(x for x in r["stages"] if x["pipeline"] == s.pipeline and x["stage"] == s.position)
            for r in records
        ]
        predicted_idle = max(0.0, p.iteration_time_s - s.compute_s - s.grad_sync_s - s.optimizer_s)
        stages.append(
            {
                "pipeline": s.pipeline,
                "stage": s.position,
                "group": s.group,
                "tp": s.tp,
                "layers": s.layers,
                "predicted": {
                    "compute_s": s.compute_s,
                    # the runtime times a sharded optimizer's all-gather within its step
                    "comm_s": s.grad_sync_s - s.param_gather_s,
                    "idle_s": predicted_idle,
                },
                "measured": {
                    k: statistics.median(t[k] for t in times)
                    for k in ("compute_s", "comm_s", "idle_s")
                },
            }
        )
    error = (p.iteration_time_s - measured) / measured
    return {
        "run_dir": str(job.run.path),
        "basis": job.basis,
        "emulated": job.emulated,
        "steps_measured": len(records),
        "predicted_iteration_s": p.iteration_time_s,
        "measured_iteration_s": measured,
        "error": error,
        "tolerance": tolerance_percent / 100,
        "within_tolerance": abs(error) <= tolerance_percent / 100,
        "stages": stages,
    }


def verdict(report: dict) -> str:
    """One line: whether the prediction held, against the tolerance; where it did not, what
    usually makes it fail."""
    off = f"{100 * abs(report['error']):.1f}%"
    limit = f"--tolerance {100 * report['tolerance']:g}%"
    if report["within_tolerance"]:
        return f"prediction held: {off} off the measured iteration, within {limit}"
    return (
        f"prediction failed: {off} off the measured iteration, beyond {limit} (profiles "
        f"measured at another time, on another machine or under another load are the usual "
        f"cause: measure them again with hethub profile)"
    )


def describe(report: dict, plan: Plan) -> str:
    """The report as text: the iteration, a table of stages named as hethub predict names them
    (Plan.stage_names), and the verdict."""
    rows = []
    for s in report["stages"]:
        pipeline, position, layers = plan.stage_names(s["pipeline"], s["stage"])
        rows.append(
            [
                pipeline,
                position,
                s["group"],
                str(s["tp"]),
                layers,
                *(
                    f"{s['predicted'][k]:.3f} / {s['measured'][k]:.3f}"
                    for k in ("compute_s", "comm_s", "idle_s")
                ),
            ]
        )
    lines = [
        f"predicted {report['predicted_iteration_s']:.3f} s per step, "
        f"measured {report['measured_iteration_s']:.3f} s "
        f"(median of {plural(report['steps_measured'], 'step')}): "
        f"error {100 * report['error']:+.1f}%"
        + (" (emulated speeds)" if report["emulated"] else ""),
        f"prediction from {report['basis']}",
        "",
        render_table(
            [
                "pipeline",
                "stage",
                "group",
                "tp",
                "layers",
                "compute s (pred / meas)",
                "comm s",
                "idle s",
            ],
            rows,
        ),
        "",
        f"trace (predicted above measured): {report['run_dir']}/trace.json (open in https://ui.perfetto.dev)",
        verdict(report),
    ]
    return "\n".join(lines)
