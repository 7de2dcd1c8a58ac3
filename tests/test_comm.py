"""The communicator's backend choice and its paths."""

from __future__ import annotations

import torch

from hethub.comm import native_backend


def test_a_machine_without_accelerators_talks_gloo():
    if torch.cuda.is_available():
        assert native_backend() == "nccl"
    else:
        assert native_backend() in ("gloo", "hccl", "xccl")
        assert native_backend() == "gloo" or not torch.cuda.is_available()
