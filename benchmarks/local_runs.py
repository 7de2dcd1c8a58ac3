"""Run plans on this machine through `hethub validate` (profiles, prediction before the run, the
real run, the measured iteration): shared by predictor_vs_runtime.py and hetero_speedup.py.

`validate_bridged` does the same for a plan across two vendors, which `hethub validate` refuses
(it measures this machine, so every group must be its CPU): see its docstring."""

from __future__ import annotations

import dataclasses
import json
import statistics
import subprocess
import sys
from pathlib import Path

import yaml


def validate(
    workdir: Path, name: str, cluster: dict, plan: dict, steps: int, profiles: Path
) -> dict:
    """`hethub validate --json` of ``plan`` on ``cluster``; its final object."""
    write_inputs(workdir, name, cluster, plan)
    done = run_hethub(
        workdir,
        name,
        "validate",
        steps,
        "--profiles",
        str(profiles.resolve()),
        "--json",
        "--run-dir",
        f"runs/{name}",
    )
    # Exit 1 is validate's verdict (off by more than --tolerance) on a run that was measured: its
    # report is what is wanted here, however far off.
    if done.returncode not in (0, 1) or not done.stdout.strip():
        raise SystemExit(
            f"{name}: hethub validate failed (exit {done.returncode}):\n{done.stderr[-3000:]}"
        )
    return json.loads(done.stdout.splitlines()[-1])


def write_inputs(workdir: Path, name: str, cluster: dict, plan: dict) -> None:
    """``workdir``/NAME.cluster.yaml and NAME.yaml: the files run_hethub names."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / f"{name}.cluster.yaml").write_text(yaml.safe_dump(cluster, sort_keys=False))
    (workdir / f"{name}.yaml").write_text(yaml.safe_dump(plan, sort_keys=False))


def run_hethub(
    workdir: Path, name: str, command: str, steps: int, *arguments: str
) -> subprocess.CompletedProcess:
    """`hethub COMMAND` of the plan ``name`` (write_inputs) for ``steps`` steps, in ``workdir``,
    its output captured."""
    return subprocess.run(
        [
            *(sys.executable, "-m", "hethub", command),
            *("--cluster", f"{name}.cluster.yaml", "--plan", f"{name}.yaml"),
            *("--steps", str(steps), *arguments),
        ],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )


def stage(group: str, tp: int, layers: int | list[int]) -> dict:
    """A stage of a plan; ``layers``: its layers, or under interleaving its chunks' layers."""
    return {"group": group, "tp": tp, "layers": layers}


def validate_bridged(
    workdir: Path, name: str, cluster: dict, plan: dict, steps: int, profiles: Path
) -> dict:
    """`hethub validate` for a plan whose groups are of different vendors (say a100-80gb beside
    mi250x), run on this machine's CPU as `hethub train` runs any group whose accelerator it
    lacks (comm.local_device): each rank a process on these cores, and every message between
    the vendors over the runtime's bridge (gloo, host-staged), counted as path "bridge".

    The prediction is made before the run from this machine's profiles, measured first as
    `hethub validate` measures them, but of the cluster's CPU twin (every group's accelerator
    ``cpu``): the predictor looks a group's profiles up by its accelerator's name, so they are
    stored again under each vendor's name (profiles_for_kinds), with the link between two kinds
    (LinkProfile.peer) taken from the CPU's own link. That is what the bridge is on one machine:
    gloo between two processes of it, the transport the CPU's link profile measured. They are
    selected as for a local run (every rank computing at once on these cores), which
    profiles.selection.local_concurrency grants only to an all-CPU cluster.

    Refuses (SystemExit) a run whose steps moved no bytes over the bridge: it would not be a
    bridged plan. Returns validate's keys that the benchmarks read, and ``bridge_bytes``."""
    from hethub.predictor import predict
    from hethub.profiles.files import load_profiles
    from hethub.runtime.rundir import RunDir
    from hethub.spec import load_model, parse_cluster, parse_plan

    write_inputs(workdir, name, cluster, plan)
    bridged = parse_cluster(cluster, f"{name}.cluster.yaml")
    twin = parse_cluster(cpu_twin(cluster), f"{name}: its CPU twin")
    plan_spec = parse_plan(plan, f"{name}.yaml")
    model = load_model(plan_spec.model)
    devices = sum(p.count * p.devices for p in plan_spec.pipelines)
    measure_cpu(profiles / "cpu", twin, model, plan_spec)
    kinds = sorted({g.accelerator.name for g in bridged.groups})
    folder = profiles_for_kinds(profiles / "cpu", profiles / "bridged", kinds)
    chosen = load_profiles(folder).select(
        dtype=plan_spec.precision.value, threads=1, concurrent_ranks=devices
    )
    predicted = predict(plan_spec, bridged, model, profiles=chosen).iteration_time_s
    run = RunDir(workdir / "runs" / name)
    done = run_hethub(
        workdir,
        name,
        "train",
        steps,
        "--checkpoint-every",
        str(steps),
        "--json",
        "--run-dir",
        str(run.path.relative_to(workdir)),
    )
    if done.returncode != 0:
        raise SystemExit(
            f"{name}: hethub train failed (exit {done.returncode}):\n{done.stderr[-3000:]}"
        )
    records = run.read_metrics()[1:]  # the first step is a warm-up, as validate leaves it out
    if not records or any(r["comm_bytes"].get("bridge", 0) <= 0 for r in records):
        raise SystemExit(f"{name}: a step moved nothing over the bridge: not a bridged plan")
    measured = statistics.median(r["iteration_time_s"] for r in records)
    return {
        "run_dir": str(run.path),
        "predicted_iteration_s": predicted,
        "measured_iteration_s": measured,
        "error": (predicted - measured) / measured,
        "bridge_bytes": records[0]["comm_bytes"]["bridge"],
    }


def cpu_twin(cluster: dict) -> dict:
    """``cluster`` with every group's accelerator this machine's CPU: what its profiles are
    measured as (the groups keep their names and sizes)."""
    return {**cluster, "groups": [{**g, "accelerator": "cpu"} for g in cluster["groups"]]}


def measure_cpu(folder: Path, twin, model, plan) -> None:
    """What ``folder`` lacks of the CPU profiles `hethub validate` would measure for ``plan`` on
    the all-CPU cluster ``twin`` (hethub.jobs.prepare: every rank at once, and each TP group
    alone where the ranks outnumber the cores)."""
    from hethub.jobs.prepare import local_measurements
    from hethub.profiler.conditions import available_cores
    from hethub.profiler.ensure import ProfileRequest, ensure_profiles

    wanted = local_measurements(twin, model, plan, available_cores())
    request = ProfileRequest(
        model=model,
        device_name="cpu",
        tps=wanted.tps,
        micro_batches=wanted.micro_batches,
        threads=1,
        concurrent_ranks=wanted.together,
        dtype=plan.precision.value,
    )
    ensure_profiles(folder, request)
    for tp in wanted.alone:
        alone = dataclasses.replace(request, tps=[tp], concurrent_ranks=tp)
        ensure_profiles(folder, alone, links=False)


def profiles_for_kinds(cpu: Path, out: Path, kinds: list[str]) -> Path:
    """Write to ``out`` the CPU profiles of ``cpu`` stored again under each of ``kinds``' names,
    and for every two kinds their link between nodes (LinkProfile.peer) from the CPU's link at
    each concurrency: the groups of those kinds run on this CPU, and the bridge between them is
    gloo between its processes. Returns ``out``."""
    from hethub.profiles.files import load_profiles, save_profile

    measured = load_profiles(cpu)
    out.mkdir(parents=True, exist_ok=True)
    for profile in measured.layers.values():
        for kind in kinds:
            save_profile(
                out, dataclasses.replace(profile, key=dataclasses.replace(profile.key, device=kind))
            )
    for link in measured.links.values():
        for kind in kinds:
            save_profile(out, dataclasses.replace(link, device=kind))
    # one link between two kinds whatever the concurrency: the most ranks at once, as the run
    most = max(measured.links.values(), key=lambda link: link.concurrent_ranks, default=None)
    for i, a in enumerate(kinds):
        for b in kinds[i + 1 :]:
            if most is not None:
                save_profile(out, dataclasses.replace(most, device=a, peer=b))
    return out
