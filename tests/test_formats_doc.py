"""The examples of docs/formats.md parse and fit together, so that the page cannot drift from the
code that reads the files."""

from __future__ import annotations

import dataclasses
import enum
import re
import types
import typing
from pathlib import Path

import yaml

from hethub.profiles.types import LayerKey, LayerProfile, LinkProfile, MeasuredOn
from hethub.spec import check_plan, load_cluster, load_model, load_plan
from hethub.spec.accelerator import (
    MEMORY_KEYS,
    OWN_READERS,
    AcceleratorSpec,
    DeviceEfficiency,
)
from hethub.spec.cluster import (
    LABELS,
    ClusterSpec,
    DeviceGroup,
    KubernetesSettings,
    LaunchSettings,
    SlurmSettings,
)
from hethub.spec.model_spec import ModelSpec
from hethub.spec.plan import PLAN_KEYS, PipelineLayout, Plan, StageSpec

FORMATS = Path(__file__).resolve().parents[1] / "docs" / "formats.md"


def test_the_cluster_model_and_plan_examples_load_and_check(tmp_path: Path) -> None:
    blocks = re.findall(r"```yaml\n(.*?)```", FORMATS.read_text(), re.DOTALL)
    assert len(blocks) == 3, "docs/formats.md: one YAML example each for cluster, model and plan"
    for name, text in zip(("cluster", "model", "plan"), blocks):
        (tmp_path / f"{name}.yaml").write_text(text)
    cluster = load_cluster(tmp_path / "cluster.yaml")
    plan = load_plan(tmp_path / "plan.yaml")
    model = load_model(plan.model, relative_to=tmp_path)
    assert model == load_model(tmp_path / "model.yaml")
    check_plan(plan, cluster, model, "plan.yaml")


def _table_after(text: str, heading: str) -> list[list[str]]:
    """The rows of the first markdown table after ``heading`` (a line of the doc), cells
    stripped, header and rule left out."""
    lines = text[text.index(heading) :].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def _type_words(hint: object, rules: dict) -> str | None:
    """How docs/formats.md writes a declared field's type (Fields.declared's readers); None for
    a type read by a reader of its own (a section, a list)."""
    if isinstance(hint, types.UnionType):
        given = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        hint = given[0] if len(given) == 1 else hint
    bound = ">= 0" if rules.get("at_least_zero") else "> 0"
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return "choice: " + ", ".join(f"`{m.value}`" for m in hint)
    if hint is bool:
        return "`true` or `false`"
    if hint is int:
        return f"int {bound}"
    if hint is float:
        return "number in (0, 1]" if rules.get("fraction") else f"number {bound}"
    if hint is str:
        choices = rules.get("choices")
        return "choice: " + ", ".join(f"`{c}`" for c in choices) if choices else "string"
    return None


def _check_table(
    heading: str,
    cls: type,
    *,
    own_readers: tuple[str, ...] = (),
    extra: tuple[str, ...] = (),
    not_in_file: tuple[str, ...] = (),
) -> None:
    """The docs' table after ``heading`` lists ``cls``'s declared fields (but ``not_in_file``)
    in order, and ``extra``, keys a reader takes beside them, anywhere among them; each's type
    as the declaration reads it (but those of ``own_readers``, read by rules of their own),
    "required" only where it has no default (a field without one may take another field's:
    ``kv_heads``), and a literal default that is the declared one."""
    rows = _table_after(FORMATS.read_text(), heading)
    declared = [f for f in dataclasses.fields(cls) if f.init and f.name not in not_in_file]
    names = [row[0].strip("`") for row in rows]
    assert [name for name in names if name not in extra] == [f.name for f in declared]
    assert sorted(set(names) - {f.name for f in declared}) == sorted(extra)
    rows = [row for row in rows if row[0].strip("`") not in extra]
    hints = typing.get_type_hints(cls)
    for field, (_, kind, default, *_) in zip(declared, rows):
        if field.name in own_readers:
            continue
        words = _type_words(hints[field.name], dict(field.metadata))
        if words is not None:
            assert kind == words, field.name
        has_default = field.default is not dataclasses.MISSING or (
            field.default_factory is not dataclasses.MISSING
        )
        assert not (has_default and default == "required"), field.name
        literal = re.fullmatch(r"`([^`]*)`", default)
        if literal and has_default:
            value = field.default.value if isinstance(field.default, enum.Enum) else field.default
            assert yaml.safe_load(literal.group(1)) == value, field.name


def test_the_plan_table_is_the_plans_declaration() -> None:
    """The plan's top-level fields as spec.plan.Plan declares them, which parse_plan reads
    (Fields.declared) and to_dict writes."""
    assert [f.name for f in dataclasses.fields(Plan)] == list(PLAN_KEYS)
    _check_table("## The plan file", Plan)


def test_the_layout_and_stage_tables_are_their_declarations() -> None:
    """A layout's and a stage's fields as spec.plan's PipelineLayout and StageSpec declare them:
    a layout's chunks per stage are a key of the file alone, a stage's chunks the list its
    ``layers`` gives."""
    _check_table(
        "A layout (`pipelines[i]`):",
        PipelineLayout,
        own_readers=("schedule",),
        extra=("virtual_stages",),
    )
    _check_table(
        "A stage (`pipelines[i].stages[j]`):",
        StageSpec,
        own_readers=("layers",),
        not_in_file=("chunks",),
    )


def test_the_cluster_tables_are_the_clusters_declaration() -> None:
    """The cluster file's tables as spec.cluster's dataclasses declare them; a group's sections
    and its accelerator have readers of their own."""
    _check_table(
        "## The cluster file",
        ClusterSpec,
        own_readers=("groups",),
        extra=LABELS,
        not_in_file=("source",),
    )
    sections = ("accelerator", "speed", "hosts", "slurm", "kubernetes", "launch")
    _check_table("A group (`groups[i]`):", DeviceGroup, own_readers=sections)
    _check_table("A group's `slurm:` section", SlurmSettings, own_readers=("time",))
    _check_table("A group's `kubernetes:` section", KubernetesSettings)
    _check_table("A group's `launch:` section", LaunchSettings)


def test_the_inline_accelerator_tables_are_its_declaration() -> None:
    """An inline accelerator's table as spec.accelerator.AcceleratorSpec declares it (its memory
    in a file's units), and its efficiency's as DeviceEfficiency does."""
    _check_table(
        "An inline accelerator (`groups[i].accelerator`",
        AcceleratorSpec,
        own_readers=OWN_READERS,
        extra=MEMORY_KEYS,
        not_in_file=("memory_bytes", "memory_reserve_bytes"),
    )
    _check_table(
        "`efficiency:` (the catalog",
        DeviceEfficiency,
        own_readers=("source",),
        not_in_file=("inherited",),
    )


def test_the_model_table_is_the_models_declaration() -> None:
    """The model file's table as spec.model_spec.ModelSpec declares it (its name is any label,
    the activation a choice by arch)."""
    _check_table(
        "# Llama-2-7B's dimensions", ModelSpec, own_readers=("name", "activation", "rope_scaling")
    )


def test_the_profile_tables_are_the_profiles_declaration() -> None:
    """A profile file's tables as profiles.types declares its dataclasses."""
    _check_table("A layer file (one micro-batch", LayerProfile)
    _check_table("A layer file's `key`:", LayerKey)
    _check_table("A link file (point-to-point", LinkProfile)
    _check_table("`measured_on`:", MeasuredOn)
