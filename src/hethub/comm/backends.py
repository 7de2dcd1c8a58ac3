"""Which collective library a homogeneous group uses natively, by what this machine has."""

from __future__ import annotations

import importlib.util

import torch


def native_backend() -> str:
    """nccl on CUDA (and on ROCm, where torch's nccl is RCCL), hccl where torch_npu is installed
    (Ascend), xccl on Intel GPUs, gloo on a CPU."""
    if torch.cuda.is_available():
        return "nccl"
    if importlib.util.find_spec("torch_npu") is not None:
        return "hccl"
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return "xccl"
    return "gloo"


def local_device(vendor: str, local_index: int = 0) -> torch.device:
    """Where a rank of a group of ``vendor`` runs on this machine: its accelerator when the machine
    has one of that kind (CUDA for NVIDIA, ROCm's CUDA API for AMD), else the CPU (DESIGN: a local
    run maps groups onto this machine's processes)."""
    if vendor in ("nvidia", "amd") and torch.cuda.is_available():
        is_rocm = torch.version.hip is not None
        if (vendor == "amd") == is_rocm:
            return torch.device("cuda", local_index % torch.cuda.device_count())
    return torch.device("cpu")


def device_backend(device: torch.device) -> str:
    """The collective library of a rank on ``device``: this machine's native one on an
    accelerator, gloo on a CPU."""
    return "gloo" if device.type == "cpu" else native_backend()


def local_devices(vendors: list[str]) -> list[torch.device]:
    """Every rank's device, ranks of accelerator groups taking this machine's accelerators in
    turn."""
    out, taken = [], 0
    for vendor in vendors:
        device = local_device(vendor, taken)
        taken += device.type != "cpu"
        out.append(device)
    return out
