"""Reading typed fields out of parsed YAML, with one clear error per broken rule."""

from __future__ import annotations

import dataclasses
import difflib
import enum
import math
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from hethub.errors import HethubError, SpecError

_MISSING = object()


class StrictLoader(yaml.SafeLoader):
    """yaml's safe loader, refusing a key given twice in one mapping: the plain loader keeps the
    second value silently, so a file would not mean what it says. Every YAML file hethub reads
    (the user's and its own data) is parsed by this loader (parse_yaml)."""

    def construct_document(self, node: yaml.Node) -> Any:
        # Where each mapping sits in the document, so that a duplicate is named as a field is
        # everywhere else ("groups[0].network_gbps"): construct_mapping sees no parents.
        self.field_paths: dict[int, str] = {}
        _record_field_paths(node, "", self.field_paths)
        return super().construct_document(node)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        first_line: dict[Any, int] = {}
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # "<<: *defaults" then a key of the mapping's own is an override
            key = self.construct_object(key_node, deep=True)
            try:
                line = first_line.get(key)
            except TypeError:
                continue  # an unhashable key: the safe loader's own error names it
            if line is not None:
                prefix = self.field_paths.get(id(node), "")
                raise DuplicateKeyError(
                    f"{prefix}.{key}" if prefix else str(key),
                    self.construct_object(value_node, deep=True)
                    if isinstance(value_node, yaml.ScalarNode)
                    else "...",
                    f"given twice in one mapping (lines {line} and "
                    f"{key_node.start_mark.line + 1}); give each key once",
                )
            first_line[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


class DuplicateKeyError(yaml.YAMLError):
    """A key given twice in one mapping of a YAML file."""

    def __init__(self, field: str, value: Any, rule: str) -> None:
        self.field, self.value, self.rule = field, value, rule
        super().__init__(f"{field} = {value!r}: {rule}")


def _record_field_paths(node: yaml.Node, path: str, paths: dict[int, str]) -> None:
    """``paths[id(mapping node)]``: the field path of each mapping under ``node``."""
    if isinstance(node, yaml.MappingNode):
        if id(node) in paths:  # an alias: one node, reached again
            return
        paths[id(node)] = path
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else "?"
            _record_field_paths(value_node, f"{path}.{key}" if path else str(key), paths)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _record_field_paths(item, f"{path}[{i}]", paths)


def parse_yaml(text: str, source: str) -> Any:
    """Parse YAML text with StrictLoader; a syntax error or a duplicate key becomes one clear
    HethubError naming ``source``."""
    try:
        return yaml.load(text, Loader=StrictLoader)  # StrictLoader is a SafeLoader
    except DuplicateKeyError as error:
        raise SpecError(source, error.field, error.value, error.rule) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise HethubError(f"{source}: not valid YAML{where}: {problem}") from None


def load_yaml(path: str | Path, what: str) -> Any:
    """Parse a YAML file; a missing file, a folder, a syntax error or a duplicate key becomes one
    clear HethubError."""
    path = Path(path)
    if path.is_dir():
        raise HethubError(f"{path}: is a directory; give the path of a {what} YAML file")
    if not path.is_file():
        raise HethubError(f"{path}: {what} file not found (give the path of an existing YAML file)")
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise HethubError(f"{path}: not a text file (a {what} file is UTF-8 YAML)") from None
    except OSError as error:
        raise HethubError(f"{path}: cannot read the {what} file ({error.strerror})") from None
    return parse_yaml(text, str(path))


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
        """The field's value as parsed (``default`` when absent). Every typed read comes here,
        so the rule no field may break is here: a number is finite (YAML's .inf and .nan parse
        as floats, and would pass a "> 0" or go through arithmetic unnoticed)."""
        if key not in self.data or self.data[key] is None:
            if default is _MISSING:
                raise self.error(key, None, "is required")
            return default
        value = self.data[key]
        if isinstance(value, float) and not math.isfinite(value):
            raise self.error(key, value, "must be a finite number (not .inf or .nan)")
        return value

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

    def non_negative_number(self, key: str, default: Any = _MISSING) -> float:
        value = self.raw(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise self.error(key, value, "must be a number >= 0")
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

    def declared(
        self, cls: type, skip: Iterable[str] = (), defaults: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """The fields of dataclass ``cls`` (but ``skip``) read from this mapping by their
        declared types, rules (``rules``, in a field's metadata) and defaults: the one
        declaration of a file's fields. A str is a non-empty string (or one of its ``choices``),
        an int a positive integer, a float a positive number (``at_least_zero``: either >= 0;
        ``fraction``: in (0, 1]), a bool true or false, a StrEnum one of its values (read into
        a member), ``X | None`` an X where given. A field left out takes ``defaults``' value
        where it has one (a default that depends on another field), else its declared default;
        without either it is required."""
        defaults = defaults or {}
        values: dict[str, Any] = {}
        for field, kind in _declaration(cls):
            if field.name in skip:
                continue
            if kind is None:  # a section or a list: its reader of its own must skip it
                raise TypeError(f"{cls.__name__}.{field.name}: no reader for its type")
            if not self.has(field.name):
                if field.name in defaults:
                    values[field.name] = defaults[field.name]
                elif field.default is not dataclasses.MISSING:
                    values[field.name] = field.default
                else:
                    raise self.error(field.name, None, "is required")
                continue
            values[field.name] = self._typed(field, kind)
        return values

    def _typed(self, field: dataclasses.Field, kind: type) -> Any:
        """The given value of ``field``, read as ``kind`` by its rules."""
        key, rules = field.name, field.metadata
        if issubclass(kind, enum.StrEnum):
            return kind(self.choice(key, [m.value for m in kind]))
        if kind is bool:
            return self.boolean(key)
        if kind is int:
            return (
                self.non_negative_int(key) if rules.get("at_least_zero") else self.positive_int(key)
            )
        if kind is float:
            at_least_zero = rules.get("at_least_zero", False)
            value = self.raw(key)
            if isinstance(value, str) and _reads_as_number(value):
                rule = "must be a number >= 0" if at_least_zero else "must be a positive number"
                raise self.error(
                    key, value, f"{rule} (YAML reads 1e-6 as text: write 1.0e-6; and unquoted)"
                )
            if rules.get("fraction"):
                return self.fraction(key)
            return self.non_negative_number(key) if at_least_zero else self.positive_number(key)
        if "choices" in rules:
            return self.choice(key, rules["choices"])
        return self.string(key)

    def mapping_list(self, key: str) -> list[Any]:
        value = self.raw(key)
        if not isinstance(value, list) or not value:
            raise self.error(key, _short(value), "must be a non-empty list")
        return value


def rules(
    *, choices: Iterable[str] = (), at_least_zero: bool = False, fraction: bool = False
) -> dict[str, Any]:
    """A declared field's rules beyond its type, for its ``dataclasses.field(metadata=...)``:
    the words a str field takes (``choices``), that a number may be 0 (``at_least_zero``) or is
    a share of a whole, in (0, 1] (``fraction``)."""
    found: dict[str, Any] = {}
    if choices:
        found["choices"] = tuple(choices)
    if at_least_zero:
        found["at_least_zero"] = True
    if fraction:
        found["fraction"] = True
    return found


_READABLE = (bool, int, float, str)
_DECLARATIONS: dict[type, tuple[tuple[dataclasses.Field, type | None], ...]] = {}
"""Each declared dataclass's fields and the type each is read as, found once: resolving a
class's string annotations (typing.get_type_hints) costs far more than reading a file's
fields, and a class's declaration is a fact of the code, the same for the whole process."""


def _declaration(cls: type) -> tuple[tuple[dataclasses.Field, type | None], ...]:
    """``cls``'s constructor fields, each with the type its given value is read as (None: a
    field of a type no reader takes, which a reader of its own must skip)."""
    found = _DECLARATIONS.get(cls)
    if found is None:
        hints = typing.get_type_hints(cls)
        found = _DECLARATIONS[cls] = tuple(
            (field, _given_type(hints[field.name]))
            for field in dataclasses.fields(cls)
            if field.init
        )
    return found


def _reads_as_number(text: str) -> bool:
    """Whether ``text`` is a number YAML left as text (``1e-6``, ``"100"``)."""
    try:
        float(text)
    except ValueError:
        return False
    return True


def _given_type(hint: Any) -> type | None:
    """The type a field's given value is read as: ``hint``, or X of ``X | None``; None where no
    reader takes it."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        given = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        hint = given[0] if len(given) == 1 else hint
    if hint in _READABLE or (isinstance(hint, type) and issubclass(hint, enum.StrEnum)):
        return hint
    return None


def field_names(cls: type) -> tuple[str, ...]:
    """The fields dataclass ``cls`` declares (those its constructor takes), in order: a file
    format's allowed keys."""
    return tuple(field.name for field in dataclasses.fields(cls) if field.init)


def _short(value: Any) -> Any:
    text = repr(value)
    return value if len(text) <= 60 else text[:57] + "..."
