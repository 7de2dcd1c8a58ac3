"""Frozen dataclasses hashed once, when they are made: they key the predictor's and the planner's
caches in their inner loops, where a generated __hash__ would hash every field on each lookup."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def hashed_once(key: Callable[[Any], object] | None = None) -> Callable[[type[T]], type[T]]:
    """A class decorator, placed under ``@dataclass(frozen=True, ...)``: the instance's hash is
    that of ``key(self)`` (default: its compared fields, in order), computed in __post_init__.

    It adds the ``_hash`` field (before the dataclass is made, so that slots have room for it)
    and a __hash__ of the class's own, which the dataclass then keeps.
    """

    def decorate(cls: type[T]) -> type[T]:
        cls.__annotations__["_hash"] = "int"
        cls._hash = dataclasses.field(default=0, init=False, repr=False, compare=False)
        compared: list[tuple[str, ...]] = []  # the field names, once the dataclass exists

        def __post_init__(self) -> None:
            if key is not None:
                value = key(self)
            else:
                if not compared:
                    compared.append(tuple(f.name for f in dataclasses.fields(self) if f.compare))
                value = tuple(getattr(self, name) for name in compared[0])
            object.__setattr__(self, "_hash", hash(value))

        def __hash__(self) -> int:
            return self._hash

        cls.__post_init__ = __post_init__
        cls.__hash__ = __hash__
        return cls

    return decorate
