"""Where the profiles that price a run came from: which of them the plan is looked up by, when and
where they were measured, what differs from this machine now, and the command that measures them
again. Written beside the prediction (prediction.json's ``profiles``) before the run starts, so
that the run can say, should its steps and the prediction disagree, why they may (hethub.report
.prediction_check) without reading the profiles itself.
"""

from __future__ import annotations

import dataclasses
import shlex
import statistics
from typing import Any

from hethub.profiles.machine import cpu_model, host_name, torch_version
from hethub.profiles.selection import Profiles
from hethub.profiles.types import LayerProfile, MeasuredOn
from hethub.spec.cluster import ClusterSpec
from hethub.spec.model import ModelSpec, preset_names
from hethub.spec.plan import Plan


def plan_layer_profiles(
    plan: Plan, cluster: ClusterSpec, model: ModelSpec, profiles: Profiles
) -> list[LayerProfile]:
    """The layer profiles the plan's stages are priced by (each once; those missing left out),
    looked up in the plan's precision under ``profiles``' run conditions, as predict() does."""
    selected = profiles.select(
        dtype=plan.precision.value,
        threads=profiles.threads,
        concurrent_ranks=profiles.concurrent_ranks,
    )
    pairs = dict.fromkeys(
        (cluster.group(s.group).accelerator.name, s.tp) for p in plan.pipelines for s in p.stages
    )
    found = [selected.layer_for(device, model, tp, plan.micro_batch) for device, tp in pairs]
    return [p for p in found if p is not None]


def differences_from_here(measured_on: MeasuredOn) -> list[str]:
    """What of ``measured_on`` is not this machine as it is now: its host, CPU and torch."""
    here = {"host": host_name(), "CPU": cpu_model(), "torch": torch_version()}
    then = {"host": measured_on.host, "CPU": measured_on.cpu, "torch": measured_on.torch}
    return [
        f"{what} {then[what]!r} then, {here[what]!r} now"
        for what in here
        if then[what] is not None and here[what] is not None and then[what] != here[what]
    ]


def measure_again_command(
    plan: Plan, cluster: ClusterSpec, profiles: Profiles, used: list[LayerProfile]
) -> str:
    """The `hethub profile --again` command(s) that measure anew the profiles the plan is priced
    by: its TP degrees and micro-batch, its precision, the run's ranks at once (and each TP
    group alone where they outnumber the cores the profiles recorded), into their folder."""
    model_ref = plan.model if plan.model.lower() in preset_names() else shlex.quote(plan.model)
    tps = sorted({s.tp for p in plan.pipelines for s in p.stages})
    together = profiles.concurrent_ranks
    cores = min((p.cores for p in used if p.cores is not None), default=together)
    concurrency = dict.fromkeys([together, *(tps if together > cores else [])])
    devices = dict.fromkeys(
        cluster.group(s.group).accelerator.name for p in plan.pipelines for s in p.stages
    )
    return " && ".join(
        f"hethub profile --model {model_ref} --device {shlex.quote(device)} "
        f"--tp {','.join(map(str, tps))} --micro-batch {plan.micro_batch} "
        f"--concurrent-ranks {','.join(map(str, concurrency))} --dtype {plan.precision.value} "
        f"--out {shlex.quote(profiles.source)} --again"
        for device in devices
    )


def provenance(
    plan: Plan, cluster: ClusterSpec, model: ModelSpec, profiles: Profiles | None
) -> dict[str, Any] | None:
    """prediction.json's ``profiles``: the folder, the oldest measuring time of the plan's layer
    profiles, where the newest was measured (None: a file from before it was recorded), the load
    average as their measuring ended (the mean; None: not recorded), what differs from this
    machine now, and the command that measures them again. None without profiles."""
    if profiles is None:
        return None
    used = plan_layer_profiles(plan, cluster, model, profiles)
    newest = max(used, key=lambda p: p.measured_at, default=None)
    where = newest.measured_on if newest else None
    loads = [
        p.measured_on.load_after
        for p in used
        if p.measured_on is not None and p.measured_on.load_after is not None
    ]
    return {
        "folder": profiles.source,
        "measured_at": min((p.measured_at for p in used), default=None),
        "measured_on": dataclasses.asdict(where) if where else None,
        "load_at_measuring": statistics.fmean(loads) if loads else None,
        "differences": differences_from_here(where) if where else [],
        "measure_again": measure_again_command(plan, cluster, profiles, used),
    }
