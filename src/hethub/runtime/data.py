"""Training data, the runtime's side: a batch's tokens onto the device. The corpora themselves,
read where they lie and shuffled by epoch, are hethub.corpus's."""

from __future__ import annotations

import torch


def to_device(tokens: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tokens`` on ``device``, copied without making the host wait: staged through pinned
    (page-locked) host memory where the device is an accelerator, which copies from it
    asynchronously; on the CPU the tensor itself."""
    if device.type != "cpu":
        tokens = tokens.pin_memory()
    return tokens.to(device, non_blocking=True)
