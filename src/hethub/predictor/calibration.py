"""The predictor's physical parameters: the share of datasheet speed real training gets."""

from __future__ import annotations

from dataclasses import dataclass, field

from hethub.spec.accelerator import calibration_data


@dataclass(frozen=True, kw_only=True, slots=True)
class Calibration:
    """Nine scalars fitted on measured iterations (benchmarks/calibrate.py); never per model."""

    matmul_efficiency: float
    """Fraction of peak TFLOP/s a large GEMM reaches."""
    matmul_half_dim: float
    """A GEMM whose narrowest dimension is this wide reaches half of that efficiency."""
    matmul_ramp_us: float
    """Fixed device time of every GEMM on top of its FLOPs (tile waves, kernel start)."""
    memory_efficiency: float
    """Fraction of memory bandwidth that memory-bound operators reach."""
    launch_us: float
    """Host time to launch one operator; a layer takes the larger of host and device time."""
    link_efficiency: float
    """Fraction of the intra-node link bandwidth that collectives reach."""
    network_efficiency: float
    """Fraction of the per-device network bandwidth that collectives reach."""
    collective_latency_us: float
    """Latency of one step of a ring collective, or of one point-to-point message."""
    step_overhead_ms: float
    """Fixed cost of one optimizer step outside the model (grad-norm, loss scaling, data
    loading)."""

    _hash: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Hashed once: instances key the predictor's and planner's caches in their inner loops.
        object.__setattr__(
            self,
            "_hash",
            hash(
                (
                    self.matmul_efficiency,
                    self.matmul_half_dim,
                    self.matmul_ramp_us,
                    self.memory_efficiency,
                    self.launch_us,
                    self.link_efficiency,
                    self.network_efficiency,
                    self.collective_latency_us,
                    self.step_overhead_ms,
                )
            ),
        )

    def __hash__(self) -> int:
        return self._hash


def default_calibration() -> Calibration:
    """The calibration stored in the catalog data file."""
    return Calibration(**calibration_data())
