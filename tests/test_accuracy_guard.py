"""The calibrated predictor stays within the accuracy target on the measured A100 iterations.

The figures are produced by benchmarks/predictor_accuracy.py; this guards them against a change
to the predictor that silently breaks its accuracy. The data lies in measurements/a100.
"""

from __future__ import annotations

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
