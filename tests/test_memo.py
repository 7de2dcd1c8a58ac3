"""hethub.memo: every cache of src/ belongs to a Memo that a search, a prediction or a run opens
and drops, and none outlives it.

conftest opens a Memo for every test; what must run outside every scope runs here in a fresh
contextvars.Context, which holds none."""

from __future__ import annotations

import ast
import contextvars
import gc
import weakref
from pathlib import Path

import pytest

import hethub
from hethub.memo import active_memo, memo_scope, memoized
from hethub.planner import search
from hethub.predictor import predict
from hethub.spec import load_cluster, load_model, load_plan, parse_cluster, parse_model

PACKAGE = Path(hethub.__file__).parent
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

PROCESS_WIDE = {
    # Each reads a file packaged with hethub or a fact of this machine: one entry, the same for
    # the whole process, so a cache of it holds nothing a search or a run filled.
    ("spec/accelerator.py", "_catalog_data"): "the packaged accelerator catalog",
    ("launchers/environment.py", "vendor_environments"): "the packaged vendor environments",
    ("launchers/jobset.py", "device_plugins"): "the packaged device plugins",
    ("profiles/machine.py", "cpu_model"): "this machine's CPU",
}


def outside_every_scope(fn, *args):
    """``fn(*args)`` in a context with no Memo active (not the test's)."""
    return contextvars.Context().run(fn, *args)


def _is_functools_cache(node: ast.expr) -> bool:
    """functools.cache / functools.lru_cache / cache / lru_cache, called or not."""
    if isinstance(node, ast.Call):
        node = node.func
    name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", None)
    return name in {"cache", "lru_cache"}


def test_no_module_level_cache_in_src_but_the_process_wide_four():
    found = set()
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == "memo.py":  # the Memo's own tables, one per memoized function per Memo
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                if any(_is_functools_cache(d) for d in node.decorator_list):
                    found.add((rel, node.name))
            elif isinstance(node, ast.Call) and _is_functools_cache(node.func):
                found.add((rel, f"line {node.lineno}"))  # functools.lru_cache(...)(fn)
    assert found == set(PROCESS_WIDE)


CALLS: list[tuple[int, int]] = []


@memoized
def _add(a: int, b: int = 0) -> int:
    """A memoized function whose every real call is counted."""
    CALLS.append((a, b))
    return a + b


def _calls_of(work) -> list[tuple[int, int]]:
    CALLS.clear()
    work()
    return list(CALLS)


def test_inside_a_scope_each_distinct_call_is_computed_once():
    def work():
        with memo_scope():
            assert [_add(1, 2), _add(1, 2), _add(2, 1), _add(1, 2), _add(3)] == [3, 3, 3, 3, 3]

    assert outside_every_scope(_calls_of, work) == [(1, 2), (2, 1), (3, 0)]


def test_outside_every_scope_every_call_runs():
    def work():
        assert active_memo() is None
        assert [_add(1, 2), _add(1, 2)] == [3, 3]

    assert outside_every_scope(_calls_of, work) == [(1, 2), (1, 2)]


def test_a_memo_and_its_entries_are_gone_when_its_scope_ends():
    def work():
        with memo_scope() as memo:
            _add(4, 5)
            assert memo.entries() == 1
            held = weakref.ref(memo)
        del memo
        gc.collect()
        return held, active_memo()

    held, after = outside_every_scope(work)
    assert held() is None
    assert after is None


def test_a_scope_inside_a_scope_joins_it_and_a_new_one_starts_empty():
    def work():
        with memo_scope() as outer:
            _add(6, 7)
            with memo_scope() as inner:
                _add(6, 7)
            assert inner is outer
            assert active_memo() is outer  # the inner scope's end leaves the outer one active
        with memo_scope() as later:
            assert later is not outer and later.entries() == 0
            _add(6, 7)

    assert outside_every_scope(_calls_of, work) == [(6, 7), (6, 7)]


def test_a_scope_left_by_an_exception_is_deactivated():
    def work():
        with pytest.raises(ZeroDivisionError), memo_scope():
            _add(8)
            _ = 1 / 0
        return active_memo()

    assert outside_every_scope(work) is None


def test_memoized_keeps_the_function_s_name_and_docstring():
    assert _add.__name__ == "_add"
    assert _add.__doc__ == "A memoized function whose every real call is counted."


def _example_plan():
    plan = load_plan(EXAMPLES / "plans" / "hethub-768-llama-140b.yaml")
    return plan, load_cluster(EXAMPLES / "clusters" / "hethub-768.yaml"), load_model(plan.model)


def test_a_prediction_is_the_same_inside_and_outside_a_scope_and_fills_the_memo():
    plan, cluster, model = _example_plan()

    def inside():
        with memo_scope() as memo:
            prediction = predict(plan, cluster, model)
            return prediction, memo.entries()

    alone = outside_every_scope(predict, plan, cluster, model)
    scoped, entries = outside_every_scope(inside)
    assert scoped == alone
    assert scoped.iteration_time_s == alone.iteration_time_s
    assert entries > 0  # predict() read and filled the scope's Memo


def test_a_search_runs_in_a_memo_of_its_own_and_leaves_none_active():
    model = parse_model(
        {"arch": "llama", "hidden": 64, "layers": 4, "heads": 4, "vocab": 256, "seq_len": 64},
        "test",
        "tiny",
    )
    groups = [{"name": "a", "accelerator": "a100-40gb", "devices_per_node": 2}]
    cluster = parse_cluster({"groups": groups}, "test")
    seen = []

    def work():
        result = search(
            cluster, model, 4, model_ref="tiny", progress=lambda *_: seen.append(active_memo())
        )
        return result, active_memo()

    result, after = outside_every_scope(work)
    assert result.best is not None
    assert after is None
    assert seen and all(memo is seen[0] for memo in seen)
    assert seen[0] is not None and seen[0].entries() > 0
