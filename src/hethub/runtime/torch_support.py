"""The torch hethub runs on: the range it supports, checked where a command needs torch, and
the installed build, which `hethub --version` names.

hethub keeps the torch that is installed (a vendor's CUDA, ROCm, torch_npu or XPU build), so it
checks the version instead of pinning it. Nothing here imports torch at import time, so that
`hethub --version`, and the commands that never run torch (plan, predict), stay without it.
"""

from __future__ import annotations

import importlib.util
import re

from hethub.errors import HethubError

# The oldest torch with every API hethub calls: torch.distributed.all_gather_single and
# reduce_scatter_single (the sharded optimizer and its profile) are new in 2.13. Keep these in
# step with pyproject.toml's torch requirement.
MINIMUM = (2, 13)
NEXT_MAJOR = 3  # a new major may change the APIs hethub calls: not supported until tested
SUPPORTED = f">={MINIMUM[0]}.{MINIMUM[1]},<{NEXT_MAJOR}"
FIX = (
    "install a torch in that range built for your accelerator (the README gives each vendor's "
    "pip line), e.g. on a CPU: pip install torch==2.13.0 --index-url "
    "https://download.pytorch.org/whl/cpu"
)


def check_torch_version(version: str) -> None:
    """Raise HethubError, in one line, unless ``version`` (torch.__version__, e.g. 2.13.0+cpu or
    a vendor's 2.14.0a0+git1234) is in the supported range; only major.minor count."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise HethubError(f"cannot read the installed torch's version {version!r}")
    major_minor = (int(match[1]), int(match[2]))
    if MINIMUM <= major_minor and major_minor[0] < NEXT_MAJOR:
        return
    why = (
        "a new major version may change the APIs it calls"
        if major_minor[0] >= NEXT_MAJOR
        else f"it calls APIs new in {MINIMUM[0]}.{MINIMUM[1]}"
    )
    raise HethubError(
        f"torch {version} is installed, hethub supports torch {SUPPORTED} ({why}): " + FIX
    )


def require_supported_torch() -> None:
    """Raise HethubError, in one line, unless a torch of the supported range is installed; the
    commands that need torch call this before any of their torch code runs."""
    if importlib.util.find_spec("torch") is None:
        raise HethubError(f"torch is not installed, hethub supports torch {SUPPORTED}: {FIX}")
    import torch

    check_torch_version(torch.__version__)


def describe_build(
    version: str,
    *,
    cuda: str | None = None,
    hip: str | None = None,
    xpu: str | None = None,
    npu: str | None = None,
) -> str:
    """torch's version and the accelerator its build is for, e.g. ``torch 2.13.0+cpu, CPU build``
    or ``torch 2.13.0+rocm7.2, ROCm 7.2 build``; ``npu`` is torch_npu's version where installed.
    """
    if hip:
        build = f"ROCm {'.'.join(hip.split('.')[:2])} build"
    elif cuda:
        build = f"CUDA {cuda} build"
    elif xpu:
        build = "Intel XPU build"
    else:
        build = "CPU build"
    if npu:  # torch_npu runs on top of torch's CPU build
        build += f", with torch_npu {npu} for Ascend NPUs"
    return f"torch {version}, {build}"


def installed_torch() -> str:
    """The installed torch's version and build (see describe_build), or ``torch not installed``."""
    if importlib.util.find_spec("torch") is None:
        return "torch not installed"
    import torch

    npu = None
    if importlib.util.find_spec("torch_npu") is not None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            npu = version("torch-npu")
        except PackageNotFoundError:  # built from source without metadata
            npu = "(version unknown)"
    return describe_build(
        torch.__version__,
        cuda=torch.version.cuda,
        hip=torch.version.hip,
        xpu=getattr(torch.version, "xpu", None),
        npu=npu,
    )
