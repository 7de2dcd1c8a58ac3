"""The plan file: the one artifact between the planner and the runtime."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from hethub.spec.fields import Fields, load_yaml
from hethub.spec.schedules import Schedule


class Recompute(enum.StrEnum):
    """A plan's activation recomputation; its value is how plan files spell it."""

    NONE = "none"
    """Every layer keeps its activations for its backward."""
    FULL = "full"
    """Each stage keeps only its input and runs its forward again before its backward."""


class Precision(enum.StrEnum):
    """The numeric format a plan trains in; its value is how plan files spell it."""

    BF16 = "bf16"
    """Mixed precision as Megatron runs it: bf16 weights, activations and matmuls; fp32 main
    gradients, master weights and Adam moments."""
    FP32 = "fp32"
    """Everything in fp32."""


# The spellings plan files and the command line accept.
RECOMPUTE = tuple(r.value for r in Recompute)
PRECISIONS = tuple(p.value for p in Precision)
SCHEDULES = tuple(s.value for s in Schedule)


@dataclass(frozen=True, kw_only=True, slots=True)
class StageSpec:
    """One pipeline stage: ``tp`` devices of one group holding ``layers`` consecutive layers."""

    group: str
    tp: int
    layers: int


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelineLayout:
    """``count`` identical data-parallel replicas, each a pipeline of ``stages``."""

    count: int
    micro_batches: int
    """Micro-batches each replica runs per optimizer step (replicas may differ: an uneven split)."""
    stages: tuple[StageSpec, ...]

    @property
    def devices(self) -> int:
        """Devices of one replica."""
        return sum(stage.tp for stage in self.stages)


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """A hybrid data x tensor x pipeline plan, possibly heterogeneous."""

    model: str
    """Preset name or path of a model YAML (relative to the plan file)."""
    global_batch: int
    micro_batch: int
    recompute: Recompute = Recompute.NONE
    schedule: Schedule = Schedule.ONE_F_ONE_B
    precision: Precision = Precision.BF16
    """bf16 by default: what GPU users expect, what published runs of these models use, and what
    the predictor was calibrated on."""
    pipelines: tuple[PipelineLayout, ...]

    def __post_init__(self) -> None:
        # Plans built in code may spell the choices as strings; the predictor compares members.
        object.__setattr__(self, "recompute", Recompute(self.recompute))
        object.__setattr__(self, "schedule", Schedule(self.schedule))
        object.__setattr__(self, "precision", Precision(self.precision))

    def to_dict(self) -> dict[str, Any]:
        """The plan file's content."""
        return {
            "model": self.model,
            "global_batch": self.global_batch,
            "micro_batch": self.micro_batch,
            "recompute": self.recompute.value,  # plain strings: yaml.safe_dump knows no enums
            "schedule": self.schedule.value,
            "precision": self.precision.value,
            "pipelines": [
                {
                    "count": p.count,
                    "micro_batches": p.micro_batches,
                    "stages": [
                        {"group": s.group, "tp": s.tp, "layers": s.layers} for s in p.stages
                    ],
                }
                for p in self.pipelines
            ],
        }

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None)

    def summary(self) -> str:
        """One line: precision, micro-batch, recomputation and each layout as
        count x [group/tp/layers ...] x micro-batches."""
        layouts = "; ".join(
            f"{p.count}x[{' '.join(f'{s.group}/tp{s.tp}/{s.layers}L' for s in p.stages)}] "
            f"x{p.micro_batches}mb"
            for p in self.pipelines
        )
        return (
            f"{self.precision}, micro-batch {self.micro_batch}, recompute {self.recompute}: "
            f"{layouts}"
        )


def parse_plan(data: Any, source: str = "") -> Plan:
    """Validate a parsed plan file on its own (see spec.check.check_plan for the cluster and the
    model)."""
    top = Fields(
        data,
        source,
        allowed=(
            "model",
            "global_batch",
            "micro_batch",
            "recompute",
            "schedule",
            "precision",
            "pipelines",
        ),
    )
    model = top.string("model")
    global_batch = top.positive_int("global_batch")
    micro_batch = top.positive_int("micro_batch", 1)
    raw_pipelines = top.mapping_list("pipelines")
    counts = []
    for i, raw in enumerate(raw_pipelines):
        counts.append(Fields(raw, source, f"pipelines[{i}]").positive_int("count", 1))
    pipelines = []
    for i, raw in enumerate(raw_pipelines):
        f = Fields(raw, source, f"pipelines[{i}]", allowed=("count", "micro_batches", "stages"))
        if f.has("micro_batches"):
            micro_batches = f.positive_int("micro_batches")
        else:
            micro_batches = _even_split(global_batch, micro_batch, sum(counts), top)
        stages = []
        for j, raw_stage in enumerate(f.mapping_list("stages")):
            s = Fields(
                raw_stage, source, f"pipelines[{i}].stages[{j}]", allowed=("group", "tp", "layers")
            )
            stages.append(
                StageSpec(
                    group=s.string("group"),
                    tp=s.positive_int("tp", 1),
                    layers=s.positive_int("layers"),
                )
            )
        pipelines.append(
            PipelineLayout(count=counts[i], micro_batches=micro_batches, stages=tuple(stages))
        )
    plan = Plan(
        model=model,
        global_batch=global_batch,
        micro_batch=micro_batch,
        recompute=Recompute(top.choice("recompute", RECOMPUTE, Recompute.NONE.value)),
        schedule=Schedule(top.choice("schedule", SCHEDULES, Schedule.ONE_F_ONE_B.value)),
        precision=Precision(top.choice("precision", PRECISIONS, Precision.BF16.value)),
        pipelines=tuple(pipelines),
    )
    sequences = sum(p.count * p.micro_batches for p in plan.pipelines) * micro_batch
    if sequences != global_batch:
        detail = " + ".join(f"{p.count}x{p.micro_batches}" for p in plan.pipelines)
        raise top.error(
            "global_batch",
            global_batch,
            f"must equal the sum of count x micro_batches x micro_batch over pipelines "
            f"(({detail}) x {micro_batch} = {sequences})",
        )
    return plan


def _even_split(global_batch: int, micro_batch: int, replicas: int, top: Fields) -> int:
    if global_batch % (micro_batch * replicas):
        raise top.error(
            "global_batch",
            global_batch,
            f"must divide evenly into {replicas} replica(s) x micro_batch {micro_batch} "
            f"when micro_batches is left out",
        )
    return global_batch // (micro_batch * replicas)


def load_plan(path: str | Path) -> Plan:
    """Read and validate a plan file (on its own; see spec.check.check_plan)."""
    return parse_plan(load_yaml(path, "plan"), str(path))


def uniform_layers(layers: int, stages: int) -> list[int]:
    """Megatron's even split; when it does not divide, the earlier stages take one layer more."""
    base, extra = divmod(layers, stages)
    return [base + (1 if i < extra else 0) for i in range(stages)]


def uniform_plan(
    *,
    model: str,
    group: str,
    tp: int,
    pp: int,
    dp: int,
    micro_batch: int,
    global_batch: int,
    recompute: Recompute = Recompute.NONE,
    schedule: Schedule = Schedule.ONE_F_ONE_B,
    precision: Precision = Precision.BF16,
    layers: int,
) -> Plan:
    """A homogeneous plan: ``dp`` identical replicas of ``pp`` stages of ``tp`` devices of
    ``group``."""
    split = uniform_layers(layers, pp)
    return parse_plan(
        {
            "model": model,
            "global_batch": global_batch,
            "micro_batch": micro_batch,
            "recompute": recompute,
            "schedule": schedule,
            "precision": precision,
            "pipelines": [
                {"count": dp, "stages": [{"group": group, "tp": tp, "layers": n} for n in split]}
            ],
        },
        "command line",
    )
