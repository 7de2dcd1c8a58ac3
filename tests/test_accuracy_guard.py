"""The predictor stays within the accuracy targets on measured training runs it was not fitted
on, and the calibration stays a fit of only what no microbenchmark pins down.

The figures are produced by benchmarks/predictor_accuracy.py (issue 36); this guards them against
a change to the predictor that silently breaks its accuracy. The data lies in measurements/.
"""

from __future__ import annotations

import sys
from collections import defaultdict

import pytest
from benchmark_scripts import load_benchmark

from hethub.predictor import default_calibration
from hethub.predictor.calibration import fitted_bounds


def _errors(rows, module) -> dict[str, list]:
    errors = defaultdict(list)
    for row in rows:
        predicted = module.predict_row(row).iteration_time_s
        errors[row.file].append((row, (predicted - row.measured_s) / row.measured_s))
    return errors


def _accuracy():
    saved_path = list(sys.path)
    try:
        return load_benchmark("predictor_accuracy")
    finally:
        sys.path[:] = saved_path  # it puts benchmarks/ on the path for its own imports


def test_megatron_lm_s_published_table_is_priced_within_the_targets_without_being_fitted():
    # Megatron-LM's README table (1.7B to 1T parameters, 32 to 3,072 A100s) is never fitted on:
    # the catalog's device figures are microbenchmarks and the step-level fit saw vTrain's rows
    # only. Targets: MAPE <= 8%, no row beyond 20%, the signed mean of its TP 8 rows within 5%.
    rows = load_benchmark("measured_rows")
    assert rows.MEGATRON_TABLE not in rows.FITTED_ON
    (items,) = _errors(rows.load_rows(rows.HELD_OUT), rows).values()
    assert len(items) == 10
    assert 100 * sum(abs(e) for _, e in items) / len(items) <= 8.0
    assert max(100 * abs(e) for _, e in items) <= 20.0
    tp8 = [e for row, e in items if row.tp == 8]
    assert abs(100 * sum(tp8) / len(tp8)) <= 5.0


def test_the_rows_the_calibration_is_fitted_on_stay_near_their_fit():
    # In sample the error rose from 7.23% / 6.22% when the devices' efficiency was fitted to
    # these rows (it overfitted them, issue 36) to 8.21% / 6.55% with the device figures from
    # microbenchmarks; this holds each file within 9%.
    rows = load_benchmark("measured_rows")
    errors = _errors(rows.load_rows(rows.FITTED_ON), rows)
    assert set(errors) == {"vtrain_a100_single_node.csv", "vtrain_a100_multi_node.csv"}
    for name, items in errors.items():
        assert 100 * sum(abs(e) for _, e in items) / len(items) <= 9.0, name


def test_the_catalog_calibration_lies_inside_the_bounds_a_fit_may_use():
    cal = default_calibration()
    for name, bound in fitted_bounds().items():
        assert bound.low <= getattr(cal, name) <= bound.high, name


@pytest.mark.slow
def test_a_fit_moves_only_its_fitted_parameters_and_never_past_their_bounds():
    rows = load_benchmark("measured_rows")
    calibrate = load_benchmark("calibrate")
    few = rows.load_rows(rows.FITTED_ON)[::60]
    start = default_calibration()
    fitted = calibrate.fit(few, start, {"step_overhead_ms": 2.0}, 40)
    bounds = fitted_bounds()
    assert fitted.step_overhead_ms == 2.0  # held
    assert (fitted.link_efficiency, fitted.network_efficiency) == (
        start.link_efficiency,
        start.network_efficiency,
    )
    for name, bound in bounds.items():
        assert bound.low <= getattr(fitted, name) <= bound.high, name


def test_the_extrapolated_fold_fits_on_small_models_and_prices_only_larger_ones():
    rows = load_benchmark("measured_rows")
    accuracy = _accuracy()
    fitted = rows.load_rows(rows.FITTED_ON)
    small = [r for r in fitted if r.model.hidden <= accuracy.SMALL_HIDDEN]
    large = [r for r in fitted if r.model.hidden > accuracy.SMALL_HIDDEN]
    assert small and large and {r.model.hidden for r in large} == {6144}


def test_the_interpolated_folds_hold_each_model_out_whole_in_folds_that_span_the_sizes():
    # benchmarks/predictor_accuracy.py scores each fold's rows with a calibration fitted on the
    # other folds' rows: a model's rows are all in one fold, or its fit would have seen it.
    rows = load_benchmark("measured_rows").load_rows()
    folds = _accuracy().folds_by_model_size(rows, 4)
    assert len(folds) == 4
    assert sorted(id(row) for fold in folds for row in fold) == sorted(map(id, rows))
    fold_of = {}
    for i, fold in enumerate(folds):
        for row in fold:
            assert fold_of.setdefault(row.model, i) == i, row.describe()
    for fold in folds:  # each fold holds a small and a large hidden size
        hidden = {row.model.hidden for row in fold}
        assert min(hidden) == 1024 and max(hidden) >= 2048, hidden
