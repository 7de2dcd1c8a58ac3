"""Reading typed fields out of parsed YAML, with one clear error per broken rule."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from hethub.errors import HethubError, SpecError

_MISSING = object()


def load_yaml(path: str | Path, what: str) -> Any:
    """Parse a YAML file; a missing file or a syntax error becomes one clear HethubError."""
    path = Path(path)
    if not path.is_file():
        raise HethubError(f"{path}: {what} file not found (give the path of an existing YAML file)")
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise HethubError(f"{path}: not valid YAML{where}: {problem}") from None
    except UnicodeDecodeError:
        raise HethubError(f"{path}: not a text file (a {what} file is UTF-8 YAML)") from None


def suggestion(name: str, choices: Iterable[str]) -> str:
    """' (did you mean X?)' for a near miss, else ''."""
    close = difflib.get_close_matches(name.lower(), list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


class Fields:
    """Typed access to one mapping of a spec file; every error names file, field and rule."""

    def __init__(self, data: Any, source: str, prefix: str = "", allowed: Iterable[str] = ()):
        if not isinstance(data, dict):
            raise SpecError(
                source, prefix or "<top level>", _short(data), "must be a mapping of fields"
            )
        self.data, self.source, self.prefix = data, source, prefix
        allowed = set(allowed)
        if allowed:
            for key in data:
                if key not in allowed:
                    raise SpecError(
                        source,
                        self.path(str(key)),
                        data[key],
                        f"unknown field{suggestion(str(key), allowed)}; allowed: "
                        f"{', '.join(sorted(allowed))}",
                    )

    def path(self, key: str) -> str:
        return f"{self.prefix}.{key}" if self.prefix else key

    def error(self, key: str, value: Any, rule: str) -> SpecError:
        return SpecError(self.source, self.path(key), value, rule)

    def raw(self, key: str, default: Any = _MISSING) -> Any:
        if key not in self.data or self.data[key] is None:
            if default is _MISSING:
                raise self.error(key, None, "is required")
            return default
        return self.data[key]

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def positive_int(self, key: str, default: Any = _MISSING) -> int:
        value = self.raw(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise self.error(key, value, "must be a positive integer")
        return value

    def non_negative_int(self, key: str, default: Any = _MISSING) -> int:
        value = self.raw(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise self.error(key, value, "must be a non-negative integer")
        return value

    def positive_number(self, key: str, default: Any = _MISSING) -> float:
        value = self.raw(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise self.error(key, value, "must be a positive number")
        return float(value)

    def fraction(self, key: str, default: Any = _MISSING) -> float:
        value = self.positive_number(key, default)
        if value > 1:
            raise self.error(key, value, "must be a number in (0, 1]")
        return value

    def boolean(self, key: str, default: Any = _MISSING) -> bool:
        value = self.raw(key, default)
        if not isinstance(value, bool):
            raise self.error(key, value, "must be true or false")
        return value

    def string(self, key: str, default: Any = _MISSING) -> str:
        value = self.raw(key, default)
        if not isinstance(value, str) or not value.strip():
            raise self.error(key, value, "must be a non-empty string")
        return value

    def choice(self, key: str, choices: Iterable[str], default: Any = _MISSING) -> str:
        choices = list(choices)
        value = self.raw(key, default)
        if not isinstance(value, str) or value.lower() not in choices:
            hint = suggestion(str(value), choices)
            raise self.error(key, value, f"must be one of {', '.join(choices)}{hint}")
        return value.lower()

    def string_list(self, key: str) -> list[str]:
        value = self.raw(key)
        if (
            not isinstance(value, list)
            or not value
            or not all(isinstance(v, str) and v.strip() for v in value)
        ):
            raise self.error(key, _short(value), "must be a non-empty list of non-empty strings")
        return value

    def mapping_list(self, key: str) -> list[Any]:
        value = self.raw(key)
        if not isinstance(value, list) or not value:
            raise self.error(key, _short(value), "must be a non-empty list")
        return value


def _short(value: Any) -> Any:
    text = repr(value)
    return value if len(text) <= 60 else text[:57] + "..."
