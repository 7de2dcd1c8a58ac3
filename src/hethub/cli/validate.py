"""`hethub validate`: the prediction of a plan against a real run of it on this machine.

The prediction is made before the run, from this machine's profiles (measured first if none
match): never from the run it is compared with. The first step is a warm-up and is left out
of the measured figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from hethub.cli.args import positive_int, seed, timeout_seconds
from hethub.cli.launch import launch
from hethub.errors import HethubError
from hethub.jobs import Job, prepare
from hethub.profiles.machine import default_profiles_dir
from hethub.report.terminal import render_table
from hethub.report.text import plural
from hethub.spec import load_cluster


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
        say=lambda message: print(f"hethub validate: {message}", file=sys.stderr, flush=True),
    )
    code = launch(job, as_json=False, max_restarts=0)  # a measurement: a failure is the answer
    if code:
        return code
    report = compare(job)
    if args.json:
        print(json.dumps(report))
    else:
        print(describe(report))
    return 0


def compare(job: Job) -> dict:
    """Predicted vs measured: the iteration (median of the steps after the warm-up) and each
    stage."""
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
    return {
        "run_dir": str(job.run.path),
        "basis": job.basis,
        "emulated": job.emulated,
        "steps_measured": len(records),
        "predicted_iteration_s": p.iteration_time_s,
        "measured_iteration_s": measured,
        "error": (p.iteration_time_s - measured) / measured,
        "stages": stages,
    }


def describe(report: dict) -> str:
    rows = [
        [
            f"{s['pipeline']}.{s['stage']}",
            s["group"],
            str(s["tp"]),
            str(s["layers"]),
            *(
                f"{s['predicted'][k]:.3f} / {s['measured'][k]:.3f}"
                for k in ("compute_s", "comm_s", "idle_s")
            ),
        ]
        for s in report["stages"]
    ]
    lines = [
        f"predicted {report['predicted_iteration_s']:.3f} s per step, "
        f"measured {report['measured_iteration_s']:.3f} s "
        f"(median of {plural(report['steps_measured'], 'step')}): "
        f"error {100 * report['error']:+.1f}%"
        + (" (emulated speeds)" if report["emulated"] else ""),
        f"prediction from {report['basis']}",
        "",
        render_table(
            ["stage", "group", "tp", "layers", "compute s (pred / meas)", "comm s", "idle s"], rows
        ),
        "",
        f"trace (predicted above measured): {report['run_dir']}/trace.json (open in https://ui.perfetto.dev)",
    ]
    return "\n".join(lines)
