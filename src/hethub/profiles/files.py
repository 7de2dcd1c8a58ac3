"""Profiles on disk: one JSON file per key, written atomically, read and validated field by field.

Pure Python, as the predictor and the planner that load them.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from pathlib import Path
from typing import Any

from hethub.errors import HethubError
from hethub.files import write_atomic
from hethub.profiles.selection import Profiles
from hethub.profiles.types import (
    COLLECTIVES,
    COMMUNICATIONS,
    FORMAT,
    LAYER,
    LINK,
    Fit,
    LayerKey,
    LayerProfile,
    LinkProfile,
    MeasuredOn,
    Points,
)
from hethub.spec.fields import Fields, field_names


def profile_path(directory: str | Path, profile: LayerProfile | LinkProfile) -> Path:
    """Where ``save_profile`` writes ``profile`` in ``directory``."""
    return Path(directory) / (
        profile.key.file_name() if isinstance(profile, LayerProfile) else profile.file_name()
    )


def to_json(profile: LayerProfile | LinkProfile) -> dict[str, Any]:
    """The object a profile file holds."""
    if isinstance(profile, LayerProfile):
        data = dataclasses.asdict(profile)
        for name in ("layer_time_cv", "measured_on"):  # not recorded: absent, as in older files
            if data[name] is None:
                del data[name]
        if not profile.key.variant:  # the arch's own layer: its key as before the field existed
            del data["key"]["variant"]
        return {"format": FORMAT, "kind": LAYER, **data}
    data = dataclasses.asdict(profile)
    if profile.peer is None:  # a link inside a machine: its file as before the field existed
        del data["peer"]
    if profile.measured_on is None:
        del data["measured_on"]
    for name in COLLECTIVES:
        data[name] = {
            str(ranks): {"latency_s": fit[0], "bytes_per_s": fit[1]}
            for ranks, fit in sorted(getattr(profile, name).items())
        }
    data["points"] = {
        kind: {
            str(ranks): [list(p) for p in points]
            for (k, ranks), points in sorted(profile.points.items())
            if k == kind
        }
        for kind in COMMUNICATIONS
    }
    return {"format": FORMAT, "kind": LINK, **data}


def save_profile(directory: str | Path, profile: LayerProfile | LinkProfile) -> Path:
    """Write ``profile`` to its own file in ``directory`` (created if need be), atomically: a
    reader never sees half a file. Returns the file's path."""
    path = profile_path(directory, profile)
    text = json.dumps(to_json(profile), indent=2) + "\n"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, text)
    except OSError as error:
        raise HethubError(f"{path}: cannot write the profile ({error.strerror})") from None
    return path


def load_profiles(directory: str | Path) -> Profiles:
    """Every profile file (``*.json``) of ``directory``; a missing directory, a malformed file or
    two files of one key are errors naming the directory, the file and the field."""
    folder = Path(directory)
    if not folder.is_dir():
        raise HethubError(
            f"{folder}: profile directory not found (write one with: hethub profile --out {folder})"
        )
    layers: dict[LayerKey, LayerProfile] = {}
    links: dict[tuple[str, int], LinkProfile] = {}
    between: dict[tuple[str, str], LinkProfile] = {}
    origin: dict[Any, Path] = {}
    for path in sorted(folder.glob("*.json")):
        profile = read_profile(path)
        if isinstance(profile, LayerProfile):
            key: Any = profile.key
        elif profile.peer is not None:
            key = ("between", *profile.pair)
        else:
            key = (profile.device, profile.concurrent_ranks)
        if key in origin:
            raise HethubError(
                f"{path}: measures the same key as {origin[key].name}; keep one of the two files"
            )
        origin[key] = path
        if isinstance(profile, LayerProfile):
            layers[key] = profile
        elif profile.peer is not None:
            between[profile.pair] = profile
        else:
            links[key] = profile
    return Profiles(layers=layers, links=links, source=str(folder), between=between)


class NonFiniteNumber(ValueError):
    """NaN, Infinity or -Infinity in a profile file: Python's json reads them, JSON has none."""


def _refuse_non_finite(constant: str) -> float:
    """json.loads' hook for NaN, Infinity and -Infinity: refused, so that no measured figure
    (nor a point of a measured curve, which Fields does not see one by one) is ever one."""
    raise NonFiniteNumber(constant)


def read_profile(path: str | Path) -> LayerProfile | LinkProfile:
    """One profile file, validated field by field."""
    path = Path(path)
    source = str(path)
    try:
        data = json.loads(path.read_text(), parse_constant=_refuse_non_finite)
    except (OSError, UnicodeDecodeError) as error:
        raise HethubError(
            f"{path}: cannot read the profile file ({getattr(error, 'strerror', None) or error})"
        ) from None
    except json.JSONDecodeError as error:
        raise HethubError(
            f"{path}: not valid JSON at line {error.lineno}, column {error.colno}: {error.msg}"
        ) from None
    except NonFiniteNumber as error:
        raise HethubError(
            f"{path}: {error} is not a number a profile holds (every figure is finite); "
            f"measure again"
        ) from None
    top = Fields(data, source)
    if top.raw("format") != FORMAT:
        raise top.error(
            "format", top.raw("format"), f"this hethub reads profile format {FORMAT}; measure again"
        )
    kind = top.choice("kind", (LAYER, LINK))
    if kind == LAYER:
        return _parse_layer(data, source)
    return _parse_link(data, source)


PREDATES_METHOD = 1
"""The method of a file written before profiles recorded theirs."""


def _parse_layer(data: dict, source: str) -> LayerProfile:
    fields = Fields(data, source, allowed=("format", "kind", *field_names(LayerProfile)))
    k = Fields(fields.raw("key"), source, "key", allowed=field_names(LayerKey))
    key = LayerKey(**k.declared(LayerKey))
    if key.concurrent_ranks < key.tp:
        raise k.error("concurrent_ranks", key.concurrent_ranks, f"must be at least tp ({key.tp})")
    return LayerProfile(
        key=key,
        measured_on=_measured_on(fields),
        **fields.declared(
            LayerProfile, skip=("key", "measured_on"), defaults={"method": PREDATES_METHOD}
        ),
    )


def _parse_link(data: dict, source: str) -> LinkProfile:
    fields = Fields(data, source, allowed=("format", "kind", *field_names(LinkProfile)))
    # A file measured before the reduce-scatter was (method 2) has none: measured anew where
    # profiles are ensured; meanwhile a sharded stage's sync is priced by the analytic model.
    collectives = {
        name: _fits(fields, name)
        for name in COLLECTIVES
        if name != "reducescatter" or fields.has(name)
    }
    return LinkProfile(
        **fields.declared(
            LinkProfile,
            skip=(*COLLECTIVES, "points", "measured_on"),
            defaults={"method": PREDATES_METHOD},
        ),
        **collectives,
        points=_points(fields),
        measured_on=_measured_on(fields),
    )


def _measured_on(fields: Fields) -> MeasuredOn | None:
    """Where the file says it was measured: None in a file written before it was recorded."""
    if not fields.has("measured_on"):
        return None
    where = Fields(
        fields.raw("measured_on"), fields.source, "measured_on", allowed=field_names(MeasuredOn)
    )
    return MeasuredOn(**where.declared(MeasuredOn))


def _points(fields: Fields) -> dict[tuple[str, int], Points]:
    """The measured points, if the file has them: sizes increasing, times positive."""
    if not fields.has("points"):
        return {}
    top = Fields(fields.raw("points"), fields.source, "points", allowed=COMMUNICATIONS)
    out: dict[tuple[str, int], Points] = {}
    for kind in COMMUNICATIONS:
        if not top.has(kind):
            continue
        per_ranks = top.raw(kind)
        if not isinstance(per_ranks, dict):
            raise top.error(
                kind, per_ranks, "must be a mapping of rank counts to [[bytes, seconds], ...]"
            )
        for ranks, raw in per_ranks.items():
            where = f"{kind}.{ranks}"
            if not str(ranks).isdigit() or int(ranks) < 2:
                raise top.error(where, raw, "keys are rank counts of at least 2")
            ok = (
                isinstance(raw, list)
                and raw
                and all(
                    isinstance(p, list)
                    and len(p) == 2
                    and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in p)
                    and p[0] > 0
                    and 0 < p[1] < math.inf
                    for p in raw
                )
            )
            if not ok or any(a[0] >= b[0] for a, b in itertools.pairwise(raw)):
                raise top.error(
                    where,
                    raw if len(str(raw)) < 60 else "[...]",
                    "must be [[bytes, seconds], ...] with positive values and sizes increasing",
                )
            out[(kind, int(ranks))] = tuple((int(n), float(t)) for n, t in raw)
    return out


def _fits(fields: Fields, name: str) -> dict[int, Fit]:
    raw = fields.raw(name)
    if not isinstance(raw, dict):
        raise fields.error(
            name, raw, "must be a mapping of rank counts to {latency_s, bytes_per_s}"
        )
    out: dict[int, Fit] = {}
    for ranks, value in raw.items():
        if not str(ranks).isdigit() or int(ranks) < 2:
            raise fields.error(f"{name}.{ranks}", value, "keys are rank counts of at least 2")
        fit = Fields(
            value,
            fields.source,
            fields.path(f"{name}.{ranks}"),
            allowed=("latency_s", "bytes_per_s"),
        )
        out[int(ranks)] = (
            fit.non_negative_number("latency_s"),
            fit.positive_number("bytes_per_s"),
        )
    return out
