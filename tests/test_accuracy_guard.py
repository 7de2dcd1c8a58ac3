"""The calibrated predictor stays within the accuracy target on the measured A100 iterations.

The figures are produced by benchmarks/predictor_accuracy.py; this guards them against a change
to the predictor that silently breaks its accuracy. The data lies in measurements/a100.
"""

from __future__ import annotations

import sys
from collections import defaultdict

from benchmark_scripts import load_benchmark


def test_mape_on_each_measured_file_is_at_most_8_percent():
    errors = defaultdict(list)
    rows = load_benchmark("vtrain_rows")
    for row in rows.load_rows():
        predicted = rows.predict_row(row).iteration_time_s
        errors[row.file].append(abs(predicted - row.measured_s) / row.measured_s)
    assert set(errors) == {"vtrain_a100_single_node.csv", "vtrain_a100_multi_node.csv"}
    for name, values in errors.items():
        assert 100 * sum(values) / len(values) <= 8.0, name


def test_the_held_out_accuracy_holds_each_model_out_whole_in_folds_that_span_the_sizes():
    # benchmarks/predictor_accuracy.py scores each fold's rows with a calibration fitted on the
    # other folds' rows: a model's rows are all in one fold, or its fit would have seen it.
    rows = load_benchmark("vtrain_rows").load_rows()
    saved_path = list(sys.path)
    try:
        accuracy = load_benchmark("predictor_accuracy")
    finally:
        sys.path[:] = saved_path  # it puts benchmarks/ on the path for its own imports
    folds = accuracy.folds_by_model_size(rows, 4)
    assert len(folds) == 4
    assert sorted(id(row) for fold in folds for row in fold) == sorted(map(id, rows))
    fold_of = {}
    for i, fold in enumerate(folds):
        for row in fold:
            assert fold_of.setdefault(row.model, i) == i, row.describe()
    for fold in folds:  # each fold holds a small and a large hidden size
        hidden = {row.model.hidden for row in fold}
        assert min(hidden) == 1024 and max(hidden) >= 2048, hidden
