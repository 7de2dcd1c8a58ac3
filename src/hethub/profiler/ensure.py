"""What is measured afresh and what is reused: a profile directory's files stand until they lack
what is asked (a key, the recomputed layer, a collective's rank count) or were measured by an
older method (profiles.types.METHOD); only those are measured again, and saved beside the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from hethub.profiler.conditions import describe_device, measuring_device
from hethub.profiler.layers import DTYPE, REPEATS, check_layer_request, measure_layers
from hethub.profiler.links import LINK_REPEATS, measure_links
from hethub.profiles.files import load_profiles, save_profile
from hethub.profiles.selection import Profiles, empty_profiles
from hethub.profiles.types import METHOD, LayerKey
from hethub.report.terminal import plural
from hethub.spec.model import ModelSpec


@dataclass(frozen=True, kw_only=True, slots=True)
class ProfileRequest:
    """The layer profiles wanted: ``model``'s layers, keyed for ``device_name``, at each TP degree
    of ``tps`` and micro-batch size of ``micro_batches``, measured in ``dtype`` with ``threads``
    torch threads a rank and ``concurrent_ranks`` ranks computing at once (and the link profile
    of that concurrency, where links are measured)."""

    model: ModelSpec
    device_name: str
    tps: Sequence[int]
    micro_batches: Sequence[int]
    threads: int = 1
    concurrent_ranks: int = 1
    dtype: str = DTYPE

    def check(self, where: torch.device) -> None:
        """Refuse, in one line, what cannot be measured on ``where`` (check_layer_request)."""
        check_layer_request(
            self.model, self.tps, self.micro_batches, device=where, **self._conditions()
        )

    def key(self, tp: int, micro_batch: int) -> LayerKey:
        """The key of the layer profile measured at ``tp`` and ``micro_batch``."""
        return LayerKey.of(
            self.model,
            device=self.device_name,
            tp=tp,
            micro_batch=micro_batch,
            **self._conditions(),
        )

    def _conditions(self) -> dict[str, int | str]:
        """What the layers are measured under, as check_layer_request and LayerKey.of name it."""
        return {
            "threads": self.threads,
            "concurrent_ranks": self.concurrent_ranks,
            "dtype": self.dtype,
        }


def ensure_profiles(
    directory: str | Path,
    request: ProfileRequest,
    *,
    ranks_list: Sequence[int] | None = None,
    repeats: int = REPEATS,
    link_repeats: int = LINK_REPEATS,
    links: bool = True,
    progress: Callable[[str], None] | None = None,
) -> Profiles:
    """Measure what ``directory`` lacks of ``request``'s layer profiles (where measuring_device
    says) and (with ``links``, on a CPU only) of the link profile (with collectives over
    ``ranks_list``, default 2 .. max(concurrent_ranks, 2)), save it there, and return the
    directory's profiles. ``repeats`` and ``link_repeats``: timed repeats of each layer pass and
    of each link message size."""
    where = measuring_device(request.device_name)
    request.check(where)
    folder = Path(directory)
    have = load_profiles(folder) if folder.is_dir() else empty_profiles(str(folder))
    for tp in dict.fromkeys(request.tps):
        missing = _missing_layers(have, request, tp)
        if not missing:
            continue
        if progress:
            progress(_measuring_layers_line(request, tp, missing, where))
        for profile in measure_layers(
            request.model,
            request.device_name,
            [tp],
            missing,
            threads=request.threads,
            concurrent_ranks=request.concurrent_ranks,
            repeats=repeats,
            dtype=request.dtype,
        ):
            save_profile(folder, profile)
    if links and where.type == "cpu":  # gloo between CPU processes is not a GPU's link
        ranks = tuple(ranks_list or range(2, max(request.concurrent_ranks, 2) + 1))
        _ensure_link(folder, have, request, ranks, link_repeats, progress)
    return load_profiles(folder)


def _missing_layers(have: Profiles, request: ProfileRequest, tp: int) -> list[int]:
    """The micro-batch sizes whose layer profile at ``tp`` is to be measured: absent, or written
    before recomputation was measured, or by an older method (each counts as missing)."""
    missing = []
    for b in request.micro_batches:
        found = have.layers.get(request.key(tp, b))
        if found is None or found.layer_recompute_backward_s is None or found.method < METHOD:
            missing.append(b)
    return missing


def _measuring_layers_line(
    request: ProfileRequest, tp: int, missing: Sequence[int], where: torch.device
) -> str:
    # fp32 on a CPU: the line as it always was (the README quotes it).
    how = "" if request.dtype == "fp32" else f", {request.dtype}"
    how += "" if where.type == "cpu" else f", on the {describe_device(where)}"
    return (
        f"measuring layers: tp {tp}, micro-batch {','.join(map(str, missing))}, "
        f"{plural(max(request.concurrent_ranks, tp), 'rank')} at once{how}"
    )


def _ensure_link(
    folder: Path,
    have: Profiles,
    request: ProfileRequest,
    ranks_list: tuple[int, ...],
    repeats: int,
    progress: Callable[[str], None] | None,
) -> None:
    """Measure the link profile of ``request``'s concurrency anew where ``have``'s is absent, of
    an older method, or lacks an all-reduce or a reduce-scatter over one of ``ranks_list``; the
    new one keeps the rank counts the current one had."""
    concurrent = request.concurrent_ranks
    link = have.link(request.device_name, concurrent)
    if (
        link is not None
        and link.method >= METHOD
        and all(r in link.allreduce and r in link.reducescatter for r in ranks_list)
    ):
        return
    if progress:
        progress(
            f"measuring links: collectives over {','.join(map(str, ranks_list))} ranks, "
            f"{max(concurrent, *ranks_list)} processes"
        )
    wanted = sorted(set(ranks_list) | set(link.allreduce if link and link.method == METHOD else ()))
    save_profile(
        folder,
        measure_links(request.device_name, wanted, concurrent_ranks=concurrent, repeats=repeats),
    )
