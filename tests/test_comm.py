"""The communicator's native backend choice."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from hethub.comm import native_backend


@pytest.mark.skipif(
    torch.cuda.is_available() or importlib.util.find_spec("torch_npu") is not None,
    reason="this machine has an accelerator with a native library",
)
def test_a_machine_without_accelerators_talks_gloo():
    assert native_backend() == "gloo"
