"""The caches of one search, prediction or run, owned by it and dropped with it.

A pure function that a search or a prediction asks again and again with the same arguments
(a layer's cost, a stage's memory, a schedule's order) is ``@memoized``. Its answers are kept
in the ``Memo`` of the work that is running, which ``memo_scope()`` opens where that work
starts (``@memo_scope()`` on planner.search, predictor.predict, the runtime's train, the dry
run; or a ``with`` block). Everything the work calls shares them, and they go when the work
ends: nothing a search filled outlives it, grows with the searches a process runs, or is read
by the next one. With no scope open, a memoized function simply runs: the same answer,
computed again.

An inner scope joins the outer one, so that a prediction made inside a search reads the
search's caches. The active Memo is a context variable: a thread or task started outside a
scope sees none (and runs uncached), never another's."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


class Memo:
    """The caches of one piece of work: per memoized function, its answers by argument tuple.
    Dropping the Memo drops every answer."""

    __slots__ = ("__weakref__", "_tables")

    def __init__(self) -> None:
        # Per function, functools' unbounded cache of it: its C key-making and lookup are
        # faster than a dict keyed in Python, and it holds only what this Memo asked.
        self._tables: dict[Callable, Callable] = {}

    def cached(self, fn: Callable[P, R]) -> Callable[P, R]:
        """``fn`` with its answers kept in this Memo."""
        table = self._tables.get(fn)
        if table is None:
            table = self._tables[fn] = functools.lru_cache(maxsize=None)(fn)
        return table

    def entries(self) -> int:
        """How many answers this Memo holds, over every function."""
        return sum(table.cache_info().currsize for table in self._tables.values())


_active: ContextVar[Memo | None] = ContextVar("hethub_memo", default=None)


def active_memo() -> Memo | None:
    """The Memo of the work running in this context, or None outside every scope."""
    return _active.get()


@contextlib.contextmanager
def memo_scope() -> Iterator[Memo]:
    """The Memo of the work about to run: the enclosing scope's if there is one (a prediction
    inside a search shares the search's), else a new one, active until the block ends, by an
    exception too."""
    outer = _active.get()
    if outer is not None:
        yield outer
        return
    memo = Memo()
    token = _active.set(memo)
    try:
        yield memo
    finally:
        _active.reset(token)


def memoized(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn``, its answers kept in the active Memo (memo_scope); with none active, it runs.
    ``fn`` must be pure and its arguments hashable, as for functools.cache."""

    current = _active.get  # bound once: the hot path of every search is this call

    @functools.wraps(fn)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        memo = current()
        if memo is None:
            return fn(*args, **kwargs)
        try:
            table = memo._tables[fn]
        except KeyError:
            table = memo.cached(fn)
        return table(*args, **kwargs) if kwargs else table(*args)  # no empty dict to pass on

    return call
