"""Predict every measured A100 iteration in measurements/a100 and report the error per file.

Usage: python benchmarks/predictor_accuracy.py [--worst N]
Target (issue 2): mean absolute percentage error <= 8% on each file.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vtrain_rows import load_rows, predict_row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--worst", type=int, default=1, help="rows with the largest error to print per file"
    )
    args = parser.parse_args()
    started = time.perf_counter()
    errors = defaultdict(list)
    for row in load_rows():
        predicted = predict_row(row).iteration_time_s
        errors[row.file].append((abs(predicted - row.measured_s) / row.measured_s, predicted, row))
    ok = True
    for name, items in errors.items():
        mape = 100 * sum(e for e, _, _ in items) / len(items)
        ok &= mape <= 8.0
        print(f"{name}: {len(items)} rows, MAPE {mape:.2f}%  (target <= 8%)")
        for error, predicted, row in sorted(items, key=lambda item: -item[0])[: args.worst]:
            print(
                f"  worst: {row.describe()} measured {row.measured_s * 1e3:.1f} ms, "
                f"predicted {predicted * 1e3:.1f} ms, error {100 * error:.1f}%"
            )
    print(
        f"predicted {sum(map(len, errors.values()))} rows "
        f"in {time.perf_counter() - started:.2f} s; "
        f"{'target met' if ok else 'TARGET MISSED'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
