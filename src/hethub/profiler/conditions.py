"""Where and under what conditions the profiler measures: the device a profile's name is measured
on, the cores it may use, the process groups its ranks measure in, and the stamp (machine, torch,
load, time) a profile records.
"""

from __future__ import annotations

import datetime
import os

import torch

from hethub.comm import local_device
from hethub.errors import HethubError
from hethub.profiles.machine import cpu_model, host_name, load_average
from hethub.profiles.types import MeasuredOn
from hethub.runtime.process_groups import GroupSpec, Role, blocks, create_groups
from hethub.spec.accelerator import catalog


def measuring_device(device_name: str) -> torch.device:
    """Where profiles named ``device_name`` are measured on this machine: its CUDA (or ROCm) GPU
    when the name is a catalog accelerator of NVIDIA (AMD), else its CPU (``cpu``, an inline CPU
    accelerator's name, an emulated group's label). An accelerator this machine lacks, or one of
    a vendor the profiler cannot drive, is an error in one line."""
    known = catalog().get(device_name.strip().lower())
    vendor = known.vendor if known is not None else "cpu"
    if vendor == "cpu":
        return torch.device("cpu")
    kind = _VENDOR_PHRASE.get(vendor, f"a {vendor}")
    if vendor not in ("nvidia", "amd"):
        raise HethubError(
            f"--device = {device_name!r}: {kind} accelerator; hethub profile measures this "
            f"machine's CPU or its NVIDIA/AMD GPU (CUDA or ROCm)"
        )
    device = local_device(vendor)
    if device.type == "cpu":
        api = "ROCm" if vendor == "amd" else "CUDA"
        raise HethubError(
            f"--device = {device_name!r}: {kind} accelerator, and this machine has no {api} "
            f"GPU to measure it on (torch.cuda.is_available() is "
            f"{torch.cuda.is_available()}); profile it on a machine that has one"
        )
    return device


_VENDOR_PHRASE = {
    "nvidia": "an NVIDIA",
    "amd": "an AMD",
    "intel": "an Intel",
    "huawei": "a Huawei",
    "other": "an other vendor's",
}


def describe_device(device: torch.device) -> str:
    """'CPU', or 'GPU (NVIDIA H200)'."""
    if device.type == "cpu":
        return "CPU"
    return f"GPU ({torch.cuda.get_device_name(device)})"


def measured_here(where: torch.device, load_before: float | None) -> MeasuredOn:
    """This machine, its torch, and the load average at a measurement's start (``load_before``)
    and now, its end: where a profile measured on ``where`` came from."""
    builds = (("cuda", torch.version.cuda), ("hip", getattr(torch.version, "hip", None)))
    return MeasuredOn(
        host=host_name(),
        cpu=cpu_model(),
        gpu=torch.cuda.get_device_name(where) if where.type == "cuda" else None,
        torch=torch.__version__,
        torch_build=next((f"{name} {version}" for name, version in builds if version), "cpu"),
        load_before=load_before,
        load_after=load_average(),
    )


def available_cores() -> int:
    """CPU cores this process (and the measuring processes it starts) may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def block_group(world: int, size: int, role: Role):
    """Collective: the groups of consecutive blocks of ``size`` ranks (process_groups.blocks);
    this rank's, or None when it is in none or alone in its block."""
    specs = [GroupSpec(role, ranks, "gloo") for ranks in blocks(world, size)]
    return next((group.handle for group in create_groups(specs).values()), None)


def timestamp() -> str:
    """Now, in UTC (ISO 8601, to the second): when a profile was measured."""
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
