"""`hethub launch`: write what starts a plan on a cluster of unlike nodes: a Slurm heterogeneous
job (one component per group), a Kubernetes JobSet (one replicated job per group) and one script
per node for a cluster without a scheduler. The plan is the plan file, or what `hethub train`
would plan (hethub.jobs.prepare)."""

from __future__ import annotations

import argparse
from pathlib import Path

from hethub.cli.agent import DEFAULT_MAX_RESTARTS
from hethub.cli.args import add_job_arguments, non_negative_int, positive_int
from hethub.errors import HethubError
from hethub.jobs import prepare
from hethub.jobs.prepare import builtin_cluster, plan_files
from hethub.launchers import Launch, agent_nodes, host_scripts, jobset_manifest, slurm_script
from hethub.launchers.environment import group_environment
from hethub.launchers.jobset import FILES_MOUNT, JobSetJob
from hethub.launchers.slurm import DEFAULT_SIGNAL_S, SlurmJob
from hethub.profiles.selection import all_cpu
from hethub.runtime.rundir import DEFAULT_SETTINGS
from hethub.spec.cluster import ClusterSpec, SlurmSettings, load_cluster
from hethub.spec.topology import build_topology

DEFAULT_PORT = 29500
"""The rendezvous port on the first node: torchrun's own default."""
TRAIN_FLAGS = ("steps", "seed", "lr", "checkpoint_every", "keep_checkpoints", "timeout")
"""`hethub train`'s flags that a launch passes on to a new run, as given."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "launch",
        help="write a Slurm heterogeneous job, a Kubernetes JobSet, or per-host scripts, that "
        "train a plan",
        description="slurm: write OUT/job.sbatch, a Slurm heterogeneous job with one component "
        "per group. jobset: write OUT/jobset.yaml, a Kubernetes JobSet with one replicated job "
        "per group, and the ConfigMap of the cluster and plan files. hosts: write "
        "OUT/GROUP-INDEX.sh, one script per node, for a cluster without a scheduler. Each way "
        "each node runs one torchrun agent, whose workers are "
        "`hethub train --this-node GROUP:INDEX`; the plan is --plan, or the one hethub train "
        "would make (written to OUT/plan.yaml).",
    )
    parser.add_argument("form", choices=("slurm", "jobset", "hosts"), help="what to write")
    add_job_arguments(parser)
    parser.add_argument("--out", default="launch", help="folder to write into (default launch)")
    parser.add_argument(
        "--max-restarts",
        type=non_negative_int,
        default=DEFAULT_MAX_RESTARTS,
        help=f"the agents restart the workers this many times (default {DEFAULT_MAX_RESTARTS})",
    )
    parser.add_argument(
        "--port",
        type=positive_int,
        default=DEFAULT_PORT,
        help=f"rendezvous port on the first node (default {DEFAULT_PORT})",
    )
    parser.add_argument(
        "--rendezvous",
        metavar="HOST",
        help="hosts: the first node's host name or address, where the agents meet (default: "
        "its host in the cluster file's hosts)",
    )
    parser.add_argument(
        "--python",
        default="python3",
        help="Python with hethub and torch on the nodes of the groups whose launch: section "
        "names none (default python3)",
    )
    for field, what in (
        ("partition", "Slurm partition"),
        ("constraint", "Slurm node features (--constraint)"),
        ("account", "Slurm account"),
        ("time", "Slurm time limit (e.g. 24:00:00)"),
    ):
        parser.add_argument(f"--{field}", help=f"{what} of the groups whose slurm: lacks it")
    parser.add_argument(
        "--cpus-per-node",
        type=positive_int,
        help="CPUs per node of the groups whose slurm: lacks it (default: one per device)",
    )
    parser.add_argument(
        "--signal-seconds",
        type=positive_int,
        default=DEFAULT_SIGNAL_S,
        help="SIGTERM this long before the time limit: the workers checkpoint and stop "
        f"(default {DEFAULT_SIGNAL_S})",
    )
    parser.add_argument(
        "--image", help="jobset: container image of the groups whose kubernetes: lacks one"
    )
    parser.add_argument(
        "--volume-claim",
        metavar="CLAIM",
        help="jobset: the PersistentVolumeClaim (ReadWriteMany) that holds the run folder; "
        "every pod mounts it at --run-dir",
    )
    parser.set_defaults(run=run, resume=None)


def run(args: argparse.Namespace) -> int:
    if not args.run_dir:
        raise HethubError("--run-dir is needed: the run folder, on storage every node sees")
    if args.form == "jobset":
        _check_jobset_flags(args)
    cluster_file = Path(args.cluster).resolve() if args.cluster else builtin_cluster()
    _check_real_accelerators(args, cluster_file)
    job = prepare(args, measure=False, write=False, local_launch=False)
    out = Path(args.out).resolve()
    # Every form carries its own copies of the files: the plan as parsed, with its model's file
    # where it is no preset (as a run folder's), and the cluster file as written. A JobSet's pods
    # read them from its ConfigMap, and the run folder where the claim is mounted; the other
    # forms read the copies beside the script, on storage every node shares.
    carried = {"cluster.yaml": _read(cluster_file), **plan_files(job.plan, job.model)}
    in_pods = args.form == "jobset"
    folder = FILES_MOUNT if in_pods else str(out)
    launch = Launch(
        name=f"hethub-{Path(args.run_dir).name}",
        cluster_file=f"{folder}/cluster.yaml",
        plan_file=f"{folder}/plan.yaml",
        run_dir=args.run_dir if in_pods else str(Path(args.run_dir).resolve()),
        train_flags=_train_flags(args),
        environments={g.name: group_environment(g, args.python) for g in job.cluster.groups},
        port=args.port,
        max_restarts=args.max_restarts,
        nodes=agent_nodes(build_topology(job.plan, job.cluster), job.cluster),
    )
    if args.form == "slurm":
        files = {"job.sbatch": _slurm(args, launch, job.cluster)}
    elif args.form == "jobset":
        files = {"jobset.yaml": _jobset(args, launch, job.cluster, carried)}
    else:
        files = host_scripts(launch, f"{_rendezvous_host(args, job.cluster, launch)}:{args.port}")
    _write(out, carried, files)  # once every check has passed
    written = ", ".join(str(out / name) for name in files)
    if args.form == "slurm":
        print(f"wrote {written}; submit it with: sbatch {out / 'job.sbatch'}")
    elif args.form == "jobset":
        print(f"wrote {written}; apply it with: kubectl apply -f {out / 'jobset.yaml'}")
    else:
        print(f"wrote {written}; run each on its node (bash FILE)")
    return 0


def _check_real_accelerators(args: argparse.Namespace, cluster_file: Path) -> None:
    """A cluster of real accelerators trains what the user means, never hethub's defaults (the
    local demo model on the standard library's documentation for 90 steps): it needs the model
    (--model, or the plan's), the data and the steps. A cluster of CPUs only (a local stand-in)
    keeps the defaults."""
    if all_cpu(load_cluster(cluster_file)):
        return
    missing = [
        flag
        for flag, given in (
            ("--model (or --plan)", args.model or args.plan),
            ("--data", args.data),
            ("--steps", args.steps),
        )
        if not given
    ]
    if missing:
        raise HethubError(
            f"{cluster_file.name}: a cluster of real accelerators needs {', '.join(missing)}: "
            "a launch there trains no default model, corpus or length"
        )


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError as error:
        raise HethubError(f"cannot read {path}: {error.strerror or error}") from None


def _write(out: Path, carried: dict[str, str], scripts: dict[str, str]) -> None:
    """The launch's folder: the files every node reads (cluster.yaml, plan.yaml, model.yaml),
    then the scripts, executable. A place that cannot be written is one line."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        for name, text in carried.items():
            (out / name).write_text(text)
        for name, text in scripts.items():
            (out / name).write_text(text)
            (out / name).chmod(0o755)
    except OSError as error:
        where = error.filename or out
        raise HethubError(
            f"--out = {str(out)!r}: cannot write {where}: {error.strerror or error}; give a "
            "folder you can write, on storage every node sees"
        ) from None


def _slurm(args: argparse.Namespace, launch: Launch, cluster: ClusterSpec) -> str:
    defaults = SlurmSettings(
        partition=args.partition,
        constraint=args.constraint,
        account=args.account,
        time=args.time,
        cpus_per_node=args.cpus_per_node,
    )
    return slurm_script(launch, cluster, SlurmJob(defaults=defaults, signal_s=args.signal_seconds))


def _check_jobset_flags(args: argparse.Namespace) -> None:
    if not args.volume_claim:
        raise HethubError(
            "jobset: --volume-claim is needed: the claim of ReadWriteMany storage that holds the "
            "run folder, which every pod mounts at --run-dir"
        )
    if not Path(args.run_dir).is_absolute() or not Path(args.run_dir).name:
        raise HethubError(
            f"jobset: --run-dir = {args.run_dir!r}: give the absolute path where every pod "
            "mounts the run's folder of the volume claim (e.g. /runs/llama)"
        )


def _jobset(
    args: argparse.Namespace, launch: Launch, cluster: ClusterSpec, files: dict[str, str]
) -> str:
    job = JobSetJob(image=args.image, volume_claim=args.volume_claim, grace_s=args.signal_seconds)
    return jobset_manifest(launch, cluster, job, files)


def _rendezvous_host(args: argparse.Namespace, cluster: ClusterSpec, launch: Launch) -> str:
    """Where the per-host scripts' agents meet: --rendezvous, else the first node's host."""
    if args.rendezvous:
        return args.rendezvous
    first = launch.nodes[0]
    hosts = cluster.group(first.group).hosts
    if hosts is None:
        raise HethubError(
            f"no address for the rendezvous on node {first.group}:"
            f"{first.node}: give --rendezvous HOST, or hosts: in group {first.group} of the "
            f"cluster file"
        )
    return hosts[first.node]


def _train_flags(args: argparse.Namespace) -> tuple[str, ...]:
    flags: list[str] = []
    if args.steps is None:  # said, not left to the workers' default: the script shows its length
        flags += ["--steps", str(DEFAULT_SETTINGS.steps)]
    for name in TRAIN_FLAGS:
        value = getattr(args, name)
        if value is not None:
            flags += [f"--{name.replace('_', '-')}", str(value)]
    if args.data:
        flags += ["--data", str(Path(args.data).resolve())]
    if args.json:
        flags.append("--json")
    return tuple(flags)
