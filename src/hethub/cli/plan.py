"""`hethub plan`: the fastest data x tensor x pipeline plan for a (heterogeneous) cluster."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import yaml

from hethub.cli.args import positive_int
from hethub.cli.summary import PROFILES_HELP, describe, note_missing, priced_by, read_profiles
from hethub.errors import HethubError
from hethub.memo import memo_scope
from hethub.planner import PricedPlan, SearchResult, UpperBound, search, upper_bound
from hethub.planner.above_bound import why_above
from hethub.report.terminal import plural, progress_bar
from hethub.spec import ClusterSpec, ModelSpec, load_cluster, load_model
from hethub.spec.model import model_file_fields, preset_names
from hethub.spec.plan import DEFAULT_PRECISION, PRECISIONS


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "plan",
        help="find the fastest plan for a cluster and write it as a plan file",
        description="Search the heterogeneous data x tensor x pipeline plan space with the "
        "predictor, write the fastest plan that fits in memory, and compare it with the "
        "theoretical upper bound (the sum of each device group's best throughput planned alone "
        "on its share of the global batch, the shares chosen to maximise the sum).",
    )
    parser.add_argument("--cluster", required=True, help="cluster YAML file")
    parser.add_argument(
        "--model",
        required=True,
        help="preset name, model YAML, or HuggingFace model folder (or its config.json)",
    )
    parser.add_argument(
        "--global-batch", required=True, type=positive_int, help="sequences per optimizer step"
    )
    parser.add_argument(
        "--seq-len",
        type=positive_int,
        help="sequence length (default: the model's; a HuggingFace model's "
        "max_position_embeddings, "
        "at most 4096)",
    )
    parser.add_argument(
        "--out", default="plan.yaml", help="where to write the plan (default: plan.yaml)"
    )
    parser.add_argument(
        "--force", action="store_true", help="overwrite --out when it exists (default: refuse)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object, no progress")
    parser.add_argument(
        "--top", type=positive_int, default=1, metavar="K", help="also list the next best plans"
    )
    parser.add_argument(
        "--time-limit", type=float, metavar="SECONDS", help="stop searching after this long"
    )
    parser.add_argument(
        "--precision",
        choices=PRECISIONS,
        default=DEFAULT_PRECISION.value,
        help="the precision of the plans searched and written: bf16 (mixed precision, the "
        "default) or fp32",
    )
    parser.add_argument("--profiles", metavar="DIR", help=PROFILES_HELP.format(what="cluster"))
    parser.set_defaults(run=run)


@memo_scope()  # the search, its bound and the report share one Memo
def run(args: argparse.Namespace) -> int:
    if args.time_limit is not None and args.time_limit <= 0:
        raise HethubError(f"--time-limit = {args.time_limit}: must be a positive number of seconds")
    cluster = load_cluster(args.cluster)
    model = load_model(args.model, source="--model", seq_len=args.seq_len)
    out = _checked_out(args)
    model_ref = _model_reference(args, model, out)
    profiles = read_profiles(args.profiles, cluster, cluster.devices)
    bar = None if args.json else progress_bar()
    result = search(
        cluster,
        model,
        args.global_batch,
        model_ref=model_ref,
        time_limit_s=args.time_limit,
        progress=bar.update if bar else None,
        profiles=profiles,
        precision=args.precision,
    )
    if bar:
        bar.close()
    if result.best is None:
        raise HethubError(_no_plan_message(result, cluster, model, args))
    bound = upper_bound(result)
    best = result.best
    missing = note_missing(best.plan, cluster, model, profiles, "plan")
    _write(out, best, model, model_ref, args)
    others = _distinct(result.ranked, args.top)[1:]
    if args.json:
        print(json.dumps(_json_report(result, bound, others, cluster, out), indent=2))
        return 0
    print(describe(best.prediction, best.plan, cluster, model, str(out),
                   priced_by(cluster, profiles, missing)))  # fmt: skip
    print()
    _print_against_bound(result, bound, others, cluster)
    print(f"wrote {out}; check it with: hethub predict --cluster {args.cluster} --plan {out}")
    return 0


def _checked_out(args: argparse.Namespace) -> Path:
    """--out, checked before the search: a folder is never replaced, nor, without --force, a
    plan someone checked or trained."""
    out = Path(args.out)
    if out.is_dir():
        raise HethubError(
            f"--out = {args.out!r}: is a directory; give the path of the plan file to write "
            f"(e.g. {str(out / 'plan.yaml')!r})"
        )
    if out.exists() and not args.force:
        raise HethubError(
            f"--out = {args.out!r}: the file exists already; give --force to overwrite it, "
            f"or another --out"
        )
    return out


def _efficiency(best: PricedPlan, bound: UpperBound) -> float:
    return best.prediction.tokens_per_s / bound.tokens_per_s if bound.tokens_per_s else 0.0


def _json_report(
    result: SearchResult, bound: UpperBound, others: list, cluster: ClusterSpec, out: Path
) -> dict:
    """`hethub plan --json`'s object."""
    best = result.best
    efficiency = _efficiency(best, bound)
    return {
        "plan": best.plan.to_dict(),
        "prediction": best.prediction.to_json(),
        "out": str(out),
        "upper_bound": bound.to_json(),
        "efficiency": efficiency,
        "above_bound_because": why_above(bound, best, cluster) if efficiency > 1 else [],
        "search_time_s": result.search_time_s,
        "candidates_evaluated": result.candidates_evaluated,
        "timed_out": result.timed_out,
        "top": [
            {"plan": r.plan.to_dict(), "tokens_per_s": r.prediction.tokens_per_s} for r in others
        ],
    }


def _print_against_bound(
    result: SearchResult, bound: UpperBound, others: list, cluster: ClusterSpec
) -> None:
    """The plan against the upper bound, why it is above it where it is, the search, and the
    next best plans (--top)."""
    best = result.best
    efficiency = _efficiency(best, bound)
    shares = ", ".join(
        f"{name} {share.global_batch} sequences {share.tokens_per_s:,.0f}"
        for name, share in bound.groups.items()
    )
    print(f"upper bound          {bound.tokens_per_s:,.0f} tokens/s (each group alone on its "
          f"share: {shares})")  # fmt: skip
    print(
        f"                     each group alone with the whole batch (not a bound): "
        f"{bound.whole_batch_tokens_per_s:,.0f} tokens/s"
    )
    print(f"efficiency           {100 * efficiency:.2f}% of the upper bound")
    if efficiency > 1:
        first, *more = why_above(bound, best, cluster)
        print(f"                     above it: {first}")
        for line in more:
            print(f"                               {line}")
    print(
        f"search               {plural(result.candidates_evaluated, 'plan')} predicted "
        f"in {result.search_time_s:.2f} s"
        + (" (stopped at --time-limit)" if result.timed_out else "")
    )
    for rank, other in enumerate(others, start=2):
        p = other.prediction
        print(
            f"#{rank}: {p.tokens_per_s:,.0f} tokens/s "
            f"({100 * p.tokens_per_s / bound.tokens_per_s:.2f}%), "
            f"{other.plan.summary()}"
        )


def _model_reference(args: argparse.Namespace, model: ModelSpec, out: Path) -> str:
    """What the plan file's model: says: the preset name, or a path relative to the plan file."""
    if args.seq_len is not None and args.seq_len != load_model(args.model).seq_len:
        return f"{out.stem}.model.yaml"  # written beside the plan by _write
    if args.model.lower() in preset_names():
        return args.model.lower()
    return os.path.relpath(Path(args.model).resolve(), out.resolve().parent)


def _write(
    out: Path, best: PricedPlan, model: ModelSpec, model_ref: str, args: argparse.Namespace
) -> None:
    p = best.prediction
    header = (
        f"# Written by hethub plan for {args.cluster}: {p.tokens_per_s:,.0f} tokens/s predicted,\n"
        f"# {p.iteration_time_s:.3f} s per step, peak {p.peak_memory_gb:.1f} GB per device.\n"
    )
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        if model_ref == f"{out.stem}.model.yaml":
            (out.parent / model_ref).write_text(
                yaml.safe_dump(model_file_fields(model), sort_keys=False)
            )
        out.write_text(header + best.plan.to_yaml())
    except OSError as error:
        raise HethubError(
            f"--out = {str(out)!r}: cannot write the plan file ({error.strerror})"
        ) from None


def _distinct(ranked: list[PricedPlan], count: int) -> list[PricedPlan]:
    """The first ``count`` plans, each plan once (refinement can reach one plan twice)."""
    seen, out = set(), []
    for r in ranked:
        if r.plan not in seen:
            seen.add(r.plan)
            out.append(r)
            if len(out) == count:
                break
    return out


def _no_plan_message(
    result, cluster: ClusterSpec, model: ModelSpec, args: argparse.Namespace
) -> str:
    what = f"no plan found for {model.name} on {args.cluster} at global batch {args.global_batch}"
    if result.timed_out:
        return (
            f"{what}: the search ran out of time (--time-limit {args.time_limit:g} s); "
            f"allow it longer"
        )
    closest = result.closest
    if closest is None:
        return f"{what}: no layout of the cluster can hold the model"
    return (
        f"no plan fits in memory: the closest candidate ({closest.summary}) needs "
        f"{closest.need_gb:.1f} GB on a device of group {closest.group!r} ({closest.accelerator}, "
        f"{closest.capacity_gb:g} GB), {closest.over_gb:.1f} GB over; give the cluster more "
        f"devices or memory, or plan a smaller model"
    )
