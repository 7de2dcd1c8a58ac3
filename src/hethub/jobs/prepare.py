"""Preparing and launching a training job, shared by `hethub train` and `hethub validate`.

Before any process starts: the inputs are checked (flags, cluster, plan, model, data, the folders
the job writes), a plan is made when none is given (the planner, on this machine's profiles), the
prediction is made (from this machine's profiles when every group runs on this machine's CPU,
else the analytic model), a job launched here passes the pre-flight check (hethub.jobs.preflight:
this machine's memory and cores), and the run directory is written. Then torchrun starts one
worker per device of the plan, and each worker reads the plan from the run directory
(hethub.runtime.worker), never from the planner.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import yaml

from hethub.errors import HethubError
from hethub.jobs import preflight
from hethub.jobs.inputs import (
    check_data,
    check_eval_data,
    check_folder,
    check_profiles_folder,
    check_recipe,
    check_run_dir,
    make_run_dir,
    run_state,
)
from hethub.messages import logger
from hethub.predictor import Prediction, predict
from hethub.predictor.traffic import predicted_traffic
from hethub.profiles.files import load_profiles
from hethub.profiles.provenance import provenance
from hethub.profiles.selection import Profiles, all_cpu, local_concurrency, select_for_run
from hethub.runtime.lr_schedule import default_min_lr, default_warmup_steps
from hethub.runtime.rundir import DEFAULT_SETTINGS, RunDir, RunSettings, new_run_dir
from hethub.spec import (
    ClusterSpec,
    ModelSpec,
    Plan,
    check_plan,
    load_cluster,
    load_model,
    load_plan,
)
from hethub.spec.model import model_file_fields, preset_names
from hethub.spec.plan import DEFAULT_PRECISION, Precision

DEFAULT_MODEL = "local-llama"
DEFAULT_GLOBAL_BATCH = 16
"""The plans' default; a plan made here for this machine's CPU may differ (planned_precision)."""


def builtin_cluster() -> Path:
    """The two-kind local cluster `hethub train` uses when given no cluster (also in examples/)."""
    return Path(str(resources.files("hethub.data").joinpath("clusters", "local-hetero.yaml")))


@dataclass(frozen=True, kw_only=True, slots=True)
class Job:
    """A checked, prepared training job: what the workers will run, and what it should take."""

    run: RunDir
    settings: RunSettings
    cluster: ClusterSpec
    plan: Plan
    model: ModelSpec
    prediction: Prediction
    basis: str
    """What the prediction rests on, in words."""
    resume_from: int | None
    """The checkpoint step a resumed job continues from (None: a new run)."""

    @property
    def emulated(self) -> bool:
        return self.cluster.emulated


def prepare(
    args: argparse.Namespace,
    *,
    measure: bool = True,
    write: bool = True,
    local_launch: bool = True,
    say=None,
) -> Job:
    """Check the inputs, plan if needed, predict, and write the run directory (when ``write``).
    ``measure``: profile this machine for what the profiles lack (never under torchrun).
    ``local_launch``: every process of the job will start on this machine (hethub train or
    validate outside torchrun; False under torchrun): the pre-flight check refuses a job this
    machine cannot hold (hethub.jobs.preflight), or with --force warns."""
    if args.resume:
        return _prepare_resume(args, measure, write, local_launch, say)
    cluster_path = Path(args.cluster) if args.cluster else builtin_cluster()
    if args.plan and not args.cluster:
        raise HethubError("--plan needs --cluster: a plan names the groups of a cluster file")
    cluster = load_cluster(cluster_path)
    settings = _settings(args, DEFAULT_SETTINGS)
    name = Path(args.plan).stem if args.plan else cluster_path.stem
    check_run_dir(args, Path("runs") / name, write)
    check_profiles_folder(args, cluster, measure)
    plan, model, profiles, basis = _plan_and_profiles(
        args, cluster, settings, measure=measure, local_launch=local_launch, say=say
    )
    prediction = predict(plan, cluster, model, profiles=profiles, timeline=True)
    _check_launch(args, plan, cluster, prediction, local_launch, say)
    if write:  # every check passed: only now is the run directory made
        run = make_run_dir(args.run_dir) if args.run_dir else new_run_dir(Path("runs"), name)
        run.write_text(run.cluster, cluster_path.read_text())
        write_plan(run, plan, model)
        run.write_settings(settings)
        _write_prediction(run, prediction, basis, plan, cluster, model, profiles=profiles)
    else:
        run = RunDir(args.run_dir or Path("runs") / name)
    return Job(
        run=run,
        settings=settings,
        cluster=cluster,
        plan=plan,
        model=model,
        prediction=prediction,
        basis=basis,
        resume_from=None,
    )


def _plan_and_profiles(
    args: argparse.Namespace,
    cluster: ClusterSpec,
    settings: RunSettings,
    *,
    measure: bool,
    local_launch: bool,
    say,
) -> tuple[Plan, ModelSpec, Profiles | None, str]:
    """The plan (the plan file's, checked against the cluster, else the one the planner finds),
    its model, checked against the data, and the profiles to price it by (measured first where
    missing and ``measure``)."""
    if args.plan:
        plan = load_plan(args.plan)
        model = load_model(
            plan.model,
            relative_to=Path(args.plan).parent,
            source=args.plan,
            seq_len=settings.seq_len,
        )
        check_plan(plan, cluster, model, args.plan)
        check_data(settings, model, plan.global_batch)  # bad data stops before anything is measured
        check_eval_data(settings, model, plan.global_batch)
        _check_before_measuring(
            args, cluster, model, plan, measure=measure, local_launch=local_launch
        )
        profiles, basis = _profiles(args, cluster, model, plan, measure=measure, say=say)
        return plan, model, profiles, basis
    model = load_model(args.model or DEFAULT_MODEL, source="--model", seq_len=settings.seq_len)
    global_batch = args.global_batch or DEFAULT_GLOBAL_BATCH
    check_data(settings, model, global_batch)
    check_eval_data(settings, model, global_batch)
    precision = planned_precision(cluster)
    _check_before_measuring(
        args,
        cluster,
        model,
        None,
        measure=measure,
        local_launch=local_launch,
        precision=precision,
    )
    if say and precision is not DEFAULT_PRECISION:
        say(f"precision {precision}, not {DEFAULT_PRECISION}: {NO_BF16_KERNELS}")
    profiles, basis = _profiles(
        args, cluster, model, None, measure=measure, say=say, precision=precision
    )
    plan = _plan(
        cluster,
        model,
        global_batch,
        model_ref=args.model or DEFAULT_MODEL,
        profiles=profiles,
        say=say,
        precision=precision,
    )
    return plan, model, profiles, basis


def _prepare_resume(
    args: argparse.Namespace, measure: bool, write: bool, local_launch: bool, say
) -> Job:
    """--resume RUN_DIR: from its latest complete checkpoint; a run that stopped before its
    first checkpoint starts again from step 0, under its settings and the flags given."""
    run = RunDir(args.resume)
    if write and run.path.is_dir():  # it goes on writing there: checked before any measuring
        check_folder(run.path, f"--resume = {args.resume!r}")
    # The host that starts every process verifies the checkpoints, once, and moves damaged ones
    # aside; under torchrun the workers' rank 0 does (hethub.runtime.worker).
    verify = local_launch and write
    settings, done = run_state(run, verify_with=(say or _say_train) if verify else None)
    if done is None:
        _check_restartable(args, run)
        if say:
            say(f"no complete checkpoint in {run.checkpoints}: the run starts again from step 0")
    else:
        _check_continues(args, settings, done)
    settings = _settings(args, settings)
    cluster_path = Path(args.cluster) if args.cluster else run.cluster
    cluster = load_cluster(cluster_path)
    plan_path = Path(args.plan) if args.plan else run.plan
    plan = load_plan(plan_path)
    model = load_model(
        plan.model, relative_to=plan_path.parent, source=str(plan_path), seq_len=settings.seq_len
    )
    check_plan(plan, cluster, model, str(plan_path))
    check_data(settings, model, plan.global_batch)
    check_eval_data(settings, model, plan.global_batch)
    check_profiles_folder(args, cluster, measure)
    _check_before_measuring(args, cluster, model, plan, measure=measure, local_launch=local_launch)
    profiles, basis = _profiles(args, cluster, model, plan, measure=measure, say=say)
    prediction = predict(plan, cluster, model, profiles=profiles, timeline=True)
    _check_launch(args, plan, cluster, prediction, local_launch, say)
    if write:
        if done is None:  # started again: the steps the stopped attempt logged are not this run's
            run.keep_metrics_until(0)
        if not run.plan.is_file() or plan != load_plan(run.plan):
            if done is not None and run.plan.is_file():
                # resumed under another plan: keep the one it trained under so far
                run.plan.rename(run.path / f"plan.before-step-{done}.yaml")
            write_plan(run, plan, model)
        if cluster_path != run.cluster:
            run.write_text(run.cluster, cluster_path.read_text())
        run.write_settings(settings)
        _write_prediction(run, prediction, basis, plan, cluster, model, profiles=profiles)
    return Job(
        run=run,
        settings=settings,
        cluster=cluster,
        plan=plan,
        model=model,
        prediction=prediction,
        basis=basis,
        resume_from=done,
    )


def _say_train(message: str) -> None:
    logger("train").info(message)


def _check_continues(args: argparse.Namespace, settings: RunSettings, done: int) -> None:
    """A run resumed from a checkpoint keeps what its losses depend on, and trains further."""
    for flag, value in (("seed", args.seed), ("lr", args.lr)):
        if value is not None and value != getattr(settings, flag):
            raise HethubError(
                f"--{flag} = {value}: the run was trained with {getattr(settings, flag)}; "
                f"a resumed run keeps its seed and learning rate so that it continues exactly"
            )
    if args.data and _absolute_data(args.data) != settings.data:
        raise HethubError(
            f"--data = {args.data!r}: the run was trained on "
            f"{settings.data or 'the built-in corpus'}"
        )
    seq_len = _flag(args, "seq_len")
    if seq_len is not None and seq_len != settings.seq_len:
        trained = settings.seq_len or "the model's own"
        raise HethubError(
            f"--seq-len = {seq_len}: the run was trained at {trained}; a resumed run keeps its "
            f"sequence length"
        )
    init_from = _flag(args, "init_from")
    if init_from and str(Path(init_from).resolve()) != settings.init_from:
        raise HethubError(
            f"--init-from = {init_from!r}: the run started from "
            f"{settings.init_from or 'its seeded initialisation'} and goes on from its "
            f"checkpoint at step {done}"
        )
    if _given(args.steps, settings.steps) <= done:
        raise HethubError(
            f"--resume = {args.resume!r}: the run is at step {done} already; "
            f"give --steps above {done}"
        )


def _check_restartable(args: argparse.Namespace, run: RunDir) -> None:
    """A run started again from step 0 needs its cluster and plan (from its folder, or given)."""
    for path, flag in ((run.cluster, args.cluster), (run.plan, args.plan)):
        if not flag and not path.is_file():
            raise HethubError(
                f"--resume = {args.resume!r}: no complete checkpoint in {run.checkpoints}, and no "
                f"{path.name} to start the run again from step 0; give --cluster and --plan, or "
                f"remove the folder: rm -r {shlex.quote(args.resume)}"
            )


def _settings(args: argparse.Namespace, base: RunSettings) -> RunSettings:
    """``base`` with the flags given in its place; the warm-up and the floor of the rate, where
    neither gives them, worked out from the run's steps and rate (runtime.lr_schedule) and
    recorded as numbers."""
    lr, steps = _given(args.lr, base.lr), _given(args.steps, base.steps)
    warmup = base.warmup_steps if base.warmup_steps is not None else default_warmup_steps(steps)
    min_lr = base.min_lr if base.min_lr is not None else default_min_lr(lr)
    init_from, eval_data = _flag(args, "init_from"), _flag(args, "eval_data")
    settings = RunSettings(
        seed=_given(args.seed, base.seed),
        lr=lr,
        data=_absolute_data(args.data) if args.data else base.data,
        steps=steps,
        checkpoint_every=_given(args.checkpoint_every, base.checkpoint_every),
        timeout_s=_given(args.timeout, base.timeout_s),
        keep_checkpoints=_given(args.keep_checkpoints, base.keep_checkpoints),
        weight_decay=_given(_flag(args, "weight_decay"), base.weight_decay),
        warmup_steps=_given(_flag(args, "warmup_steps"), warmup),
        lr_schedule=_given(_flag(args, "lr_schedule"), base.lr_schedule),
        min_lr=_given(_flag(args, "min_lr"), min_lr),
        clip_grad=_given(_flag(args, "clip_grad"), base.clip_grad),
        init_from=str(Path(init_from).resolve()) if init_from else base.init_from,
        seq_len=_given(_flag(args, "seq_len"), base.seq_len),
        eval_data=_absolute_data(eval_data) if eval_data else base.eval_data,
        eval_every=_given(_flag(args, "eval_every"), base.eval_every),
        trace_every=_given(_flag(args, "trace_every"), base.trace_every),
        eval_sequences=_given(_flag(args, "eval_sequences"), base.eval_sequences),
    )
    check_recipe(settings)
    return settings


def _flag(args: argparse.Namespace, name: str):
    """A flag of the recipe or of evaluation, None where not given (or where the command has
    no such flag)."""
    return getattr(args, name, None)


def _absolute_data(spec: str) -> str:
    """--data or --eval-data with its paths absolute (each part's, in a blend): a resume reads
    it from anywhere."""
    from hethub.corpus import absolute_spec

    return absolute_spec(spec, Path.cwd())


def _forced(args: argparse.Namespace) -> bool:
    """--force given (hethub validate's namespace has no such flag: never forced there)."""
    return bool(getattr(args, "force", False))


def planned_precision(cluster: ClusterSpec) -> Precision:
    """The precision of a plan made here (no --plan): the plans' default, bf16, unless every
    device is this machine's CPU and torch has no bf16 kernels for it (NO_BF16_KERNELS): then
    fp32, so that the profiles, the plan and the run are all fp32. A --plan's precision is
    always kept (and profiled as it is)."""
    if not all_cpu(cluster):
        return DEFAULT_PRECISION
    from hethub.runtime.precision import cpu_has_bf16_kernels  # torch: only for a CPU cluster

    return DEFAULT_PRECISION if cpu_has_bf16_kernels() else Precision.FP32


NO_BF16_KERNELS = (
    "torch has no bf16 kernels for this CPU (on x86 they need AVX-512 or AMX), and bf16 would "
    "train several times slower here"
)


def _check_before_measuring(
    args: argparse.Namespace,
    cluster: ClusterSpec,
    model: ModelSpec,
    plan: Plan | None,
    *,
    measure: bool,
    local_launch: bool,
    precision: Precision = DEFAULT_PRECISION,
) -> None:
    """Profiling this machine for a CPU cluster starts as many processes as the job and takes
    minutes: what the pre-flight would refuse is refused before it, on the analytic prediction of
    the plan (no plan yet: on what every plan of the model in ``precision`` needs). With --force
    it is left to the pre-flight proper, which warns."""
    if not (local_launch and measure and all_cpu(cluster)) or _forced(args):
        return
    machine = preflight.this_machine()
    if plan is None:
        found = preflight.unplanned_excesses(cluster, model, precision, machine)
    else:
        found = preflight.launch_excesses(plan, cluster, predict(plan, cluster, model), machine)
    preflight.refuse_or_warn(found, force=False, warn=_warn)


def _check_launch(
    args: argparse.Namespace,
    plan: Plan,
    cluster: ClusterSpec,
    prediction: Prediction,
    local_launch: bool,
    say,
) -> None:
    """The pre-flight check of a job launched on this machine."""
    if local_launch:
        preflight.refuse_or_warn(
            preflight.launch_excesses(plan, cluster, prediction, preflight.this_machine()),
            force=_forced(args),
            warn=say or _warn,
        )


def _warn(message: str) -> None:
    logger().warning(message)


def plan_devices(plan: Plan) -> int:
    return sum(p.count * p.devices for p in plan.pipelines)


def _given(value, default):
    return default if value is None else value


@dataclass(frozen=True)
class LocalMeasurements:
    """What a local job measures on this machine's CPU (hethub train and validate, and what a
    bare hethub profile measures for them)."""

    tps: tuple[int, ...]
    micro_batches: tuple[int, ...]
    together: int
    """Ranks computing at once: the job's (profiles.selection.local_concurrency)."""
    alone: tuple[int, ...]
    """TP degrees also measured as one TP group alone, where the job's ranks outnumber the
    cores (predictor.sharing prices a shared machine from both)."""


def local_measurements(
    cluster: ClusterSpec, model: ModelSpec, plan: Plan | None, cores: int
) -> LocalMeasurements:
    """A plan's TP degrees and micro-batch, or without one everything the planner will try (its
    TP degrees for the cluster's groups and its micro-batch sizes), on ``cores`` cores."""
    from hethub.planner.candidates import tp_degrees
    from hethub.planner.search import MICRO_BATCH_SIZES

    if plan:
        tps = tuple(sorted({s.tp for p in plan.pipelines for s in p.stages}))
        micro = (plan.micro_batch,)
    else:
        tps = tuple(sorted({t for g in cluster.groups for t in tp_degrees(g, model)}))
        micro = tuple(MICRO_BATCH_SIZES)
    together = local_concurrency(cluster, plan_devices(plan) if plan else cluster.devices)
    return LocalMeasurements(tps, micro, together, tps if together > cores else ())


def _profiles(
    args: argparse.Namespace,
    cluster: ClusterSpec,
    model: ModelSpec,
    plan: Plan | None,
    *,
    measure: bool,
    say,
    precision: Precision = DEFAULT_PRECISION,
) -> tuple[Profiles | None, str]:
    """This machine's profiles for the job (measured first where missing), or None: the
    analytic model. ``precision``: the plan's to be made, when there is no plan."""
    folder = Path(args.profiles)
    dtype = (plan.precision if plan else precision).value  # what the run will train in
    if not all_cpu(cluster):
        return None, "the analytic model (the cluster's accelerators are not this machine's CPU)"
    devices = plan_devices(plan) if plan else cluster.devices
    if measure:
        # torch: only when measuring
        from hethub.profiler.conditions import available_cores
        from hethub.profiler.ensure import ProfileRequest, ensure_profiles

        given = getattr(args, "repeats", None)  # hethub validate --repeats
        repeats = {"repeats": given, "link_repeats": given} if given else {}
        wanted = local_measurements(cluster, model, plan, available_cores())
        for device in sorted({g.accelerator.name for g in cluster.groups}):
            request = ProfileRequest(
                model=model,
                device_name=device,
                tps=wanted.tps,
                micro_batches=wanted.micro_batches,
                threads=1,
                concurrent_ranks=wanted.together,
                dtype=dtype,
            )
            ensure_profiles(folder, request, progress=say, **repeats)
            for tp in wanted.alone:
                alone = dataclasses.replace(request, tps=[tp], concurrent_ranks=tp)
                ensure_profiles(folder, alone, links=False, progress=say, **repeats)
    elif not folder.is_dir():
        return None, f"the analytic model (no profiles in {folder})"
    return select_for_run(
        load_profiles(folder), cluster, devices
    ), f"this machine's profiles in {folder}"  # predict() looks them up in the plan's precision


def _plan(
    cluster: ClusterSpec,
    model: ModelSpec,
    global_batch: int,
    *,
    model_ref: str,
    profiles: Profiles | None,
    say,
    precision: Precision,
) -> Plan:
    from hethub.planner import search

    if say:
        say(f"planning {model.name} on the cluster, global batch {global_batch}")
    result = search(
        cluster,
        model,
        global_batch,
        model_ref=model_ref.lower()
        if model_ref.lower() in preset_names()
        else str(Path(model_ref).resolve()),
        profiles=profiles,
        precision=precision,
    )
    if result.best is None:
        raise HethubError(
            f"no plan fits {model.name} at global batch {global_batch} on the cluster"
        )
    return result.best.plan


def write_plan(run: RunDir, plan: Plan, model: ModelSpec) -> None:
    """plan.yaml in a run folder (or `hethub launch`'s), with its model beside it (model.yaml)
    unless it is a preset."""
    for name, text in plan_files(plan, model).items():
        run.write_text(run.path / name, text)


def plan_files(plan: Plan, model: ModelSpec) -> dict[str, str]:
    """The texts of plan.yaml and, unless its model is a preset, of model.yaml beside it, which
    the plan then names."""
    if plan.model.lower() in preset_names():
        return {"plan.yaml": plan.to_yaml()}
    model_text = yaml.safe_dump(model_file_fields(model), sort_keys=False)
    return {
        "model.yaml": model_text,
        "plan.yaml": dataclasses.replace(plan, model="model.yaml").to_yaml(),
    }


def _write_prediction(
    run: RunDir,
    prediction: Prediction,
    basis: str,
    plan: Plan,
    cluster: ClusterSpec,
    model: ModelSpec,
    *,
    profiles: Profiles | None,
) -> None:
    """prediction.json: the prediction of ``plan``, a step's bytes on each path
    (predictor.traffic), what it rests on (``basis``, and the ``profiles``' provenance: where and
    when they were measured, hethub.profiles.provenance) and its timeline."""
    emulated = cluster.emulated
    run.write_json(
        run.prediction,
        {
            **prediction.to_json(),
            **predicted_traffic(plan, cluster, model),
            "basis": basis,
            "emulated": emulated,
            "profiles": provenance(plan, cluster, model, profiles),
            "timeline": [event.to_dict() for event in prediction.timeline],
        },
    )
