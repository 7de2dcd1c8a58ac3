"""The predictor's step-level parameters: what no microbenchmark of a device pins down.

A device's own figures (its GEMM, attention and memory efficiency and its kernel launch) are the
catalog's, per accelerator, each from a microbenchmark (spec.accelerator.DeviceEfficiency). What
is left is priced here: the framework's dispatch of an operator, the collectives' share of their
links, their latency, a GEMM's fixed tail and a step's overhead outside the model. Each of these
that benchmarks/calibrate.py fits to measured step times stays inside bounds the catalog writes
next to their physical reason; the rest are held at a published figure.
"""

from __future__ import annotations

from dataclasses import dataclass

from hethub.spec.accelerator import calibration_data
from hethub.spec.hashing import hashed_once


@dataclass(frozen=True, kw_only=True, slots=True)
@hashed_once()
class Calibration:
    """Six scalars, the same for every device and model (the catalog's `calibration:`)."""

    dispatch_us: float
    """The framework's host time to dispatch one operator (Python, autograd, the dispatcher),
    before the device's own launch: with the launches it is what a pass of small operators
    waits on the host for."""
    matmul_ramp_us: float
    """Fixed device time of every GEMM on top of its roofline time (its last partial wave of
    tiles, its start)."""
    link_efficiency: float
    """Fraction of the intra-node link bandwidth that collectives reach."""
    network_efficiency: float
    """Fraction of the per-device network bandwidth that collectives reach."""
    collective_latency_us: float
    """Latency of one step of a ring collective, or of one point-to-point message."""
    step_overhead_ms: float
    """Fixed cost of one optimizer step outside the model (loss scaling, data loading, the
    step's synchronisation)."""


@dataclass(frozen=True, slots=True)
class Bound:
    """Where a fit may move one parameter, and why there."""

    low: float
    high: float
    reason: str


def default_calibration() -> Calibration:
    """The calibration stored in the catalog data file."""
    return Calibration(**{name: entry["value"] for name, entry in calibration_data().items()})


def fitted_bounds() -> dict[str, Bound]:
    """The parameters benchmarks/calibrate.py may fit, with their bounds; the others are held."""
    return {
        name: Bound(*entry["fitted"], entry["why"])
        for name, entry in calibration_data().items()
        if "fitted" in entry
    }
