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


def local_device(vendor: str, local_rank: int = 0) -> torch.device:
    """Where a rank of a group of ``vendor`` runs on its node: the accelerator numbered
    ``local_rank`` (modulo the ones this process sees, so CUDA_VISIBLE_DEVICES and its kin choose
    which) when the node has that vendor's kind (CUDA for NVIDIA, ROCm's CUDA API for AMD,
    torch_npu for Ascend, XPU for Intel), else the CPU: a local run emulates any group there."""
    rocm = torch.version.hip is not None
    if vendor in ("nvidia", "amd") and torch.cuda.is_available() and (vendor == "amd") == rocm:
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    if vendor == "huawei" and importlib.util.find_spec("torch_npu") is not None:
        import torch_npu  # noqa: F401  (registers torch.npu)

        if torch.npu.is_available():
            return torch.device("npu", local_rank % torch.npu.device_count())
    if vendor == "intel" and hasattr(torch, "xpu") and torch.xpu.is_available():
        return torch.device("xpu", local_rank % torch.xpu.device_count())
    return torch.device("cpu")


def peak_memory_bytes(device: torch.device) -> int | None:
    """The most memory the process has held on ``device`` (None on a CPU: nothing counts it)."""
    if device.type == "cpu":
        return None
    return getattr(torch, device.type).max_memory_allocated(device)


def device_backend(device: torch.device) -> str:
    """The collective library of a rank on ``device``: this machine's native one on an
    accelerator, gloo on a CPU."""
    return "gloo" if device.type == "cpu" else native_backend()
