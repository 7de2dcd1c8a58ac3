"""The measured A100 iterations of measurements/a100 as hethub specs (shared by the accuracy and
calibration scripts).

Every row is predicted as the data's README says the runs were set up: Megatron-LM GPT, vocabulary
51,200, nodes of 8 x a100-80gb on an 800 Gbit/s network, 1F1B, full recomputation; and its layers
priced as the one that ran, Megatron-LM's (spec.layer_ops' Kernels.MEGATRON_LM: the attention
scores in memory), not hethub's flash-attention layer.
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
from hethub.spec.layer_ops import Kernels

DATA = Path(__file__).resolve().parents[1] / "measurements" / "a100"
FILES = ("vtrain_a100_single_node.csv", "vtrain_a100_multi_node.csv")
MEASURED_KERNELS = Kernels.MEGATRON_LM
"""The layer the rows ran, which they are priced as."""


@dataclass(frozen=True)
class Row:
    file: str
    line: int
    plan: Plan
    cluster: ClusterSpec
    model: ModelSpec
    measured_s: float

    def describe(self) -> str:
        p = self.plan.pipelines[0]
        return (
            f"{self.file}:{self.line} h={self.model.hidden} L={self.model.layers} "
            f"gb={self.plan.global_batch} "
            f"mb={self.plan.micro_batch} tp={p.stages[0].tp} dp={p.count} pp={len(p.stages)}"
        )


def predict_row(row: Row, calibration: Calibration | None = None) -> Prediction:
    """The prediction of ``row``'s run, its layers priced as Megatron-LM's (MEASURED_KERNELS)."""
    return predict(
        row.plan, row.cluster, row.model, calibration=calibration, kernels=MEASURED_KERNELS
    )


def load_rows(data: Path = DATA) -> list[Row]:
    if not data.is_dir():
        raise SystemExit(
            f"{data}: the measured data set is missing (expected measurements/a100 in the repo)"
        )
    rows = []
    for name in FILES:
        with open(data / name, newline="") as handle:
            for line, raw in enumerate(csv.DictReader(handle), start=2):
                rows.append(_row(name, line, raw))
    return rows


def _row(name: str, line: int, raw: dict[str, str]) -> Row:
    gpus, tp, dp, pp = (
        int(raw[k])
        for k in ("# GPUs", "tensor parallelism", "data parallelism", "pipeline parallelism")
    )
    layers = int(raw["# layers"])
    model = parse_model(
        {
            "arch": "gpt",
            "hidden": int(raw["hidden size"]),
            "layers": layers,
            "heads": int(raw["attention heads"]),
            "vocab": 51200,
            "seq_len": int(raw["sequence length"]),
        },
        f"{name}:{line}",
        "gpt",
    )
    cluster = parse_cluster(
        {
            "groups": [
                {
                    "name": "a100",
                    "accelerator": "a100-80gb",
                    "nodes": math.ceil(gpus / 8),
                    "devices_per_node": 8,
                    "network_gbps": 800,
                }
            ]
        },
        f"{name}:{line}",
    )
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
                    "stages": [{"group": "a100", "tp": tp, "layers": layers // pp}] * pp,
                }
            ],
        },
        f"{name}:{line}",
    )
    check_plan(plan, cluster, model, f"{name}:{line}", tp_within_node=False)
    return Row(name, line, plan, cluster, model, float(raw["iteration time (ms)"]) / 1e3)
