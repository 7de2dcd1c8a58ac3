"""Fit the predictor's physical parameters (the `calibration:` block of the catalog) to the
measured A100 iterations of measurements/a100.

Usage: python benchmarks/calibrate.py [--iterations N] [--hold NAME=VALUE ...]

``--hold`` keeps a parameter at a value known from the hardware instead of fitting it (a fraction
that a free fit drives to its bound, 1.0, is compensating for something else).
Prints the fitted values as YAML to paste into src/hethub/data/catalog.yaml. The objective is the
mean of the per-file MAPEs, so that the 41 multi-node rows weigh as much as the 1,440 single-node
ones. Needs SciPy (`pip install scipy`); the predictor itself does not.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vtrain_rows import load_rows, predict_row

from hethub.predictor import Calibration, default_calibration
from hethub.predictor.compute import embedding_cost, head_cost, layer_cost

FRACTIONS = {"matmul_efficiency", "memory_efficiency", "link_efficiency", "network_efficiency"}


def per_file_mape(cal: Calibration, rows) -> dict[str, float]:
    errors = defaultdict(list)
    for row in rows:
        predicted = predict_row(row, cal).iteration_time_s
        errors[row.file].append(abs(predicted - row.measured_s) / row.measured_s)
    return {name: 100 * sum(e) / len(e) for name, e in errors.items()}


HELD_IN_THE_CATALOG = ("link_efficiency",)
"""What the catalog's calibration holds instead of fitting (docs/predictor.md says why): a free
fit drives it to its bound, 1.0 of the NVLink figure, which no collective reaches."""


def fit(rows, start: Calibration, held: dict[str, float], iterations: int, say=None) -> Calibration:
    """Nelder-Mead from ``start`` over every parameter but ``held``, minimising the mean of the
    per-file MAPEs of ``rows`` (fractions through a logistic, the rest through a log)."""
    from scipy.optimize import minimize

    start = dataclasses.replace(start, **held)
    names = [f.name for f in dataclasses.fields(Calibration) if f.init and f.name not in held]

    def to_cal(x) -> Calibration:
        values = dict(held)
        for name, v in zip(names, x):
            values[name] = 1 / (1 + math.exp(-v)) if name in FRACTIONS else math.exp(v)
        return dataclasses.replace(start, **values)

    def objective(x) -> float:
        for cached in (layer_cost, embedding_cost, head_cost):
            cached.cache_clear()
        mapes = per_file_mape(to_cal(x), rows)
        return sum(mapes.values()) / len(mapes)

    # A fraction fitted to its bound prints as 1 (4 digits): start just inside it.
    x0 = [
        math.log(v / (1 - v)) if n in FRACTIONS else math.log(v)
        for n, v in ((n, getattr(start, n)) for n in names)
        for v in [min(v, 1 - 1e-4) if n in FRACTIONS else v]
    ]
    if say:
        say(f"start: {per_file_mape(start, rows)}")
    result = minimize(
        objective,
        x0,
        method="Nelder-Mead",
        options={"maxiter": iterations, "xatol": 1e-3, "fatol": 1e-3},
    )
    fitted = to_cal(result.x)
    if say:
        say(f"fitted: {per_file_mape(fitted, rows)} in {result.nfev} evaluations")
    return fitted


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=1500)
    parser.add_argument(
        "--hold", action="append", default=[], metavar="NAME=VALUE", help="not fitted"
    )
    args = parser.parse_args()
    held = {name: float(value) for name, value in (h.split("=", 1) for h in args.hold)}
    fitted = fit(
        load_rows(),
        default_calibration(),
        held,
        args.iterations,
        say=lambda line: print(line, file=sys.stderr),
    )
    print("calibration:")
    for name in (f.name for f in dataclasses.fields(Calibration) if f.init):
        print(f"  {name}: {getattr(fitted, name):.4g}{'  (held)' if name in held else ''}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
