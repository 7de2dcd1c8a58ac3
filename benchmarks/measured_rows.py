"""The measured training runs of measurements/ as hethub specs, each priced as the software that
ran it (shared by the accuracy and calibration scripts).

Each data set is a run of some software, and its rows are priced as that software's layer (the
predictor's `kernels`), not hethub's: a prediction that priced Megatron-LM's attention scores as
flash attention would be fitted to make up the difference, and carry it into every other plan.

- vTrain's A100 iterations (measurements/a100): Megatron-LM GPT, as its README says: nodes of 8 x
  a100-80gb on an 800 Gbit/s network, 1F1B, full recomputation, no gradient bucketing. Priced as
  Kernels.MEGATRON_LM (no flash attention, the scores in memory, dropout, its fused kernels where
  they applied). The calibration is fitted on these rows (FITTED_ON).
- Megatron-LM's published table (measurements/megatron-lm): its README's Table 1, GPT from 1.7B
  to 1T parameters on DGX A100 (Selene: 8 x a100-80gb a node, 8 x 200 Gbit/s HDR), with the
  settings of Megatron-LM's examples/sc21/run_table_1.sh. Priced as Kernels.MEGATRON_LM too: the
  same software, a year apart. Never fitted on (HELD_OUT).
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

from hethub.predictor import Calibration, Prediction, predict
from hethub.spec import (
    ClusterSpec,
    ModelSpec,
    Plan,
    check_plan,
    parse_cluster,
    parse_model,
    parse_plan,
)
from hethub.spec.ops import Kernels

MEASUREMENTS = Path(__file__).resolve().parents[1] / "measurements"
VOCAB = 51200
"""Megatron-LM's GPT-2 vocabulary padded to a multiple of 1024, in every data set here."""


@dataclass(frozen=True)
class DataSet:
    """One file of measured runs, and the software description that prices it."""

    folder: str
    file: str
    kernels: Kernels
    """The layer that ran (predict's ``kernels``)."""
    why: str
    """Why that description prices these runs."""


VTRAIN_SINGLE = DataSet(
    "a100",
    "vtrain_a100_single_node.csv",
    Kernels.MEGATRON_LM,
    "vTrain ran Megatron-LM's GPT (no flash attention; fused softmax, bias-GELU, bias-dropout-add)",
)
VTRAIN_MULTI = DataSet("a100", "vtrain_a100_multi_node.csv", Kernels.MEGATRON_LM, VTRAIN_SINGLE.why)
MEGATRON_TABLE = DataSet(
    "megatron-lm",
    "megatron_lm_table1_a100.csv",
    Kernels.MEGATRON_LM,
    "Megatron-LM's own runs of 2021 (its SC21 scripts), the same layer as vTrain's",
)
FITTED_ON = (VTRAIN_SINGLE, VTRAIN_MULTI)
"""What benchmarks/calibrate.py fits the step-level parameters to."""
HELD_OUT = (MEGATRON_TABLE,)
"""Never fitted on: priced by the catalog's calibration as it is."""
ALL = FITTED_ON + HELD_OUT


@dataclass(frozen=True)
class Row:
    file: str
    line: int
    plan: Plan
    cluster: ClusterSpec
    model: ModelSpec
    measured_s: float
    kernels: Kernels = Kernels.MEGATRON_LM

    @property
    def tp(self) -> int:
        return self.plan.pipelines[0].stages[0].tp

    def describe(self) -> str:
        p = self.plan.pipelines[0]
        return (
            f"{self.file}:{self.line} h={self.model.hidden} L={self.model.layers} "
            f"gb={self.plan.global_batch} "
            f"mb={self.plan.micro_batch} tp={self.tp} dp={p.count} pp={len(p.stages)}"
        )


def predict_row(row: Row, calibration: Calibration | None = None) -> Prediction:
    """The prediction of ``row``'s run, its layers priced as the software that ran it."""
    return predict(row.plan, row.cluster, row.model, calibration=calibration, kernels=row.kernels)


def load_rows(datasets: tuple[DataSet, ...] = FITTED_ON) -> list[Row]:
    rows = []
    for data in datasets:
        path = MEASUREMENTS / data.folder / data.file
        if not path.is_file():
            raise SystemExit(f"{path}: the measured data set is missing (expected in the repo)")
        read = _megatron_table_row if data is MEGATRON_TABLE else _vtrain_row
        with open(path, newline="") as handle:
            for line, raw in enumerate(csv.DictReader(handle), start=2):
                rows.append(read(data, line, raw))
    return rows


def _gpt(raw: dict[str, str], seq_len: int, where: str) -> ModelSpec:
    return parse_model(
        {
            "arch": "gpt",
            "hidden": int(raw["hidden size"]),
            "layers": int(raw["# layers"]),
            "heads": int(raw["attention heads"]),
            "vocab": VOCAB,
            "seq_len": seq_len,
        },
        where,
        "gpt",
    )


def _a100_nodes(gpus: int, network_gbps: float | None, where: str) -> ClusterSpec:
    group = {
        "name": "a100",
        "accelerator": "a100-80gb",
        "nodes": math.ceil(gpus / 8),
        "devices_per_node": 8,
    }
    if network_gbps is not None:
        group["network_gbps"] = network_gbps
    return parse_cluster({"groups": [group]}, where)


def _vtrain_row(data: DataSet, line: int, raw: dict[str, str]) -> Row:
    where = f"{data.file}:{line}"
    gpus, tp, dp, pp = (
        int(raw[k])
        for k in ("# GPUs", "tensor parallelism", "data parallelism", "pipeline parallelism")
    )
    model = _gpt(raw, int(raw["sequence length"]), where)
    cluster = _a100_nodes(gpus, 800, where)
    global_batch, micro_batch = int(raw["global batch"]), int(raw["micro batch"])
    plan = parse_plan(
        {
            "model": "gpt",
            "global_batch": global_batch,
            "micro_batch": micro_batch,
            "recompute": "full",
            "pipelines": [
                {
                    "count": dp,
                    "micro_batches": global_batch // (dp * micro_batch),
                    "stages": [{"group": "a100", "tp": tp, "layers": model.layers // pp}] * pp,
                }
            ],
        },
        where,
    )
    check_plan(plan, cluster, model, where, tp_within_node=False)
    return Row(
        data.file, line, plan, cluster, model, float(raw["iteration time (ms)"]) / 1e3, data.kernels
    )


SEQ_LEN = 2048
"""Megatron-LM's Table 1: every model at sequence 2048."""


def megatron_model_flops(model: ModelSpec, global_batch: int) -> float:
    """The FLOPs of one step as Megatron-LM's paper counts them for its TFLOP/s (Narayanan et
    al. 2021, eq. 3): 96 B s l h^2 (1 + s / 6h + V / 16lh), full recomputation's extra forward
    included."""
    b, s, layers, h, v = global_batch, model.seq_len, model.layers, model.hidden, model.vocab
    return 96 * b * s * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))


def _megatron_table_row(data: DataSet, line: int, raw: dict[str, str]) -> Row:
    """A row of Megatron-LM's Table 1 as its SC21 script ran it: full recomputation (uniform,
    one layer a checkpoint), the interleaved schedule where it gives layers per virtual stage,
    torch's DDP (gradients all-reduced in buckets during the backward: overlap_grad_sync) where
    the script says DDP=torch and Megatron's local DDP (after the backward) where it says local.
    Its measured step is the paper's FLOPs (megatron_model_flops) over the achieved TFLOP/s and
    the GPUs."""
    where = f"{data.file}:{line}"
    model = _gpt(raw, SEQ_LEN, where)
    gpus, tp, pp = (int(raw[k]) for k in ("# GPUs", "tensor parallelism", "pipeline parallelism"))
    global_batch, micro_batch = int(raw["global batch"]), int(raw["micro batch"])
    dp = gpus // (tp * pp)
    cluster = _a100_nodes(gpus, None, where)  # the catalog's DGX A100: 8 x 200 Gbit/s HDR
    per_stage = model.layers // pp
    stage: dict = {"group": "a100", "tp": tp, "layers": per_stage}
    pipeline: dict = {"count": dp, "micro_batches": global_batch // (dp * micro_batch)}
    plan: dict = {
        "model": "gpt",
        "global_batch": global_batch,
        "micro_batch": micro_batch,
        "recompute": "full",
    }
    chunk = raw["layers per virtual stage"]
    if chunk and per_stage // int(chunk) > 1:
        stage["layers"] = [int(chunk)] * (per_stage // int(chunk))
        pipeline["virtual_stages"] = per_stage // int(chunk)
        plan["schedule"] = "interleaved-1f1b"
    pipeline["stages"] = [stage] * pp
    plan["pipelines"] = [pipeline]
    plan["overlap_grad_sync"] = raw["data-parallel module"] == "torch"
    parsed = parse_plan(plan, where)
    check_plan(parsed, cluster, model, where, tp_within_node=False)
    achieved = float(raw["achieved TFLOP/s per GPU"]) * 1e12
    measured_s = megatron_model_flops(model, global_batch) / (gpus * achieved)
    return Row(data.file, line, parsed, cluster, model, measured_s, data.kernels)
