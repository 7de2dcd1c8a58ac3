"""The plan file: the one artifact between the planner and the runtime."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from hethub.errors import SpecError
from hethub.spec.fields import Fields, field_names, load_yaml
from hethub.spec.schedules import Schedule, chunks_per_stage, stage_model_chunks


class Recompute(enum.StrEnum):
    """A plan's activation recomputation; its value is how plan files spell it."""

    NONE = "none"
    """Every layer keeps its activations for its backward."""
    SELECTIVE = "selective"
    """Each layer's attention keeps only its QKV projection's output and runs its inner part
    (the rotations, v's copy, the attention kernel) again in its backward (Megatron-LM's
    selective recomputation, Korthikanti et al. 2022)."""
    FULL = "full"
    """Each layer keeps only its input and runs its forward again before its backward."""


FP32_BYTES = 4
"""Bytes of one fp32 element."""
MAIN_GRAD_BYTES = FP32_BYTES
"""Bytes of one element of the gradients the sync sums: fp32 main gradients in either precision
(bf16 training accumulates into its fp32 masters' gradients, as Megatron does)."""


class Precision(enum.StrEnum):
    """The numeric format a plan trains in; its value is how plan files spell it.

    Every byte count that depends on the precision is read here, by the predictor (what it
    prices), the profile store (a profile's dtype) and the runtime (the dtype it computes in).
    """

    BF16 = "bf16"
    """Mixed precision as Megatron runs it: bf16 weights, activations and matmuls; fp32 main
    gradients, master weights and Adam moments."""
    FP32 = "fp32"
    """Everything in fp32."""

    @property
    def dtype_name(self) -> str:
        """The dtype weights, activations and matmuls compute in, as torch names it
        (getattr(torch, name))."""
        return "bfloat16" if self is Precision.BF16 else "float32"

    @property
    def element_bytes(self) -> int:
        """Bytes of one element of the compute dtype: what activations, memory-bound operators'
        traffic, tensor-parallel all-reduces and pipeline sends move."""
        return 2 if self is Precision.BF16 else FP32_BYTES

    @property
    def weight_bytes(self) -> int:
        """Bytes per parameter of the weights the model computes with (the compute dtype)."""
        return self.element_bytes

    @property
    def main_grad_bytes(self) -> int:
        """Bytes per parameter of the gradients kept and summed (fp32 in either precision)."""
        return MAIN_GRAD_BYTES

    @property
    def master_weights(self) -> bool:
        """The optimizer updates an fp32 copy of the weights (bf16), not the weights (fp32)."""
        return self is Precision.BF16

    def optimizer_bytes(self, shards: int) -> float:
        """Optimizer state per parameter on one of ``shards`` ranks sharing it: both fp32 Adam
        moments and bf16's fp32 master weights, split over the shards: 12 / shards bytes in bf16,
        8 / shards in fp32, where a sharded optimizer steps its shard of the weights themselves
        and keeps no copy of it (as Megatron-LM's distributed optimizer does)."""
        state = 2 * FP32_BYTES + (FP32_BYTES if self.master_weights else 0)
        return state if shards == 1 else state / shards  # whole bytes when unsharded

    @property
    def optimizer_bytes_moved(self) -> int:
        """Bytes Adam reads and writes per parameter of a step: the main gradient, the fp32
        weight it updates and both moments (read and write each), and bf16's copy back to its
        bf16 weight: 30 in bf16, 28 in fp32."""
        copy_back = self.weight_bytes if self.master_weights else 0
        return self.main_grad_bytes + 2 * FP32_BYTES + 2 * 2 * FP32_BYTES + copy_back

    @property
    def grad_accumulation_bytes(self) -> int:
        """Bytes moved per parameter when a backward's gradients join the main gradients: the
        backward's gradient (the compute dtype) read, the fp32 main gradient read and written
        (hethub's runtime, at each chunk's backward)."""
        return self.weight_bytes + 2 * self.main_grad_bytes

    @property
    def loss_bytes(self) -> int:
        """Bytes of one element of the cross-entropy's logits and of the loss (fp32 in either
        precision)."""
        return FP32_BYTES


# The spellings plan files and the command line accept.
RECOMPUTE = tuple(r.value for r in Recompute)
PRECISIONS = tuple(p.value for p in Precision)
DEFAULT_PRECISION = Precision.BF16
"""A plan's precision where none is given: what GPU users expect, what published runs of these
models use, and what the predictor was calibrated on."""
SCHEDULES = tuple(s.value for s in Schedule)


@dataclass(frozen=True, kw_only=True, slots=True)
class StageSpec:
    """One pipeline stage: ``tp`` devices of one group holding ``layers`` layers, in ``chunks``
    of consecutive layers (one chunk unless its pipeline interleaves: stage s of p then holds the
    model's chunks s, s + p, ..., in that order)."""

    group: str
    tp: int = 1
    layers: int
    """All the stage's layers, over its chunks."""
    chunks: tuple[int, ...] = ()
    """Layers per chunk; left out, one chunk of ``layers``."""
    recompute: Recompute | None = None
    """The stage's activation recomputation; left out (None), the plan's (Plan fills it in)."""

    def __post_init__(self) -> None:
        if self.recompute is not None:
            object.__setattr__(self, "recompute", Recompute(self.recompute))
        if len(self.chunks) <= 1:  # one chunk: all the layers (dataclasses.replace included)
            object.__setattr__(self, "chunks", (self.layers,))
        elif sum(self.chunks) != self.layers:
            raise ValueError(f"chunks {self.chunks} do not sum to the stage's {self.layers} layers")

    @classmethod
    def of_chunks(
        cls,
        group: str,
        tp: int,
        chunks: tuple[int, ...] | list[int],
        recompute: Recompute | None = None,
    ) -> StageSpec:
        """A stage holding ``chunks`` (layers per chunk)."""
        return cls(
            group=group, tp=tp, layers=sum(chunks), chunks=tuple(chunks), recompute=recompute
        )

    def layers_field(self) -> int | list[int]:
        """``layers`` as plan files spell it: a count for one chunk, else the list."""
        return self.layers if len(self.chunks) == 1 else list(self.chunks)


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelineLayout:
    """``count`` identical data-parallel replicas, each a pipeline of ``stages``."""

    count: int = 1
    micro_batches: int
    """Micro-batches each replica runs per optimizer step (replicas may differ: an uneven split)."""
    stages: tuple[StageSpec, ...]
    schedule: Schedule | None = None
    """The replicas' pipeline schedule; left out (None), the plan's (Plan fills it in)."""

    def __post_init__(self) -> None:
        if self.schedule is not None:
            object.__setattr__(self, "schedule", Schedule(self.schedule))

    @property
    def devices(self) -> int:
        """Devices of one replica."""
        return sum(stage.tp for stage in self.stages)

    @property
    def virtual_stages(self) -> int:
        """Chunks per stage (every stage holds as many): 1 unless the pipeline interleaves."""
        return len(self.stages[0].chunks)

    def chunk_layers(self) -> list[int]:
        """Layers of each of the model's chunks, in model order: stage s's chunk c is the
        model's spec.schedules.model_chunk (c x p + s but under ZBV's V)."""
        p, v = len(self.stages), self.virtual_stages
        schedule = self.schedule or Schedule.INTERLEAVED_1F1B
        layers = [0] * (p * v)
        for stage, held in zip(self.stages, stage_model_chunks(schedule, p, v)):
            for g, count in zip(held, stage.chunks):
                layers[g] = count
        return layers


def stage_chunk_layers(
    schedule: Schedule, chunk_layers: Sequence[int], stages: int
) -> list[list[int]]:
    """Each stage's layers per chunk, from each of the model's chunks' layers in model order:
    PipelineLayout.chunk_layers' inverse."""
    chunks = len(chunk_layers) // stages
    return [
        [chunk_layers[g] for g in held] for held in stage_model_chunks(schedule, stages, chunks)
    ]


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """A hybrid data x tensor x pipeline plan, possibly heterogeneous."""

    model: str
    """Preset name or path of a model YAML (relative to the plan file)."""
    global_batch: int
    micro_batch: int = 1
    recompute: Recompute = Recompute.NONE
    """Every stage's recomputation, where the stage does not set its own (StageSpec.recompute)."""
    schedule: Schedule = Schedule.ONE_F_ONE_B
    """Every layout's schedule, where the layout does not set its own
    (PipelineLayout.schedule)."""
    precision: Precision = DEFAULT_PRECISION
    shard_optimizer: bool = False
    """Split the optimizer state (Adam moments, bf16's fp32 master weights) across the
    data-parallel ranks holding the same parameters (Megatron's distributed optimizer, ZeRO-1)."""
    overlap_grad_sync: bool = False
    """Sync each gradient bucket as soon as the last backward writing it ends, during the
    backwards still to run, instead of after the last one."""
    overlap_param_gather: bool = False
    """With a sharded optimizer: leave the all-gather of the updated weights under way after the
    step, each bucket waited for just before the next step's first forward that reads it
    (Megatron-LM's overlap_param_gather). Off by default, as there: docs/formats.md has why."""
    compile: bool = False
    """Compile each transformer layer with torch.compile (runtime.compiled), as torchtitan does
    per block: the same training, in fewer and fused kernels, after a compilation at the first
    step. Off by default: docs/runtime.md, "Compile", has where it pays."""
    sequence_parallel: bool = False
    """At every stage of TP > 1, split the norms' and the residual's activations along the
    sequence over the TP ranks, with all-gather and reduce-scatter in place of the TP all-reduces
    (Megatron-LM's sequence parallelism): docs/runtime.md, "Sequence parallelism"."""
    pipelines: tuple[PipelineLayout, ...]

    def __post_init__(self) -> None:
        # Plans built in code may spell the choices as strings; the predictor compares members.
        object.__setattr__(self, "recompute", Recompute(self.recompute))
        object.__setattr__(self, "schedule", Schedule(self.schedule))
        object.__setattr__(self, "precision", Precision(self.precision))
        # Each layout's schedule and each stage's recomputation, the plan's where left out: what
        # the predictor and the runtime read.
        object.__setattr__(
            self,
            "pipelines",
            tuple(
                dataclasses.replace(
                    p,
                    schedule=p.schedule or self.schedule,
                    stages=tuple(
                        s if s.recompute else dataclasses.replace(s, recompute=self.recompute)
                        for s in p.stages
                    ),
                )
                for p in self.pipelines
            ),
        )

    def to_dict(self) -> dict[str, Any]:
        """The plan file's content."""
        settings: dict[str, Any] = {}
        for field in dataclasses.fields(self):  # the scalars, as parse_plan reads them
            value = getattr(self, field.name)
            if field.name == "pipelines" or value is False:  # a switch off is left out
                continue
            # plain strings: yaml.safe_dump knows no enums
            settings[field.name] = value.value if isinstance(value, enum.Enum) else value
        return {
            **settings,
            "pipelines": [
                {
                    "count": p.count,
                    "micro_batches": p.micro_batches,
                    **({"schedule": p.schedule.value} if p.schedule != self.schedule else {}),
                    **({"virtual_stages": p.virtual_stages} if p.virtual_stages > 1 else {}),
                    "stages": [
                        {
                            "group": s.group,
                            "tp": s.tp,
                            "layers": s.layers_field(),
                            **(
                                {"recompute": s.recompute.value}
                                if s.recompute != self.recompute
                                else {}
                            ),
                        }
                        for s in p.stages
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

        def stage_text(s: StageSpec) -> str:
            own = f"/recompute {s.recompute}" if s.recompute != self.recompute else ""
            return f"{s.group}/tp{s.tp}/{_layers_text(s)}L{own}"

        layouts = "; ".join(
            f"{p.count}x[{' '.join(map(stage_text, p.stages))}] x{p.micro_batches}mb"
            + (f" {p.schedule}" if p.schedule != self.schedule else "")
            for p in self.pipelines
        )
        extras = "".join(
            f", {what}"
            for what, on in (
                (str(self.schedule), self.schedule != Schedule.ONE_F_ONE_B),
                ("sharded optimizer", self.shard_optimizer),
                ("overlapped grad sync", self.overlap_grad_sync),
                ("overlapped param gather", self.overlap_param_gather),
                ("compiled layers", self.compile),
                ("sequence parallel", self.sequence_parallel),
            )
            if on
        )
        return (
            f"{self.precision}, micro-batch {self.micro_batch}, recompute {self.recompute}"
            f"{extras}: {layouts}"
        )

    def stage_names(self, pipeline: int, position: int) -> tuple[str, str, str]:
        """How the tables of hethub predict, plan and validate name a stage, after the plan file:
        its pipeline (the index under ``pipelines``, and that layout's replicas), its position
        from 0, and its layers (chunk by chunk, "3+2", where the pipeline interleaves)."""
        layout = self.pipelines[pipeline]
        stage = layout.stages[position]
        return f"{pipeline} (x{layout.count})", str(position), _layers_text(stage)


def _layers_text(stage: StageSpec) -> str:
    return "+".join(map(str, stage.chunks))


PLAN_KEYS = tuple(field.name for field in dataclasses.fields(Plan))
"""A plan file's top-level keys: Plan's fields, in the order a plan file writes them."""
LAYOUT_KEYS = (*field_names(PipelineLayout), "virtual_stages")
"""A layout's keys: its declared fields, and its chunks per stage (which its stages' chunks
hold, once read)."""
STAGE_KEYS = tuple(name for name in field_names(StageSpec) if name != "chunks")
"""A stage's keys: its declared fields but its chunks (given as its ``layers``' list)."""


def parse_plan(data: Any, source: str = "") -> Plan:
    """Validate a parsed plan file on its own (see spec.check.check_plan for the cluster and the
    model). Its scalar fields are Plan's, read by their declared types and defaults
    (Fields.declared); its pipelines are read layout by layout."""
    top = Fields(data, source, allowed=PLAN_KEYS)
    settings = top.declared(Plan, skip=("pipelines",))
    layouts = [
        Fields(raw, source, f"pipelines[{i}]", allowed=LAYOUT_KEYS)
        for i, raw in enumerate(top.mapping_list("pipelines"))
    ]
    scalars = [
        f.declared(
            PipelineLayout,
            skip=("micro_batches", "stages"),
            defaults={"schedule": settings["schedule"]},
        )
        for f in layouts
    ]
    replicas = sum(layout["count"] for layout in scalars)
    pipelines = tuple(
        _parse_layout(f, layout, settings, replicas, top) for f, layout in zip(layouts, scalars)
    )
    plan = Plan(**settings, pipelines=pipelines)
    if plan.overlap_param_gather and not plan.shard_optimizer:
        raise top.error(
            "overlap_param_gather",
            True,
            "needs shard_optimizer: true (only a sharded optimizer gathers the weights)",
        )
    sequences = sum(p.count * p.micro_batches for p in plan.pipelines) * plan.micro_batch
    if sequences != plan.global_batch:
        detail = " + ".join(f"{p.count}x{p.micro_batches}" for p in plan.pipelines)
        raise top.error(
            "global_batch",
            plan.global_batch,
            f"must equal the sum of count x micro_batches x micro_batch over pipelines "
            f"(({detail}) x {plan.micro_batch} = {sequences})",
        )
    return plan


def _parse_layout(
    f: Fields, scalars: dict[str, Any], settings: dict[str, Any], replicas: int, top: Fields
) -> PipelineLayout:
    """One pipeline layout of a plan file (``scalars``: its count and schedule, read;
    ``settings``: the plan's scalar fields, its defaults; ``replicas``: every layout's count,
    which an even split divides among)."""
    schedule = scalars["schedule"]
    if f.has("micro_batches"):
        micro_batches = f.positive_int("micro_batches")
    else:
        micro_batches = _even_split(
            settings["global_batch"], settings["micro_batch"], replicas, top
        )
    fixed_chunks = chunks_per_stage(schedule)
    virtual_stages = f.positive_int("virtual_stages", fixed_chunks or 1)
    if fixed_chunks is not None and virtual_stages != fixed_chunks:
        raise f.error(
            "virtual_stages",
            virtual_stages,
            f"schedule {schedule.value} runs {fixed_chunks} chunk(s) per stage"
            + (
                f"; more needs schedule {Schedule.INTERLEAVED_1F1B.value} (any count) or "
                f"{Schedule.ZBV.value} (2)"
                if fixed_chunks == 1
                else "; give each stage's layers as a list of 2 (its chunks s and 2p - 1 - s)"
            ),
        )
    raw_stages = f.mapping_list("stages")
    if virtual_stages > 1 and len(raw_stages) < 2:
        what = f"schedule {schedule.value}" if fixed_chunks else "more than one chunk per stage"
        raise f.error(
            "schedule" if fixed_chunks else "virtual_stages",
            schedule.value if fixed_chunks else virtual_stages,
            f"{what} needs a pipeline of at least 2 stages (this one has 1)",
        )
    stages = []
    for j, raw_stage in enumerate(raw_stages):
        s = Fields(raw_stage, f.source, f.path(f"stages[{j}]"), allowed=STAGE_KEYS)
        stage = s.declared(
            StageSpec, skip=("layers", "chunks"), defaults={"recompute": settings["recompute"]}
        )
        chunks = tuple(_chunks(s, virtual_stages))
        stages.append(StageSpec(**stage, layers=sum(chunks), chunks=chunks))
    return PipelineLayout(**scalars, micro_batches=micro_batches, stages=tuple(stages))


def _chunks(stage: Fields, virtual_stages: int) -> list[int]:
    """A stage's ``layers``: a count (one chunk) or a list of ``virtual_stages`` counts."""
    value = stage.raw("layers")
    if isinstance(value, list):
        if len(value) != virtual_stages or not all(
            isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in value
        ):
            raise stage.error(
                "layers",
                value,
                f"must be a list of virtual_stages ({virtual_stages}) positive integers, "
                f"the layers of each of the stage's chunks",
            )
        return value
    if virtual_stages > 1:
        raise stage.error(
            "layers",
            value,
            f"must be a list of virtual_stages ({virtual_stages}) positive integers, "
            f"the layers of each of the stage's chunks",
        )
    return [stage.positive_int("layers")]


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


@dataclass(frozen=True, slots=True)
class UniformLayout:
    """A homogeneous layout, as Megatron-LM's flags give one: ``dp`` identical replicas of ``pp``
    stages of ``tp`` devices of ``group``, each stage holding ``virtual_stages`` chunks of the
    model's ``layers`` split evenly over pp x virtual_stages chunks."""

    group: str
    tp: int
    pp: int
    dp: int
    layers: int
    virtual_stages: int = 1


def uniform_plan(
    layout: UniformLayout, *, model: str, global_batch: int, micro_batch: int, **settings: Any
) -> Plan:
    """The plan of ``layout`` at ``global_batch`` sequences a step, ``micro_batch`` each;
    ``settings``: the plan's other fields (recompute, schedule, precision, shard_optimizer, ...),
    Plan's defaults where left out. Raises SpecError where the batch does not split evenly over
    the replicas' micro-batches."""
    micro_batches, rest = divmod(global_batch, layout.dp * micro_batch)
    if rest or not micro_batches:
        raise SpecError(
            "command line",
            "global_batch",
            global_batch,
            f"must be a positive multiple of dp x micro_batch ({layout.dp} x {micro_batch})",
        )
    schedule = Schedule(settings.get("schedule", Schedule.ONE_F_ONE_B))
    split = uniform_layers(layout.layers, layout.pp * layout.virtual_stages)
    stages = tuple(
        StageSpec.of_chunks(layout.group, layout.tp, chunks)
        for chunks in stage_chunk_layers(schedule, split, layout.pp)
    )
    pipeline = PipelineLayout(count=layout.dp, micro_batches=micro_batches, stages=stages)
    return Plan(
        model=model,
        global_batch=global_batch,
        micro_batch=micro_batch,
        pipelines=(pipeline,),
        **settings,
    )
