"""`hethub profile`: measure this machine's per-layer costs and link speeds for a model, and write
them as profile files that `hethub predict`, `plan` and `validate` read (--profiles DIR)."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from hethub.cli.args import node, positive_int, timeout_seconds
from hethub.errors import HethubError
from hethub.jobs.prepare import (
    DEFAULT_MODEL,
    builtin_cluster,
    local_measurements,
    planned_precision,
)
from hethub.messages import logger
from hethub.planner.search import MICRO_BATCH_SIZES
from hethub.profiles.files import load_profiles, profile_path, to_json
from hethub.profiles.machine import PROFILES_ENV, default_profiles_dir
from hethub.profiles.selection import Profiles
from hethub.profiles.types import LayerProfile, LinkProfile
from hethub.report.terminal import plural, render_table
from hethub.spec import load_cluster, load_model
from hethub.spec.plan import DEFAULT_PRECISION, PRECISIONS

DEFAULT_CLUSTER_TIMEOUT_S = 600.0
"""--timeout with --cluster: every wait of the distributed profiler, the longest of which is a
node waiting for the slowest kind's measurement."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "profile",
        help="measure per-layer time and memory and link speeds on this machine",
        description="Measure, on this machine's CPU (or its GPU: --device), with the runtime's "
        "own modules in --dtype, the forward and backward time and memory of one layer, the "
        "embedding and the head, and the optimizer, for each TP degree and micro-batch size; and, "
        "on a CPU, the point-to-point, all-reduce, broadcast and all-gather speed between local "
        "processes. One profile file per key (device, layer shape, dtype, threads, ranks at once, "
        "TP, micro-batch); what the directory holds already is kept unless --again.",
    )
    _add_what_to_measure(parser)
    _add_where_it_goes(parser)
    parser.set_defaults(run=run)


def _add_what_to_measure(parser: argparse.ArgumentParser) -> None:
    """The flags that say what is measured: the model, TP degrees, micro-batches, threads,
    ranks at once, the device, the dtype and the repeats."""
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"preset name, model YAML or HuggingFace model folder (default {DEFAULT_MODEL}, "
        "as hethub train's)",
    )
    parser.add_argument(
        "--tp",
        help="TP degrees, comma-separated (default: those hethub train with no plan may use); "
        "TP > 1 is measured in a real process group of that many ranks",
    )
    parser.add_argument(
        "--micro-batch",
        help="micro-batch sizes, comma-separated (default: those the planner tries, "
        f"{','.join(map(str, MICRO_BATCH_SIZES))})",
    )
    parser.add_argument(
        "--threads", default="1", help="torch threads per rank (default 1, as the runtime)"
    )
    parser.add_argument(
        "--concurrent-ranks",
        help="ranks computing at once on this machine, comma-separated: profile a local run of N "
        "processes with N, as they share the cores; at least the TP degree (default: as many "
        "as hethub train with no plan runs, and each TP group alone where they outnumber the "
        "cores)",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="the accelerator name the profiles are for, as cluster files name it (default cpu); "
        "a catalog NVIDIA or AMD accelerator (e.g. h200) is measured on this machine's CUDA or "
        "ROCm GPU, one rank alone (--tp 1, --concurrent-ranks 1), without links; any other "
        "name on its CPU",
    )
    parser.add_argument(
        "--dtype",
        choices=PRECISIONS,
        help="what the layers compute in (default: what hethub train with no plan trains in, "
        "bf16 unless torch lacks bf16 kernels for this CPU; on a GPU bf16): bf16 is bf16 "
        "weights and activations, the loss in fp32 and AdamW on fp32 master weights",
    )
    parser.add_argument(
        "--repeats",
        type=positive_int,
        default=None,
        help="timed repeats of each layer pass and each link message size (default 30 and 15): "
        "fewer is quicker and noisier",
    )


def _add_where_it_goes(parser: argparse.ArgumentParser) -> None:
    """The flags that say where profiles go and how: the folder, measuring anew, JSON, and a
    cluster's torchrun job."""
    parser.add_argument(
        "--out",
        default=str(default_profiles_dir()),
        help=f"profile directory (default ${PROFILES_ENV}, else this machine's folder in the "
        f"user's cache: {default_profiles_dir()})",
    )
    parser.add_argument(
        "--again", action="store_true", help="measure anew what the directory holds already"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--cluster",
        help="under torchrun on the cluster's nodes (one process per device): every group "
        "measures its own kind on its own nodes, the links inside a node, between nodes of a "
        "group and between groups are measured, and rank 0 writes one folder for the cluster",
    )
    # Not "--node": torchrun refuses it as an abbreviation of its --node-rank (hethub train).
    parser.add_argument(
        "--this-node",
        type=node,
        metavar="GROUP:INDEX",
        help="with --cluster: which node of the cluster this one is, as hethub train takes it; "
        "without it, this host's name in the group's hosts",
    )
    parser.add_argument(
        "--timeout",
        type=timeout_seconds,
        help="with --cluster: seconds any process waits for the others, at each step "
        f"(default {DEFAULT_CLUSTER_TIMEOUT_S:g}; more than a kind's measurement takes)",
    )


def run(args: argparse.Namespace) -> int:
    if args.cluster or "LOCAL_RANK" in os.environ:
        return _run_cluster(args)
    alone = [f for f in ("this_node", "timeout") if getattr(args, f) is not None]
    if alone:
        raise HethubError(
            f"--{alone[0].replace('_', '-')}: only with --cluster, under torchrun on the "
            f"cluster's nodes"
        )
    model = load_model(args.model, source="--model")
    device = _device(args.device)
    # torch: only to measure
    from hethub.profiler.conditions import describe_device, measuring_device
    from hethub.profiler.ensure import ensure_profiles
    from hethub.profiler.layers import REPEATS
    from hethub.profiler.links import LINK_REPEATS

    where = measuring_device(device)
    requests = _requests(args, model, device, where)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise HethubError(f"--out = {args.out!r}: not a directory")
    before = load_profiles(out) if out.is_dir() else None
    say = None if args.json else logger("profile").info
    started = time.perf_counter()
    for request in requests:
        if args.again and before is not None:
            _forget(before, request)
        profiles = ensure_profiles(
            out,
            request,
            progress=say,
            repeats=args.repeats or REPEATS,
            link_repeats=args.repeats or LINK_REPEATS,
        )
    elapsed = time.perf_counter() - started
    layers = [
        profiles.layer(r.key(tp, b)) for r in requests for tp in r.tps for b in r.micro_batches
    ]
    links = (
        [profiles.link(device, r.concurrent_ranks) for r in requests] if where.type == "cpu" else []
    )
    wanted = [p for p in [*layers, *links] if p is not None]
    measured = [p for p in wanted if before is None or args.again or _is_new(before, p)]
    if args.json:
        print(
            json.dumps(
                {
                    "out": str(out),
                    "model": model.name,
                    "dtype": args.dtype,
                    "measured_on": describe_device(where),
                    "seconds": elapsed,
                    "measured": [str(profile_path(out, p)) for p in measured],
                    "layers": [to_json(p) for p in layers if p],
                    "links": [to_json(p) for p in links if p],
                },
                indent=2,
            )
        )
        return 0
    print(
        describe(
            model.name,
            device,
            [p for p in layers if p],
            [p for p in links if p],
            measured=measured,
            out=out,
            elapsed=elapsed,
            where=describe_device(where),
        )
    )
    return 0


def _requests(args: argparse.Namespace, model, device: str, where) -> list:
    """What to measure, one ProfileRequest per number of ranks at once: the flags given, the rest
    as a local run (on a CPU) or one rank alone would have them; each refused in one line where it
    cannot be measured on ``where``."""
    from hethub.profiler.conditions import available_cores
    from hethub.profiler.ensure import ProfileRequest

    if where.type == "cpu":
        _default_to_local_run(args, model, available_cores())
    tps, micro, threads, concurrency = _measuring_options(_default_to_one_rank(args))
    requests = [
        ProfileRequest(
            model=model,
            device_name=device,
            tps=tps,
            micro_batches=micro,
            threads=threads[0],
            concurrent_ranks=c,
            dtype=args.dtype,
        )
        for c in concurrency
    ]
    for request in requests:
        request.check(where)
    return requests


def _default_to_local_run(args: argparse.Namespace, model, cores: int) -> None:
    """Fill the flags not given with what `hethub train` with no plan measures and looks up for
    ``model`` (hethub.jobs.prepare.local_measurements on the built-in local cluster): its TP
    degrees, micro-batch sizes, ranks computing at once (and each TP group alone where they
    outnumber ``cores``) and the precision it plans in."""
    cluster = load_cluster(builtin_cluster())
    wanted = local_measurements(cluster, model, None, cores)
    _fill(
        args,
        tp=",".join(map(str, wanted.tps)),
        micro_batch=",".join(map(str, wanted.micro_batches)),
        concurrent_ranks=",".join(map(str, dict.fromkeys([wanted.together, *wanted.alone]))),
        dtype=planned_precision(cluster).value,
    )


def _default_to_one_rank(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the flags still not given (a GPU, or --cluster) as one rank alone in bf16: tp 1,
    the planner's micro-batch sizes, 1 rank at once."""
    _fill(
        args,
        tp="1",
        micro_batch=",".join(map(str, MICRO_BATCH_SIZES)),
        concurrent_ranks="1",
        dtype=DEFAULT_PRECISION.value,
    )
    return args


def _fill(args: argparse.Namespace, **defaults: str) -> None:
    """Set each flag of ``defaults`` that the user did not give."""
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def _measuring_options(args: argparse.Namespace) -> tuple[list[int], ...]:
    """--tp, --micro-batch, --threads (one count) and --concurrent-ranks, as lists."""
    tps, micro, threads, concurrency = (
        _positive_list(getattr(args, flag), flag)
        for flag in ("tp", "micro_batch", "threads", "concurrent_ranks")
    )
    if len(threads) != 1:
        raise HethubError(f"--threads = {args.threads}: give one thread count")
    return tps, micro, threads, concurrency


def _run_cluster(args: argparse.Namespace) -> int:
    """The distributed profiler (hethub.profiler.cluster), in one process of the user's torchrun."""
    timeout = args.timeout or DEFAULT_CLUSTER_TIMEOUT_S
    try:
        if "LOCAL_RANK" not in os.environ:
            raise HethubError(
                "--cluster: only under torchrun, one torchrun per node of the cluster with "
                "--nproc-per-node its devices (docs/clusters.md, Distributed profiling); on one "
                "machine, "
                "hethub profile --device NAME"
            )
        if not args.cluster:
            raise HethubError(
                "under torchrun give --cluster (the cluster file of the nodes it runs on)"
            )
        if args.device != "cpu" or args.again:
            raise HethubError(
                f"--{'device' if args.device != 'cpu' else 'again'}: not with --cluster: each "
                f"group's accelerator names its profiles, and every one is measured anew"
            )
        cluster = load_cluster(args.cluster)
        model = load_model(args.model, source="--model")
        tps, micro, threads, concurrency = _measuring_options(_default_to_one_rank(args))
        if args.dtype not in PRECISIONS:
            raise HethubError(f"--dtype = {args.dtype!r}: must be one of {', '.join(PRECISIONS)}")
    except HethubError as error:  # the other nodes' processes would wait for this one's claim
        from hethub.runtime.nodes import post_refusal_to_peers

        post_refusal_to_peers(error, args.this_node, timeout)
        raise
    from hethub.profiler.cluster import Request, profile_cluster, summary  # torch: to measure

    request = Request(
        tps=tuple(tps),
        micro_batches=tuple(micro),
        threads=threads[0],
        concurrency=tuple(concurrency),
        dtype=args.dtype,
        timeout_s=timeout,
        repeats=args.repeats,
    )
    out = Path(args.out)
    started = time.perf_counter()
    written = profile_cluster(
        cluster,
        model,
        args.this_node,
        request,
        out,
        None if args.json else _say,
    )
    if written is None:  # not rank 0: rank 0 reports
        return 0
    elapsed = time.perf_counter() - started
    if args.json:
        print(
            json.dumps(
                {
                    "out": str(out),
                    "model": model.name,
                    "cluster": args.cluster,
                    "dtype": args.dtype,
                    "seconds": elapsed,
                    "measured": [str(profile_path(out, p)) for p in written],
                },
                indent=2,
            )
        )
        return 0
    print("\n".join(summary(written)))
    print(
        f"{len(written)} profiles of {model.name} on {args.cluster} in {elapsed:.1f} s; in {out} "
        f"(use them with --profiles {out})"
    )
    return 0


def _say(message: str) -> None:
    logger("profile").info(message)


def _recomputed(profile: LayerProfile) -> str:
    if profile.layer_recompute_forward_s is None or profile.layer_recompute_backward_s is None:
        return "not measured"
    forward, backward = profile.layer_recompute_forward_s, profile.layer_recompute_backward_s
    return f"{forward * 1e3:.3f} / {backward * 1e3:.3f}"


def describe(
    model: str,
    device: str,
    layers: list[LayerProfile],
    links: list[LinkProfile],
    *,
    measured: list,
    out: Path,
    elapsed: float,
    where: str = "CPU",
) -> str:
    """The profiles as two tables: layers (per TP rank, one micro-batch), and links (``where``
    they were measured: 'CPU', 'GPU (NAME)')."""
    fresh = {id(p) for p in measured}
    header, rows = _layer_table(layers, fresh)
    link_header, link_rows = _link_table(links, fresh)
    first = layers[0].key if layers else None
    shape = (
        f"{first.arch} hidden {first.hidden}, heads {first.heads}/{first.kv_heads}, "
        f"ffn {first.ffn_hidden}, seq {first.seq_len}, vocab {first.vocab}, {first.dtype}, "
        f"{plural(first.threads, 'thread')} per rank"
        + (f", {plural(layers[0].cores, 'core')}" if layers[0].cores else "")
        if first
        else ""
    )
    return "\n".join(
        [
            (
                f"profiles of {model} on this machine's {where} as {device!r} ({shape}), "
                f"per TP rank and micro-batch:"
            ),
            "",
            render_table(header, rows),
            "",
            render_table(link_header, link_rows)
            if link_rows
            else "no link profile"
            + ("" if where == "CPU" else " (links are measured between CPU processes only)"),
            "",
            f"{len(measured)} measured in {elapsed:.1f} s; profiles in {out} ({_how_used(out)})",
        ]
    )


def _layer_table(layers: list[LayerProfile], fresh: set[int]) -> tuple[list[str], list[list[str]]]:
    """describe's table of layer profiles (``fresh``: the ids of those measured now)."""
    header = [
        "tp",
        "micro-batch",
        "ranks at once",
        "layer fwd ms",
        "layer bwd ms",
        "recomputed fwd/bwd ms",
        "embed fwd/bwd ms",
        "head fwd/bwd ms",
        "adamw ns/param",
        "activations MB/layer",
        "",
    ]
    rows = [
        [
            str(p.key.tp),
            str(p.key.micro_batch),
            str(p.key.concurrent_ranks),
            f"{p.layer_forward_s * 1e3:.3f}",
            f"{p.layer_backward_s * 1e3:.3f}",
            _recomputed(p),
            f"{p.embed_forward_s * 1e3:.3f} / {p.embed_backward_s * 1e3:.3f}",
            f"{p.head_forward_s * 1e3:.3f} / {p.head_backward_s * 1e3:.3f}",
            f"{p.optimizer_s_per_param * 1e9:.2f}",
            f"{p.layer_activation_bytes / 1e6:.2f}",
            "measured" if id(p) in fresh else "kept",
        ]
        for p in layers
    ]
    return header, rows


def _link_table(links: list[LinkProfile], fresh: set[int]) -> tuple[list[str], list[list[str]]]:
    """describe's table of link profiles (``fresh``: the ids of those measured now)."""
    header = ["ranks at once", "point to point", "all-reduce", "broadcast", "all-gather", ""]
    rows = [
        [
            str(link.concurrent_ranks),
            _fit((link.p2p_latency_s, link.p2p_bytes_per_s)),
            *(
                "; ".join(
                    f"{plural(ranks, 'rank')} {_fit(fit)}"
                    for ranks, fit in sorted(getattr(link, kind).items())
                )
                for kind in ("allreduce", "broadcast", "allgather")
            ),
            "measured" if id(link) in fresh else "kept",
        ]
        for link in links
    ]
    return header, rows


def _how_used(out: Path) -> str:
    """How the commands find the profiles in ``out``."""
    if Path(out).resolve() == default_profiles_dir().resolve():
        return (
            "hethub train and validate read them there by default; predict and plan with "
            f"--profiles {out}"
        )
    return f"use them with --profiles {out}"


def _fit(fit: tuple[float, float]) -> str:
    return f"{fit[0] * 1e6:.0f} us + {fit[1] / 1e9:.2f} GB/s"


def _positive_list(text: str, flag: str) -> list[int]:
    name = f"--{flag.replace('_', '-')}"
    try:
        values = [int(part) for part in str(text).split(",")]
    except ValueError:
        raise HethubError(
            f"{name} = {text!r}: must be positive integers, comma-separated"
        ) from None
    if not values or any(v <= 0 for v in values):
        raise HethubError(f"{name} = {text!r}: must be positive integers, comma-separated")
    return list(dict.fromkeys(values))


def _device(name: str) -> str:
    """The device label: any name (where it is measured: profiler.conditions.measuring_device)."""
    name = name.strip()
    if not name:
        raise HethubError(
            "--device = '': must name the accelerator the profiles are for (e.g. cpu)"
        )
    return name


def _is_new(before: Profiles, profile: LayerProfile | LinkProfile) -> bool:
    if isinstance(profile, LayerProfile):
        return before.layer(profile.key) != profile
    return before.link(profile.device, profile.concurrent_ranks) != profile


def _forget(before: Profiles, request) -> None:
    """Remove the files of what ``request`` (a profiler.ensure.ProfileRequest) measures anew."""
    for tp in request.tps:
        for b in request.micro_batches:
            profile = before.layer(request.key(tp, b))
            if profile is not None:
                profile_path(before.source, profile).unlink(missing_ok=True)
    link = before.link(request.device_name, request.concurrent_ranks)
    if link is not None:
        profile_path(before.source, link).unlink(missing_ok=True)
