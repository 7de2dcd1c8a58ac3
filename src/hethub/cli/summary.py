"""What a prediction rests on and how it reads, shared by `hethub predict` and `hethub plan`: the
profiles read for a run's conditions, one note per piece they lack, the basis in words, and the
summary table."""

from __future__ import annotations

from hethub.messages import logger
from hethub.predictor import Prediction
from hethub.predictor.memory import fits
from hethub.predictor.profiled import missing_profiles
from hethub.profiles.files import load_profiles
from hethub.profiles.machine import default_profiles_dir
from hethub.profiles.selection import Profiles, all_cpu, select_for_run
from hethub.report.terminal import plural, render_table
from hethub.spec import ClusterSpec, ModelSpec, Plan
from hethub.spec.parameters import parameter_count
from hethub.spec.schedules import Schedule

PROFILES_HELP = (
    "price with the measured profiles in DIR (hethub profile), under the run conditions of the "
    "runtime: the plan's precision as dtype, 1 thread per rank, and as many ranks computing "
    "at once as the {what} has devices when every group's accelerator is a CPU (a local run: "
    "all ranks share this machine), else 1; "
    "what DIR lacks is priced by the analytic model, with a note on stderr"
)


def read_profiles(directory: str | None, cluster: ClusterSpec, devices: int) -> Profiles | None:
    """The profiles of ``directory`` (None: none given) selected for a runtime job of ``devices``
    devices on ``cluster`` (hethub.profiles.select_for_run); predict() and search() look them up
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
        logger(command).info(f"note: {note}")
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
            f"measure it with hethub profile --model M and add --profiles {default_profiles_dir()}"
        )
    unmeasured = sorted(
        {g.accelerator.name for g in cluster.groups if "gemm" in g.accelerator.efficiency.inherited}
    )
    caveat = (
        f"; {', '.join(unmeasured)} {'has' if len(unmeasured) == 1 else 'have'} no GEMM "
        f"benchmark of its own: its vendor's default figures (hethub catalog marks them *)"
        if unmeasured
        else ""
    )
    return (
        "the analytic model, at each device's microbenchmarked efficiency (hethub catalog): "
        "2.3% mean error on Megatron-LM's published A100 table, which it was never fitted on "
        "(benchmarks/predictor_accuracy.py); other accelerators are not checked against "
        f"measured steps{caveat}"
    )


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


STAGE_COLUMNS = (
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
    "memory / usable GB",
)


def _stage_table(
    prediction: Prediction, plan: Plan, cluster: ClusterSpec, per_stage: bool
) -> tuple[list[str], list[list[str]]]:
    """describe's table: a row per stage (``per_stage``: with each stage's recomputation)."""
    header = list(STAGE_COLUMNS)
    if per_stage:
        header.insert(header.index("micro-batches"), "recompute")
    rows = []
    for s in prediction.stages:
        layout = plan.pipelines[s.pipeline]
        device = cluster.group(s.group).accelerator
        flag = "" if fits(s.memory, device) else "  OVER"
        pipeline, position, layers = plan.stage_names(s.pipeline, s.position)
        row = [
            pipeline,
            position,
            s.group,
            s.accelerator,
            str(s.tp),
            layers,
            str(layout.micro_batches),
            f"{s.forward_s * 1e3:.2f}",
            f"{s.backward_s * 1e3:.2f}",
            f"{s.compute_s:.3f}",
            f"{s.grad_sync_s * 1e3:.1f}",
            f"{s.memory.total_gb:.1f} / {device.usable_memory_gb:.1f}{flag}",
        ]
        if per_stage:
            row.insert(header.index("recompute"), str(layout.stages[s.position].recompute))
        rows.append(row)
    return header, rows


def describe(
    prediction: Prediction,
    plan: Plan,
    cluster: ClusterSpec,
    model: ModelSpec,
    source: str,
    basis: str,
) -> str:
    """A readable summary: one row per stage, then the step as a whole."""
    # A column of each stage's recomputation where a stage sets its own (the plan's otherwise,
    # on the line above the table).
    per_stage = {s.recompute for p in plan.pipelines for s in p.stages} != {plan.recompute}
    header, rows = _stage_table(prediction, plan, cluster, per_stage)
    p = prediction
    params = parameter_count(model)
    size = (
        f"{params / 1e9:.2f}B" if params >= 1e9 else f"{params / 1e6:.1f}M"
    )  # local models are millions
    lines = [
        (
            f"model {model.name} ({size} parameters), plan {source}: "
            f"global batch {plan.global_batch} x {model.seq_len} tokens, "
            f"{plan.precision}, micro-batch {plan.micro_batch}, "
            f"recompute {'per stage' if per_stage else plan.recompute}, {schedule_text(plan)}, "
            f"{plural(p.devices, 'device')}"
        ),
        "",
        render_table(header, rows),
        "",
        f"iteration time       {p.iteration_time_s:.4f} s",
        f"throughput           {p.tokens_per_s:,.0f} tokens/s",
        (
            f"model TFLOP/s/device {p.model_tflops_per_device:.1f} (MFU {100 * p.mfu:.1f}% of "
            f"the plan's mean {p.precision} peak {p.mean_peak_tflops:.4g})"
        ),
        f"pipeline bubble      {100 * p.bubble_fraction:.1f}%",
        f"peak memory          {p.peak_memory_gb:.1f} GB per device",
        "fits in memory       "
        + ("yes" if p.fits else "NO: a stage needs more memory than its device has"),
        f"priced by            {basis}",
    ]
    return "\n".join(lines)
