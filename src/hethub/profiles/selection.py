"""A directory's profiles, and how a plan's are chosen among them: the run conditions (dtype,
threads, ranks at once) a prediction selects, then looked up by device and shape.

Pure Python, as the predictor and the planner that read them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from hethub.errors import HethubError
from hethub.profiles.types import DTYPE_BYTES, LayerKey, LayerProfile, LinkProfile, node_pair
from hethub.spec.cluster import ClusterSpec
from hethub.spec.hashing import hashed_once
from hethub.spec.model import ModelSpec


@dataclass(frozen=True, slots=True)
@hashed_once(
    # Its dicts cannot be hashed: their keys stand for them (equal Profiles have equal keys).
    key=lambda p: (
        p.source,
        p.dtype,
        p.threads,
        p.concurrent_ranks,
        frozenset(p.layers),
        frozenset(p.links),
        frozenset(p.between),
    )
)
class Profiles:
    """The profiles of one directory, and the run conditions a prediction selects them under.

    Hashed once (predictor and planner caches are keyed on it). ``select`` fixes the conditions
    a job runs under; ``layer_for`` and ``link_for`` then look up by device and shape.
    """

    layers: dict[LayerKey, LayerProfile]
    links: dict[tuple[str, int], LinkProfile]
    source: str = ""
    dtype: str = "fp32"
    threads: int = 1
    concurrent_ranks: int = 1
    """Ranks of the job computing at once on one machine (1: each rank has its device to itself)."""
    between: dict[tuple[str, str], LinkProfile] = field(default_factory=dict)
    """Links between two nodes, by the pair of their kinds (node_pair)."""

    def select(
        self, *, dtype: str = "fp32", threads: int = 1, concurrent_ranks: int = 1
    ) -> Profiles:
        """The same profiles, looked up under these run conditions."""
        if dtype not in DTYPE_BYTES:
            raise HethubError(f"dtype = {dtype!r}: must be one of {', '.join(DTYPE_BYTES)}")
        if threads <= 0 or concurrent_ranks <= 0:
            raise HethubError(
                f"threads = {threads}, concurrent_ranks = {concurrent_ranks}: must be positive"
            )
        return dataclasses.replace(
            self, dtype=dtype, threads=threads, concurrent_ranks=concurrent_ranks
        )

    @property
    def bytes_per_element(self) -> int:
        """Activations' and gradients' element size under the selected dtype."""
        return DTYPE_BYTES[self.dtype]

    def layer(self, key: LayerKey) -> LayerProfile | None:
        """The profile measured for exactly ``key``, or None."""
        return self.layers.get(key)

    def layer_key(self, device: str, model: ModelSpec, tp: int, micro_batch: int) -> LayerKey:
        """The key a layer of ``model`` on ``device`` is looked up by under the selected
        conditions."""
        return LayerKey.of(
            model,
            device=device,
            dtype=self.dtype,
            threads=self.threads,
            concurrent_ranks=self.concurrent_ranks,
            tp=tp,
            micro_batch=micro_batch,
        )

    def layer_for(
        self, device: str, model: ModelSpec, tp: int, micro_batch: int
    ) -> LayerProfile | None:
        return self.layers.get(self.layer_key(device, model, tp, micro_batch))

    def link(self, device: str, concurrent_ranks: int) -> LinkProfile | None:
        return self.links.get((device, concurrent_ranks))

    def link_for(self, device: str) -> LinkProfile | None:
        """The link profile of ``device`` under the selected concurrency."""
        return self.links.get((device, self.concurrent_ranks))

    def link_between(self, a: str, b: str) -> LinkProfile | None:
        """The measured link between a node of kind ``a`` and one of kind ``b``, or None."""
        return self.between.get(node_pair(a, b))

    def merged(self, profiles: list[LayerProfile | LinkProfile]) -> Profiles:
        """These profiles with ``profiles`` added (replacing any of the same key)."""
        layers, links, between = dict(self.layers), dict(self.links), dict(self.between)
        for p in profiles:
            if isinstance(p, LayerProfile):
                layers[p.key] = p
            elif p.peer is not None:
                between[p.pair] = p
            else:
                links[(p.device, p.concurrent_ranks)] = p
        return dataclasses.replace(self, layers=layers, links=links, between=between)


def empty_profiles(source: str = "") -> Profiles:
    return Profiles(layers={}, links={}, source=source)


def all_cpu(cluster: ClusterSpec) -> bool:
    """Every group's accelerator is a CPU: a local run puts every rank on this machine's cores."""
    return all(g.accelerator.vendor == "cpu" for g in cluster.groups)


def local_concurrency(cluster: ClusterSpec, devices: int) -> int:
    """Ranks computing at once on one machine in a run of ``devices`` devices of ``cluster``: all of
    them when every group's accelerator is a CPU (a local run, every rank on this machine's
    cores), else 1 (each rank has its accelerator to itself)."""
    return devices if all_cpu(cluster) else 1


def select_for_run(
    profiles: Profiles, cluster: ClusterSpec, devices: int, dtype: str = "fp32"
) -> Profiles:
    """``profiles`` under the conditions of a runtime job on ``cluster``: ``dtype`` (the plan's
    precision; fp32 where a caller names none), one thread per rank, and the concurrency of
    local_concurrency()."""
    return profiles.select(
        dtype=dtype, threads=1, concurrent_ranks=local_concurrency(cluster, devices)
    )
