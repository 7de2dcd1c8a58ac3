"""Fit the predictor's step-level parameters (the catalog's `calibration:` entries marked
`fitted`) to the measured A100 iterations of measurements/a100, each inside its bounds.

Usage: python benchmarks/calibrate.py [--iterations N] [--hold NAME=VALUE ...]

Only what no microbenchmark of a device pins down is fitted: the framework's dispatch of an
operator, a GEMM's fixed tail, a collective's latency and a step's overhead, each within the
bounds the catalog writes next to its physical reason. A device's GEMM, attention and memory
efficiency and its kernel launch are its own catalog figures, from microbenchmarks, and are never
fitted to step times. ``--hold`` keeps a fitted parameter at a value.

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

from measured_rows import FITTED_ON, load_rows, predict_row

from hethub.memo import memo_scope
from hethub.predictor import Calibration, default_calibration
from hethub.predictor.calibration import Bound, fitted_bounds


@memo_scope()  # one evaluation's caches: dropped with it, so a fit's memory stays one evaluation's
def per_file_mape(cal: Calibration, rows) -> dict[str, float]:
    errors = defaultdict(list)
    for row in rows:
        predicted = predict_row(row, cal).iteration_time_s
        errors[row.file].append(abs(predicted - row.measured_s) / row.measured_s)
    return {name: 100 * sum(e) / len(e) for name, e in errors.items()}


def fit(rows, start: Calibration, held: dict[str, float], iterations: int, say=None) -> Calibration:
    """Nelder-Mead from ``start`` over the catalog's fitted parameters but ``held``, minimising
    the mean of the per-file MAPEs of ``rows``; each parameter moves inside its bounds (through
    a logistic between them), never outside."""
    from scipy.optimize import minimize

    start = dataclasses.replace(start, **held)
    bounds = {name: b for name, b in fitted_bounds().items() if name not in held}
    names = list(bounds)

    def inside(value: float, bound: Bound) -> float:
        span = bound.high - bound.low
        share = min(max((value - bound.low) / span, 1e-4), 1 - 1e-4)
        return math.log(share / (1 - share))

    def to_cal(x) -> Calibration:
        values = {
            name: bounds[name].low + (bounds[name].high - bounds[name].low) / (1 + math.exp(-v))
            for name, v in zip(names, x)
        }
        return dataclasses.replace(start, **values)

    def objective(x) -> float:
        mapes = per_file_mape(to_cal(x), rows)
        return sum(mapes.values()) / len(mapes)

    x0 = [inside(getattr(start, name), bounds[name]) for name in names]
    if say:
        say(f"start: {per_file_mape(start, rows)}")
    # Each vertex moves one parameter by a unit of its logit (about a fifth of its range from
    # the middle): scipy's default simplex moves a parameter at its midpoint (logit 0) by 0.00025.
    simplex = [x0] + [
        [v + (1.0 if i == j else 0.0) for j, v in enumerate(x0)] for i in range(len(x0))
    ]
    result = minimize(
        objective,
        x0,
        method="Nelder-Mead",
        options={
            "maxiter": iterations,
            "xatol": 1e-3,
            "fatol": 1e-3,
            "initial_simplex": simplex,
        },
    )
    fitted = to_cal(result.x)
    if say:
        say(f"fitted: {per_file_mape(fitted, rows)} in {result.nfev} evaluations")
    return fitted


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=600)
    parser.add_argument(
        "--hold", action="append", default=[], metavar="NAME=VALUE", help="not fitted"
    )
    args = parser.parse_args()
    held = {name: float(value) for name, value in (h.split("=", 1) for h in args.hold)}
    fitted = fit(
        load_rows(FITTED_ON),
        default_calibration(),
        held,
        args.iterations,
        say=lambda line: print(line, file=sys.stderr),
    )
    bounds = fitted_bounds()
    print("calibration:")
    for name in (f.name for f in dataclasses.fields(Calibration) if f.init):
        how = (
            "held"
            if name in held or name not in bounds
            else f"fitted in [{bounds[name].low:g}, {bounds[name].high:g}]"
        )
        print(f"  {name}: {getattr(fitted, name):.4g}  # {how}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
