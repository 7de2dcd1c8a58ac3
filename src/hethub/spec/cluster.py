"""The cluster file: device groups, each one kind of accelerator on identical nodes."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hethub.spec.accelerator import AcceleratorSpec, parse_accelerator
from hethub.spec.fields import Fields, field_names, load_yaml
from hethub.spec.hashing import hashed_once


@dataclass(frozen=True, kw_only=True, slots=True)
class SlurmSettings:
    """A group's ``slurm:`` section: the options of its component of a Slurm heterogeneous job
    (`hethub launch`). Each is left to the Slurm site's default when None."""

    partition: str | None = None
    constraint: str | None = None
    """Slurm's --constraint: the node features that pick this kind of node (e.g. ``a100``)."""
    account: str | None = None
    time: str | None = None
    """The time limit, in Slurm's form (minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS)."""
    cpus_per_node: int | None = None
    """CPUs for the node's one task (the agent and its workers; None: one per device)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class KubernetesSettings:
    """A group's ``kubernetes:`` section: its pods in the JobSet that `hethub launch jobset`
    writes. Each is left to the flags (image) or to the data (device_resource) when None."""

    image: str | None = None
    """The container image of the group's pods: one with hethub and the torch of this vendor's
    accelerators (a CUDA, ROCm, CANN or Gaudi build)."""
    node_selector: tuple[tuple[str, str], ...] = ()
    """Node labels that pick this kind of node (the pod's nodeSelector), in the file's order."""
    device_resource: str | None = None
    """The extended resource a pod asks for, one per device (None: the vendor's device plugin's,
    hethub/data/device_plugins.yaml)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LaunchSettings:
    """A group's ``launch:`` section: how its nodes start in what `hethub launch` writes (the
    Slurm job, the per-host scripts, the JobSet's pods). Each vendor's torch build lives in its
    own environment, so each group names its own interpreter and variables."""

    python: str | None = None
    """The Python of this group's nodes, with hethub and this vendor's torch build (None: the
    --python flag)."""
    env: tuple[tuple[str, str | None], ...] = ()
    """Environment variables of the group's agents and workers, in the file's order; each
    replaces the vendor's default of that name (hethub/data/vendor_env.yaml), and a None drops
    that default."""


@dataclass(frozen=True, kw_only=True, slots=True)
@hashed_once()
class DeviceGroup:
    """Identical nodes of one accelerator kind."""

    name: str
    """The name a plan's stages refer to."""
    accelerator: AcceleratorSpec
    nodes: int = 1
    devices_per_node: int
    network_gbps: float
    """Scale-out network per node, Gbit/s."""
    speed: float | None = None
    """Emulated speed relative to this machine, in (0, 1], on a CPU group only (None: real
    hardware)."""
    intra_node_gb_s: float | None = None
    """The link inside a node as measured on these nodes, GB/s per device per direction (None:
    the accelerator's figure)."""
    hosts: tuple[str, ...] | None = None
    """The host name of each node, in node order (None: not given). A process under torchrun
    without --node finds its node by its host name here (hethub.runtime.nodes)."""
    slurm: SlurmSettings | None = None
    """Where Slurm puts the group's nodes (None: no ``slurm:`` section; `hethub launch` then
    takes its flags)."""
    kubernetes: KubernetesSettings | None = None
    """The group's pods on Kubernetes (None: no ``kubernetes:`` section; `hethub launch jobset`
    then takes its flags)."""
    launch: LaunchSettings | None = None
    """The interpreter and environment of the group's nodes in every form `hethub launch`
    writes (None: no ``launch:`` section; the --python flag and the vendor's defaults)."""

    @property
    def link_gb_s(self) -> float:
        """The intra-node link the predictor prices: the group's measured figure, else the
        accelerator's."""
        if self.intra_node_gb_s is not None:
            return self.intra_node_gb_s
        return self.accelerator.intra_node_gb_s

    @property
    def devices(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def network_gb_s_per_device(self) -> float:
        """Each device's share of its node's network, GB/s."""
        return self.network_gbps / 8.0 / self.devices_per_node


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterSpec:
    """A possibly heterogeneous cluster: named device groups and the network between them."""

    groups: tuple[DeviceGroup, ...]
    cross_group_gbps: float | None = None
    """Per node pair between groups, Gbit/s; None: the smaller network_gbps of the two groups."""
    source: str = ""

    def group(self, name: str) -> DeviceGroup:
        for group in self.groups:
            if group.name == name:
                return group
        raise KeyError(name)

    @property
    def emulated(self) -> bool:
        """Whether any group runs at an emulated ``speed`` (a local run standing in for slower
        devices): its measured times then say what the emulation gives, not real hardware."""
        return any(group.speed is not None for group in self.groups)

    @property
    def group_names(self) -> tuple[str, ...]:
        return tuple(g.name for g in self.groups)

    @property
    def devices(self) -> int:
        return sum(g.devices for g in self.groups)

    def cross_gbps(self, a: DeviceGroup, b: DeviceGroup) -> float:
        """Network between a node of group a and a node of group b, Gbit/s."""
        if self.cross_group_gbps is not None:
            return self.cross_group_gbps
        return min(a.network_gbps, b.network_gbps)


LABELS = ("name", "description")
"""A cluster file's keys for its readers, which hethub accepts and keeps nowhere."""
SECTIONS = ("accelerator", "speed", "hosts", "slurm", "kubernetes", "launch")
"""A group's fields of more than a scalar and its type: each has its own reader below."""
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
"""A name the shell can export (POSIX: letters, digits, '_', not a digit first)."""
SLURM_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")
"""Slurm's time limit forms; slurm_time_seconds reads them."""


def parse_cluster(data: Any, source: str = "") -> ClusterSpec:
    """Validate a parsed cluster file."""
    keys = [name for name in field_names(ClusterSpec) if name != "source"]
    top = Fields(data, source, allowed=(*keys, *LABELS))
    groups: list[DeviceGroup] = []
    for i, raw in enumerate(top.mapping_list("groups")):
        f = Fields(raw, source, f"groups[{i}]", allowed=field_names(DeviceGroup))
        name = f.string("name")
        if any(g.name == name for g in groups):
            raise f.error("name", name, "group names must be unique")
        accelerator = parse_accelerator(f.raw("accelerator"), source, f.path("accelerator"))
        scalars = f.declared(
            DeviceGroup, skip=SECTIONS, defaults={"network_gbps": accelerator.network_gbps}
        )
        groups.append(
            DeviceGroup(
                **scalars,
                accelerator=accelerator,
                speed=_speed(f, accelerator) if f.has("speed") else None,
                hosts=_hosts(f, scalars["nodes"]) if f.has("hosts") else None,
                slurm=_slurm(f.raw("slurm"), source, f.path("slurm")) if f.has("slurm") else None,
                kubernetes=(
                    _kubernetes(f.raw("kubernetes"), source, f.path("kubernetes"))
                    if f.has("kubernetes")
                    else None
                ),
                launch=(
                    _launch(f.raw("launch"), source, f.path("launch")) if f.has("launch") else None
                ),
            )
        )
    return ClusterSpec(
        groups=tuple(groups), **top.declared(ClusterSpec, skip=("groups", "source")), source=source
    )


def _speed(f: Fields, accelerator: AcceleratorSpec) -> float:
    """A group's ``speed``: the runtime emulates a slower device by stretching each pass on this
    machine's CPU with sleep, so it takes a CPU group (on a GPU it would slow a real device and
    misprice it) and at most 1 (sleeping cannot make this machine faster)."""
    speed = f.positive_number("speed")
    if accelerator.vendor != "cpu":
        raise f.error(
            "speed",
            speed,
            f"emulates a slower device on this machine's CPU, so only a group whose accelerator "
            f"is the CPU takes it (this group's is {accelerator.name}); leave it out for real "
            f"hardware",
        )
    if speed > 1:
        raise f.error(
            "speed",
            speed,
            "must be at most 1: the runtime slows a group down by sleeping, it cannot speed one "
            "up (1 is this machine's own speed)",
        )
    return speed


def _hosts(f: Fields, nodes: int) -> tuple[str, ...]:
    """A group's ``hosts``: one distinct host name per node (a node is one machine)."""
    hosts = f.string_list("hosts")
    if len(hosts) != nodes:
        raise f.error(
            "hosts", hosts, f"must name one host per node: {nodes} names (nodes = {nodes})"
        )
    for i, host in enumerate(hosts):
        if host in hosts[:i]:
            raise f.error("hosts", hosts, f"{host!r} is named twice: each node is its own host")
    return tuple(hosts)


def _one_word(f: Fields, settings: dict[str, Any], keys: tuple[str, ...], taker: str) -> None:
    """Each of the section's ``keys`` that it gives is one word, as ``taker`` (a scheduler)
    takes it."""
    for key in keys:
        text = settings[key]
        if text is not None and any(c.isspace() for c in text):
            raise f.error(key, text, f"must be one word, as {taker} takes it (no spaces)")


def _slurm(raw: Any, source: str, prefix: str) -> SlurmSettings:
    """A group's ``slurm:`` section: strings Slurm takes as they are, a time limit in its form."""
    f = Fields(raw, source, prefix, allowed=field_names(SlurmSettings))
    settings = f.declared(SlurmSettings, skip=("time",))
    _one_word(f, settings, ("partition", "constraint", "account"), "Slurm")
    time = None
    if f.has("time"):
        time = str(f.raw("time"))  # a YAML int (minutes) or text
        slurm_time_seconds(time, f.error("time", time, SLURM_TIME_RULE))
    return SlurmSettings(**settings, time=time)


def _kubernetes(raw: Any, source: str, prefix: str) -> KubernetesSettings:
    """A group's ``kubernetes:`` section: an image, node labels, a resource name, each one word."""
    f = Fields(raw, source, prefix, allowed=field_names(KubernetesSettings))
    settings = f.declared(KubernetesSettings, skip=("node_selector",))
    _one_word(f, settings, ("image", "device_resource"), "Kubernetes")
    selector: tuple[tuple[str, str], ...] = ()
    if f.has("node_selector"):
        labels = f.raw("node_selector")
        if (
            not isinstance(labels, dict)
            or not labels
            or not all(isinstance(k, str) and k.strip() for k in labels)
            or not all(isinstance(v, str) for v in labels.values())
        ):
            raise f.error(
                "node_selector",
                labels,
                "must be a mapping of node label to value, both strings (quote a number or "
                'true: "true")',
            )
        selector = tuple(labels.items())
    return KubernetesSettings(**settings, node_selector=selector)


def _launch(raw: Any, source: str, prefix: str) -> LaunchSettings:
    """A group's ``launch:`` section: an interpreter, and variables the shell can export, each a
    string or a whole number (quoted by hethub, as written), or null to drop a vendor default."""
    f = Fields(raw, source, prefix, allowed=field_names(LaunchSettings))
    settings = f.declared(LaunchSettings, skip=("env",))
    env: list[tuple[str, str | None]] = []
    if f.has("env"):
        variables = f.raw("env")
        if not isinstance(variables, dict):
            raise f.error("env", variables, "must be a mapping of variable name to value")
        for name, value in variables.items():
            if not isinstance(name, str) or not ENV_NAME.match(name):
                raise f.error(
                    "env",
                    name,
                    "a variable's name is letters, digits and '_', not a digit first",
                )
            if isinstance(value, bool) or not isinstance(value, (str, int, type(None))):
                raise f.error(
                    f"env.{name}",
                    value,
                    'must be a string or a whole number (quote it: "1", "true"), or null to '
                    "drop the vendor's default",
                )
            env.append((name, None if value is None else str(value)))
    return LaunchSettings(**settings, env=tuple(env))


SLURM_TIME_RULE = (
    "must be a Slurm time limit: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS, above 0"
)


def slurm_time_seconds(text: str, error: Exception) -> int:
    """Seconds of a Slurm time limit (sbatch(1), --time); ``error`` raised when it is not one."""
    found = SLURM_TIME.match(text.strip())
    if not found:
        raise error
    days, first, second, third = found.groups()
    if days is not None:  # D-HH, D-HH:MM, D-HH:MM:SS
        hours, minutes, seconds = int(first), int(second or 0), int(third or 0)
        total = int(days) * 86400 + hours * 3600 + minutes * 60 + seconds
    elif third is not None:  # HH:MM:SS
        total = int(first) * 3600 + int(second) * 60 + int(third)
    elif second is not None:  # MM:SS
        total = int(first) * 60 + int(second)
    else:  # minutes
        total = int(first) * 60
    if total <= 0:
        raise error
    return total


def load_cluster(path: str | Path) -> ClusterSpec:
    """Read and validate a cluster file."""
    return parse_cluster(load_yaml(path, "cluster"), str(path))
