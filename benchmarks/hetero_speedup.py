"""The planner's answer to heterogeneity, measured: on the emulated two-kind local cluster
(examples/clusters/local-hetero.yaml: one rank at this machine's speed, one at half of it),
the measured throughput of the planner's plan against the uniform layer split and against the
fast group alone, and its efficiency against the upper bound measured the same way (the sum of
each group's measured throughput alone, under the planner's plan for that group alone).

Usage: python benchmarks/hetero_speedup.py [--steps N] [--workdir DIR]
Target (issue 5): the planner's plan beats the uniform split as measured, not only as predicted.
The speeds are emulated (compute stretched by sleeping): the figures are of this machine.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from local_runs import stage, validate

from hethub.spec import parse_plan

ROOT = Path(__file__).resolve().parents[1]
MODEL, GLOBAL_BATCH = "local-llama", 16


def planned(workdir: Path, name: str, cluster: dict, profiles: Path) -> dict:
    """`hethub plan` on this machine's profiles for ``cluster``: the plan, as a dict."""
    (workdir / f"{name}.cluster.yaml").write_text(yaml.safe_dump(cluster, sort_keys=False))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "hethub",
            "plan",
            "--cluster",
            f"{name}.cluster.yaml",
            "--model",
            MODEL,
            "--global-batch",
            str(GLOBAL_BATCH),
            "--profiles",
            str(profiles.resolve()),
            "--out",
            f"{name}.yaml",
            "--force",  # a --workdir kept from an earlier run holds this file already
        ],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if done.returncode:
        raise SystemExit(f"hethub plan for {name} failed:\n{done.stderr[-3000:]}")
    return yaml.safe_load((workdir / f"{name}.yaml").read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--steps", type=int, default=6, help="steps per run, the first a warm-up (default 6)"
    )
    parser.add_argument(
        "--workdir", type=Path, help="keep the runs here (default: a temporary folder)"
    )
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="hethub-hetero-"))
    workdir.mkdir(parents=True, exist_ok=True)
    profiles = workdir / "profiles"
    started = time.perf_counter()
    cluster = yaml.safe_load((ROOT / "examples/clusters/local-hetero.yaml").read_text())
    groups = {g["name"]: g for g in cluster["groups"]}
    layers = 8

    # This machine's profiles for every micro-batch size the planner tries, alone and two at once.
    for concurrent in (1, 2):
        subprocess.run(
            [
                sys.executable,
                "-m",
                "hethub",
                "profile",
                "--model",
                MODEL,
                "--micro-batch",
                "1,2,4",
                "--concurrent-ranks",
                str(concurrent),
                "--out",
                str(profiles),
            ],
            check=True,
            stdout=subprocess.DEVNULL,
            timeout=600,
        )
    runs, alone = {}, {}
    for name, group in groups.items():
        solo = {"groups": [group]}
        alone[name] = validate(
            workdir,
            f"{name}-alone",
            solo,
            planned(workdir, f"{name}-alone", solo, profiles),
            args.steps,
            profiles,
        )
    best = planned(workdir, "planner", cluster, profiles)
    uniform = {
        "model": MODEL,
        "global_batch": GLOBAL_BATCH,
        "micro_batch": best["micro_batch"],
        "recompute": best.get("recompute", "none"),
        "pipelines": [
            {"count": 1, "stages": [stage("fast", 1, layers // 2), stage("slow", 1, layers // 2)]}
        ],
    }
    # The uniform split must be a plan the cluster can run with the planner's micro-batch: it is.
    runs["planner"] = validate(workdir, "planner", cluster, best, args.steps, profiles)
    runs["uniform"] = validate(workdir, "uniform", cluster, uniform, args.steps, profiles)

    tokens = GLOBAL_BATCH * 128  # local-llama's sequence length

    def speed(report: dict, key: str) -> float:
        return tokens / report[key]

    bound = sum(speed(r, "measured_iteration_s") for r in alone.values())
    bound_predicted = sum(speed(r, "predicted_iteration_s") for r in alone.values())
    print(
        "emulated cluster local-hetero: fast at 1.0x, slow at 0.5x this machine "
        f"(compute stretched); {MODEL}, "
        f"global batch {GLOBAL_BATCH}; measured = median of {args.steps - 1} steps after a warm-up"
    )
    print(f"planner's plan: {parse_plan(best).summary()}")
    print(f"{'run':<22} {'measured tokens/s':>18} {'predicted tokens/s':>19}")
    for label, report in [
        ("planner's plan", runs["planner"]),
        ("uniform split 4/4", runs["uniform"]),
        ("fast group alone", alone["fast"]),
        ("slow group alone", alone["slow"]),
    ]:
        print(
            f"{label:<22} {speed(report, 'measured_iteration_s'):>18,.0f} "
            f"{speed(report, 'predicted_iteration_s'):>19,.0f}"
        )
    planner_speed, uniform_speed = (
        speed(runs["planner"], "measured_iteration_s"),
        speed(runs["uniform"], "measured_iteration_s"),
    )
    planner_predicted, uniform_predicted = (
        speed(runs["planner"], "predicted_iteration_s"),
        speed(runs["uniform"], "predicted_iteration_s"),
    )
    print(
        f"upper bound (fast alone + slow alone): measured {bound:,.0f} tokens/s, "
        f"predicted {bound_predicted:,.0f}"
    )
    print(
        f"planner vs uniform split: {planner_speed / uniform_speed:.3f}x measured, "
        f"{planner_predicted / uniform_predicted:.3f}x "
        f"predicted"
    )
    print(
        "planner vs fast group alone: "
        f"{planner_speed / speed(alone['fast'], 'measured_iteration_s'):.3f}x measured"
    )
    print(f"planner's efficiency: {100 * planner_speed / bound:.1f}% of the measured upper bound")
    met = planner_speed > uniform_speed
    print(
        f"target (planner beats the uniform split as measured): {'met' if met else 'MISSED'}; "
        f"{time.perf_counter() - started:.0f} s in all"
    )
    return 0 if met else 1


if __name__ == "__main__":
    raise SystemExit(main())
