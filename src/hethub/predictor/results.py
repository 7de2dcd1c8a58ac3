"""What a prediction says: the step's figures and each stage's, and their JSON (hethub predict
--json)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hethub.predictor.memory import StageMemory
from hethub.report.timeline import TimelineEvent
from hethub.spec.plan import Precision


@dataclass(frozen=True, slots=True)
class StagePrediction:
    """One stage of one pipeline layout (the same for each of its ``count`` replicas)."""

    pipeline: int
    position: int
    group: str
    accelerator: str
    tp: int
    layers: int
    chunks: tuple[int, ...]
    """Layers per chunk (one chunk unless the pipeline interleaves)."""
    forward_s: float
    """One micro-batch forward through all its chunks, TP communication included."""
    backward_s: float
    """One micro-batch backward, recomputation and TP communication included."""
    compute_s: float
    """All micro-batches of the step: forward plus backward."""
    send_s: float
    """One activation send to the next stage (0 for the last stage)."""
    grad_sync_s: float
    """The gradients' sum and, with a sharded optimizer, the updated weights' all-gather."""
    param_gather_s: float
    """Of ``grad_sync_s``, a sharded optimizer's all-gather: it follows the optimizer step."""
    optimizer_s: float
    end_s: float
    """When the stage finishes its last backward."""
    memory: StageMemory


@dataclass(frozen=True, slots=True)
class Prediction:
    iteration_time_s: float
    tokens_per_s: float
    model_tflops_per_device: float
    """Model FLOPs (Megatron's convention: attention over all seq^2 pairs, no recomputation)
    a second, per device."""
    mean_peak_tflops: float
    """The dense peak TFLOP/s of the plan's devices in its precision, their device-weighted
    mean: what ``mfu`` divides by."""
    peak_memory_gb: float
    fits: bool
    devices: int
    bubble_fraction: float
    """Device-weighted share of the pipeline time that stages sit idle."""
    pipeline_time_s: tuple[float, ...]
    """Per pipeline layout: from the first forward to the last backward."""
    stages: tuple[StagePrediction, ...]
    precision: Precision = Precision.BF16
    """The plan's precision, which the step was priced in."""
    schedule: str = "1f1b"
    shard_optimizer: bool = False
    overlap_grad_sync: bool = False
    overlap_param_gather: bool = False
    timeline: list[TimelineEvent] | None = field(default=None, compare=False)
    """With predict(..., timeline=True): every simulated operation and communication."""

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation: the model FLOP/s a device achieves over its dense peak in the
        plan's precision (on a mixed cluster, the device-weighted mean peak)."""
        return self.model_tflops_per_device / self.mean_peak_tflops

    def to_json(self) -> dict:
        """The object ``hethub predict --json`` prints."""
        return {
            "precision": self.precision.value,
            "schedule": self.schedule,
            "shard_optimizer": self.shard_optimizer,
            "overlap_grad_sync": self.overlap_grad_sync,
            "overlap_param_gather": self.overlap_param_gather,
            "iteration_time_s": self.iteration_time_s,
            "tokens_per_s": self.tokens_per_s,
            "model_tflops_per_device": self.model_tflops_per_device,
            "mean_peak_tflops": self.mean_peak_tflops,
            "mfu": self.mfu,
            "peak_memory_gb": self.peak_memory_gb,
            "fits": self.fits,
            "devices": self.devices,
            "bubble_fraction": self.bubble_fraction,
            "pipeline_time_s": list(self.pipeline_time_s),
            "stages": [
                {
                    "pipeline": s.pipeline,
                    "stage": s.position,
                    "group": s.group,
                    "accelerator": s.accelerator,
                    "tp": s.tp,
                    "layers": s.layers,
                    "chunks": list(s.chunks),
                    "forward_s": s.forward_s,
                    "backward_s": s.backward_s,
                    "compute_s": s.compute_s,
                    "send_s": s.send_s,
                    "grad_sync_s": s.grad_sync_s,
                    "optimizer_s": s.optimizer_s,
                    "memory_gb": s.memory.total_gb,
                    "memory_breakdown_gb": {
                        "weights": s.memory.weights_gb,
                        "grads": s.memory.grads_gb,
                        "optimizer": s.memory.optimizer_gb,
                        "activations": s.memory.activations_gb,
                        "buffers": s.memory.buffers_gb,
                    },
                }
                for s in self.stages
            ],
        }
