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
