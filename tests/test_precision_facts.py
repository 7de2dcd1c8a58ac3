"""Every byte count that depends on a plan's precision lives on spec.plan.Precision: what the
predictor prices with is what the runtime keeps."""

from __future__ import annotations

import pytest
import torch

from hethub.profiles.types import DTYPE_BYTES
from hethub.spec.buckets import MAIN_GRAD_BYTES
from hethub.spec.plan import Precision


@pytest.mark.parametrize(
    ("precision", "element", "state", "moved"),
    [(Precision.BF16, 2, 18, 30), (Precision.FP32, 4, 16, 28)],
)
def test_bytes_per_parameter_and_per_element(precision, element, state, moved) -> None:
    assert precision.element_bytes == precision.weight_bytes == element
    assert precision.main_grad_bytes == MAIN_GRAD_BYTES == 4  # fp32 main gradients in either
    assert precision.weight_bytes + precision.main_grad_bytes + precision.optimizer_bytes(1) == (
        state
    )
    for shards in (2, 3, 8):  # the moments and bf16's masters, split; fp32 steps the weights
        assert precision.optimizer_bytes(shards) == (state - element - 4) / shards
    assert precision.optimizer_bytes_moved == moved
    assert precision.loss_bytes == 4
    # the runtime computes in the dtype torch names so, and a profile of it has its element size
    assert getattr(torch, precision.dtype_name).itemsize == element
    assert DTYPE_BYTES[precision.value] == element
